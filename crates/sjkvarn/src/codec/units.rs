//! Bulk reading of a reference record into the absorbed-scale form attention scores from
//! ([`DecodedHalf`]), into buffers reused record after record.
//!
//! [`super::record::Decoder::q`] defines every code one at a time (the payload order of the
//! layout: fragment order for 4-bit scalar sides, token-major for 2/3-bit scalar sides,
//! channel-major trellis runs). Attention reads thousands of records per call, so this reader
//! walks each payload in storage order instead: token-major streams unpack linearly, and
//! trellis runs read their windows run by run. The tests check it against `Decoder::q` code for
//! code. 4-bit scalar sides (fragment order) are not unpacked at all: attention scores them in
//! place (`attention::fragment_dots`).

use super::layout::{unpack, Body, RecordLayout};
use super::trellis::{codebook_words, window};
use crate::codec::extension::body::DecodedHalf;
use crate::error::{CodecError, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// `out[i] = fp16 at byte offset at(i) of rec`, for `i < n`: gathered into `halves`, then
/// converted in one slice call (F16C where the CPU has it; the conversion is exact either way).
#[inline(always)]
fn scale_field(
    rec: &[u8],
    halves: &mut Vec<f16>,
    out: &mut Vec<f32>,
    n: usize,
    at: impl Fn(usize) -> usize,
) {
    halves.clear();
    halves.extend((0..n).map(|i| {
        let off = at(i);
        f16::from_bits(u16::from_le_bytes([rec[off], rec[off + 1]]))
    }));
    out.resize(n, 0.0);
    halves.convert_to_f32_slice(out);
}

/// `out[i] = fp16 at byte offset start + 2i of rec`, for `i < n`: one slice conversion
/// straight from the record where its bytes are 2-aligned (little-endian targets), else
/// through [`scale_field`].
#[inline(always)]
fn scale_run(rec: &[u8], halves: &mut Vec<f16>, out: &mut Vec<f32>, n: usize, start: usize) {
    out.resize(n, 0.0);
    // SAFETY: every bit pattern is a valid u16; `align_to` only yields the aligned middle.
    let (pre, mid, _) = unsafe { rec[start..start + 2 * n].align_to::<u16>() };
    if cfg!(target_endian = "little") && pre.is_empty() && mid.len() == n {
        use half::slice::HalfBitsSliceExt;
        mid.reinterpret_cast::<f16>().convert_to_f32_slice(out);
    } else {
        scale_field(rec, halves, out, n, |i| start + 2 * i);
    }
}

/// `out[c] = fp16 number slots[c] of the field at byte `start` of rec` (a per-channel field
/// stored in slot order): on AVX-512 by word permutes over the field held in registers (up to
/// 512 entries, 32 at a time), else through [`scale_field`]. The conversion is exact either way.
#[inline(always)]
fn scale_slots(rec: &[u8], halves: &mut Vec<f16>, out: &mut Vec<f32>, start: usize, slots: &[u16]) {
    let n = slots.len();
    out.resize(n, 0.0);
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx512() && n.is_multiple_of(32) && n <= 512 {
        // SAFETY: the CPU reported AVX-512 F/BW; the field's `2n` bytes are in `rec` (the
        // slice below checks it), every slot is below `n` (a layout permutation), and `out`
        // holds `n` values.
        unsafe { gather_slots_avx512(&rec[start..start + 2 * n], slots, out) };
        return;
    }
    scale_field(rec, halves, out, n, |c| start + 2 * slots[c] as usize);
}

/// [`scale_slots`] on AVX-512: the field's `n / 32` vectors in registers, one two-register
/// word permute per pair of them, blended by the slot's pair.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn gather_slots_avx512(field: &[u8], slots: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = slots.len();
    let regs = n / 32;
    assert!(field.len() == 2 * n && out.len() >= n && regs <= 16 && n.is_multiple_of(32));
    let mut src = [_mm512_setzero_si512(); 16];
    for (r, v) in src.iter_mut().enumerate().take(regs) {
        // SAFETY: 64 bytes at `64 r` of the `2n`-byte field.
        *v = _mm512_loadu_si512(field.as_ptr().add(64 * r) as *const __m512i);
    }
    for j in 0..regs {
        // SAFETY: 32 slots at `32 j`; 32 floats stored at `32 j` of `out` (checked above).
        let idx = _mm512_loadu_si512(slots.as_ptr().add(32 * j) as *const __m512i);
        let pair = _mm512_srli_epi16::<6>(idx);
        let mut acc = _mm512_permutex2var_epi16(src[0], idx, src[1]);
        for p in 1..regs.div_ceil(2) {
            let r = _mm512_permutex2var_epi16(src[2 * p], idx, src[2 * p + 1]);
            let m = _mm512_cmpeq_epi16_mask(pair, _mm512_set1_epi16(p as i16));
            acc = _mm512_mask_blend_epi16(m, acc, r);
        }
        let o = out.as_mut_ptr().add(32 * j);
        _mm512_storeu_ps(o, _mm512_cvtph_ps(_mm512_castsi512_si256(acc)));
        _mm512_storeu_ps(
            o.add(16),
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(acc)),
        );
    }
}

