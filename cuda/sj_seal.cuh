// Seal of one body sub-record: Sinkhorn balancing and scalar min/max rounding of one K tile and
// one V tile, byte-identical to `BodySpec::encode_rotated` (scalar coding) in
// `crates/sjkvarn/src/body.rs` and `balance()` in `crates/sjkvarn/src/balance.rs`.
//
// Every reduction keeps the reference's order: a column sum runs over rows in order in one lane,
// a row sum uses the reference's 8 interleaved partial sums, tile-wide sums run in one lane.
#pragma once
#include "sj_common.cuh"
#include "sj_layer.cuh"
#include "sj_trellis.cuh"

#define SJ_LANES 8
#define SJ_STAT_STD 0
#define SJ_STAT_RMS 1
#define SJ_MODE_FINAL 0
#define SJ_MODE_BEST 1

struct SjBalanceSettings {
    int passes;
    int mode;
    int stat;
};

// Lane-shared scratch for balancing a tile of up to `rows` x `cols` (doubles).
struct SjBalanceScratch {
    double* row_full;    // rows
    double* row_rel;     // rows
    double* row_before;  // rows
    double* row_spread;  // rows
    double* row_inv;     // rows: exp(-row_full)
    double* col_log;     // cols
    double* col_spread;  // cols
    double* col_inv;     // cols: exp(-col_log)
    double* kept_row;    // rows
    double* kept_col;    // cols
    double* shared;      // 4: global_log, mean, kept imbalance, spare
};

SJ_HD int sj_balance_scratch_doubles(int rows, int cols) { return 6 * rows + 4 * cols + 4; }

SJ_HD SjBalanceScratch sj_balance_scratch(double* base, int rows, int cols) {
    SjBalanceScratch s;
    s.row_full = base;
    s.row_rel = base + rows;
    s.row_before = base + 2 * rows;
    s.row_spread = base + 3 * rows;
    s.row_inv = base + 4 * rows;
    s.kept_row = base + 5 * rows;
    s.col_log = base + 6 * rows;
    s.col_spread = base + 6 * rows + cols;
    s.col_inv = base + 6 * rows + 2 * cols;
    s.kept_col = base + 6 * rows + 3 * cols;
    s.shared = base + 6 * rows + 4 * cols;
    return s;
}

SJ_HD double sj_spread(double sum, double sum_sq, int n, int stat) {
    if (stat == SJ_STAT_RMS) return sqrt(sum_sq / (double)n);
    if (n < 2) return 0.0;
    double mean = sum / (double)n;
    return sqrt(fmax((sum_sq - mean * sum) / ((double)n - 1.0), 0.0));
}

// Column spreads of tile / (row scale * col scale): one lane per column, rows in order.
SJ_HD void sj_column_spreads_lanes(const float* tile, int rows, int cols, SjBalanceScratch s,
                                   int stat, int tid, int nthreads) {
    for (int i = tid; i < rows; i += nthreads) s.row_inv[i] = exp(-s.row_full[i]);
    SJ_SYNC();
    for (int j = tid; j < cols; j += nthreads) {
        double sum = 0.0, sum_sq = 0.0;
        for (int i = 0; i < rows; ++i) {
            double v = (double)tile[i * cols + j] * s.row_inv[i];
            sum += v;
            sum_sq += v * v;
        }
        s.col_spread[j] = sj_spread(sum, sum_sq, rows, stat) * exp(-s.col_log[j]);
    }
    SJ_SYNC();
}

