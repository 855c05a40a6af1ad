//! The data the CUDA kernels take, laid out exactly as the C structs in this crate's
//! `cuda/sj_layer.cuh`, and the kernel source text with its headers inlined.
//!
//! Nothing here needs CUDA: the host tests (`crates/sjkvarn-cuda-host`) build the same structs
//! over host memory and run the kernels' lane functions on the CPU, and the `cuda` feature fills
//! them with device addresses. The device backend implements the SJ-KVaRN reference bodies only
//! ([`device_layout`]).

use crate::codec::codebooks::{TQ6_CENTROIDS, TQ6_MIDPOINTS};
use crate::codec::{Body, RecordLayout, GROUP};
use crate::journal::Staging;

/// `SJ_STAGING_*`: how ring rows are staged (all in the rotated frame), numbered by
/// [`Staging::code`].
pub const STAGING_TQ6: i32 = Staging::Tq6.code() as i32;
/// ggml `q8_0` blocks (read by attention and the seal's gather; not produced by the kernels).
pub const STAGING_Q8_0: i32 = Staging::Q8_0.code() as i32;
pub const STAGING_F16: i32 = Staging::F16.code() as i32;

/// Mirrors `SjRecordLayout`: the byte offsets of [`RecordLayout`] plus the fragment flags.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelRecordLayout {
    pub head_dim: i32,
    pub group: i32,
    pub bits_k: i32,
    pub bits_v: i32,
    /// `SJ_BODY_SCALAR` (0) or `SJ_BODY_TRELLIS` (1).
    pub body: i32,
    pub k_frag: i32,
    pub v_frag: i32,
    pub pad0: i32,
    pub k_payload: i32,
    pub v_payload: i32,
    pub k_scale: i32,
    pub k_zero: i32,
    pub k_tok: i32,
    pub v_ch: i32,
    pub v_scale: i32,
    pub v_zero: i32,
    pub bytes: i32,
    pub pad1: i32,
}

/// Mirrors `SjLayerView`: one layer of one sequence; addresses are device (or, in the host
/// tests, host) pointers.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelLayerView {
    /// `[SINK][kv_heads][head_dim]` rotated fp16.
    pub sink_k: u64,
    pub sink_v: u64,
    /// `[ring_rows][kv_heads][2][row_bytes]` rotated staged rows.
    pub ring: u64,
    /// Slot-major record arena; the record of KV head `h` at `h * rec.bytes` in its slot.
    pub pool: u64,
    /// Slot of each sealed group (`u32`).
    pub blocks: u64,
    /// [`tq6_tables`] of the head's block size (127 `f32`).
    pub tq_table: u64,
    /// [`codebook_f32`] of each side (trellis bodies), else 0.
    pub k_codebook: u64,
    pub v_codebook: u64,
    pub slot_bytes: u64,
    pub len: i32,
    pub sealed: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub ring_rows: i32,
    pub row_bytes: i32,
    pub staging: i32,
    pub pad: i32,
    pub rec: KernelRecordLayout,
}

impl KernelRecordLayout {
    pub fn of(l: &RecordLayout) -> Self {
        let i = |v: usize| v as i32;
        Self {
            head_dim: i(l.head_dim),
            group: i(l.group),
            bits_k: l.bits_k as i32,
            bits_v: l.bits_v as i32,
            body: l.body as i32,
            k_frag: l.fragment_order(false) as i32,
            v_frag: l.fragment_order(true) as i32,
            pad0: 0,
            k_payload: i(l.k_payload),
            v_payload: i(l.v_payload),
            k_scale: i(l.k_scale),
            k_zero: i(l.k_zero),
            k_tok: i(l.k_tok),
            v_ch: i(l.v_ch),
            v_scale: i(l.v_scale),
            v_zero: i(l.v_zero),
            bytes: i(l.bytes),
            pad1: 0,
        }
    }
}

