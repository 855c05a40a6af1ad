// The device view of one layer of one sequence: the same bytes as the CPU journal
// (`crates/sjkvarn/src/cache/sequence.rs`), addressed the same way. Mirrored field for field by
// `KernelLayerView` in `crates/sjkvarn/src/kernel_abi.rs`.
#pragma once
#include "sj_common.cuh"
#include "sj_staging.cuh"

#define SJ_MAX_GROUP_HEADS 16
#define SJ_STAGING_TQ6 0
#define SJ_STAGING_F16 2
#define SJ_CODING_SCALAR 0
#define SJ_RUNS_ALONG_ROWS 1
#define SJ_RUNS_ALONG_COLS 2

// Byte layout of one sub-record (a 256-wide half of a 512 head, or the whole head).
struct SjRecordLayout {
    int width;        // rotation width r
    int halves;       // head_dim / r
    int k_bits, v_bits;
    int k_code_bytes, v_code_bytes;
    int sub_bytes;    // codes + metadata of one half
    int record_bytes; // halves * sub_bytes (one KV head)
};

SJ_HD SjRecordLayout sj_record_layout(int head_dim, int k_bits, int v_bits) {
    SjRecordLayout l;
    l.width = head_dim > 256 ? 256 : head_dim;
    l.halves = head_dim / l.width;
    l.k_bits = k_bits;
    l.v_bits = v_bits;
    l.k_code_bytes = (int)sj_packed_len((sj_u32)(l.width * SJ_GROUP), (sj_u32)k_bits);
    l.v_code_bytes = (int)sj_packed_len((sj_u32)(l.width * SJ_GROUP), (sj_u32)v_bits);
    l.sub_bytes = l.k_code_bytes + l.v_code_bytes + ((2 * l.width + SJ_GROUP) + (l.width + 2 * SJ_GROUP)) * 2;
    l.record_bytes = l.halves * l.sub_bytes;
    return l;
}

// One layer of one sequence as the kernels see it (same bytes as the CPU journal).
struct SjLayerView {
    const sj_u16* sink_k;  // [SINK][kv_heads][head_dim] fp16
    const sj_u16* sink_v;
    const sj_u8* ring;     // [ring_rows][kv_heads][2][row_bytes]
    const sj_u8* pool;     // slot-major record arena
    const sj_u32* blocks;  // slot id of each sealed group
    const float* tq_table; // 64-entry Lloyd-Max table
    const float* k_codebook;
    const float* v_codebook;
    sj_u64 slot_bytes;
    int len, sealed;
    int kv_heads, head_dim;
    int ring_rows, row_bytes, staging;
    int k_coding, v_coding;
    SjRecordLayout rec;
};

SJ_HD int sj_ring_start(const SjLayerView v) { return SJ_SINK + SJ_GROUP * v.sealed; }

// Cache blocks in reading order: the sink, every sealed group, ring blocks of <= 128 positions.
SJ_HD int sj_cache_blocks(const SjLayerView v) {
    if (v.len == 0) return 0;
    if (v.len <= SJ_SINK) return 1;
    int ring = v.len - sj_ring_start(v);
    return 1 + v.sealed + (ring + SJ_GROUP - 1) / SJ_GROUP;
}

SJ_HD const sj_u8* sj_ring_row(const SjLayerView v, int pos, int head, int value) {
    int idx = (pos - SJ_SINK) % v.ring_rows;
    return v.ring + ((sj_u64)(idx * v.kv_heads + head) * 2 + (sj_u64)value) * (sj_u64)v.row_bytes;
}

// Staged ring value `c` of a row, and whether rows are in the rotated frame.
SJ_HD float sj_ring_value(const SjLayerView v, const sj_u8* row, int c) {
    if (v.staging == SJ_STAGING_F16) return sj_f16_to_f32(sj_load_u16_le(row + 2 * c));
    return sj_tq_row_value(row, v.head_dim, v.tq_table, c);
}

