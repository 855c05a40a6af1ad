//! Flat-array block formats behind one name-based API, plus multi-threaded encode and decode.
//!
//! Blocks are independent, so a parallel run writes exactly the bytes a serial run writes. The
//! rotated formats rotate each block (Hadamard over the block) before coding and back after
//! decoding, unless the caller says the values are already in the rotated frame. `tq6_0` is the
//! SJ-KVaRN reference staging block ([`crate::codec::tq6`]); `turbo3`, `turbo4` and `tq5_0` are
//! comparators.

use crate::codec::comparators::ggml::{block_scales, GgmlFormat, QK};
use crate::codec::comparators::tq::TqBlock;
use crate::codec::hadamard::fwht_unchecked;
use crate::error::{check_finite, CodecError, Result};
use half::f16;
use rayon::prelude::*;

/// Every flat block format the codec speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Turbo3,
    Turbo4,
    Tq5_0,
    Tq6_0,
}

const ALL: [BlockFormat; 10] = [
    BlockFormat::F16,
    BlockFormat::Q8_0,
    BlockFormat::Q4_0,
    BlockFormat::Q4_1,
    BlockFormat::Q5_0,
    BlockFormat::Q5_1,
    BlockFormat::Turbo3,
    BlockFormat::Turbo4,
    BlockFormat::Tq5_0,
    BlockFormat::Tq6_0,
];

/// Values per block of the rotated formats when used on flat arrays.
pub const TQ_BLOCK: usize = 128;

enum Kind {
    F16,
    Ggml(GgmlFormat),
    Tq(TqBlock),
}