/// The record layout the device backend uses for a layer, or why it has none: the reference
/// bodies only (scalar 2..4 bits per side; trellis 3/3, 3/2, 2/2), group 128, head_dim 64
/// (the sjkvarn 64-wide extension), 128, 256 or 512.
pub fn device_layout(
    head_dim: usize,
    bits_k: u32,
    bits_v: u32,
    body: Body,
) -> Result<RecordLayout, String> {
    if ![64, 128, 256, 512].contains(&head_dim) {
        return Err(format!(
            "head_dim {head_dim} (the device kernels support 64, 128, 256 and 512)"
        ));
    }
    RecordLayout::new(head_dim, GROUP, bits_k, bits_v, body).map_err(|e| {
        format!(
            "{bits_k}/{bits_v}-bit {} body: {e} (the device kernels support scalar 2..4 bits \
             per side and trellis 3/3, 3/2, 2/2)",
            body.name()
        )
    })
}

/// The `tq6_0` tables the kernels take for rows of `head_dim` values: 64 centroids then 63
/// midpoints of the block size (128, or 64 for 64-wide heads: the tables times sqrt 2 in f32,
/// exactly as `codec::tq6` scales them).
pub fn tq6_tables(head_dim: usize) -> Vec<f32> {
    let scale = |v: f32| {
        if head_dim == 64 {
            v * std::f32::consts::SQRT_2
        } else {
            v
        }
    };
    TQ6_CENTROIDS
        .iter()
        .chain(TQ6_MIDPOINTS.iter())
        .map(|&v| scale(v))
        .collect()
}

/// A side's trellis codebook as the kernels read it (`2^(6 + bits)` f32).
pub fn codebook_f32(bits: u32, is_v: bool) -> Vec<f32> {
    crate::codec::trellis::codebook_f32(bits, is_v)
}

/// Trellis lane groups per seal block (`SJ_SEAL_GROUPS`).
const SEAL_GROUPS: usize = 4;
/// `SJ_VITERBI_BYTES`: metrics, targets and choices of one lane group.
const VITERBI_BYTES: usize = 2 * 64 * 4 + GROUP * 4 + GROUP * 64;

/// `sj_seal_scratch_bytes(head_dim)`: the scratch of one seal block.
pub fn seal_scratch_bytes(head_dim: usize) -> usize {
    let (d, g) = (head_dim, GROUP);
    let big = d.max(g);
    2 * 8 * big
        + 2 * 4 * d * g
        + 4 * 4 * big
        + SEAL_GROUPS * VITERBI_BYTES
        + 16
        + 2 * 2 * d * g
        + d * g
}

/// Device workspace per seal block (the scratch rounded up to 256 bytes, as `sj_seal` strides).
pub fn seal_workspace_bytes(head_dim: usize) -> usize {
    seal_scratch_bytes(head_dim).div_ceil(256) * 256
}

/// Floats of dynamic shared memory per attention block (`GS * head_dim` rotated queries plus
/// `sj_attend_scratch_floats(GS)`).
pub fn attend_shared_floats(group: usize, head_dim: usize) -> usize {
    group * head_dim + group * (2 * GROUP + 256 + 2) + 8 * GROUP
}

/// Kernel sources by file name, embedded at build time.
pub const KERNEL_FILES: [(&str, &str); 8] = [
    ("sjkvarn.cu", include_str!("../cuda/sjkvarn.cu")),
    ("sj_common.cuh", include_str!("../cuda/sj_common.cuh")),
    ("sj_hadamard.cuh", include_str!("../cuda/sj_hadamard.cuh")),
    ("sj_staging.cuh", include_str!("../cuda/sj_staging.cuh")),
    ("sj_layer.cuh", include_str!("../cuda/sj_layer.cuh")),
    ("sj_seal.cuh", include_str!("../cuda/sj_seal.cuh")),
    ("sj_trellis.cuh", include_str!("../cuda/sj_trellis.cuh")),
    ("sj_attention.cuh", include_str!("../cuda/sj_attention.cuh")),
];