// Row spreads with the reference's 8 interleaved partial sums; `row_log` is the row log scale
// the spreads are divided by.
SJ_HD void sj_row_spreads_lanes(const float* tile, int rows, int cols, const double* row_log,
                                SjBalanceScratch s, int stat, int tid, int nthreads) {
    for (int j = tid; j < cols; j += nthreads) s.col_inv[j] = exp(-s.col_log[j]);
    SJ_SYNC();
    for (int i = tid; i < rows; i += nthreads) {
        double p[SJ_LANES], p2[SJ_LANES];
        for (int l = 0; l < SJ_LANES; ++l) {
            p[l] = 0.0;
            p2[l] = 0.0;
        }
        const float* row = tile + i * cols;
        int full = cols / SJ_LANES * SJ_LANES;
        for (int j0 = 0; j0 < full; j0 += SJ_LANES) {
            for (int l = 0; l < SJ_LANES; ++l) {
                double v = (double)row[j0 + l] * s.col_inv[j0 + l];
                p[l] += v;
                p2[l] += v * v;
            }
        }
        for (int j = full; j < cols; ++j) {
            double v = (double)row[j] * s.col_inv[j];
            p[0] += v;
            p2[0] += v * v;
        }
        double sum = -0.0, sum_sq = -0.0;
        for (int l = 0; l < SJ_LANES; ++l) {
            sum += p[l];
            sum_sq += p2[l];
        }
        double rl = row_log ? row_log[i] : 0.0;
        s.row_spread[i] = sj_spread(sum, sum_sq, cols, stat) * exp(-rl);
    }
    SJ_SYNC();
}

SJ_HD double sj_ratio(const double* spreads, int n) {
    double lo = SJ_INF_D, hi = 0.0;
    for (int i = 0; i < n; ++i) {
        lo = fmin(lo, spreads[i]);
        hi = fmax(hi, spreads[i]);
    }
    if (hi == 0.0) return 1.0;
    if (lo == 0.0) return SJ_INF_D;
    return hi / lo;
}

SJ_HD void sj_absorb_lanes(double* logs, const double* spreads, int n, int tid, int nthreads) {
    for (int i = tid; i < n; i += nthreads) {
        double s = spreads[i];
        double step = 0.0;
        if (s > 0.0) step = log(fmin(fmax(s, 1e-3), 1e3));
        logs[i] = fmin(fmax(logs[i] + step, -0.3), 10.0);
    }
    SJ_SYNC();
}

// Balances a tile and leaves the chosen column log scales in `s.kept_col`.
SJ_HD void sj_balance_lanes(const float* tile, int rows, int cols, SjBalanceSettings cfg,
                            SjBalanceScratch s, int tid, int nthreads) {
    // Divide by the geometric mean of the row spreads first so the clamps act relative to it.
    for (int j = tid; j < cols; j += nthreads) s.col_log[j] = 0.0;
    SJ_SYNC();
    sj_row_spreads_lanes(tile, rows, cols, 0, s, cfg.stat, tid, nthreads);
    if (tid == 0) {
        double log_sum = 0.0;
        int count = 0;
        for (int i = 0; i < rows; ++i) {
            if (s.row_spread[i] > 0.0) {
                log_sum = log_sum + log(s.row_spread[i]);
                count += 1;
            }
        }
        s.shared[0] = count > 0 ? log_sum / (double)count : 0.0;
        s.shared[2] = SJ_INF_D;
    }
    SJ_SYNC();
    double global_log = s.shared[0];
    for (int i = tid; i < rows; i += nthreads) {
        s.row_rel[i] = 0.0;
        s.row_full[i] = global_log;
        s.kept_row[i] = global_log;
    }
    for (int j = tid; j < cols; j += nthreads) s.kept_col[j] = 0.0;
    SJ_SYNC();
    for (int pass = 0; pass < cfg.passes; ++pass) {
        sj_column_spreads_lanes(tile, rows, cols, s, cfg.stat, tid, nthreads);
        sj_absorb_lanes(s.col_log, s.col_spread, cols, tid, nthreads);
        sj_row_spreads_lanes(tile, rows, cols, s.row_full, s, cfg.stat, tid, nthreads);
        for (int i = tid; i < rows; i += nthreads) s.row_before[i] = s.row_rel[i];
        SJ_SYNC();
        sj_absorb_lanes(s.row_rel, s.row_spread, rows, tid, nthreads);
        if (tid == 0) {
            double sum = -0.0;
            for (int j = 0; j < cols; ++j) sum += s.col_log[j];
            s.shared[1] = sum / (double)cols;
        }
        SJ_SYNC();
        double mean = s.shared[1];
        for (int j = tid; j < cols; j += nthreads) s.col_log[j] -= mean;
        for (int i = tid; i < rows; i += nthreads) {
            s.row_rel[i] += mean;
            s.row_full[i] = global_log + s.row_rel[i];
        }
        SJ_SYNC();
        if (cfg.mode == SJ_MODE_BEST) {
            for (int i = tid; i < rows; i += nthreads) {
                s.row_spread[i] *= exp(-(s.row_rel[i] - mean - s.row_before[i]));
            }
            SJ_SYNC();
            sj_column_spreads_lanes(tile, rows, cols, s, cfg.stat, tid, nthreads);
            if (tid == 0) {
                double imbalance = sj_ratio(s.col_spread, cols) + sj_ratio(s.row_spread, rows);
                s.shared[3] = imbalance <= s.shared[2] ? 1.0 : 0.0;
                if (imbalance <= s.shared[2]) s.shared[2] = imbalance;
            }
            SJ_SYNC();
            if (s.shared[3] != 0.0) {
                for (int i = tid; i < rows; i += nthreads) s.kept_row[i] = s.row_full[i];
                for (int j = tid; j < cols; j += nthreads) s.kept_col[j] = s.col_log[j];
            }
            SJ_SYNC();
        }
    }
    if (cfg.mode == SJ_MODE_FINAL || cfg.passes == 0) {
        for (int j = tid; j < cols; j += nthreads) s.kept_col[j] = s.col_log[j];
        SJ_SYNC();
    }
}