/// Reads reference records of one layout; tables are built once.
#[derive(Debug, Clone)]
pub struct UnitReader {
    layout: RecordLayout,
    /// Trellis codebooks in 16-bit fixed point (K, V) and their steps; empty for scalar
    /// bodies.
    words: [Vec<i16>; 2],
    steps: [f32; 2],
    k_slot: Vec<u16>,
    v_slot: Vec<u16>,
    /// Token-major codes of one side before the K transpose.
    scratch: Vec<u8>,
    /// One scale field's fp16 values, gathered.
    halves: Vec<f16>,
}

impl UnitReader {
    pub fn new(layout: RecordLayout) -> Self {
        let ((k_words, k_step), (v_words, v_step)) = if layout.body == Body::Trellis {
            (
                codebook_words(layout.bits_k, false),
                codebook_words(layout.bits_v, true),
            )
        } else {
            ((Vec::new(), 0.0), (Vec::new(), 0.0))
        };
        let d = layout.head_dim;
        Self {
            layout,
            words: [k_words, v_words],
            steps: [k_step, v_step],
            k_slot: (0..d).map(|c| layout.k_channel_slot(c) as u16).collect(),
            v_slot: (0..d).map(|c| layout.v_channel_slot(c) as u16).collect(),
            scratch: vec![0u8; d * layout.group],
            halves: Vec::with_capacity(d.max(layout.group)),
        }
    }

    pub fn layout(&self) -> &RecordLayout {
        &self.layout
    }

    /// Fills `out` (buffers resized as needed) with record `rec`: units `k_units[c][t]`,
    /// `v_units[t][c]` (trellis sides: codebook words `k_words` / `v_words`, `[c][t]`), and
    /// the fp16 scale fields as f32.
    #[inline(always)]
    pub fn read(&mut self, rec: &[u8], out: &mut DecodedHalf) -> Result<()> {
        let l = self.layout;
        if rec.len() != l.bytes {
            return Err(CodecError::LengthMismatch {
                what: "body record",
                expected: l.bytes,
                got: rec.len(),
            });
        }
        let (d, g) = (l.head_dim, l.group);
        out.k_fragments = self.fragments(false);
        out.v_fragments = self.fragments(true);
        if l.body == Body::Trellis {
            for (is_v, words) in [(false, &mut out.k_words), (true, &mut out.v_words)] {
                words.resize(d * g, 0);
                self.trellis_side(rec, is_v, words);
            }
            out.word_steps = Some(self.steps);
        } else {
            out.word_steps = None;
            for buf in [&mut out.k_units, &mut out.v_units] {
                buf.resize(d * g, 0.0);
            }
            if out.k_fragments.is_none() {
                self.scalar_side(rec, false, &mut out.k_units);
            }
            if out.v_fragments.is_none() {
                self.scalar_side(rec, true, &mut out.v_units);
            }
        }
        let (k_slot, v_slot, halves) = (&self.k_slot, &self.v_slot, &mut self.halves);
        scale_slots(rec, halves, &mut out.a_k, l.k_scale, k_slot);
        scale_slots(rec, halves, &mut out.z_k, l.k_zero, k_slot);
        scale_run(rec, halves, &mut out.s_k, g, l.k_tok);
        scale_run(rec, halves, &mut out.a_v, g, l.v_scale);
        scale_run(rec, halves, &mut out.z_v, g, l.v_zero);
        scale_slots(rec, halves, &mut out.s_v, l.v_ch, v_slot);
        Ok(())
    }

