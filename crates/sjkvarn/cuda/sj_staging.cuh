// Staging rows: `tq6_0` blocks of rotated values (the ring), rotated fp16 (the sink and fp16 ring
// rows), byte-identical to `codec::tq6` and `codec::rotation`.
//
// A tq6_0 block of n = 128 values is 98 bytes: `norm: fp16 LE`, `qs[64]` (code i's low nibble at
// bit 4*(i%2) of qs[i/2]), `qh[32]` (code i's top two bits at bit 2*(i%4) of qh[i/4]). The
// 64-wide extension block is 50 bytes (`norm`, `qs[32]`, `qh[16]`). Codes index 64 centroids;
// the caller passes the block size's tables as 127 floats: 64 centroids then 63 midpoints (for
// 64-value blocks the format's tables times sqrt(2), one f32 multiply each, done on the host:
// `kernel_abi::tq6_tables`).
//
// Encoding: the squared norm is summed in f32 in index order by one lane, values are scaled by
// one f32 reciprocal `1 / norm`, each code is a binary search over the midpoints (a value on a
// midpoint goes up), and the stored norm is `norm / ||c[codes]||` (zero-norm blocks: every code
// 32, norm 0).
#pragma once
#include "sj_common.cuh"
#include "sj_hadamard.cuh"

#define SJ_TQ_LEVELS 64
#define SJ_TQ_TABLE_FLOATS 127

SJ_HD int sj_tq_block_len(int head_dim) { return head_dim == 64 ? 64 : 128; }
SJ_HD int sj_tq_block_bytes(int len) { return 2 + 3 * len / 4; }
SJ_HD int sj_tq_row_bytes(int head_dim) {
    int len = sj_tq_block_len(head_dim);
    return head_dim / len * sj_tq_block_bytes(len);
}

// Index of the centroid nearest to `v`: binary search over the 63 midpoints, a value on a
// midpoint goes up (`codec::tq6::nearest`).
SJ_HD sj_u32 sj_tq_nearest(const float* midpoints, float v) {
    sj_u32 lo = 0, hi = 63;
    while (lo < hi) {
        sj_u32 m = (lo + hi) / 2;
        if (v < midpoints[m]) {
            hi = m;
        } else {
            lo = m + 1;
        }
    }
    return lo;
}

// Encodes one rotated block `x[0..len)` into `out` (sj_tq_block_bytes(len) bytes). `codes` is
// lane-shared scratch of `len` bytes and `slot` two floats of lane-shared scratch. Returns
// SJ_ERR_F16_OVERFLOW when the stored norm does not fit fp16 (every lane gets the same answer).
SJ_HD int sj_tq_encode_block_lanes(const float* x, int len, const float* tables, sj_u8* codes,
                                   float* slot, sj_u8* out, int tid, int nthreads) {
    const float* centroids = tables;
    const float* midpoints = tables + SJ_TQ_LEVELS;
    if (tid == 0) {
        float norm_sq = 0.0f;
        for (int i = 0; i < len; ++i) norm_sq = norm_sq + x[i] * x[i];
        slot[0] = sqrtf(norm_sq);
    }
    SJ_SYNC();
    float norm = slot[0];
    bool live = norm > 1e-10f;
    float inv = live ? 1.0f / norm : 0.0f;
    for (int i = tid; i < len; i += nthreads) {
        float u = live ? x[i] * inv : 0.0f;
        codes[i] = (sj_u8)sj_tq_nearest(midpoints, u);
    }
    SJ_SYNC();
    if (tid == 0) {
        float rn_sq = 0.0f;
        for (int i = 0; i < len; ++i) {
            float c = centroids[codes[i]];
            rn_sq = rn_sq + c * c;
        }
        float rn = sqrtf(rn_sq);
        float stored = rn > 1e-10f ? norm / rn : norm;
        sj_u16 h = sj_f32_to_f16(stored);
        sj_store_u16_le(out, h);
        slot[1] = sj_f16_finite(h) ? 0.0f : 1.0f;
    }
    sj_u8* qs = out + 2;
    sj_u8* qh = out + 2 + len / 2;
    for (int b = tid; b < len / 2; b += nthreads) {
        qs[b] = (sj_u8)((codes[2 * b] & 0xfu) | ((codes[2 * b + 1] & 0xfu) << 4));
    }
    for (int b = tid; b < len / 4; b += nthreads) {
        sj_u32 w = 0;
        for (int k = 0; k < 4; ++k) w |= (sj_u32)((codes[4 * b + k] >> 4) & 0x3u) << (2 * k);
        qh[b] = (sj_u8)w;
    }
    SJ_SYNC();
    return slot[1] != 0.0f ? SJ_ERR_F16_OVERFLOW : SJ_OK;
}

