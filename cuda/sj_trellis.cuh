// Trellis body coding on the device: the 64-state tail-biting Viterbi of
// `crates/sjkvarn/src/trellis.rs` (wrap-around method, the same tie rules) and the per-row
// normalisation and least-squares refit of `trellis_rows` in `body.rs`. Byte-identical records.
//
// A group of lanes encodes one run: lane l owns states l, l + lanes, ...; metrics are
// double-buffered in lane-shared scratch and every step ends with SJ_SYNC. Several groups share a
// block, each on its own run; all groups pass every barrier.
#pragma once
#include "sj_common.cuh"
#include "sj_layer.cuh"

#define SJ_STATES 64

SJ_HD int sj_trellis_window(int bits) { return (6 + bits + bits - 1) / bits; }
SJ_HD sj_u32 sj_trellis_mask(int bits) { return (1u << (6 + bits)) - 1u; }

// Codebook value at step t of a run of n unpacked codes (tail-biting window).
SJ_HD float sj_trellis_code_value(const float* cb, int bits, const sj_u8* codes, int n, int t) {
    sj_u32 idx = 0;
    for (int j = 0; j < sj_trellis_window(bits); ++j) {
        idx |= (sj_u32)codes[(t + n * 4 - j) % n] << (j * bits);
    }
    return cb[idx & sj_trellis_mask(bits)];
}

// Lane-shared scratch of one run's Viterbi.
struct SjViterbiScratch {
    float* metric;   // [2][64]
    sj_u32* origin;  // [2][64]
    float* carried;  // [64] end metrics of the first lap
    sj_u8* choice;   // [n][64]
    int* flags;      // [4]: end state, have-best, spare
};

SJ_HD sj_u64 sj_viterbi_scratch_bytes(int n) {
    return (sj_u64)(2 * 64 * 4 + 2 * 64 * 4 + 64 * 4 + 16) + (sj_u64)n * 64u;
}

SJ_HD SjViterbiScratch sj_viterbi_scratch(sj_u8* base, int n) {
    SjViterbiScratch v;
    v.metric = (float*)base;
    v.origin = (sj_u32*)(base + 512);
    v.carried = (float*)(base + 1024);
    v.flags = (int*)(base + 1280);
    v.choice = base + 1296;
    (void)n;
    return v;
}

#define SJ_START_FREE 0
#define SJ_START_FIXED 1
#define SJ_START_CARRIED 2

// One Viterbi pass over x[0..n); leaves the final metrics/origins in buffer (n % 2).
// `active` is false for groups without a run this round (they still pass every barrier).
SJ_HD void sj_viterbi_pass_lanes(const float* cb, int bits, const float* x, int n, int start,
                                 int fixed_state, SjViterbiScratch v, bool active, int lane,
                                 int lanes) {
    float* m0 = v.metric;
    sj_u32* o0 = v.origin;
    if (active) {
        float floor = SJ_INF_F;
        if (start == SJ_START_CARRIED) {
            for (int s = 0; s < SJ_STATES; ++s) floor = fminf(floor, v.carried[s]);
        }
        for (int s = lane; s < SJ_STATES; s += lanes) {
            float m = SJ_INF_F;
            if (start == SJ_START_FREE) m = 0.0f;
            if (start == SJ_START_FIXED && s == fixed_state) m = 0.0f;
            if (start == SJ_START_CARRIED) m = v.carried[s] - floor;
            m0[s] = m;
            o0[s] = (sj_u32)s;
        }
    }
    SJ_SYNC();
    int fan = 1 << bits;
    int low = SJ_STATES / fan;
    for (int t = 0; t < n; ++t) {
        const float* from = v.metric + (t & 1) * SJ_STATES;
        const sj_u32* from_origin = v.origin + (t & 1) * SJ_STATES;
        float* to = v.metric + ((t + 1) & 1) * SJ_STATES;
        sj_u32* to_origin = v.origin + ((t + 1) & 1) * SJ_STATES;
        if (active) {
            float xt = x[t];
            for (int s = lane; s < SJ_STATES; s += lanes) {
                float best = SJ_INF_F;
                sj_u32 pick = 0, best_origin = 0;
                for (int h = 0; h < fan; ++h) {
                    int p = h * low + s / fan;
                    float e = xt - cb[h * SJ_STATES + s];
                    float cand = from[p] + e * e;
                    if (cand < best) {
                        best = cand;
                        pick = (sj_u32)h;
                        best_origin = from_origin[p];
                    }
                }
                to[s] = best;
                to_origin[s] = best_origin;
                v.choice[t * SJ_STATES + s] = (sj_u8)pick;
            }
        }
        SJ_SYNC();
    }
}