    /// The byte range of a side whose codes attention reads in place (4-bit scalar sides in
    /// fragment order: `attention::fragment_dots`), or `None` for sides read into units.
    fn fragments(&self, is_v: bool) -> Option<std::ops::Range<usize>> {
        let l = self.layout;
        let (start, end) = if is_v {
            (l.v_payload, l.k_scale)
        } else {
            (l.k_payload, l.v_payload)
        };
        l.fragment_order(is_v).then_some(start..end)
    }

    /// One trellis side's codebook words, channel-major (`[c * G + t]`): each run of `G`
    /// codes is one channel, each code's word its window's entry.
    #[inline(always)]
    fn trellis_side(&self, rec: &[u8], is_v: bool, out: &mut [i16]) {
        let l = self.layout;
        let (d, g) = (l.head_dim, l.group);
        let bits = l.bits(is_v);
        let payload_len = l.payload(rec, is_v).len();
        let cb = &self.words[is_v as usize];
        let start = if is_v { l.v_payload } else { l.k_payload };
        let out = &mut out[..d * g];
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx512() && g.is_multiple_of(64) && (bits == 2 || bits == 3) {
            // SAFETY: the CPU reported AVX-512 F/BW/VL/DQ (and VBMI for that reader); the
            // kernel reads 8 or 16 bytes at a time only where they end inside `rec`, writes
            // `d * g` words, and the codebook has `1 << (6 + bits)` entries (256 or 512),
            // indexed by windows of `6 + bits` bits.
            unsafe {
                match (crate::simd::avx512_vbmi(), bits) {
                    (true, 2) => trellis_side_vbmi::<4>(rec, start, bits, g, cb, out),
                    (true, _) => trellis_side_vbmi::<8>(rec, start, bits, g, cb, out),
                    (false, 2) => trellis_side_avx512::<4>(rec, start, bits, g, cb, out),
                    (false, _) => trellis_side_avx512::<8>(rec, start, bits, g, cb, out),
                }
            }
            return;
        }
        for (c, run) in out.chunks_exact_mut(g).enumerate() {
            trellis_run(rec, start, payload_len, bits, c, cb, run);
        }
    }

    /// One scalar side's units: keys channel-major (`[c * G + t]`), values token-major
    /// (`[t * D + c]`).
    #[inline(always)]
    fn scalar_side(&mut self, rec: &[u8], is_v: bool, out: &mut [f32]) {
        let l = self.layout;
        let (d, g) = (l.head_dim, l.group);
        let bits = l.bits(is_v);
        let payload = l.payload(rec, is_v);
        // Token-major stream: unpack linearly, then place (a transpose for keys).
        let codes = &mut self.scratch[..d * g];
        unpack_linear(payload, bits, codes);
        if is_v {
            for (o, &q) in out.iter_mut().zip(codes.iter()) {
                *o = q as f32;
            }
        } else {
            for t in 0..g {
                for c in 0..d {
                    out[c * g + t] = codes[t * d + c] as f32;
                }
            }
        }
    }
}

