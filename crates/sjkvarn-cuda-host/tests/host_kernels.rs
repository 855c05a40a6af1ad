//! The CUDA kernels' lane functions, compiled for the host, against the Rust reference: the
//! staging and seal paths must give the same bytes; attention, which sums in another order
//! (per-split partial sums merged by log-sum-exp), the same outputs within 1e-4 relative.

use half::f16;
use sjkvarn::body::{BodyCoding, TrellisAxis};
use sjkvarn::cache::attention::attend;
use sjkvarn::cache::{CacheConfig, LayerCoding, Sequence, Staging};
use sjkvarn::kernel_abi::{KernelBalance, KernelLayerView, KernelRecordLayout};
use sjkvarn::rng::SplitMix64;
use sjkvarn::{BalanceConfig, BalanceMode, BalanceStat};
use sjkvarn_cuda_host::{c_struct_sizes, f16_to_f32, f32_to_f16, fwht, pack, stage_row, HostLayer};
use std::sync::Arc;

#[test]
fn c_structs_have_the_rust_layout() {
    assert_eq!(
        c_struct_sizes(),
        (
            std::mem::size_of::<KernelLayerView>(),
            std::mem::size_of::<KernelRecordLayout>(),
            std::mem::size_of::<KernelBalance>()
        )
    );
}

#[test]
fn scratch_sizes_match_the_c_functions() {
    for width in [64usize, 128, 256] {
        assert_eq!(
            sjkvarn::kernel_abi::seal_scratch_bytes(width),
            sjkvarn_cuda_host::c_seal_scratch_bytes(width)
        );
    }
    for gs in [1usize, 3, 8, 16] {
        for d in [64usize, 512] {
            assert_eq!(
                sjkvarn::kernel_abi::attend_shared_floats(gs, d),
                gs * d + sjkvarn_cuda_host::c_attend_scratch_floats(gs)
            );
        }
    }
}

#[test]
fn fp16_conversion_is_bit_exact() {
    let mut rng = SplitMix64::new(11);
    let mut specials: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        65504.0,
        65520.0,
        65519.99,
        6.0e-8,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
        1.0e-9,
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::INFINITY,
        -f32::INFINITY,
        6.1035156e-5,
        6.1035152e-5,
    ];
    for _ in 0..400_000 {
        specials.push(f32::from_bits(rng.next_u64() as u32));
    }
    for x in specials {
        let want = f16::from_f32(x);
        let got = f32_to_f16(x);
        if x.is_nan() {
            assert!(f16::from_bits(got).is_nan(), "{x}");
        } else {
            assert_eq!(got, want.to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
    }
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        let got = f16_to_f32(bits);
        if want.is_nan() {
            assert!(got.is_nan());
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#x}");
        }
    }
}

#[test]
fn packing_matches_bitpack() {
    let mut rng = SplitMix64::new(5);
    for bits in 2..=8u32 {
        for n in [1usize, 7, 8, 64, 127, 128 * 64] {
            let codes: Vec<u8> = (0..n)
                .map(|_| (rng.next_u64() % (1u64 << bits)) as u8)
                .collect();
            let mut want = vec![0u8; sjkvarn::bitpack::packed_len(n, bits)];
            sjkvarn::bitpack::pack(&codes, bits, &mut want);
            assert_eq!(pack(&codes, bits), want, "{bits} bits, {n} codes");
        }
    }
}

