// The SJ-KVaRN record layout (`codec::layout::RecordLayout`) and the device view of one layer of
// one sequence. Mirrored field for field by `KernelRecordLayout` / `KernelLayerView` in
// `crates/sjkvarn/src/kernel_abi.rs`.
//
// One record is one KV head over one group of 128 tokens:
//   K payload | V payload | Kscale[D] Kzero[D] Ktok[G] | Vch[D] Vscale[G] Vzero[G]   (fp16 LE)
//   K[t,d] = (qK[t,d] * Kscale[slot(d)] + Kzero[slot(d)]) * Ktok[t]
//   V[t,d] = (qV[t,d] * Vscale[t] + Vzero[t]) * Vch[slot(d)]
// 4-bit scalar sides are in tensor-core fragment order (channel fields permuted to match),
// 2/3-bit scalar sides token-major, trellis sides channel-major.
#pragma once
#include "sj_common.cuh"
#include "sj_staging.cuh"

#define SJ_MAX_GROUP_HEADS 16
// Staging kinds, numbered as `Staging::code` (journal/rows.rs); a host test ties them.
#define SJ_STAGING_TQ6 0
#define SJ_STAGING_F16 1
#define SJ_STAGING_Q8 2
// The q8_0 block (codec/q8_0.rs): an fp16 scale, then 32 signed codes; a host test ties them.
#define SJ_Q8_0_BLOCK_VALUES 32
#define SJ_Q8_0_CODES_OFFSET 2
#define SJ_Q8_0_BLOCK_BYTES 34
#define SJ_BODY_SCALAR 0
#define SJ_BODY_TRELLIS 1
#define SJ_HISTORY_BITS 6
#define SJ_STATES 64

// Byte offsets of every field of a record (`RecordLayout`), plus the fragment-order flags.
struct SjRecordLayout {
    int head_dim, group;
    int bits_k, bits_v;
    int body;          // SJ_BODY_SCALAR / SJ_BODY_TRELLIS
    int k_frag, v_frag; // side stored in fragment order (4-bit scalar)
    int pad0;
    int k_payload, v_payload;
    int k_scale, k_zero, k_tok;
    int v_ch, v_scale, v_zero;
    int bytes;
    int pad1;
};

// The layout of `RecordLayout::new(head_dim, 128, bits_k, bits_v, body)` (geometry assumed
// valid; the Rust side validates before launching).
SJ_HD SjRecordLayout sj_record_layout(int head_dim, int bits_k, int bits_v, int body) {
    SjRecordLayout l;
    int d = head_dim, g = SJ_GROUP;
    l.head_dim = d;
    l.group = g;
    l.bits_k = bits_k;
    l.bits_v = bits_v;
    l.body = body;
    l.k_frag = body == SJ_BODY_SCALAR && bits_k == 4 ? 1 : 0;
    l.v_frag = body == SJ_BODY_SCALAR && bits_v == 4 ? 1 : 0;
    l.pad0 = 0;
    l.k_payload = 0;
    l.v_payload = l.k_payload + d * bits_k / 8 * g;
    l.k_scale = l.v_payload + d * bits_v / 8 * g;
    l.k_zero = l.k_scale + 2 * d;
    l.k_tok = l.k_zero + 2 * d;
    l.v_ch = l.k_tok + 2 * g;
    l.v_scale = l.v_ch + 2 * d;
    l.v_zero = l.v_scale + 2 * g;
    l.bytes = l.v_zero + 2 * g;
    l.pad1 = 0;
    return l;
}

SJ_HD int sj_side_bits(const SjRecordLayout& l, int is_v) { return is_v ? l.bits_v : l.bits_k; }
SJ_HD int sj_side_frag(const SjRecordLayout& l, int is_v) { return is_v ? l.v_frag : l.k_frag; }

// Bit offset of the code of token t, channel d inside the K or V payload (`code_bit`).
SJ_HD int sj_code_bit(const SjRecordLayout& l, int t, int d, int is_v) {
    int bits = sj_side_bits(l, is_v);
    if (l.body == SJ_BODY_TRELLIS) return (d * l.group + t) * bits;
    if (!sj_side_frag(l, is_v)) return (t * l.head_dim + d) * bits;
    int tile_t = t >> 4, tt = t & 15, tile_d = d >> 4, dd = d & 15;
    int lane, reg, half;
    if (is_v) {
        lane = 4 * (dd & 7) + ((tt >> 1) & 3);
        reg = (dd >> 3) + 2 * (tt >> 3);
        half = tt & 1;
    } else {
        lane = 4 * (tt & 7) + ((dd >> 1) & 3);
        reg = (tt >> 3) + 2 * (dd >> 3);
        half = dd & 1;
    }
    int word = (tile_t * (l.head_dim / 16) + tile_d) * 32 + lane;
    return word * 32 + (reg + 4 * half) * 4;
}

// Slot of channel d in Kscale / Kzero (`k_channel_slot`).
SJ_HD int sj_k_slot(const SjRecordLayout& l, int d) {
    if (!l.k_frag) return d;
    int tile = d >> 4, dd = d & 15;
    int pair = dd >> 1, e = dd & 1;
    return (pair & 3) * (l.head_dim / 4) + tile * 4 + (pair >> 2) * 2 + e;
}

