// Seal of one (group, KV head) record, byte-identical to `codec::record::Sealer::seal`:
// log-domain variance balancing (`codec::balance`), per-row min/max affine with the row scale
// absorbed into the stored fp16 fields, scalar codes (ties to even) or the 64-state trellis with
// its moment-matching refit, column scales last.
//
// Lane contract: every value that decides a byte is computed by one lane with the reference's
// own operation order (a spread is one lane's 8-chunk f64 reduction, a row's min/max and refit
// sums are one lane's loops), so the bytes do not depend on the lane count. The kernels are
// compiled with `--fmad=false` and the host build with `-ffp-contract=off`; the one explicit
// fused multiply-add is the reference's (`fma` in the second moment).
#pragma once
#include "sj_common.cuh"
#include "sj_layer.cuh"
#include "sj_trellis.cuh"

#define SJ_LANES 8

// Lane-shared scratch of one record seal (device: global workspace of the block).
struct SjSealScratch {
    double* log_row;  // [big]
    double* log_col;  // [big]
    float* m;         // [D * G] the side's tile as read (K: [D][G], V: [G][D])
    float* tile;      // [D * G] balanced tile M / s_col / s_row
    float* s_row;     // [big]
    float* s_col;     // [big]
    float* lo;        // [big]
    float* step;      // [big]
    sj_u8* viterbi;   // SJ_SEAL_GROUPS * SJ_VITERBI_BYTES
    int* status;      // 4 ints
    sj_u16* rows_k;   // [G][D] gathered fp16 rows (seal kernel only)
    sj_u16* rows_v;   // [G][D]
    sj_u8* codes;     // [D * G] codes in payload stream order
};

SJ_HD sj_u64 sj_seal_scratch_bytes(int head_dim) {
    sj_u64 d = (sj_u64)head_dim, g = SJ_GROUP;
    sj_u64 big = d > g ? d : g;
    return 2u * 8u * big + 2u * 4u * d * g + 4u * 4u * big +
           (sj_u64)SJ_SEAL_GROUPS * SJ_VITERBI_BYTES + 16u + 2u * 2u * d * g + d * g;
}

SJ_HD SjSealScratch sj_seal_scratch(sj_u8* base, int head_dim) {
    sj_u64 d = (sj_u64)head_dim, g = SJ_GROUP;
    sj_u64 big = d > g ? d : g;
    SjSealScratch s;
    s.log_row = (double*)base;
    base += 8u * big;
    s.log_col = (double*)base;
    base += 8u * big;
    s.m = (float*)base;
    base += 4u * d * g;
    s.tile = (float*)base;
    base += 4u * d * g;
    s.s_row = (float*)base;
    base += 4u * big;
    s.s_col = (float*)base;
    base += 4u * big;
    s.lo = (float*)base;
    base += 4u * big;
    s.step = (float*)base;
    base += 4u * big;
    s.viterbi = base;
    base += (sj_u64)SJ_SEAL_GROUPS * SJ_VITERBI_BYTES;
    s.status = (int*)base;
    base += 16u;
    s.rows_k = (sj_u16*)base;
    base += 2u * d * g;
    s.rows_v = (sj_u16*)base;
    base += 2u * d * g;
    s.codes = base;
    return s;
}

SJ_HD double sj_reduce8(const double* p) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// Sample standard deviation (n - 1) of x[0], x[stride], ..., x[(n-1)*stride] with the 8-lane
// reduction contract (`codec::balance::sample_std`).
SJ_HD float sj_sample_std(const float* x, int n, int stride) {
    int chunk = n / SJ_LANES;
    double p[SJ_LANES];
    for (int l = 0; l < SJ_LANES; ++l) {
        double acc = 0.0;
        for (int i = 0; i < chunk; ++i) acc = acc + (double)x[(l * chunk + i) * stride];
        p[l] = acc;
    }
    double mean = sj_reduce8(p) / (double)n;
    for (int l = 0; l < SJ_LANES; ++l) {
        double acc = 0.0;
        for (int i = 0; i < chunk; ++i) {
            double d = (double)x[(l * chunk + i) * stride] - mean;
            acc = fma(d, d, acc);
        }
        p[l] = acc;
    }
    int dof = (n < 2 ? 2 : n) - 1;
    return (float)sqrt(sj_reduce8(p) / (double)dof);
}

// One balancing step of a row or column: clamp the spread, accumulate its log (clamped), return
// the new scale. Device `log`/`exp` (double) are the one known risk to bit-exactness (see
// docs/cuda.md); the host build uses the host libm, as the Rust reference does.
SJ_HD float sj_balance_step(double* logv, float sd) {
    sd = sj_minf(sj_maxf(sd, 1e-3f), 1e3f);
    double l = sj_mind(sj_maxd(*logv + log((double)sd), -0.3), 10.0);
    *logv = l;
    return (float)exp(l);
}

SJ_HD void sj_recompute_lanes(const float* m, int rows, int cols, SjSealScratch s, int tid,
                              int nthreads) {
    for (int e = tid; e < rows * cols; e += nthreads) {
        int r = e / cols, c = e % cols;
        s.tile[e] = m[e] / s.s_col[c] / s.s_row[r];
    }
    SJ_SYNC();
}

