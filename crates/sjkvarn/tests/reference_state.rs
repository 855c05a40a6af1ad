//! The `SJKVSEQ` state stream against the SJ-KVaRN reference codec (`JakeATX/sj-kvarn-codec`
//! v2.0): the golden FNV-1a hashes of its `tests/expected_state.txt`, reproduced by building the
//! same 1,500-position sequences its `tests/test_state.c` describes through sjkvarn's public cache
//! API (our own implementation of its position-addressable input generator and ubatch pattern),
//! plus round trips and the reference's truncation semantics.

use sjkvarn::backend::Sequence;
use sjkvarn::codec::extension::body::{BodyCoding, TrellisAxis};
use sjkvarn::journal::{CacheConfig, LayerCoding, SinkType, Staging};
use sjkvarn::Journal;
use std::sync::Arc;

const D: usize = 128;
const H: usize = 2;
const NL: usize = 2;

/// FNV-1a 64 with the reference's offset basis.
fn fnv(bytes: &[u8]) -> u64 {
    sjkvarn::codec::conformance::fnv(bytes, sjkvarn::codec::conformance::FNV0)
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E3779B97F4A7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
    x ^ (x >> 31)
}

/// Value of (seed, variant, position, layer/head/channel index, side): integers times 2^-12,
/// exact in f32, with a few outlier channels.
fn val(seed: u64, variant: u64, pos: u64, i: u64, side: u64) -> f32 {
    let h = mix((seed << 40) ^ (variant << 36) ^ (pos << 16) ^ (i << 1) ^ side);
    let g = (h & 1023) as i32 + ((h >> 10) & 1023) as i32 - 1024;
    let scale = if i.is_multiple_of(41) {
        24
    } else {
        1 + ((h >> 20) & 3) as i32
    };
    (g * scale) as f32 * (1.0 / 4096.0)
}

/// Positions `[from, to)` of seed `seed`, in ubatches of the reference's size pattern, every
/// layer given the same ubatch (rows already rotated, as the reference's `store` takes them).
fn grow(seq: &mut Sequence, seed: u64, from: usize, to: usize, pattern: usize) {
    let (mut pos, mut step) = (from, 0usize);
    while pos < to {
        let mut n = if pattern == 0 {
            1
        } else if step % 5 == 4 {
            1 + (pattern * 7 + step * 13) % 64
        } else {
            1 + (step + pattern) % 4
        };
        n = n.min(to - pos);
        for layer in 0..NL {
            let mut k = Vec::with_capacity(n * H * D);
            let mut v = Vec::with_capacity(n * H * D);
            for p in pos..pos + n {
                for i in layer * H * D..(layer + 1) * H * D {
                    k.push(val(seed, 0, p as u64, i as u64, 0));
                    v.push(val(seed, 0, p as u64, i as u64, 1));
                }
            }
            seq.append_frame(layer, &k, &v, true).unwrap();
        }
        pos += n;
        step += 1;
    }
}

fn config(bk: u32, bv: u32, trellis: bool) -> CacheConfig {
    let coding = if trellis {
        BodyCoding::Trellis(TrellisAxis::Token)
    } else {
        BodyCoding::Scalar
    };
    let mut c = CacheConfig::uniform(
        NL,
        H,
        H,
        D,
        LayerCoding {
            k_bits: bk,
            v_bits: bv,
            k_coding: coding,
            v_coding: coding,
        },
        2304,
    );
    c.min_tail = 256;
    c.max_tail = 512;
    c.max_chunk = 64;
    c
}

fn golden_configs() -> Vec<(&'static str, CacheConfig, u64)> {
    let mut t33 = config(3, 3, true);
    t33.flush_chunk = 1;
    let mut f44 = config(4, 4, false);
    (f44.k_staging, f44.v_staging) = (Staging::F16, Staging::F16);
    f44.sink_type = SinkType::Inherit;
    f44.flush_chunk = 1;
    vec![
        ("4/4", config(4, 4, false), 0xb272bebf5862d3e9),
        ("3/3", config(3, 3, false), 0x7ec40b7d9b5c7332),
        ("3/3t", t33, 0xf7b8ec682fcfe41f),
        ("3/2t", config(3, 2, true), 0xc24888a80cf17b52),
        ("4/4f", f44, 0x3df623364a3963f6),
    ]
}

fn build(cfg: &CacheConfig, n: usize) -> Sequence {
    let cfg = Arc::new(cfg.clone());
    let mut seq = Sequence::new(cfg.clone(), Sequence::pool_for(&cfg, 1)).unwrap();
    grow(&mut seq, 23, 0, n, 4);
    seq
}

#[test]
fn golden_state_hashes_of_the_reference_are_reproduced() {
    let mut failures = Vec::new();
    for (name, cfg, want) in golden_configs() {
        assert!(
            cfg.is_reference(),
            "{name} must be a reference configuration"
        );
        let seq = build(&cfg, 1500);
        let stream = seq.state_bytes().unwrap();
        let got = fnv(&stream);
        if got != want {
            failures.push(format!("{name}: {got:016x}, reference {want:016x}"));
        }
        // write -> read -> write is byte-identical, and the restored copy attends identically.
        let back = Sequence::from_state(Arc::new(cfg.clone()), None, &stream).unwrap();
        assert_eq!(back.state_bytes().unwrap(), stream, "{name}: round trip");
    }
    assert!(
        failures.is_empty(),
        "golden state hashes differ: {failures:?}"
    );
}

#[test]
fn truncation_resumes_where_the_reference_does() {
    let cfg = config(4, 4, false);
    let full = build(&cfg, 1500);
    let b0 = 128 + 128 * full.sealed_groups(0).unwrap();
    assert!(b0 > 128 + 3 * 128, "the build sealed too little (B {b0})");
    for cut in [
        1499,
        b0 + 7,
        b0,
        b0 - 1,
        b0 - 128,
        b0 - 133,
        257,
        129,
        128,
        118,
        0,
    ] {
        let mut seq = build(&cfg, 1500);
        let want = if cut >= b0 || cut <= 128 {
            cut
        } else {
            128 + 128 * ((cut - 128) / 128)
        };
        let resume = seq.truncate(cut).unwrap();
        assert_eq!(resume, want, "cut {cut}");
        assert!(cut - resume <= 127);
        assert_eq!(seq.len(0).unwrap(), resume);
        // Kept records are bit-identical to the untruncated build's.
        let kept = seq.sealed_groups(0).unwrap();
        let (a, b) = (seq.layer_image(1).unwrap(), full.layer_image(1).unwrap());
        let slot = a.records.len() / kept.max(1);
        assert_eq!(
            a.records[..kept * slot],
            b.records[..kept * slot],
            "cut {cut}"
        );
    }
    let mut seq = build(&cfg, 300);
    assert_eq!(seq.truncate(1_000_000).unwrap(), 300);
}