// Slot of channel d in Vch (`v_channel_slot`).
SJ_HD int sj_v_slot(const SjRecordLayout& l, int d) {
    if (!l.v_frag) return d;
    int tile = d >> 4, dd = d & 15;
    return (dd & 7) * (l.head_dim / 8) + tile * 2 + (dd >> 3);
}

// Trellis window (codebook index) of code i of run `run` in a channel-major payload of runs of
// `run_len` codes (`codec::trellis::window`): the 6 + bits stream bits ending with the code,
// bits before the start of the run reading as zero. `payload_bytes` bounds the read.
SJ_HD sj_u32 sj_trellis_window(const sj_u8* payload, int payload_bytes, int bits, int run, int i,
                               int run_len) {
    int bit = (run * run_len + i) * bits;
    int width = SJ_HISTORY_BITS + bits;
    int full_history = (width - 1) / bits;
    if (i >= full_history) {
        int start = bit - SJ_HISTORY_BITS;
        int byte = start >> 3, shift = start & 7;
        sj_u32 lo = payload[byte];
        sj_u32 hi = byte + 1 < payload_bytes ? payload[byte + 1] : 0u;
        return ((lo | (hi << 8)) >> shift) & ((1u << width) - 1u);
    }
    sj_u32 w = sj_unpack_bits(payload, (sj_u32)bit, (sj_u32)bits) << SJ_HISTORY_BITS;
    for (int k = 1; k <= i; ++k) {
        w |= sj_unpack_bits(payload, (sj_u32)(bit - k * bits), (sj_u32)bits)
             << (SJ_HISTORY_BITS - k * bits);
    }
    return w;
}

SJ_HD float sj_rec_half(const sj_u8* rec, int off) { return sj_f16_to_f32(sj_load_u16_le(rec + off)); }

// The code value q of token t, channel d (integer code, or codebook value): `Decoder::q`.
SJ_HD float sj_record_q(const SjRecordLayout& l, const sj_u8* rec, const float* codebook, int t,
                        int d, int is_v) {
    int bits = sj_side_bits(l, is_v);
    const sj_u8* payload = rec + (is_v ? l.v_payload : l.k_payload);
    if (l.body == SJ_BODY_TRELLIS) {
        int bytes = (is_v ? l.k_scale - l.v_payload : l.v_payload - l.k_payload);
        return codebook[sj_trellis_window(payload, bytes, bits, d, t, l.group)];
    }
    return (float)sj_unpack_bits(payload, (sj_u32)sj_code_bit(l, t, d, is_v), (sj_u32)bits);
}

// One layer of one sequence as the kernels see it. Sink rows and ring rows are in the rotated
// frame.
struct SjLayerView {
    const sj_u16* sink_k;  // [SINK][kv_heads][head_dim] rotated fp16
    const sj_u16* sink_v;
    const sj_u8* ring;     // [ring_rows][kv_heads][2][row_bytes]
    const sj_u8* pool;     // slot-major record arena; record of head h at h * rec.bytes
    const sj_u32* blocks;  // slot id of each sealed group
    const float* tq_table; // tq6_0 tables of the block size: 64 centroids, 63 midpoints
    const float* k_codebook; // trellis codebooks as f32 (2^(6 + bits) entries), or null
    const float* v_codebook;
    sj_u64 slot_bytes;
    int len, sealed;
    int kv_heads, head_dim;
    int ring_rows, row_bytes, staging;
    int pad;
    SjRecordLayout rec;
};

SJ_HD int sj_ring_start(const SjLayerView& v) { return SJ_SINK + SJ_GROUP * v.sealed; }

// Cache blocks in reading order: the sink, every sealed group, ring blocks of <= 128 positions.
SJ_HD int sj_cache_blocks(const SjLayerView& v) {
    if (v.len == 0) return 0;
    if (v.len <= SJ_SINK) return 1;
    int ring = v.len - sj_ring_start(v);
    return 1 + v.sealed + (ring + SJ_GROUP - 1) / SJ_GROUP;
}

SJ_HD const sj_u8* sj_ring_row(const SjLayerView& v, int pos, int head, int value) {
    int idx = (pos - SJ_SINK) % v.ring_rows;
    return v.ring + ((sj_u64)(idx * v.kv_heads + head) * 2 + (sj_u64)value) * (sj_u64)v.row_bytes;
}

// Staged ring value `c` of a row (rotated frame): tq6_0, q8_0 or fp16.
SJ_HD float sj_ring_value(const SjLayerView& v, const sj_u8* row, int c) {
    if (v.staging == SJ_STAGING_F16) return sj_f16_to_f32(sj_load_u16_le(row + 2 * c));
    if (v.staging == SJ_STAGING_Q8) {
        const sj_u8* block = row + (c / SJ_Q8_0_BLOCK_VALUES) * SJ_Q8_0_BLOCK_BYTES;
        float d = sj_f16_to_f32(sj_load_u16_le(block));
        return d * (float)(signed char)block[SJ_Q8_0_CODES_OFFSET + c % SJ_Q8_0_BLOCK_VALUES];
    }
    return sj_tq_row_value(row, v.head_dim, v.tq_table, c);
}