// Stored column scales: fp16(exp(col_log)), at least the smallest positive fp16.
SJ_HD void sj_column_scales_lanes(SjBalanceScratch s, int cols, sj_u16* out, int tid,
                                  int nthreads) {
    for (int j = tid; j < cols; j += nthreads) {
        sj_u16 h = sj_f32_to_f16((float)exp(s.kept_col[j]));
        out[j] = h < 1 ? (sj_u16)1 : h;
    }
    SJ_SYNC();
}

// Divides every column of `tile` (rows x cols) by its stored fp16 scale, in place.
SJ_HD void sj_divide_columns_lanes(float* tile, int rows, int cols, const sj_u16* scales, int tid,
                                   int nthreads) {
    for (int e = tid; e < rows * cols; e += nthreads) {
        float inv = 1.0f / sj_f16_to_f32(scales[e % cols]);
        tile[e] = tile[e] * inv;
    }
    SJ_SYNC();
}

// Per-row min/max rounding to `bits` with fp16 (a, z); codes go to `codes` (rows x cols).
// Returns SJ_ERR_F16_OVERFLOW if any row's scale does not fit fp16.
SJ_HD int sj_round_rows_lanes(const float* x, int rows, int cols, int bits, sj_u8* codes,
                              sj_u16* a_out, sj_u16* z_out, int tid, int nthreads) {
    int status = SJ_OK;
    float top = (float)((1u << bits) - 1u);
    for (int i = tid; i < rows; i += nthreads) {
        const float* row = x + i * cols;
        float lo = SJ_INF_F, hi = -SJ_INF_F;
        for (int j = 0; j < cols; ++j) {
            lo = fminf(lo, row[j]);
            hi = fmaxf(hi, row[j]);
        }
        sj_u16 a16 = sj_f32_to_f16((hi - lo) / top);
        sj_u16 z16 = sj_f32_to_f16(lo);
        if (!sj_f16_finite(a16) || !sj_f16_finite(z16)) status = SJ_ERR_F16_OVERFLOW;
        float af = sj_f16_to_f32(a16), zf = sj_f16_to_f32(z16);
        float inv_a = af > 0.0f ? 1.0f / af : 0.0f;
        for (int j = 0; j < cols; ++j) {
            float q = roundf((row[j] - zf) * inv_a);
            q = fminf(fmaxf(q, 0.0f), top);
            codes[i * cols + j] = (sj_u8)q;
        }
        a_out[i] = a16;
        z_out[i] = z16;
    }
    SJ_SYNC();
    return status;
}