/// The kernel translation unit with every `#include "..."` of our headers inlined once, so
/// NVRTC needs no include path.
pub fn kernel_source() -> String {
    let mut seen = Vec::new();
    let mut out = String::new();
    inline_file("sjkvarn.cu", &mut seen, &mut out);
    out
}

fn inline_file(name: &str, seen: &mut Vec<String>, out: &mut String) {
    if seen.iter().any(|s| s == name) {
        return;
    }
    seen.push(name.to_string());
    let text = KERNEL_FILES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .unwrap_or_else(|| panic!("kernel header {name} is not embedded"));
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed == "#pragma once" {
            continue;
        }
        if let Some(inc) = trimmed
            .strip_prefix("#include \"")
            .and_then(|r| r.strip_suffix('"'))
        {
            inline_file(inc, seen, out);
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::q8_0;

    #[test]
    fn the_kernels_number_staging_kinds_and_lay_out_q8_0_as_the_core_does() {
        let header = KERNEL_FILES
            .iter()
            .find(|(name, _)| *name == "sj_layer.cuh")
            .expect("sj_layer.cuh is embedded")
            .1;
        let defined = |name: &str| -> i32 {
            header
                .lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("sj_layer.cuh defines {name}"))
                .trim()
                .parse()
                .expect("a number")
        };
        assert_eq!(defined("SJ_STAGING_TQ6"), Staging::Tq6.code() as i32);
        assert_eq!(defined("SJ_STAGING_Q8"), Staging::Q8_0.code() as i32);
        assert_eq!(defined("SJ_STAGING_F16"), Staging::F16.code() as i32);
        assert_eq!(defined("SJ_Q8_0_BLOCK_VALUES"), q8_0::BLOCK_VALUES as i32);
        assert_eq!(defined("SJ_Q8_0_CODES_OFFSET"), q8_0::CODES_OFFSET as i32);
        assert_eq!(defined("SJ_Q8_0_BLOCK_BYTES"), q8_0::BLOCK_BYTES as i32);
        for s in Staging::ALL {
            assert_eq!(Staging::from_code(s.code() as u32), Some(s));
            assert_eq!(s.name().parse::<Staging>().unwrap(), s);
        }
    }

    #[test]
    fn source_inlines_every_header_once() {
        let src = kernel_source();
        assert!(!src.contains("#include \""));
        assert_eq!(src.matches("struct SjLayerView {").count(), 1);
        for name in [
            "sj_append_stage",
            "sj_seal(",
            "SJ_ATTEND_KERNEL(6)",
            "sj_attend_merge",
        ] {
            assert!(src.contains(name), "{name}");
        }
    }

    #[test]
    fn struct_sizes_match_the_c_layout() {
        // 9 x 8-byte fields, 8 ints, 18-int record layout.
        assert_eq!(std::mem::size_of::<KernelLayerView>(), 176);
        assert_eq!(std::mem::size_of::<KernelRecordLayout>(), 72);
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;

    #[test]
    fn device_layouts_are_the_reference_bodies() {
        for d in [64, 128, 256, 512] {
            assert!(device_layout(d, 4, 4, Body::Scalar).is_ok());
            assert!(device_layout(d, 3, 2, Body::Trellis).is_ok());
        }
        assert!(device_layout(96, 4, 4, Body::Scalar).is_err());
        assert!(device_layout(1024, 4, 4, Body::Scalar).is_err());
        assert!(device_layout(128, 5, 4, Body::Scalar).is_err());
        assert!(device_layout(128, 4, 3, Body::Trellis).is_err());
        let l = device_layout(256, 4, 2, Body::Scalar).unwrap();
        let k = KernelRecordLayout::of(&l);
        assert_eq!((k.k_frag, k.v_frag, k.bytes as usize), (1, 0, l.bytes));
        assert_eq!(
            tq6_tables(64)[0],
            TQ6_CENTROIDS[0] * std::f32::consts::SQRT_2
        );
        assert_eq!(tq6_tables(128)[64], TQ6_MIDPOINTS[0]);
    }
}