SJ_HD int sj_argmin64(const float* m) {
    int best = 0;
    for (int s = 1; s < SJ_STATES; ++s) {
        if (m[s] < m[best]) best = s;
    }
    return best;
}

// Tail-biting encode of x[0..n) into codes[0..n) (same survivor choices as
// `Viterbi::encode_codes`).
SJ_HD void sj_viterbi_encode_lanes(const float* cb, int bits, const float* x, int n, sj_u8* codes,
                                   SjViterbiScratch v, bool active, int lane, int lanes) {
    int fin = n & 1;
    sj_viterbi_pass_lanes(cb, bits, x, n, SJ_START_FREE, 0, v, active, lane, lanes);
    if (active && lane == 0) {
        const float* m = v.metric + fin * SJ_STATES;
        const sj_u32* o = v.origin + fin * SJ_STATES;
        int overall = sj_argmin64(m);
        v.flags[0] = overall;
        v.flags[1] = (int)o[overall] == overall ? 1 : 0;
        for (int s = 0; s < SJ_STATES; ++s) v.carried[s] = m[s];
    }
    SJ_SYNC();
    // Every group runs the same passes so the barriers line up; a group whose free pass was
    // already tail-biting runs them inactive.
    bool lap = active && v.flags[1] == 0;
    sj_viterbi_pass_lanes(cb, bits, x, n, SJ_START_CARRIED, 0, v, lap, lane, lanes);
    if (lap && lane == 0) {
        const float* m = v.metric + fin * SJ_STATES;
        const sj_u32* o = v.origin + fin * SJ_STATES;
        int best = -1;
        for (int s = 0; s < SJ_STATES; ++s) {
            if ((int)o[s] == s && (best < 0 || m[s] < m[best])) best = s;
        }
        v.flags[2] = best < 0 ? 1 : 0;
        v.flags[0] = best < 0 ? sj_argmin64(m) : best;
    }
    if (active && lane == 0 && !lap) v.flags[2] = 0;
    SJ_SYNC();
    bool pinned = lap && v.flags[2] != 0;
    sj_viterbi_pass_lanes(cb, bits, x, n, SJ_START_FIXED, v.flags[0], v, pinned, lane, lanes);
    if (active && lane == 0) {
        int low_bits = 6 - bits;
        int s = v.flags[0];
        for (int t = n - 1; t >= 0; --t) {
            codes[t] = (sj_u8)(s & ((1 << bits) - 1));
            int h = v.choice[t * SJ_STATES + s];
            s = (h << low_bits) | (s >> bits);
        }
    }
    SJ_SYNC();
}

// Lane-shared scratch of one trellis-coded tile.
struct SjTrellisScratch {
    float* unit;     // [rows][cols] normalised rows, then the decoded codebook values
    double* mean;    // [rows]
    sj_u8* viterbi;  // groups x sj_viterbi_scratch_bytes(max run)
    float* run_x;    // groups x max run
};

SJ_HD sj_u64 sj_trellis_scratch_bytes(int rows, int cols, int groups) {
    int run = rows > cols ? rows : cols;
    sj_u64 v = (sj_viterbi_scratch_bytes(run) + 15u) / 16u * 16u;
    return (sj_u64)rows * cols * 4u + (sj_u64)rows * 8u + (sj_u64)groups * (v + (sj_u64)run * 4u) + 64u;
}

SJ_HD SjTrellisScratch sj_trellis_scratch(sj_u8* base, int rows, int cols, int groups) {
    int run = rows > cols ? rows : cols;
    sj_u64 v = (sj_viterbi_scratch_bytes(run) + 15u) / 16u * 16u;
    SjTrellisScratch s;
    s.mean = (double*)base;
    base += (sj_u64)rows * 8u;
    s.unit = (float*)base;
    base += (sj_u64)rows * cols * 4u;
    s.run_x = (float*)base;
    base += (sj_u64)groups * run * 4u;
    base = (sj_u8*)(((sj_u64)base + 15u) / 16u * 16u);
    s.viterbi = base;
    (void)v;
    return s;
}