// Lane-shared scratch of one sub-record seal.
struct SjSealScratch {
    float* k_tile;   // [r][GROUP] channel-major
    float* v_tile;   // [GROUP][r] token-major
    sj_u8* codes;    // r * GROUP
    sj_u16* meta;    // 3r + 3 GROUP fp16 values, in record order
    double* balance; // sj_balance_scratch_doubles(max(r, GROUP), max(r, GROUP))
    int* status;     // 1
    sj_u8* trellis;  // sj_trellis_scratch_bytes(max(r, GROUP), max(r, GROUP), SJ_SEAL_GROUPS)
};

// Viterbi lane groups one seal block may run (256 lanes / 64 states).
#define SJ_SEAL_GROUPS 4

SJ_HD sj_u64 sj_seal_scratch_bytes(int width) {
    int big = width > SJ_GROUP ? width : SJ_GROUP;
    sj_u64 bytes = 0;
    bytes += (sj_u64)sizeof(double) * (sj_u64)sj_balance_scratch_doubles(big, big);
    bytes += (sj_u64)sizeof(float) * 2u * (sj_u64)width * SJ_GROUP;
    bytes += (sj_u64)width * SJ_GROUP;
    bytes += 2u * (sj_u64)(3 * width + 3 * SJ_GROUP);
    bytes += 16u;
    bytes = (bytes + 255u) / 256u * 256u;
    bytes += (sj_trellis_scratch_bytes(big, big, SJ_SEAL_GROUPS) + 255u) / 256u * 256u;
    return bytes;
}

SJ_HD SjSealScratch sj_seal_scratch(sj_u8* base, int width) {
    int big = width > SJ_GROUP ? width : SJ_GROUP;
    SjSealScratch s;
    s.balance = (double*)base;
    base += sizeof(double) * (sj_u64)sj_balance_scratch_doubles(big, big);
    s.k_tile = (float*)base;
    base += sizeof(float) * (sj_u64)width * SJ_GROUP;
    s.v_tile = (float*)base;
    base += sizeof(float) * (sj_u64)width * SJ_GROUP;
    s.status = (int*)base;
    base += 16;
    s.meta = (sj_u16*)base;
    base += 2u * (sj_u64)(3 * width + 3 * SJ_GROUP);
    s.codes = base;
    base += (sj_u64)width * SJ_GROUP;
    base = (sj_u8*)(((sj_u64)base + 255u) / 256u * 256u);
    s.trellis = base;
    return s;
}

// Codes one balanced tile (column scales divided out) with scalar rounding or the trellis.
SJ_HD int sj_code_tile_lanes(const float* x, int rows, int cols, int bits, int coding,
                             const float* codebook, SjSealScratch s, sj_u16* a_out, sj_u16* z_out,
                             int tid, int nthreads) {
    if (coding == SJ_CODING_SCALAR) {
        return sj_round_rows_lanes(x, rows, cols, bits, s.codes, a_out, z_out, tid, nthreads);
    }
    int big = rows > cols ? rows : cols;
    SjTrellisScratch ts = sj_trellis_scratch(s.trellis, big, big, SJ_SEAL_GROUPS);
    return sj_trellis_rows_lanes(x, rows, cols, bits, coding, codebook, ts, s.codes, a_out, z_out,
                                 tid, nthreads);
}

