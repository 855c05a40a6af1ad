use super::*;
use crate::codec::layout::{unpack, Body, RecordLayout};
use crate::rng::SplitMix64;

/// Fixed point rounds to nearest with the stated limit; zero, tiny and non-finite
/// operands come out as stated.
#[test]
fn fixed_point_rounds_within_its_limit() {
    let mut rng = SplitMix64::new(9);
    for magnitude in [1e-20f32, 3e-3, 1.0, 7.5e4, 1e30] {
        let x: Vec<f32> = rng.gaussians(256).iter().map(|v| v * magnitude).collect();
        let mut n = vec![0i32; 256];
        let (scale, total) = to_fixed(&x, &mut n);
        assert_eq!(total, n.iter().sum::<i32>());
        let m = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let top = n.iter().map(|v| v.abs()).max().unwrap();
        assert!(top <= 32512 && top > 16256, "{magnitude}: {top}");
        for (&v, &q) in x.iter().zip(&n) {
            assert!(
                (v - q as f32 * scale).abs() <= 0.5 * scale,
                "{v} {q} {scale}"
            );
        }
        assert!(scale <= m / 16256.0);
    }
    let mut n = vec![7i32; 16];
    assert_eq!(to_fixed(&[0.0; 16], &mut n), (0.0, 0));
    assert!(n.iter().all(|&v| v == 0));
    let mut x = vec![1.0f32; 16];
    x[3] = f32::INFINITY;
    assert!(to_fixed(&x, &mut n).0.is_nan());
    x[3] = f32::NAN;
    assert!(to_fixed(&x, &mut n).0.is_nan());
}

/// The portable sums are the plain sums over the layout's codes, for keys (sum over
/// channels per token) and values (sum over tokens per channel).
#[test]
fn portable_sums_follow_the_layout() {
    let (d, g) = (64usize, 128usize);
    let layout = RecordLayout::new(d, g, 4, 4, Body::Scalar).unwrap();
    let mut rng = SplitMix64::new(4);
    let rec: Vec<u8> = (0..layout.bytes).map(|_| rng.next_u64() as u8).collect();
    for is_v in [false, true] {
        let payload = layout.payload(&rec, is_v);
        let (grid, rows, cols) = grid_of(d, g, is_v);
        let n: Vec<i32> = (0..2 * rows)
            .map(|_| (rng.next_u64() % 65025) as i32 - 32512)
            .collect();
        let mut out = vec![0i32; 2 * cols];
        fragment_dots_portable(payload, grid, 2, &n, rows, &mut out, &mut Ahead::new(&[]));
        for s in 0..2 {
            for c in 0..cols {
                let want: i64 = (0..rows)
                    .map(|r| {
                        let (t, ch) = if is_v { (r, c) } else { (c, r) };
                        let u = unpack(payload, layout.code_bit(t, ch, is_v), 4) as i64;
                        n[s * rows + r] as i64 * u
                    })
                    .sum();
                assert_eq!(out[s * cols + c] as i64, want, "is_v {is_v}");
            }
        }
    }
}

fn grid_of(d: usize, g: usize, is_v: bool) -> (TileGrid, usize, usize) {
    let tiles_d = d / TILE;
    if is_v {
        let grid = TileGrid {
            cols: tiles_d,
            rows: g / TILE,
            col_stride: 1,
            row_stride: tiles_d,
        };
        (grid, g, d)
    } else {
        let grid = TileGrid {
            cols: g / TILE,
            rows: tiles_d,
            col_stride: tiles_d,
            row_stride: 1,
        };
        (grid, d, g)
    }
}

/// Every kernel this CPU has gives the portable products bit for bit (so also the same
/// fixed-point scales and sums), for 1 to 8 operands (several passes), both sides, partial
/// value rows and an operand dominated by one entry (n at the fixed-point limit).
#[test]
fn every_kernel_gives_the_portable_bits() {
    let mut kernels = vec![FragmentKernel::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            kernels.push(FragmentKernel::Avx2);
        }
        if crate::simd::avx512_vnni() {
            kernels.push(FragmentKernel::Vnni);
        }
    }
    eprintln!("kernels compared: {kernels:?}");
    let mut rng = SplitMix64::new(31);
    for d in [64usize, 256] {
        let layout = RecordLayout::new(d, 128, 4, 4, Body::Scalar).unwrap();
        let rec: Vec<u8> = (0..layout.bytes).map(|_| rng.next_u64() as u8).collect();
        for is_v in [false, true] {
            let payload = layout.payload(&rec, is_v);
            let (mut grid, rows, cols) = grid_of(d, 128, is_v);
            if is_v {
                grid.rows = 5; // the first 80 tokens visible
            }
            for operands in 1..=8 {
                let mut x = rng.gaussians(operands * rows);
                x[rows / 2] = -3e4; // one operand dominated by a single entry
                let mut want = vec![f32::NAN; operands * cols];
                let mut sc = FragmentScratch::default();
                for &kernel in &kernels {
                    let mut got = vec![f32::NAN; operands * cols];
                    let ahead = &mut Ahead::new(&[]);
                    fragment_products(
                        kernel, payload, grid, operands, &x, rows, &mut sc, &mut got, cols, ahead,
                    );
                    if kernel == FragmentKernel::Portable {
                        want = got;
                        continue;
                    }
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kernel:?} D {d} is_v {is_v} {operands} operands");
                }
            }
        }
    }
}