/// The words of trellis run `c` (`out.len()` codes) of the payload at `rec[start..start +
/// len]`: code `t`'s word is the codebook entry of its window, the `6 + bits` stream bits
/// ending with it, with zeros before the run's first code ([`window`]).
#[inline(always)]
fn trellis_run(
    rec: &[u8],
    start: usize,
    len: usize,
    bits: u32,
    c: usize,
    cb: &[i16],
    out: &mut [i16],
) {
    let payload = &rec[start..start + len];
    let g = out.len();
    for (t, o) in out.iter_mut().enumerate() {
        *o = cb[window(payload, bits, c, t, g)];
    }
}

/// Every run of one trellis side (`out.len() / g` runs of `g` codes) as [`trellis_run`]
/// gives them, with AVX-512: 16 windows per 8-byte read, 32 looked up per step in the word
/// codebook held in registers (`PAIRS` pairs of 32 entries: 4 for 256 entries, 8 for 512;
/// word permutes pick within a pair, bits 6.. of the window pick the pair).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn trellis_side_avx512<const PAIRS: usize>(
    rec: &[u8],
    start: usize,
    bits: u32,
    g: usize,
    cb16: &[i16],
    out: &mut [i16],
) {
    use super::trellis::HISTORY_BITS;
    use std::arch::x86_64::*;
    assert_eq!(cb16.len(), 64 * PAIRS);
    let mask = _mm512_set1_epi32((1 << (HISTORY_BITS + bits)) - 1);
    let steps = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    let bits64 = _mm512_set1_epi64(bits as i64);
    let (shifts_lo, shifts_hi) = (
        _mm512_mullo_epi64(steps, bits64),
        _mm512_mullo_epi64(_mm512_add_epi64(steps, _mm512_set1_epi64(8)), bits64),
    );
    // Windows of codes t0..t0 + 16 of the run starting at stream bit `run_bit`, as 16 u32
    // lanes: the stream bits from 6 before code t0 (zeros before the run) in one u64, window
    // j starting `j * bits` bits in.
    let windows16 = |run_bit: usize, t0: usize| -> __m512i {
        let (from, pad) = if t0 == 0 {
            (run_bit, HISTORY_BITS)
        } else {
            (run_bit + t0 * bits as usize - HISTORY_BITS as usize, 0)
        };
        let word = if start + from / 8 + 8 <= rec.len() {
            // SAFETY: the 8 bytes end inside `rec` (checked just above).
            (rec.as_ptr().add(start + from / 8) as *const u64).read_unaligned()
        } else {
            // The record's last bytes: the same bits one byte at a time.
            let mut w = 0u64;
            for (k, &b) in rec[start + from / 8..].iter().take(8).enumerate() {
                w |= (b as u64) << (8 * k);
            }
            w
        };
        let word = _mm512_set1_epi64(((word >> (from % 8)) << pad) as i64);
        let lo = _mm512_srlv_epi64(word, shifts_lo);
        let hi = _mm512_srlv_epi64(word, shifts_hi);
        let idx = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtepi64_epi32(lo)),
            _mm512_cvtepi64_epi32(hi),
        );
        _mm512_and_si512(idx, mask)
    };
    trellis_runs::<PAIRS>(g, bits, cb16, out, |run_bit, t0| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtepi32_epi16(windows16(run_bit, t0))),
            _mm512_cvtepi32_epi16(windows16(run_bit, t0 + 16)),
        )
    });
}