// Seals one half: `s.k_tile`/`s.v_tile` hold the rotated tiles on entry (they are divided by
// their column scales in place). Writes `l.sub_bytes` bytes to `out`. K and V are coded as the
// view's k_coding / v_coding say. Returns SJ_OK or SJ_ERR_F16_OVERFLOW.
SJ_HD int sj_seal_half_lanes(const SjLayerView view, SjBalanceSettings cfg, SjSealScratch s,
                             sj_u8* out, int tid, int nthreads) {
    SjRecordLayout l = view.rec;
    int r = l.width;
    sj_u16* a_k = s.meta;
    sj_u16* z_k = a_k + r;
    sj_u16* s_k = z_k + r;
    sj_u16* a_v = s_k + SJ_GROUP;
    sj_u16* z_v = a_v + SJ_GROUP;
    sj_u16* s_v = z_v + SJ_GROUP;
    if (tid == 0) *s.status = SJ_OK;
    SJ_SYNC();

    // K: rows = channels, columns = tokens; stored column scales are per token.
    SjBalanceScratch bk = sj_balance_scratch(s.balance, r, SJ_GROUP);
    sj_balance_lanes(s.k_tile, r, SJ_GROUP, cfg, bk, tid, nthreads);
    sj_column_scales_lanes(bk, SJ_GROUP, s_k, tid, nthreads);
    sj_divide_columns_lanes(s.k_tile, r, SJ_GROUP, s_k, tid, nthreads);
    int st = sj_code_tile_lanes(s.k_tile, r, SJ_GROUP, l.k_bits, view.k_coding, view.k_codebook, s,
                                a_k, z_k, tid, nthreads);
    if (st != SJ_OK) *s.status = st;
    sj_pack_lanes(s.codes, (sj_u32)(r * SJ_GROUP), (sj_u32)l.k_bits, out, tid, nthreads);
    SJ_SYNC();

    // V: rows = tokens, columns = channels; stored column scales are per channel.
    SjBalanceScratch bv = sj_balance_scratch(s.balance, SJ_GROUP, r);
    sj_balance_lanes(s.v_tile, SJ_GROUP, r, cfg, bv, tid, nthreads);
    sj_column_scales_lanes(bv, r, s_v, tid, nthreads);
    sj_divide_columns_lanes(s.v_tile, SJ_GROUP, r, s_v, tid, nthreads);
    st = sj_code_tile_lanes(s.v_tile, SJ_GROUP, r, l.v_bits, view.v_coding, view.v_codebook, s, a_v,
                            z_v, tid, nthreads);
    if (st != SJ_OK) *s.status = st;
    sj_pack_lanes(s.codes, (sj_u32)(r * SJ_GROUP), (sj_u32)l.v_bits, out + l.k_code_bytes, tid,
                  nthreads);
    sj_u8* meta_out = out + l.k_code_bytes + l.v_code_bytes;
    for (int i = tid; i < 3 * r + 3 * SJ_GROUP; i += nthreads) {
        sj_store_u16_le(meta_out + 2 * i, s.meta[i]);
    }
    SJ_SYNC();
    return *s.status;
}

// Gathers half `half` of group `g`, KV head `h` from the ring into the scratch tiles (rotated
// frame) and seals it into `out` (one sub-record). The whole body of the seal kernel.
SJ_HD int sj_seal_group_half_lanes(const SjLayerView view, int g, int h, int half,
                                   SjBalanceSettings cfg, SjSealScratch s, sj_u8* out, int tid,
                                   int nthreads) {
    int r = view.rec.width;
    for (int e = tid; e < r * SJ_GROUP; e += nthreads) {
        int c = e / SJ_GROUP, t = e % SJ_GROUP;
        int pos = SJ_SINK + g * SJ_GROUP + t;
        s.k_tile[e] = sj_ring_value(view, sj_ring_row(view, pos, h, 0), half * r + c);
    }
    for (int e = tid; e < r * SJ_GROUP; e += nthreads) {
        int t = e / r, c = e % r;
        int pos = SJ_SINK + g * SJ_GROUP + t;
        s.v_tile[e] = sj_ring_value(view, sj_ring_row(view, pos, h, 1), half * r + c);
    }
    SJ_SYNC();
    return sj_seal_half_lanes(view, cfg, s, out, tid, nthreads);
}
