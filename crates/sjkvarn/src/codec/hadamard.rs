//! Orthonormal Walsh-Hadamard rotation (Sylvester order, no random signs).
//!
//! `H_n / sqrt(n)` is symmetric and orthonormal, so the same call rotates and un-rotates. The fast
//! transform runs in place in `n log n` adds and never allocates, which matters because it runs on
//! every appended key, value and query.

use crate::error::{CodecError, Result};

/// Rotation lengths the transform accepts.
#[cfg(test)]
pub const ROTATION_LENGTHS: [usize; 3] = [64, 128, 256];

/// Rotation size `R` for a head: the head itself up to 256, two 256 halves for a 512-wide head.
pub fn rotation_size(head_dim: usize) -> Result<usize> {
    match head_dim {
        64 | 128 | 256 => Ok(head_dim),
        512 => Ok(256),
        _ => Err(CodecError::UnsupportedHeadDim(head_dim)),
    }
}

/// In-place orthonormal fast Walsh-Hadamard transform of one block of 64, 128 or 256 values.
#[cfg(test)]
pub fn fwht(block: &mut [f32]) -> Result<()> {
    let n = block.len();
    if !ROTATION_LENGTHS.contains(&n) {
        return Err(CodecError::UnsupportedRotationLength(n));
    }
    fwht_unchecked(block);
    Ok(())
}

/// The butterfly passes; `block.len()` must be a power of two (the format's transform,
/// [`crate::codec::rotation`], applied to one block).
pub(crate) fn fwht_unchecked(block: &mut [f32]) {
    crate::codec::rotation::hadamard_unchecked(block)
}

/// Rotates one head vector in place: whole for 64/128/256, as two 256 halves for 512.
#[cfg(test)]
pub fn rotate_head(head: &mut [f32]) -> Result<()> {
    let r = rotation_size(head.len())?;
    for chunk in head.chunks_exact_mut(r) {
        fwht_unchecked(chunk);
    }
    Ok(())
}

/// Rotates every row of a row-major `[rows][head_dim]` buffer in place.
pub fn rotate_rows(values: &mut [f32], head_dim: usize) -> Result<()> {
    let r = rotation_size(head_dim)?;
    if !values.len().is_multiple_of(head_dim) {
        return Err(CodecError::NotBlockMultiple {
            what: "rotate",
            len: values.len(),
            block: head_dim,
        });
    }
    for chunk in values.chunks_exact_mut(r) {
        fwht_unchecked(chunk);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense_hadamard(n: usize) -> Vec<f32> {
        // Sylvester: H[i][j] = (-1)^popcount(i & j)
        let s = 1.0 / (n as f32).sqrt();
        (0..n * n)
            .map(|k| {
                let (i, j) = (k / n, k % n);
                if (i & j).count_ones() % 2 == 0 {
                    s
                } else {
                    -s
                }
            })
            .collect()
    }

    #[test]
    fn matches_dense_matrix_and_is_self_inverse() {
        for &n in &ROTATION_LENGTHS {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
            let h = dense_hadamard(n);
            let dense: Vec<f32> = (0..n)
                .map(|i| (0..n).map(|j| h[i * n + j] * x[j]).sum())
                .collect();
            let mut fast = x.clone();
            fwht(&mut fast).unwrap();
            for (a, b) in fast.iter().zip(&dense) {
                assert!((a - b).abs() < 1e-4, "n={n}: {a} vs {b}");
            }
            fwht(&mut fast).unwrap();
            for (a, b) in fast.iter().zip(&x) {
                assert!((a - b).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn rejects_other_lengths() {
        for n in [0usize, 1, 32, 96, 512, 1024] {
            assert_eq!(
                fwht(&mut vec![0.0; n]),
                Err(CodecError::UnsupportedRotationLength(n))
            );
        }
        assert!(rotate_head(&mut vec![0.0; 192]).is_err());
        assert!(rotate_head(&mut vec![0.0; 512]).is_ok());
    }
}