// Trellis-codes a balanced tile x (rows x cols, column scales already divided out) in the
// given layout (SJ_RUNS_ALONG_ROWS / _COLS): run-major codes to `codes`, fp16 (a, z) per row.
// Returns SJ_ERR_F16_OVERFLOW if a row's affine does not fit fp16.
SJ_HD int sj_trellis_rows_lanes(const float* x, int rows, int cols, int bits, int layout,
                                const float* cb, SjTrellisScratch s, sj_u8* codes, sj_u16* a_out,
                                sj_u16* z_out, int tid, int nthreads) {
    // 1. Per-row normalisation to zero mean, unit variance (f64 sums in index order).
    for (int i = tid; i < rows; i += nthreads) {
        const float* row = x + i * cols;
        double sum = -0.0;
        for (int j = 0; j < cols; ++j) sum += (double)row[j];
        double mean = sum / (double)cols;
        double sq = -0.0;
        for (int j = 0; j < cols; ++j) {
            double dv = (double)row[j] - mean;
            sq += dv * dv;
        }
        double var = sq / (double)cols;
        double inv = var > 0.0 ? 1.0 / sqrt(var) : 0.0;
        for (int j = 0; j < cols; ++j) s.unit[i * cols + j] = (float)(((double)row[j] - mean) * inv);
        s.mean[i] = mean;
    }
    SJ_SYNC();

    // 2. Viterbi per run, groups of lanes in parallel.
    int runs = layout == SJ_RUNS_ALONG_COLS ? cols : rows;
    int len = layout == SJ_RUNS_ALONG_COLS ? rows : cols;
    int lanes = nthreads < SJ_STATES ? nthreads : SJ_STATES;
    int groups = nthreads / lanes;
    int group = tid / lanes, lane = tid % lanes;
    bool in_group = group < groups;
    int vbytes = (int)((sj_viterbi_scratch_bytes(rows > cols ? rows : cols) + 15u) / 16u * 16u);
    SjViterbiScratch v = sj_viterbi_scratch(s.viterbi + (sj_u64)(in_group ? group : 0) * vbytes, len);
    float* run_x = s.run_x + (sj_u64)(in_group ? group : 0) * (rows > cols ? rows : cols);
    for (int base = 0; base < runs; base += groups) {
        int run = base + group;
        bool active = in_group && run < runs;
        if (active) {
            for (int t = lane; t < len; t += lanes) {
                int i = layout == SJ_RUNS_ALONG_COLS ? t : run;
                int j = layout == SJ_RUNS_ALONG_COLS ? run : t;
                run_x[t] = s.unit[i * cols + j];
            }
        }
        SJ_SYNC();
        sj_viterbi_encode_lanes(cb, bits, run_x, len, codes + (sj_u64)(active ? run : 0) * len, v,
                                active, lane, lanes);
    }
    SJ_SYNC();

    // 3. Decoded values in tile order, then the least-squares refit of each row's (a, z).
    for (int e = tid; e < rows * cols; e += nthreads) {
        int i = e / cols, j = e % cols;
        int run = layout == SJ_RUNS_ALONG_COLS ? j : i;
        int t = layout == SJ_RUNS_ALONG_COLS ? i : j;
        s.unit[e] = sj_trellis_code_value(cb, bits, codes + (sj_u64)run * len, len, t);
    }
    SJ_SYNC();
    int status = SJ_OK;
    for (int i = tid; i < rows; i += nthreads) {
        const float* xs = x + i * cols;
        const float* cs = s.unit + i * cols;
        double n = (double)cols;
        double csum = -0.0;
        for (int j = 0; j < cols; ++j) csum += (double)cs[j];
        double c_mean = csum / n;
        double cov = 0.0, var = 0.0;
        for (int j = 0; j < cols; ++j) {
            double dc = (double)cs[j] - c_mean;
            cov += dc * ((double)xs[j] - s.mean[i]);
            var += dc * dc;
        }
        double a = var > 0.0 ? cov / var : 0.0;
        double a16 = (double)sj_f16_to_f32(sj_f32_to_f16((float)a));
        sj_u16 ah = sj_f32_to_f16((float)a);
        sj_u16 zh = sj_f32_to_f16((float)(s.mean[i] - a16 * c_mean));
        if (!sj_f16_finite(ah) || !sj_f16_finite(zh)) status = SJ_ERR_F16_OVERFLOW;
        a_out[i] = ah;
        z_out[i] = zh;
    }
    SJ_SYNC();
    return status;
}