/// [`trellis_side_avx512`] with VBMI, 64 codes a step: one 32-byte read, one byte permute
/// that gives each 64-bit lane the stream bytes of its eight tokens, and one multishift
/// (`vpmultishiftqb`) that cuts each token's window bits 0-7 out of its lane (a second one,
/// one bit further, gives bit 8 of 9-bit windows); looked up by byte permutes
/// ([`trellis_runs_bytes`]), in the token order that lookup wants.
/// Runs start byte-aligned (`g * bits` is a multiple of 8, as are 8-code groups), so the window
/// of token `T + j` (`T` a multiple of 8) starts `bits * j + 2` bits into the bytes from one
/// before the stream byte of token `T` (a zero byte before a run's first step: the run's zero
/// history).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")]
unsafe fn trellis_side_vbmi<const PAIRS: usize>(
    rec: &[u8],
    start: usize,
    bits: u32,
    g: usize,
    cb16: &[i16],
    out: &mut [i16],
) {
    use std::arch::x86_64::*;
    let b = bits as usize;
    assert!((g * b).is_multiple_of(8) && (b == 2 || b == 3) && g.is_multiple_of(64));
    // Lane `Q` of the step holds the tokens `BYTE_TOKEN[8 Q]..` (eight in a row): its bytes
    // are the stream bytes from that token's, counted from one before the step's first byte.
    let lane_bytes: [u8; 64] =
        std::array::from_fn(|p| (b * BYTE_TOKEN[8 * (p / 8)] / 8 + p % 8) as u8);
    // The first step of a run reads from its first byte: one less, and a zero for the byte
    // before it.
    let first_bytes: [u8; 64] = std::array::from_fn(|p| lane_bytes[p].saturating_sub(1));
    let first_zero: u64 = !(0..64).fold(0u64, |m, p| m | (((lane_bytes[p] == 0) as u64) << p));
    let low: [u8; 64] = std::array::from_fn(|p| (b * (p % 8) + 2) as u8);
    let high: [u8; 64] = std::array::from_fn(|p| (b * (p % 8) + 3) as u8);
    let load = |v: &[u8; 64]| _mm512_loadu_si512(v.as_ptr() as *const __m512i);
    let (lane_bytes, first_bytes) = (load(&lane_bytes), load(&first_bytes));
    let (low, high) = (load(&low), load(&high));
    // 32 bytes from `at` (zeros past the record's end: a masked load reads none of them).
    let bytes32 = |at: usize| -> __m512i {
        let valid = rec.len().saturating_sub(at).min(32);
        let mask: __mmask32 = if valid == 32 { !0 } else { (1u32 << valid) - 1 };
        // SAFETY: the mask keeps the read to the `valid` bytes that lie inside `rec`.
        _mm512_zextsi256_si512(_mm256_maskz_loadu_epi8(
            mask,
            rec.as_ptr().add(at) as *const i8,
        ))
    };
    trellis_runs_bytes::<PAIRS>(g, bits, cb16, out, |run_bit, t0| {
        let first = start + (run_bit + t0 * b) / 8;
        let lanes = if t0 == 0 {
            _mm512_maskz_permutexvar_epi8(first_zero, first_bytes, bytes32(first))
        } else {
            _mm512_permutexvar_epi8(lane_bytes, bytes32(first - 1))
        };
        let idx = _mm512_multishift_epi64_epi8(low, lanes);
        let bit8 = if b == 3 {
            _mm512_movepi8_mask(_mm512_multishift_epi64_epi8(high, lanes))
        } else {
            0
        };
        (idx, bit8)
    });
}

/// Token of byte `p` of a lookup step ([`trellis_runs_bytes`]): byte `16 L + 8 h + j` takes
/// token `32 h + 8 L + j`, so that interleaving the low and high byte planes lane by lane
/// (`vpunpck[lh]bw`) gives the words in token order.
#[cfg(target_arch = "x86_64")]
const BYTE_TOKEN: [usize; 64] = {
    let mut t = [0; 64];
    let mut p = 0;
    while p < 64 {
        t[p] = 32 * ((p % 16) / 8) + 8 * (p / 16) + p % 8;
        p += 1;
    }
    t
};

