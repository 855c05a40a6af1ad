//! The data the CUDA kernels take, laid out exactly as the C structs in `cuda/sj_layer.cuh` and
//! `cuda/sj_seal.cuh`, and the kernel source text with its headers inlined.
//!
//! Nothing here needs CUDA: the host tests (`crates/sjkvarn-cuda-host`) build the same structs
//! over host memory and run the kernels' lane functions on the CPU, and the `cuda` feature fills
//! them with device addresses.

use crate::balance::{BalanceConfig, BalanceMode, BalanceStat};
use crate::body::{BodyCoding, BodySpec, TrellisAxis};
use crate::cache::{CacheConfig, Staging};

/// Mirrors `SjRecordLayout`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelRecordLayout {
    pub width: i32,
    pub halves: i32,
    pub k_bits: i32,
    pub v_bits: i32,
    pub k_code_bytes: i32,
    pub v_code_bytes: i32,
    pub sub_bytes: i32,
    pub record_bytes: i32,
}

/// Mirrors `SjLayerView`: one layer of one sequence; addresses are device (or, in the host
/// tests, host) pointers.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelLayerView {
    pub sink_k: u64,
    pub sink_v: u64,
    pub ring: u64,
    pub pool: u64,
    pub blocks: u64,
    pub tq_table: u64,
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
    pub k_coding: i32,
    pub v_coding: i32,
    pub rec: KernelRecordLayout,
}

/// Mirrors `SjBalanceSettings`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelBalance {
    pub passes: i32,
    pub mode: i32,
    pub stat: i32,
}

/// `SJ_STAGING_*` codes.
pub fn staging_code(staging: Staging) -> Option<i32> {
    match staging {
        Staging::Tq6 => Some(0),
        Staging::F16 => Some(2),
        Staging::Q8_0 => None,
    }
}

/// `SJ_CODING_SCALAR` / `SJ_RUNS_ALONG_ROWS` / `SJ_RUNS_ALONG_COLS` for the K (`is_key`) or V
/// tile; the same mapping as `TileLayout::of` in `body.rs`.
pub fn coding_code(coding: BodyCoding, is_key: bool) -> i32 {
    match (coding, is_key) {
        (BodyCoding::Scalar, _) => 0,
        (BodyCoding::Trellis(TrellisAxis::Token), true) => 1,
        (BodyCoding::Trellis(TrellisAxis::Token), false) => 2,
        (BodyCoding::Trellis(TrellisAxis::Channel), true) => 2,
        (BodyCoding::Trellis(TrellisAxis::Channel), false) => 1,
        // No kernel codes RoPE-block keys; the device path refuses such layers up front.
        (BodyCoding::RopeBlocks, _) => -1,
    }
}

impl KernelRecordLayout {
    pub fn of(spec: &BodySpec) -> Self {
        let width = spec.width();
        let halves = spec.half_count();
        let code = |bits: u32| crate::bitpack::packed_len(width * crate::GROUP, bits) as i32;
        let sub = spec.record_bytes() / halves;
        Self {
            width: width as i32,
            halves: halves as i32,
            k_bits: spec.k_bits as i32,
            v_bits: spec.v_bits as i32,
            k_code_bytes: code(spec.k_bits),
            v_code_bytes: code(spec.v_bits),
            sub_bytes: sub as i32,
            record_bytes: spec.record_bytes() as i32,
        }
    }
}

impl KernelLayerView {
    /// The geometry part of a layer's view (every address left 0 for the caller to fill).
    pub fn describe(config: &CacheConfig, layer: usize, len: usize, sealed: usize) -> Self {
        let lc = config.layer_coding[layer];
        let spec = crate::body::BodySpec::new(config.head_dim, lc.k_bits, lc.v_bits)
            .and_then(|s| s.with_coding(lc.k_coding, lc.v_coding))
            .expect("validated configuration");
        let rows = crate::cache::staging::RowCodec::new(config.staging, config.head_dim);
        Self {
            slot_bytes: config.slot_bytes() as u64,
            len: len as i32,
            sealed: sealed as i32,
            kv_heads: config.kv_heads as i32,
            head_dim: config.head_dim as i32,
            ring_rows: config.ring_rows() as i32,
            row_bytes: rows.row_bytes() as i32,
            staging: staging_code(config.staging).unwrap_or(-1),
            k_coding: coding_code(spec.k_coding, true),
            v_coding: coding_code(spec.v_coding, false),
            rec: KernelRecordLayout::of(&spec),
            ..Self::default()
        }
    }
}