#[test]
fn hadamard_matches_bit_for_bit() {
    let mut rng = SplitMix64::new(9);
    for n in [64usize, 128, 256] {
        let x = rng.gaussians(n);
        let mut want = x.clone();
        sjkvarn::hadamard::fwht(&mut want).unwrap();
        let mut got = x.clone();
        fwht(&mut got);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn staged_rows_match_the_ring_codec() {
    let mut rng = SplitMix64::new(21);
    for d in [64usize, 128, 256, 512] {
        let codec = sjkvarn::cache::staging::RowCodec::new(Staging::Tq6, d);
        for case in 0..40 {
            let mut row = rng.gaussians(d);
            match case % 4 {
                0 => row.iter_mut().for_each(|v| *v = 0.0),
                1 => row.iter_mut().for_each(|v| *v *= 1e-3),
                2 => row[3] *= 40.0,
                _ => {}
            }
            let mut rotated = row.clone();
            sjkvarn::hadamard::rotate_rows(&mut rotated, d).unwrap();
            let mut want = vec![0u8; codec.row_bytes()];
            codec.encode(&rotated, &mut want).unwrap();
            let (got, status) = stage_row(&row);
            assert_eq!(status, 0);
            assert_eq!(got, want, "d {d} case {case}");
        }
    }
    // A norm fp16 cannot hold is reported, as the reference refuses it.
    let (_, status) = stage_row(&vec![60000.0f32; 128]);
    assert_eq!(status, 2);
}

/// K/V with a few loud channels, like real post-RoPE keys.
fn kv_tokens(rng: &mut SplitMix64, n: usize, h: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut k = rng.gaussians(n * h * d);
    let v = rng.gaussians(n * h * d);
    for (i, x) in k.iter_mut().enumerate() {
        let c = i % d;
        if c == 5 || c == d - 3 {
            *x *= 12.0;
        }
        *x += 0.5 * ((i / (h * d)) as f32 * 0.01).sin();
    }
    (k, v)
}

fn filled_sequence(config: CacheConfig, tokens: usize, seed: u64) -> Sequence {
    let config = Arc::new(config);
    let pool = Sequence::pool_for(&config, 1);
    let mut seq = Sequence::new(config.clone(), pool).unwrap();
    let mut rng = SplitMix64::new(seed);
    let (h, d) = (config.kv_heads, config.head_dim);
    let mut done = 0;
    while done < tokens {
        let n = (tokens - done).min(97);
        for layer in 0..config.layers {
            let (k, v) = kv_tokens(&mut rng, n, h, d);
            seq.append(layer, &k, &v).unwrap();
        }
        done += n;
    }
    seq
}

fn small_config(d: usize, coding: LayerCoding, balance: BalanceConfig) -> CacheConfig {
    let mut c = CacheConfig::uniform(1, 6, 2, d, coding, 4096);
    c.min_tail = 256;
    c.max_tail = 512;
    c.max_chunk = 128;
    c.balance = balance;
    c
}

#[test]
fn sealed_records_are_byte_identical() {
    let balances = [
        BalanceConfig::default(),
        BalanceConfig::kvarn_reference(),
        BalanceConfig {
            passes: 3,
            mode: BalanceMode::Final,
            stat: BalanceStat::Rms,
        },
    ];
    let trellis = |k_bits, v_bits, k_axis, v_axis| LayerCoding {
        k_bits,
        v_bits,
        k_coding: BodyCoding::Trellis(k_axis),
        v_coding: BodyCoding::Trellis(v_axis),
    };
    let (tok, chan) = (TrellisAxis::Token, TrellisAxis::Channel);
    let cases = [
        (64usize, LayerCoding::scalar(4, 4), 0usize),
        (128, LayerCoding::scalar(3, 2), 1),
        (256, LayerCoding::scalar(2, 3), 2),
        (512, LayerCoding::scalar(4, 2), 0),
        (64, LayerCoding::scalar(8, 5), 1),
        (64, trellis(3, 3, tok, tok), 0),
        (64, trellis(2, 4, chan, chan), 1),
        (128, trellis(3, 2, tok, chan), 0),
        (256, trellis(4, 3, chan, tok), 0),
    ];
    for (d, coding, bi) in cases {
        let kb = coding.k_bits;
        let config = small_config(d, coding, balances[bi]);
        // Seal from the ring as it was before each append (rows of sealed groups are reused
        // once the ring wraps) and compare with the records the append sealed.
        let config = Arc::new(config);
        let pool = Sequence::pool_for(&config, 1);
        let mut seq = Sequence::new(config.clone(), pool).unwrap();
        let mut rng = SplitMix64::new(d as u64 + kb as u64);
        let slot = config.slot_bytes();
        let rb = config.body_spec(0).record_bytes();
        let kb_cfg = KernelBalance::of(&config.balance);
        let mut checked = 0;
        while seq.len(0).unwrap() < 1800 {
            let n = 1 + (rng.next_u64() % 150) as usize;
            let before = seq.layer_image(0).unwrap();
            let (k, v) = kv_tokens(&mut rng, n, config.kv_heads, d);
            seq.append(0, &k, &v).unwrap();
            let after = seq.layer_image(0).unwrap();
            if after.sealed == before.sealed {
                continue;
            }
            let host = HostLayer::new(&config, 0, &before);
            for g in before.sealed..after.sealed {
                for h in 0..config.kv_heads {
                    let (got, status) = host.seal_group(g, h, &kb_cfg);
                    assert_eq!(status, 0);
                    let want = &after.records[g * slot + h * rb..g * slot + (h + 1) * rb];
                    assert!(
                        got == want,
                        "d {d} {coding:?} balance {bi}: group {g} head {h} differs at byte {:?}",
                        got.iter().zip(want).position(|(a, b)| a != b)
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 20, "only {checked} records checked");
    }
}

fn max_relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

#[test]
fn attention_matches_the_cpu_path() {
    let trellis = LayerCoding {
        k_bits: 3,
        v_bits: 2,
        k_coding: BodyCoding::Trellis(TrellisAxis::Token),
        v_coding: BodyCoding::Trellis(TrellisAxis::Channel),
    };
    let trellis_other_axes = LayerCoding {
        k_bits: 2,
        v_bits: 3,
        k_coding: BodyCoding::Trellis(TrellisAxis::Channel),
        v_coding: BodyCoding::Trellis(TrellisAxis::Token),
    };
    let cases = [
        (64usize, LayerCoding::scalar(4, 4), Staging::Tq6, 1100usize),
        (128, LayerCoding::scalar(3, 2), Staging::Tq6, 900),
        (512, LayerCoding::scalar(4, 4), Staging::Tq6, 700),
        (64, trellis, Staging::Tq6, 800),
        (64, trellis_other_axes, Staging::Tq6, 800),
        (64, LayerCoding::scalar(4, 4), Staging::F16, 900),
        (64, LayerCoding::scalar(4, 4), Staging::Tq6, 100),
    ];
    for (d, coding, staging, tokens) in cases {
        let mut config = small_config(d, coding, BalanceConfig::default());
        config.staging = staging;
        let seq = filled_sequence(config.clone(), tokens, 77);
        let image = seq.layer_image(0).unwrap();
        let host = HostLayer::new(&config, 0, &image);
        let mut rng = SplitMix64::new(3);
        for rows in [1usize, 5] {
            let q = rng.gaussians(rows * config.q_heads * d);
            let scale = 1.0 / (d as f32).sqrt();
            let want = attend(&seq, 0, &q, None).unwrap();
            for splits in [1usize, 3, 64] {
                let got = host.attend(&q, config.q_heads, scale, splits).unwrap();
                let err = max_relative_error(&got, &want);
                assert!(
                    err < 1e-4,
                    "d {d} {coding:?} {staging:?} {tokens} tokens, {rows} rows, {splits} splits: {err}"
                );
            }
        }
    }
}