/// The shared step of both trellis readers: for each run (`g` codes at stream bit
/// `c * g * bits`) and each 32-code step `t0`, `windows32(run_bit, t0)` gives the 32 windows
/// as 16-bit lanes; they are looked up in the word codebook held in registers and stored.
/// Inlined into each reader, so it runs on that reader's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn trellis_runs<const PAIRS: usize>(
    g: usize,
    bits: u32,
    cb16: &[i16],
    out: &mut [i16],
    windows32: impl Fn(usize, usize) -> std::arch::x86_64::__m512i,
) {
    use std::arch::x86_64::*;
    assert_eq!(cb16.len(), 64 * PAIRS);
    // SAFETY (loads): the codebook has 64 * PAIRS entries, read as 2 * PAIRS vectors of 32.
    let table = |k: usize| _mm512_loadu_si512(cb16.as_ptr().add(32 * k) as *const __m512i);
    let even: [__m512i; PAIRS] = std::array::from_fn(|k| table(2 * k));
    let odd: [__m512i; PAIRS] = std::array::from_fn(|k| table(2 * k + 1));
    let select: [__m512i; 3] = std::array::from_fn(|l| _mm512_set1_epi16(64 << l));
    for (c, run) in out.chunks_exact_mut(g).enumerate() {
        let run_bit = c * g * bits as usize;
        for t0 in (0..g).step_by(32) {
            let idx = windows32(run_bit, t0);
            let mut level: [__m512i; PAIRS] =
                std::array::from_fn(|k| _mm512_permutex2var_epi16(even[k], idx, odd[k]));
            let mut alive = PAIRS;
            for sel in select.iter().take(PAIRS.trailing_zeros() as usize) {
                let upper = _mm512_test_epi16_mask(idx, *sel);
                for k in 0..alive / 2 {
                    level[k] = _mm512_mask_blend_epi16(upper, level[2 * k], level[2 * k + 1]);
                }
                alive /= 2;
            }
            // SAFETY: `t0 + 32 <= g = run.len()`.
            _mm512_storeu_si512(run.as_mut_ptr().add(t0) as *mut __m512i, level[0]);
        }
    }
}

/// [`trellis_runs`] with VBMI byte permutes, 64 codes a step: the codebook split into its low
/// and high bytes, each plane `PAIRS / 2` tables of 128 (`vpermi2b` looks up 64 bytes in one
/// table from the window's bits 0-6; bits 7 and 8 pick the table), and the two planes
/// interleaved back into words. `windows64(run_bit, t0)` gives the step's window bits 0-7 as
/// bytes in [`BYTE_TOKEN`] order, and bit 8 of each as a mask (512-entry codebooks).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")]
unsafe fn trellis_runs_bytes<const PAIRS: usize>(
    g: usize,
    bits: u32,
    cb16: &[i16],
    out: &mut [i16],
    windows64: impl Fn(usize, usize) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__mmask64),
) {
    use std::arch::x86_64::*;
    assert!(cb16.len() == 64 * PAIRS && (PAIRS == 4 || PAIRS == 8) && g.is_multiple_of(64));
    // SAFETY (loads): the codebook has 64 * PAIRS words, read as 2 * PAIRS vectors of 32.
    let word_vec = |k: usize| _mm512_loadu_si512(cb16.as_ptr().add(32 * k) as *const __m512i);
    // Plane vector k: bytes of entries 64k..64k + 64 (low bytes, or high with `high`).
    let plane = |k: usize, high: bool| {
        let (a, b) = (word_vec(2 * k), word_vec(2 * k + 1));
        let (a, b) = if high {
            (_mm512_srli_epi16::<8>(a), _mm512_srli_epi16::<8>(b))
        } else {
            (a, b)
        };
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
            _mm512_cvtepi16_epi8(b),
        )
    };
    let lo: [__m512i; PAIRS] = std::array::from_fn(|k| plane(k, false));
    let hi: [__m512i; PAIRS] = std::array::from_fn(|k| plane(k, true));
    // One plane's bytes for the step: four (or two) table lookups, blended by bits 7 and 8.
    let look = |planes: &[__m512i; PAIRS], idx: __m512i, bit7: __mmask64, bit8: __mmask64| {
        let t = |k: usize| _mm512_permutex2var_epi8(planes[2 * k], idx, planes[2 * k + 1]);
        let low = _mm512_mask_blend_epi8(bit7, t(0), t(1));
        if PAIRS == 8 {
            _mm512_mask_blend_epi8(bit8, low, _mm512_mask_blend_epi8(bit7, t(2), t(3)))
        } else {
            low
        }
    };
    for (c, run) in out.chunks_exact_mut(g).enumerate() {
        let run_bit = c * g * bits as usize;
        for t0 in (0..g).step_by(64) {
            let (idx, bit8) = windows64(run_bit, t0);
            let bit7 = _mm512_movepi8_mask(idx);
            let (l, h) = (look(&lo, idx, bit7, bit8), look(&hi, idx, bit7, bit8));
            // SAFETY: `t0 + 64 <= g = run.len()`.
            let o = run.as_mut_ptr().add(t0) as *mut __m512i;
            _mm512_storeu_si512(o, _mm512_unpacklo_epi8(l, h));
            _mm512_storeu_si512(o.add(1), _mm512_unpackhi_epi8(l, h));
        }
    }
}