impl KernelBalance {
    pub fn of(config: &BalanceConfig) -> Self {
        Self {
            passes: config.passes as i32,
            mode: match config.mode {
                BalanceMode::Final => 0,
                BalanceMode::Best => 1,
            },
            stat: match config.stat {
                BalanceStat::Std => 0,
                BalanceStat::Rms => 1,
            },
        }
    }
}

/// `sj_viterbi_scratch_bytes`: metrics, origins, carried metrics, flags, choices.
fn viterbi_scratch_bytes(n: usize) -> usize {
    2 * 64 * 4 + 2 * 64 * 4 + 64 * 4 + 16 + n * 64
}

/// `sj_trellis_scratch_bytes`.
fn trellis_scratch_bytes(rows: usize, cols: usize, groups: usize) -> usize {
    let run = rows.max(cols);
    let v = viterbi_scratch_bytes(run).div_ceil(16) * 16;
    rows * cols * 4 + rows * 8 + groups * (v + run * 4) + 64
}

/// Viterbi lane groups per seal block (`SJ_SEAL_GROUPS`).
const SEAL_GROUPS: usize = 4;

/// Bytes of device scratch one seal block uses (`sj_seal_scratch_bytes` in `sj_seal.cuh`).
pub fn seal_scratch_bytes(width: usize) -> usize {
    let big = width.max(crate::GROUP);
    let doubles = 6 * big + 4 * big + 4;
    let bytes = 8 * doubles
        + 4 * 2 * width * crate::GROUP
        + width * crate::GROUP
        + 2 * (3 * width + 3 * crate::GROUP)
        + 16;
    bytes.div_ceil(256) * 256 + trellis_scratch_bytes(big, big, SEAL_GROUPS).div_ceil(256) * 256
}

/// Floats of dynamic shared memory per attention block (`GS * head_dim` rotated queries plus
/// `sj_attend_scratch_floats(GS)`).
pub fn attend_shared_floats(group: usize, head_dim: usize) -> usize {
    group * head_dim + group * (2 * crate::GROUP + 256 + 2) + 8 * crate::GROUP
}

/// Kernel sources by file name, embedded at build time.
pub const KERNEL_FILES: [(&str, &str); 8] = [
    ("sjkvarn.cu", include_str!("../../../cuda/sjkvarn.cu")),
    ("sj_common.cuh", include_str!("../../../cuda/sj_common.cuh")),
    (
        "sj_hadamard.cuh",
        include_str!("../../../cuda/sj_hadamard.cuh"),
    ),
    (
        "sj_staging.cuh",
        include_str!("../../../cuda/sj_staging.cuh"),
    ),
    ("sj_layer.cuh", include_str!("../../../cuda/sj_layer.cuh")),
    ("sj_seal.cuh", include_str!("../../../cuda/sj_seal.cuh")),
    (
        "sj_trellis.cuh",
        include_str!("../../../cuda/sj_trellis.cuh"),
    ),
    (
        "sj_attention.cuh",
        include_str!("../../../cuda/sj_attention.cuh"),
    ),
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
        // 9 x 8-byte fields, 9 ints, 8-int record layout, padded to 8.
        assert_eq!(std::mem::size_of::<KernelLayerView>(), 144);
        assert_eq!(std::mem::size_of::<KernelRecordLayout>(), 32);
        assert_eq!(std::mem::size_of::<KernelBalance>(), 12);
    }
}