// Balances the row-major tile `s.m` ([rows][cols]) with `iters` column-then-row passes into
// `s.tile`, `s.s_row`, `s.s_col` (`codec::balance::Balanced::run`).
SJ_HD void sj_balance_lanes(int rows, int cols, int iters, SjSealScratch s, int tid,
                            int nthreads) {
    for (int r = tid; r < rows; r += nthreads) {
        s.s_row[r] = 1.0f;
        s.log_row[r] = 0.0;
    }
    for (int c = tid; c < cols; c += nthreads) {
        s.s_col[c] = 1.0f;
        s.log_col[c] = 0.0;
    }
    SJ_SYNC();
    sj_recompute_lanes(s.m, rows, cols, s, tid, nthreads);
    for (int it = 0; it < iters; ++it) {
        for (int c = tid; c < cols; c += nthreads) {
            s.s_col[c] = sj_balance_step(&s.log_col[c], sj_sample_std(s.tile + c, rows, cols));
        }
        SJ_SYNC();
        sj_recompute_lanes(s.m, rows, cols, s, tid, nthreads);
        for (int r = tid; r < rows; r += nthreads) {
            s.s_row[r] = sj_balance_step(&s.log_row[r], sj_sample_std(s.tile + r * cols, cols, 1));
        }
        SJ_SYNC();
        sj_recompute_lanes(s.m, rows, cols, s, tid, nthreads);
    }
}

SJ_HD void sj_put_half(sj_u8* rec, int off, float v) { sj_store_u16_le(rec + off, sj_f32_to_f16(v)); }

// Trellis codes of every channel run of the balanced side into `s.codes` (channel-major, the
// payload's stream order); targets are (x - lo[r]) / step[r].
SJ_HD void sj_trellis_code_lanes(const SjRecordLayout& l, int is_v, const float* cb,
                                 SjSealScratch s, int tid, int nthreads) {
    int d = l.head_dim, g = l.group, bits = sj_side_bits(l, is_v);
    int cols = is_v ? d : g;
    int lanes = nthreads < SJ_STATES ? nthreads : SJ_STATES;
    int groups = nthreads / lanes;
    if (groups > SJ_SEAL_GROUPS) groups = SJ_SEAL_GROUPS;
    int group = tid / lanes, lane = tid % lanes;
    bool in_group = group < groups;
    SjViterbiScratch v = sj_viterbi_scratch(s.viterbi + (sj_u64)(in_group ? group : 0) * SJ_VITERBI_BYTES);
    for (int base = 0; base < d; base += groups) {
        int ch = base + group;
        bool active = in_group && ch < d;
        if (active) {
            for (int t = lane; t < g; t += lanes) {
                int r = is_v ? t : ch, c = is_v ? ch : t;
                v.y[t] = (s.tile[r * cols + c] - s.lo[r]) / s.step[r];
            }
        }
        SJ_SYNC();
        sj_viterbi_lanes(v, g, bits, cb, s.codes + (sj_u64)(active ? ch : 0) * g, active, lane,
                         lanes);
    }
}

// Moment-matching refit of each row's affine to the decoded codebook values
// (`Sealer::refit`); degenerate rows keep the min/max affine.
SJ_HD void sj_refit_lanes(const SjRecordLayout& l, int is_v, const float* cb, SjSealScratch s,
                          sj_u8* rec, int tid, int nthreads) {
    int rows = is_v ? l.group : l.head_dim, cols = is_v ? l.head_dim : l.group;
    int bits = sj_side_bits(l, is_v);
    const sj_u8* payload = rec + (is_v ? l.v_payload : l.k_payload);
    int pbytes = is_v ? l.k_scale - l.v_payload : l.v_payload - l.k_payload;
    int scale_off = is_v ? l.v_scale : l.k_scale, zero_off = is_v ? l.v_zero : l.k_zero;
    double n = (double)cols;
    for (int r = tid; r < rows; r += nthreads) {
        double sx = 0.0, sy = 0.0, sxx = 0.0, syy = 0.0;
        for (int c = 0; c < cols; ++c) {
            int t = is_v ? r : c, ch = is_v ? c : r;
            double x = (double)s.tile[r * cols + c];
            double yh = (double)cb[sj_trellis_window(payload, pbytes, bits, ch, t, l.group)];
            sx = sx + x;
            sy = sy + yh;
            sxx = sxx + x * x;
            syy = syy + yh * yh;
        }
        double vy = n * syy - sy * sy;
        if (!(vy > 0.0)) continue;
        double vx = n * sxx - sx * sx;
        if (!(vx > 0.0)) continue;
        double a = sqrt(vx / vy);
        double b = (sx - a * sy) / n;
        if (!(a > 0.0) || b != b || a > 1e30 || fabs(b) > 1e30) continue;
        int slot = is_v ? r : sj_k_slot(l, r);
        float s_row = s.s_row[r];
        sj_put_half(rec, scale_off + 2 * slot, s_row * (float)a);
        sj_put_half(rec, zero_off + 2 * slot, s_row * (float)b);
    }
    SJ_SYNC();
}