// Code `i` of a block of `len` values.
SJ_HD sj_u32 sj_tq_code(const sj_u8* block, int len, int i) {
    sj_u32 lo = (block[2 + i / 2] >> ((i % 2) * 4)) & 0xfu;
    sj_u32 hi = (block[2 + len / 2 + i / 4] >> ((i % 4) * 2)) & 0x3u;
    return lo | (hi << 4);
}

// Value `i` of a block: `centroid[code] * norm` (`codec::tq6::decode_block`).
SJ_HD float sj_tq_value(const sj_u8* block, int len, const float* tables, int i) {
    float norm = sj_f16_to_f32(sj_load_u16_le(block));
    return tables[sj_tq_code(block, len, i)] * norm;
}

// Value `c` of a staged head row of `head_dim` values.
SJ_HD float sj_tq_row_value(const sj_u8* row, int head_dim, const float* tables, int c) {
    int len = sj_tq_block_len(head_dim);
    int block = c / len;
    return sj_tq_value(row + block * sj_tq_block_bytes(len), len, tables, c % len);
}

// Converts one rotated row to fp16 (sink rows and fp16 ring rows); returns SJ_ERR_F16_OVERFLOW
// for values fp16 cannot hold. Every lane writes its own values; the caller reduces the status.
SJ_HD int sj_f16_row_lanes(const float* x, int head_dim, sj_u16* out, int tid, int nthreads) {
    int status = SJ_OK;
    for (int c = tid; c < head_dim; c += nthreads) {
        sj_u16 h = sj_f32_to_f16(x[c]);
        if (!sj_f16_finite(h)) status = SJ_ERR_F16_OVERFLOW;
        out[c] = h;
    }
    return status;
}

// Codes one rotated row (lane-shared, head_dim floats) as a staged tq6_0 ring row
// (`sj_tq_row_bytes(head_dim)` bytes). `codes` holds 128 bytes and `slot` two floats of
// lane-shared scratch.
SJ_HD int sj_tq_row_lanes(const float* row, int head_dim, const float* tables, sj_u8* codes,
                          float* slot, sj_u8* out, int tid, int nthreads) {
    int len = sj_tq_block_len(head_dim);
    int status = SJ_OK;
    for (int b = 0; b < head_dim / len; ++b) {
        int st = sj_tq_encode_block_lanes(row + b * len, len, tables, codes, slot,
                                          out + b * sj_tq_block_bytes(len), tid, nthreads);
        if (st != SJ_OK) status = st;
    }
    return status;
}

// Rotates one model-frame row in place and codes it as a staged tq6_0 ring row. The body of the
// append kernel for ring tokens (`codec::rotation::hadamard` then `codec::tq6::encode_row`).
SJ_HD int sj_stage_row_lanes(float* row, int head_dim, const float* tables, sj_u8* codes,
                             float* slot, sj_u8* out, int tid, int nthreads) {
    sj_rotate_head_lanes(row, head_dim, tid, nthreads);
    return sj_tq_row_lanes(row, head_dim, tables, codes, slot, out, tid, nthreads);
}