/// Unpacks consecutive `bits`-bit codes (LSB first) into `out`.
#[inline(always)]
fn unpack_linear(stream: &[u8], bits: u32, out: &mut [u8]) {
    match bits {
        2 => {
            for (o, &b) in out.chunks_exact_mut(4).zip(stream) {
                o.copy_from_slice(&[b & 3, (b >> 2) & 3, (b >> 4) & 3, b >> 6]);
            }
        }
        4 => {
            for (o, &b) in out.chunks_exact_mut(2).zip(stream) {
                o.copy_from_slice(&[b & 15, b >> 4]);
            }
        }
        3 => {
            for (o, b) in out.chunks_exact_mut(8).zip(stream.chunks_exact(3)) {
                let w = b[0] as u32 | (b[1] as u32) << 8 | (b[2] as u32) << 16;
                for (i, x) in o.iter_mut().enumerate() {
                    *x = ((w >> (3 * i)) & 7) as u8;
                }
            }
        }
        _ => {
            for (i, x) in out.iter_mut().enumerate() {
                *x = unpack(stream, i * bits as usize, bits) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::record::Decoder;
    use crate::rng::SplitMix64;

    fn scalar_4bit(body: Body, bits: u32) -> bool {
        body == Body::Scalar && bits == 4
    }

    #[test]
    fn every_code_and_scale_matches_the_per_code_decoder() {
        let cases = [
            (4, 4, Body::Scalar),
            (4, 3, Body::Scalar),
            (4, 2, Body::Scalar),
            (3, 3, Body::Scalar),
            (3, 2, Body::Scalar),
            (2, 4, Body::Scalar),
            (2, 2, Body::Scalar),
            (3, 3, Body::Trellis),
            (3, 2, Body::Trellis),
            (2, 2, Body::Trellis),
        ];
        let mut rng = SplitMix64::new(11);
        for d in [64usize, 128, 256] {
            for &(k, v, body) in &cases {
                let layout = RecordLayout::new(d, 128, k, v, body).unwrap();
                // Random bytes: every code pattern; the scale fields are whatever fp16 they spell.
                let rec: Vec<u8> = (0..layout.bytes).map(|_| rng.next_u64() as u8).collect();
                let mut reader = UnitReader::new(layout);
                let mut got = DecodedHalf::empty();
                reader.read(&rec, &mut got).unwrap();
                let dec = Decoder::new(layout);
                // Fragment sides are read in place (their sums are checked against the
                // layout in `attention::fragment_dots`): exactly the side's payload bytes.
                for (is_v, range) in [(false, &got.k_fragments), (true, &got.v_fragments)] {
                    let fragment = scalar_4bit(body, if is_v { v } else { k });
                    assert_eq!(range.is_some(), fragment, "{d} {k}/{v} {body:?}");
                    if let Some(r) = range {
                        assert_eq!(&rec[r.clone()], layout.payload(&rec, is_v));
                    }
                }
                // Trellis sides are read as codebook words: each the code's value over the
                // side's step, rounded (`codebook_words`).
                assert_eq!(got.word_steps.is_some(), body == Body::Trellis);
                let word = |value: f32, step: f32| (value / step).round_ties_even() as i16;
                for c in 0..d {
                    for t in 0..128 {
                        let (kq, vq) = (dec.q(&rec, t, c, false), dec.q(&rec, t, c, true));
                        if let Some([ks, vs]) = got.word_steps {
                            assert_eq!(got.k_words[c * 128 + t], word(kq, ks));
                            assert_eq!(got.v_words[c * 128 + t], word(vq, vs));
                            continue;
                        }
                        if got.k_fragments.is_none() {
                            assert_eq!(got.k_units[c * 128 + t].to_bits(), kq.to_bits());
                        }
                        if got.v_fragments.is_none() {
                            assert_eq!(got.v_units[t * d + c].to_bits(), vq.to_bits());
                        }
                    }
                }
                let want = super::super::body_codec::reference_half(&layout, &rec).unwrap();
                for (a, b) in [
                    (&got.a_k, &want.a_k),
                    (&got.z_k, &want.z_k),
                    (&got.s_k, &want.s_k),
                    (&got.a_v, &want.a_v),
                    (&got.z_v, &want.z_v),
                    (&got.s_v, &want.s_v),
                ] {
                    let bits = |x: &Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(a), bits(b), "{d} {k}/{v} {body:?}");
                }
                assert!(reader.read(&rec[1..], &mut got).is_err());
            }
        }
    }

    /// Each AVX-512 trellis reader this CPU has (plain, and VBMI where present) gives the
    /// portable per-run values bit for bit; the reader test above only sees the one `read`
    /// picks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_trellis_readers_equal_the_portable_runs() {
        if !crate::simd::avx512() {
            eprintln!("no AVX-512 here: the portable runs are checked by the reader test");
            return;
        }
        let mut rng = SplitMix64::new(13);
        for d in [64usize, 256] {
            for (k, v) in [(3u32, 3u32), (3, 2), (2, 2)] {
                let layout = RecordLayout::new(d, 128, k, v, Body::Trellis).unwrap();
                let rec: Vec<u8> = (0..layout.bytes).map(|_| rng.next_u64() as u8).collect();
                for (is_v, bits) in [(false, k), (true, v)] {
                    let start = if is_v {
                        layout.v_payload
                    } else {
                        layout.k_payload
                    };
                    let len = layout.payload(&rec, is_v).len();
                    let (cb, _) = codebook_words(bits, is_v);
                    let mut want = vec![0i16; d * 128];
                    for (c, run) in want.chunks_exact_mut(128).enumerate() {
                        trellis_run(&rec, start, len, bits, c, &cb, run);
                    }
                    let cb16 = &cb[..];
                    let mut readers = vec!["avx512"];
                    if crate::simd::avx512_vbmi() {
                        readers.push("vbmi");
                    }
                    for reader in readers {
                        let mut got = vec![0i16; d * 128];
                        // SAFETY: AVX-512 (and VBMI for that reader) present, checked above;
                        // sizes as `read_side` uses.
                        unsafe {
                            match (reader, bits) {
                                ("vbmi", 2) => {
                                    trellis_side_vbmi::<4>(&rec, start, bits, 128, cb16, &mut got)
                                }
                                ("vbmi", _) => {
                                    trellis_side_vbmi::<8>(&rec, start, bits, 128, cb16, &mut got)
                                }
                                (_, 2) => {
                                    trellis_side_avx512::<4>(&rec, start, bits, 128, cb16, &mut got)
                                }
                                _ => {
                                    trellis_side_avx512::<8>(&rec, start, bits, 128, cb16, &mut got)
                                }
                            }
                        }
                        assert!(want == got, "{reader}: D {d} {k}/{v} is_v {is_v}");
                    }
                }
            }
        }
    }
}