// Quantises the balanced side in `s.tile` into `rec` (`Sealer::quantize_side`).
SJ_HD void sj_quantize_side_lanes(const SjRecordLayout& l, int is_v, const float* cb,
                                  SjSealScratch s, sj_u8* rec, int tid, int nthreads) {
    int rows = is_v ? l.group : l.head_dim, cols = is_v ? l.head_dim : l.group;
    int bits = sj_side_bits(l, is_v);
    float qmax = (float)((1u << bits) - 1u);
    bool trellis = l.body == SJ_BODY_TRELLIS;
    int scale_off = is_v ? l.v_scale : l.k_scale, zero_off = is_v ? l.v_zero : l.k_zero;
    sj_u8* payload = rec + (is_v ? l.v_payload : l.k_payload);
    for (int r = tid; r < rows; r += nthreads) {
        const float* row = s.tile + r * cols;
        float lo = row[0], hi = row[0];
        for (int c = 1; c < cols; ++c) {
            lo = sj_minf(lo, row[c]);
            hi = sj_maxf(hi, row[c]);
        }
        float step = sj_maxf((hi - lo) / qmax, 1e-10f);
        int slot = is_v ? r : sj_k_slot(l, r);
        float s_row = s.s_row[r];
        sj_put_half(rec, scale_off + 2 * slot, s_row * step);
        sj_put_half(rec, zero_off + 2 * slot, s_row * lo);
        s.lo[r] = lo;
        s.step[r] = step;
        if (trellis) continue;
        for (int c = 0; c < cols; ++c) {
            int t = is_v ? r : c, ch = is_v ? c : r;
            float q = rintf((row[c] - lo) / step);
            if (q < 0.0f) q = 0.0f;
            if (q > qmax) q = qmax;
            s.codes[sj_code_bit(l, t, ch, is_v) / bits] = q == q ? (sj_u8)q : (sj_u8)0;
        }
    }
    SJ_SYNC();
    if (trellis) sj_trellis_code_lanes(l, is_v, cb, s, tid, nthreads);
    sj_pack_lanes(s.codes, (sj_u32)(l.head_dim * l.group), (sj_u32)bits, payload, tid, nthreads);
    SJ_SYNC();
    if (trellis) sj_refit_lanes(l, is_v, cb, s, rec, tid, nthreads);
    for (int c = tid; c < cols; c += nthreads) {
        int off = is_v ? l.v_ch + 2 * sj_v_slot(l, c) : l.k_tok + 2 * c;
        sj_put_half(rec, off, s.s_col[c]);
    }
    SJ_SYNC();
}

// Seals 128 rotated rows of K and V (fp16 bits, row t at t * stride) into `rec` (l.bytes
// bytes): `Sealer::seal` with `iters` balancing iterations. `cb_k`/`cb_v` are the f32 trellis
// codebooks (unused for scalar bodies).
SJ_HD int sj_seal_record_lanes(const SjRecordLayout& l, const sj_u16* k, const sj_u16* v,
                               int stride, int iters, const float* cb_k, const float* cb_v,
                               SjSealScratch s, sj_u8* rec, int tid, int nthreads) {
    int d = l.head_dim, g = l.group;
    for (int e = tid; e < d * g; e += nthreads) {
        int c = e / g, t = e % g;
        s.m[e] = sj_f16_to_f32(k[t * stride + c]);
    }
    SJ_SYNC();
    sj_balance_lanes(d, g, iters, s, tid, nthreads);
    sj_quantize_side_lanes(l, 0, cb_k, s, rec, tid, nthreads);
    for (int e = tid; e < d * g; e += nthreads) {
        int t = e / d, c = e % d;
        s.m[e] = sj_f16_to_f32(v[t * stride + c]);
    }
    SJ_SYNC();
    sj_balance_lanes(g, d, iters, s, tid, nthreads);
    sj_quantize_side_lanes(l, 1, cb_v, s, rec, tid, nthreads);
    return SJ_OK;
}

// Gathers group `g` of KV head `h` from the ring (each staged value decoded and rounded to fp16,
// as the CPU journal hands rows to the sealer) and seals it into `out`. The seal kernel's body.
SJ_HD int sj_seal_group_lanes(const SjLayerView& view, int g, int h, int iters, SjSealScratch s,
                              sj_u8* out, int tid, int nthreads) {
    int d = view.head_dim;
    for (int e = tid; e < d * SJ_GROUP; e += nthreads) {
        int t = e / d, c = e % d;
        int pos = SJ_SINK + g * SJ_GROUP + t;
        s.rows_k[e] = sj_f32_to_f16(sj_ring_value(view, sj_ring_row(view, pos, h, 0), c));
        s.rows_v[e] = sj_f32_to_f16(sj_ring_value(view, sj_ring_row(view, pos, h, 1), c));
    }
    SJ_SYNC();
    return sj_seal_record_lanes(view.rec, s.rows_k, s.rows_v, d, iters, view.k_codebook,
                                view.v_codebook, s, out, tid, nthreads);
}
