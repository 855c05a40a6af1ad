//! The SJ-KVaRN rotation: the orthonormal Sylvester-Hadamard transform over the whole head.
//!
//! `H_n / sqrt(n)` is symmetric, so the same call rotates and un-rotates. The butterflies run
//! from stride 1 upward and the scale `1 / sqrt(n)` (one f32 division) is applied last, in that
//! order, because the reference's staged bytes depend on the exact f32 rounding sequence. Every
//! head is rotated whole: a 512-wide head is one 512-point transform.

use crate::error::{CodecError, Result};

/// Rotates (or un-rotates) `x` in place; `x.len()` must be a power of two.
pub fn hadamard(x: &mut [f32]) -> Result<()> {
    let n = x.len();
    if n == 0 || !n.is_power_of_two() {
        return Err(CodecError::UnsupportedRotationLength(n));
    }
    hadamard_unchecked(x);
    Ok(())
}

/// The transform itself; `x.len()` is a power of two.
pub(crate) fn hadamard_unchecked(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for start in (0..n).step_by(2 * h) {
            let (lo, hi) = x[start..start + 2 * h].split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (p, q) = (*a, *b);
                *a = p + q;
                *b = p - q;
            }
        }
        h *= 2;
    }
    let scale = 1.0f32 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// Rotates every `head_dim`-wide head of a flat row-major buffer.
pub fn rotate_heads(values: &mut [f32], head_dim: usize) -> Result<()> {
    if head_dim == 0 || !head_dim.is_power_of_two() {
        return Err(CodecError::UnsupportedRotationLength(head_dim));
    }
    if !values.len().is_multiple_of(head_dim) {
        return Err(CodecError::NotBlockMultiple {
            what: "rotation",
            len: values.len(),
            block: head_dim,
        });
    }
    values
        .chunks_exact_mut(head_dim)
        .for_each(hadamard_unchecked);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_its_own_inverse_and_orthonormal() {
        for n in [32usize, 64, 128, 256, 512] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25)
                .collect();
            let mut y = x.clone();
            hadamard(&mut y).unwrap();
            let (nx, ny): (f32, f32) =
                (x.iter().map(|v| v * v).sum(), y.iter().map(|v| v * v).sum());
            assert!((nx - ny).abs() <= 1e-4 * nx);
            hadamard(&mut y).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5, "n = {n}");
            }
        }
        assert!(hadamard(&mut [0.0; 48]).is_err());
    }
}
