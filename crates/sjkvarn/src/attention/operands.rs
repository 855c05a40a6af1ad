//! Operand checks shared by the ring kernels.

use super::tile_gemm::MAX_ROWS;

/// Whether a ring value sum's operands fit: `m` query pairs (at most [`MAX_ROWS`]) whose
/// weights (`weights = (w, ldw)`) cover `n` rows, each row at least `row_end` bytes long,
/// `d` values (a multiple of `block`) per output row, outputs `(len, ldo)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn value_operands_fit(
    d: usize,
    block: usize,
    m: usize,
    (w, ldw): (&[f32], usize),
    rows: &[&[u8]],
    row_end: usize,
    n: usize,
    (out_len, ldo): (usize, usize),
) -> bool {
    m <= MAX_ROWS
        && d.is_multiple_of(block)
        && n <= rows.len()
        && rows[..n].iter().all(|r| r.len() >= row_end)
        && (m == 0 || (w.len() >= (m - 1) * ldw + n && out_len >= (m - 1) * ldo + d))
}
