// Staging rows: `tq6_0` blocks of rotated values (the ring) and fp16 (the sink).
//
// A tq6_0 block of n = 128 (or 64) values is `[corrected norm: f16 LE][n 6-bit codes]`; the
// codes index the 64-entry Lloyd-Max table of N(0,1) after scaling by sqrt(n)/||x||. Identical
// to `TqBlock::encode_rotated` in `crates/sjkvarn/src/tq.rs`: norms are summed in f64 in index
// order by one lane, codes are found per value.
#pragma once
#include "sj_common.cuh"
#include "sj_hadamard.cuh"

#define SJ_TQ_BITS 6
#define SJ_TQ_LEVELS 64

SJ_HD int sj_tq_block_len(int head_dim) { return head_dim < 128 ? head_dim : 128; }
SJ_HD int sj_tq_block_bytes(int len) { return 2 + (int)sj_packed_len((sj_u32)len, SJ_TQ_BITS); }
SJ_HD int sj_tq_row_bytes(int head_dim) {
    int len = sj_tq_block_len(head_dim);
    return head_dim / len * sj_tq_block_bytes(len);
}

// Encodes one rotated block `x[0..len)` into `out`. `codes` is lane-shared scratch of `len`
// bytes and `norm_slot` two doubles of lane-shared scratch. Returns SJ_ERR_F16_OVERFLOW when the
// stored norm does not fit fp16 (every lane gets the same answer).
SJ_HD int sj_tq_encode_block_lanes(const float* x, int len, const float* table, sj_u8* codes,
                                   double* norm_slot, sj_u8* out, int tid, int nthreads) {
    if (tid == 0) {
        double sum = -0.0;
        for (int i = 0; i < len; ++i) sum += (double)x[i] * (double)x[i];
        norm_slot[0] = sqrt(sum);
    }
    SJ_SYNC();
    double norm = norm_slot[0];
    if (norm == 0.0) {
        sj_u32 zero_code = sj_nearest_index(table, SJ_TQ_LEVELS, 0.0f);
        for (int i = tid; i < len; i += nthreads) codes[i] = (sj_u8)zero_code;
    } else {
        double to_table = sqrt((double)len) / norm;
        for (int i = tid; i < len; i += nthreads) {
            codes[i] = (sj_u8)sj_nearest_index(table, SJ_TQ_LEVELS, (float)((double)x[i] * to_table));
        }
    }
    SJ_SYNC();
    if (tid == 0) {
        float stored = 0.0f;
        if (norm != 0.0) {
            double decoded_sq = -0.0;
            for (int i = 0; i < len; ++i) {
                double c = (double)table[codes[i]];
                decoded_sq += c * c;
            }
            double unit_norm = sqrt(decoded_sq / (double)len);
            stored = (float)(norm / unit_norm);
        }
        sj_u16 h = sj_f32_to_f16(stored);
        sj_store_u16_le(out, h);
        norm_slot[1] = sj_f16_finite(h) ? 0.0 : 1.0;
    }
    sj_pack_lanes(codes, (sj_u32)len, SJ_TQ_BITS, out + 2, tid, nthreads);
    SJ_SYNC();
    return norm_slot[1] != 0.0 ? SJ_ERR_F16_OVERFLOW : SJ_OK;
}

// Value `i` of a tq6_0 block (rotated frame).
SJ_HD float sj_tq_value(const sj_u8* block, int len, const float* table, int i) {
    float step = sj_f16_to_f32(sj_load_u16_le(block)) / sqrtf((float)len);
    return step * table[sj_code_at(block + 2, SJ_TQ_BITS, (sj_u32)i)];
}

// Value `c` of a staged head row of `head_dim` values.
SJ_HD float sj_tq_row_value(const sj_u8* row, int head_dim, const float* table, int c) {
    int len = sj_tq_block_len(head_dim);
    int block = c / len;
    return sj_tq_value(row + block * sj_tq_block_bytes(len), len, table, c % len);
}

// Converts one model-frame row to the fp16 sink; returns SJ_ERR_F16_OVERFLOW for values fp16
// cannot hold. Every lane writes its own values; the caller reduces the status.
SJ_HD int sj_sink_row_lanes(const float* x, int head_dim, sj_u16* out, int tid, int nthreads) {
    int status = SJ_OK;
    for (int c = tid; c < head_dim; c += nthreads) {
        sj_u16 h = sj_f32_to_f16(x[c]);
        if (!sj_f16_finite(h)) status = SJ_ERR_F16_OVERFLOW;
        out[c] = h;
    }
    return status;
}

// Rotates one model-frame row in place (lane-shared, head_dim floats) and codes it as a staged
// ring row (`sj_tq_row_bytes(head_dim)` bytes). `codes` holds 128 bytes and `norm_slot` two
// doubles of lane-shared scratch. The whole body of the append kernel for ring tokens.
SJ_HD int sj_stage_row_lanes(float* row, int head_dim, const float* table, sj_u8* codes,
                             double* norm_slot, sj_u8* out, int tid, int nthreads) {
    int r = head_dim > 256 ? 256 : head_dim;
    for (int c0 = 0; c0 < head_dim; c0 += r) sj_fwht_lanes(row + c0, r, tid, nthreads);
    int len = sj_tq_block_len(head_dim);
    int status = SJ_OK;
    for (int b = 0; b < head_dim / len; ++b) {
        int st = sj_tq_encode_block_lanes(row + b * len, len, table, codes, norm_slot,
                                          out + b * sj_tq_block_bytes(len), tid, nthreads);
        if (st != SJ_OK) status = st;
    }
    return status;
}