impl BlockFormat {
    pub fn all() -> &'static [BlockFormat] {
        &ALL
    }

    pub fn names() -> Vec<&'static str> {
        ALL.iter().map(|f| f.name()).collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockFormat::F16 => "f16",
            BlockFormat::Q8_0 => "q8_0",
            BlockFormat::Q4_0 => "q4_0",
            BlockFormat::Q4_1 => "q4_1",
            BlockFormat::Q5_0 => "q5_0",
            BlockFormat::Q5_1 => "q5_1",
            BlockFormat::Turbo3 => "turbo3",
            BlockFormat::Turbo4 => "turbo4",
            BlockFormat::Tq5_0 => "tq5_0",
            BlockFormat::Tq6_0 => "tq6_0",
        }
    }

    pub fn from_name(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        ALL.iter()
            .copied()
            .find(|f| f.name() == lower || (lower == "fp16" && *f == BlockFormat::F16))
            .ok_or_else(|| CodecError::UnknownFormat {
                name: name.to_string(),
                known: Self::names().join(", "),
            })
    }

    fn kind(self) -> Kind {
        self.kind_with(TQ_BLOCK)
    }

    /// Rotated formats code 128-value blocks, or 64-value blocks on rows of 64 (a 64-wide head
    /// vector, as the cache's staging does); other formats ignore the row length.
    fn tq_len_for(row_len: usize) -> usize {
        if row_len == 64 {
            64
        } else {
            TQ_BLOCK
        }
    }

    fn kind_with(self, tq_len: usize) -> Kind {
        let tq = |bits| Kind::Tq(TqBlock { bits, len: tq_len });
        match self {
            BlockFormat::F16 => Kind::F16,
            BlockFormat::Q8_0 => Kind::Ggml(GgmlFormat::Q8_0),
            BlockFormat::Q4_0 => Kind::Ggml(GgmlFormat::Q4_0),
            BlockFormat::Q4_1 => Kind::Ggml(GgmlFormat::Q4_1),
            BlockFormat::Q5_0 => Kind::Ggml(GgmlFormat::Q5_0),
            BlockFormat::Q5_1 => Kind::Ggml(GgmlFormat::Q5_1),
            BlockFormat::Turbo3 => tq(3),
            BlockFormat::Turbo4 => tq(4),
            BlockFormat::Tq5_0 => tq(5),
            BlockFormat::Tq6_0 => tq(6),
        }
    }

    /// Values per block on rows of `row_len` values (see [`encode_rows`]).
    pub fn block_values_for(self, row_len: usize) -> usize {
        match self.kind_with(Self::tq_len_for(row_len)) {
            Kind::F16 => 1,
            Kind::Ggml(_) => QK,
            Kind::Tq(b) => b.len,
        }
    }

    /// Bytes per block on rows of `row_len` values.
    pub fn block_bytes_for(self, row_len: usize) -> usize {
        match self.kind_with(Self::tq_len_for(row_len)) {
            Kind::F16 => 2,
            Kind::Ggml(g) => g.block_bytes(),
            Kind::Tq(b) => b.bytes(),
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self.kind() {
            Kind::F16 => 1,
            Kind::Ggml(_) => QK,
            Kind::Tq(b) => b.len,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self.kind() {
            Kind::F16 => 2,
            Kind::Ggml(g) => g.block_bytes(),
            Kind::Tq(b) => b.bytes(),
        }
    }

    pub fn bits_per_value(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_values() as f64
    }

    /// Whether blocks are Hadamard-rotated before coding (and rotated back on decode).
    pub fn rotated(self) -> bool {
        matches!(self.kind(), Kind::Tq(_))
    }

    /// Encoded size of `values` values, or an error if it is not a whole number of blocks.
    pub fn encoded_len(self, values: usize) -> Result<usize> {
        let bv = self.block_values();
        if !values.is_multiple_of(bv) {
            return Err(CodecError::NotBlockMultiple {
                what: self.name(),
                len: values,
                block: bv,
            });
        }
        Ok(values / bv * self.block_bytes())
    }

    fn encode_block(
        self,
        tq_len: usize,
        rotated: bool,
        block: &[f32],
        out: &mut [u8],
    ) -> Result<()> {
        match self.kind_with(tq_len) {
            Kind::F16 => {
                let h = f16::from_f32(block[0]);
                if !h.is_finite() {
                    return Err(CodecError::ScaleOverflow {
                        what: "f16 value",
                        value: block[0],
                    });
                }
                out.copy_from_slice(&h.to_le_bytes());
                Ok(())
            }
            Kind::Ggml(g) => {
                let (d, m) = block_scales(g, block);
                for s in std::iter::once(d).chain(m) {
                    if !f16::from_f32(s).is_finite() {
                        return Err(CodecError::ScaleOverflow {
                            what: "block scale",
                            value: s,
                        });
                    }
                }
                g.encode_block(block, out);
                Ok(())
            }
            Kind::Tq(b) => {
                let mut rot = [0.0f32; TQ_BLOCK];
                let rot = &mut rot[..b.len];
                rot.copy_from_slice(block);
                if !rotated {
                    fwht_unchecked(rot);
                }
                if b.bits != 6 {
                    return b.encode_rotated(rot, out);
                }
                crate::codec::tq6::encode_row(rot, out);
                let norm = f16::from_le_bytes([out[0], out[1]]);
                if !norm.is_finite() {
                    return Err(CodecError::ScaleOverflow {
                        what: "tq6_0 norm",
                        value: rot.iter().map(|x| x * x).sum::<f32>().sqrt(),
                    });
                }
                Ok(())
            }
        }
    }

    fn decode_block(self, tq_len: usize, rotated: bool, bytes: &[u8], out: &mut [f32]) {
        match self.kind_with(tq_len) {
            Kind::F16 => out[0] = f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
            Kind::Ggml(g) => g.decode_block(bytes, out),
            Kind::Tq(b) => {
                if b.bits == 6 {
                    crate::codec::tq6::decode_row(bytes, out);
                } else {
                    b.decode_rotated(bytes, out);
                }
                if !rotated {
                    fwht_unchecked(out);
                }
            }
        }
    }
}

/// Runs `work` on `threads` threads (`None`: rayon's global pool, one per core).
pub fn with_threads<T: Send>(threads: Option<usize>, work: impl FnOnce() -> T + Send) -> Result<T> {
    match threads {
        None => Ok(work()),
        Some(0) => Err(CodecError::InvalidSetting(
            "threads must be at least 1".into(),
        )),
        Some(n) => {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .map_err(|e| CodecError::ThreadPool(e.to_string()))?;
            Ok(pool.install(work))
        }
    }
}

/// Blocks handed to one parallel task: large enough to amortise scheduling.
const BLOCKS_PER_TASK: usize = 256;

/// Encodes `values` into `out` (exactly `encoded_len` bytes). Validates everything first, so on
/// error `out` is untouched except for a scale overflow found part-way.
pub fn encode_into(
    format: BlockFormat,
    values: &[f32],
    out: &mut [u8],
    threads: Option<usize>,
) -> Result<()> {
    encode_rows_into(format, values, 0, out, threads)
}

/// Encoded size of `values` values on rows of `row_len` (0: any row length).
pub fn encoded_len_rows(format: BlockFormat, values: usize, row_len: usize) -> Result<usize> {
    let bv = format.block_values_for(row_len);
    if !values.is_multiple_of(bv) {
        return Err(CodecError::NotBlockMultiple {
            what: format.name(),
            len: values,
            block: bv,
        });
    }
    Ok(values / bv * format.block_bytes_for(row_len))
}

/// Like [`encode_into`], for rows of `row_len` values: rotated formats use 64-value blocks on
/// rows of 64 (one 64-wide head vector) and 128-value blocks otherwise.
pub fn encode_rows_into(
    format: BlockFormat,
    values: &[f32],
    row_len: usize,
    out: &mut [u8],
    threads: Option<usize>,
) -> Result<()> {
    encode_rows_frame(format, values, row_len, false, out, threads)
}

/// [`encode_rows_into`] with values already in the rotated frame when `rotated` (rotated formats
/// then skip their own rotation; other formats ignore the flag).
pub fn encode_rows_frame(
    format: BlockFormat,
    values: &[f32],
    row_len: usize,
    rotated: bool,
    out: &mut [u8],
    threads: Option<usize>,
) -> Result<()> {
    let expected = encoded_len_rows(format, values.len(), row_len)?;
    if out.len() != expected {
        return Err(CodecError::LengthMismatch {
            what: "encode output bytes",
            expected,
            got: out.len(),
        });
    }
    check_finite(values)?;
    let tq_len = BlockFormat::tq_len_for(row_len);
    let (bv, bb) = (
        format.block_values_for(row_len),
        format.block_bytes_for(row_len),
    );
    with_threads(threads, || {
        values
            .par_chunks(bv * BLOCKS_PER_TASK)
            .zip(out.par_chunks_mut(bb * BLOCKS_PER_TASK))
            .try_for_each(|(vals, bytes)| {
                vals.chunks_exact(bv)
                    .zip(bytes.chunks_exact_mut(bb))
                    .try_for_each(|(v, b)| format.encode_block(tq_len, rotated, v, b))
            })
    })?
}

/// Encodes `values` into a new byte vector.
pub fn encode(format: BlockFormat, values: &[f32], threads: Option<usize>) -> Result<Vec<u8>> {
    encode_rows(format, values, 0, threads)
}

/// Encodes rows of `row_len` values into a new byte vector (see [`encode_rows_into`]).
pub fn encode_rows(
    format: BlockFormat,
    values: &[f32],
    row_len: usize,
    threads: Option<usize>,
) -> Result<Vec<u8>> {
    let mut out = vec![0u8; encoded_len_rows(format, values.len(), row_len)?];
    encode_rows_into(format, values, row_len, &mut out, threads)?;
    Ok(out)
}

/// Decodes `bytes` into `out`, whose length fixes how many values are expected.
pub fn decode_into(
    format: BlockFormat,
    bytes: &[u8],
    out: &mut [f32],
    threads: Option<usize>,
) -> Result<()> {
    decode_rows_into(format, bytes, 0, out, threads)
}

/// Decodes rows of `row_len` values (see [`encode_rows_into`]).
pub fn decode_rows_into(
    format: BlockFormat,
    bytes: &[u8],
    row_len: usize,
    out: &mut [f32],
    threads: Option<usize>,
) -> Result<()> {
    decode_rows_frame(format, bytes, row_len, false, out, threads)
}

/// [`decode_rows_into`] leaving rotated formats' values in the rotated frame when `rotated`.
pub fn decode_rows_frame(
    format: BlockFormat,
    bytes: &[u8],
    row_len: usize,
    rotated: bool,
    out: &mut [f32],
    threads: Option<usize>,
) -> Result<()> {
    let expected = encoded_len_rows(format, out.len(), row_len)?;
    if bytes.len() != expected {
        return Err(CodecError::LengthMismatch {
            what: "encoded bytes",
            expected,
            got: bytes.len(),
        });
    }
    let tq_len = BlockFormat::tq_len_for(row_len);
    let (bv, bb) = (
        format.block_values_for(row_len),
        format.block_bytes_for(row_len),
    );
    with_threads(threads, || {
        bytes
            .par_chunks(bb * BLOCKS_PER_TASK)
            .zip(out.par_chunks_mut(bv * BLOCKS_PER_TASK))
            .for_each(|(bytes, vals)| {
                for (b, v) in bytes.chunks_exact(bb).zip(vals.chunks_exact_mut(bv)) {
                    format.decode_block(tq_len, rotated, b, v);
                }
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names() {
        let expect = [
            ("f16", 1, 2),
            ("q8_0", 32, 34),
            ("q4_0", 32, 18),
            ("q4_1", 32, 20),
            ("q5_0", 32, 22),
            ("q5_1", 32, 24),
            ("turbo3", 128, 50),
            ("turbo4", 128, 66),
            ("tq5_0", 128, 82),
            ("tq6_0", 128, 98),
        ];
        for (name, values, bytes) in expect {
            let f = BlockFormat::from_name(name).unwrap();
            assert_eq!(
                (f.block_values(), f.block_bytes()),
                (values, bytes),
                "{name}"
            );
        }
        assert!((BlockFormat::Tq6_0.bits_per_value() - 6.125).abs() < 1e-12);
        assert!(matches!(
            BlockFormat::from_name("q3_k"),
            Err(CodecError::UnknownFormat { .. })
        ));
    }

    #[test]
    fn bad_input_is_an_error_and_leaves_output_alone() {
        let mut out = vec![7u8; 34];
        let mut x = vec![1.0f32; 32];
        x[3] = f32::INFINITY;
        assert_eq!(
            encode_into(BlockFormat::Q8_0, &x, &mut out, None),
            Err(CodecError::NonFinite { index: 3 })
        );
        assert!(out.iter().all(|&b| b == 7));
        assert!(matches!(
            encode(BlockFormat::Tq6_0, &[0.0; 100], None),
            Err(CodecError::NotBlockMultiple { .. })
        ));
        assert!(matches!(
            encode(BlockFormat::F16, &[1e6], None),
            Err(CodecError::ScaleOverflow { .. })
        ));
        assert!(matches!(
            decode_into(BlockFormat::Q4_0, &[0u8; 17], &mut [0.0; 32], None),
            Err(CodecError::LengthMismatch { .. })
        ));
        assert!(matches!(
            encode(BlockFormat::Q4_0, &[1.0; 32], Some(0)),
            Err(CodecError::InvalidSetting(_))
        ));
    }

    #[test]
    fn rows_of_64_use_64_value_rotated_blocks() {
        let x: Vec<f32> = (0..64 * 6)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 29.0)
            .collect();
        let b = encode_rows(BlockFormat::Tq6_0, &x, 64, None).unwrap();
        assert_eq!(b.len(), 6 * 50);
        let mut y = vec![0.0; x.len()];
        decode_rows_into(BlockFormat::Tq6_0, &b, 64, &mut y, None).unwrap();
        let err: f32 = x
            .iter()
            .zip(&y)
            .map(|(a, c)| (a - c) * (a - c))
            .sum::<f32>()
            / x.iter().map(|a| a * a).sum::<f32>();
        assert!(err < 0.002, "{err}");
        // other formats ignore the row length
        assert_eq!(
            encode_rows(BlockFormat::Q8_0, &x, 64, None).unwrap(),
            encode(BlockFormat::Q8_0, &x, None).unwrap()
        );
        assert!(encode_rows(BlockFormat::Turbo4, &x[..96], 96, None).is_err());
    }

    #[test]
    fn thread_count_does_not_change_bytes() {
        let x: Vec<f32> = (0..128 * 600)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 97.0)
            .collect();
        for &f in BlockFormat::all() {
            let one = encode(f, &x, Some(1)).unwrap();
            let two = encode(f, &x, Some(2)).unwrap();
            assert_eq!(one, two, "{}", f.name());
        }
    }
}
