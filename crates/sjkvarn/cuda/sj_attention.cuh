// One-pass attention over sink + body records + ring for one query row and one KV head, over a
// range of 128-position cache blocks (a split of flash-decoding). Everything is in the rotated
// frame: the sink and the ring hold rotated rows, records decode to rotated rows
// (`codec::Decoder::k_row` / `v_row`), and the queries are rotated once; the merged output is
// un-rotated once. Body records are read in the absorbed-scale form:
//   logit[t] = Ktok[t] * (sum_d (q[d] * Kscale[d]) * qK[t,d] + sum_d q[d] * Kzero[d])
//   out[d]  += Vch[d] * (sum_t (w[t] * Vscale[t]) * qV[t,d] + sum_t w[t] * Vzero[t])
// with qK/qV the integer code (scalar) or the codebook value at the trellis window.
#pragma once
#include "sj_common.cuh"
#include "sj_hadamard.cuh"
#include "sj_layer.cuh"
#include "sj_staging.cuh"

// Channels of the query-times-scale scratch processed at once.
#define SJ_QA_CHUNK 256

// Softmax state of one query head: running max, sum and the (rotated) value accumulator.
struct SjSoftmaxState {
    float* max;  // [gs]
    float* sum;  // [gs]
    float* acc;  // [gs][head_dim]
};

// Lane-shared scratch of the attention block loop.
struct SjAttendScratch {
    float* logits;   // [gs][GROUP] (weights after the softmax step)
    float* qa;       // [gs][SJ_QA_CHUNK]
    float* offset;   // [gs]
    float* rescale;  // [gs]
    float* weight_a; // [gs][GROUP]
    float* step;     // [2][GROUP][4]: tq6_0 block norms of each ring row (K, V)
};

SJ_HD int sj_attend_scratch_floats(int gs) { return gs * (2 * SJ_GROUP + SJ_QA_CHUNK + 2) + 8 * SJ_GROUP; }

SJ_HD SjAttendScratch sj_attend_scratch(float* base, int gs) {
    SjAttendScratch s;
    s.logits = base;
    s.weight_a = base + gs * SJ_GROUP;
    s.qa = base + 2 * gs * SJ_GROUP;
    s.offset = s.qa + gs * SJ_QA_CHUNK;
    s.rescale = s.offset + gs;
    s.step = s.rescale + gs;
    return s;
}

SJ_HD void sj_softmax_init_lanes(SjSoftmaxState st, int gs, int d, int tid, int nthreads) {
    for (int j = tid; j < gs; j += nthreads) {
        st.max[j] = -SJ_INF_F;
        st.sum[j] = 0.0f;
    }
    for (int e = tid; e < gs * d; e += nthreads) st.acc[e] = 0.0f;
    SJ_SYNC();
}

// Turns `s.logits[j][0..visible)` into weights and rescales the state (one lane per head).
SJ_HD void sj_softmax_fold_lanes(SjSoftmaxState st, SjAttendScratch s, int gs, int d, int visible,
                                 int tid, int nthreads) {
    for (int j = tid; j < gs; j += nthreads) {
        float* lg = s.logits + j * SJ_GROUP;
        float block_max = -SJ_INF_F;
        for (int t = 0; t < visible; ++t) block_max = fmaxf(block_max, lg[t]);
        float new_max = fmaxf(st.max[j], block_max);
        float rescale = expf(st.max[j] - new_max);
        st.sum[j] *= rescale;
        st.max[j] = new_max;
        float sum = 0.0f;
        for (int t = 0; t < visible; ++t) {
            lg[t] = expf(lg[t] - new_max);
            sum += lg[t];
        }
        st.sum[j] += sum;
        s.rescale[j] = rescale;
    }
    SJ_SYNC();
    for (int e = tid; e < gs * d; e += nthreads) {
        st.acc[e] *= s.rescale[e / d];
    }
    SJ_SYNC();
}

// Per-row tq6_0 block norms of ring rows [first, first + rows) of head h, K then V, so the
// inner loops do one table lookup and one multiply per value.
SJ_HD void sj_ring_steps_lanes(const SjLayerView& v, int h, int first, int rows, float* step,
                               int tid, int nthreads) {
    if (v.staging != SJ_STAGING_TQ6) return;
    int len = sj_tq_block_len(v.head_dim);
    int blocks = v.head_dim / len;
    for (int e = tid; e < 2 * rows; e += nthreads) {
        int value = e / rows, t = e % rows;
        const sj_u8* row = sj_ring_row(v, first + t, h, value);
        for (int b = 0; b < blocks; ++b) {
            step[(value * SJ_GROUP + t) * 4 + b] =
                sj_f16_to_f32(sj_load_u16_le(row + b * sj_tq_block_bytes(len)));
        }
    }
    SJ_SYNC();
}

// Ring value `c` of a row whose tq6_0 block norms are in `step` (see sj_ring_steps_lanes):
// `centroid[code] * norm`, as `codec::tq6::decode_block`.
SJ_HD float sj_ring_value_fast(const SjLayerView& v, const sj_u8* row, const float* step, int c) {
    if (v.staging != SJ_STAGING_TQ6) return sj_ring_value(v, row, c);
    int len = sj_tq_block_len(v.head_dim);
    int b = c / len;
    return v.tq_table[sj_tq_code(row + b * sj_tq_block_bytes(len), len, c - b * len)] * step[b];
}

// Folds cache blocks [b0, b1) of KV head `h` into the state of the query row at position
// `qpos`. `q_rot` holds the GS rotated query heads of this KV head, [GS][head_dim]. GS is a
// template parameter so the per-head partial sums stay in registers.
template <int GS>
SJ_HD void sj_attend_blocks_lanes(const SjLayerView& v, int h, const float* q_rot, int qpos,
                                  float scale, int b0, int b1, SjSoftmaxState st,
                                  SjAttendScratch s, int tid, int nthreads) {
    const int gs = GS;
    int d = v.head_dim;
    int rstart = sj_ring_start(v);
    const SjRecordLayout& l = v.rec;
    for (int b = b0; b < b1; ++b) {
        int first, rows, kind;  // kind: 0 sink, 1 body, 2 ring
        if (b == 0) {
            first = 0; rows = v.len < SJ_SINK ? v.len : SJ_SINK; kind = 0;
        } else if (b <= v.sealed) {
            first = SJ_SINK + (b - 1) * SJ_GROUP; rows = SJ_GROUP; kind = 1;
        } else {
            first = rstart + (b - 1 - v.sealed) * SJ_GROUP;
            rows = v.len - first < SJ_GROUP ? v.len - first : SJ_GROUP;
            kind = 2;
        }
        int visible = qpos + 1 - first;
        if (visible <= 0) continue;  // causal: the whole block lies after this query
        if (visible > rows) visible = rows;
        const sj_u8* rec = 0;
        if (kind == 1) {
            rec = v.pool + (sj_u64)v.blocks[b - 1] * v.slot_bytes + (sj_u64)h * (sj_u64)l.bytes;
        }

        // 1. Logits.
        if (kind == 1) {
            for (int e = tid; e < gs * visible; e += nthreads) s.logits[e / visible * SJ_GROUP + e % visible] = 0.0f;
            for (int j = tid; j < gs; j += nthreads) {
                float off = 0.0f;
                for (int c = 0; c < d; ++c) off += q_rot[j * d + c] * sj_rec_half(rec, l.k_zero + 2 * sj_k_slot(l, c));
                s.offset[j] = off;
            }
            SJ_SYNC();
            for (int c0 = 0; c0 < d; c0 += SJ_QA_CHUNK) {
                int cw = d - c0 < SJ_QA_CHUNK ? d - c0 : SJ_QA_CHUNK;
                for (int e = tid; e < gs * cw; e += nthreads) {
                    int j = e / cw, c = e % cw;
                    s.qa[j * SJ_QA_CHUNK + c] =
                        q_rot[j * d + c0 + c] * sj_rec_half(rec, l.k_scale + 2 * sj_k_slot(l, c0 + c));
                }
                SJ_SYNC();
                for (int t = tid; t < visible; t += nthreads) {
                    float part[GS];
                    SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] = 0.0f;
                    for (int c = 0; c < cw; ++c) {
                        float u = sj_record_q(l, rec, v.k_codebook, t, c0 + c, 0);
                        SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] += s.qa[j * SJ_QA_CHUNK + c] * u;
                    }
                    SJ_UNROLL for (int j = 0; j < GS; ++j) s.logits[j * SJ_GROUP + t] += part[j];
                }
                SJ_SYNC();
            }
            for (int e = tid; e < gs * visible; e += nthreads) {
                int j = e / visible, t = e % visible;
                float tok = sj_rec_half(rec, l.k_tok + 2 * t);
                s.logits[j * SJ_GROUP + t] = tok * (s.logits[j * SJ_GROUP + t] + s.offset[j]) * scale;
            }
        } else {
            if (kind == 2) sj_ring_steps_lanes(v, h, first, visible, s.step, tid, nthreads);
            for (int t = tid; t < visible; t += nthreads) {
                float part[GS];
                SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] = 0.0f;
                int pos = first + t;
                const sj_u8* row = kind == 2 ? sj_ring_row(v, pos, h, 0) : 0;
                for (int c = 0; c < d; ++c) {
                    float kv = kind == 0 ? sj_f16_to_f32(v.sink_k[((sj_u64)pos * v.kv_heads + h) * d + c])
                                         : sj_ring_value_fast(v, row, s.step + t * 4, c);
                    SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] += q_rot[j * d + c] * kv;
                }
                SJ_UNROLL for (int j = 0; j < GS; ++j) s.logits[j * SJ_GROUP + t] = part[j] * scale;
            }
        }
        SJ_SYNC();

        // 2. Online softmax: logits become weights, the state is rescaled.
        sj_softmax_fold_lanes(st, s, gs, d, visible, tid, nthreads);

        // 3. Values.
        if (kind == 1) {
            for (int e = tid; e < gs * visible; e += nthreads) {
                int j = e / visible, t = e % visible;
                s.weight_a[j * SJ_GROUP + t] = s.logits[j * SJ_GROUP + t] * sj_rec_half(rec, l.v_scale + 2 * t);
            }
            for (int j = tid; j < gs; j += nthreads) {
                float off = 0.0f;
                for (int t = 0; t < visible; ++t) off += s.logits[j * SJ_GROUP + t] * sj_rec_half(rec, l.v_zero + 2 * t);
                s.offset[j] = off;
            }
            SJ_SYNC();
            for (int c = tid; c < d; c += nthreads) {
                float part[GS];
                SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] = 0.0f;
                for (int t = 0; t < visible; ++t) {
                    float u = sj_record_q(l, rec, v.v_codebook, t, c, 1);
                    SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] += s.weight_a[j * SJ_GROUP + t] * u;
                }
                float ch = sj_rec_half(rec, l.v_ch + 2 * sj_v_slot(l, c));
                SJ_UNROLL for (int j = 0; j < GS; ++j) st.acc[j * d + c] += ch * (part[j] + s.offset[j]);
            }
            SJ_SYNC();
        } else {
            for (int c = tid; c < d; c += nthreads) {
                float part[GS];
                SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] = 0.0f;
                for (int t = 0; t < visible; ++t) {
                    int pos = first + t;
                    float vv = kind == 0 ? sj_f16_to_f32(v.sink_v[((sj_u64)pos * v.kv_heads + h) * d + c])
                                         : sj_ring_value_fast(v, sj_ring_row(v, pos, h, 1),
                                                              s.step + (SJ_GROUP + t) * 4, c);
                    SJ_UNROLL for (int j = 0; j < GS; ++j) part[j] += s.logits[j * SJ_GROUP + t] * vv;
                }
                SJ_UNROLL for (int j = 0; j < GS; ++j) st.acc[j * d + c] += part[j];
            }
            SJ_SYNC();
        }
    }
}

// The whole body of `sj_attend_gs{GS}` for block (KV head h, split, query row i): rotates the
// row's GS queries into `smem` (GS * head_dim floats, followed by sj_attend_scratch_floats(GS)),
// then folds the split's cache blocks into its partial state in pmax/psum [rows][splits][q_heads]
// and pacc [rows][splits][q_heads][head_dim] (rotated frame).
template <int GS>
SJ_HD void sj_attend_split_lanes(const SjLayerView& view, const float* q, int q_heads, int base,
                                 float scale, int blocks_per_split, int h, int split, int splits,
                                 int i, float* pmax, float* psum, float* pacc, float* smem,
                                 int tid, int nthreads) {
    int d = view.head_dim;
    float* q_rot = smem;
    SjAttendScratch s = sj_attend_scratch(smem + GS * d, GS);
    const float* q_plain = q + ((sj_u64)i * q_heads + (sj_u64)h * GS) * d;
    for (int e = tid; e < GS * d; e += nthreads) q_rot[e] = q_plain[e];
    SJ_SYNC();
    for (int j = 0; j < GS; ++j) sj_rotate_head_lanes(q_rot + j * d, d, tid, nthreads);
    sj_u64 head0 = ((sj_u64)i * splits + split) * q_heads + (sj_u64)h * GS;
    SjSoftmaxState st;
    st.max = pmax + head0;
    st.sum = psum + head0;
    st.acc = pacc + head0 * d;
    sj_softmax_init_lanes(st, GS, d, tid, nthreads);
    int nb = sj_cache_blocks(view);
    int b0 = split * blocks_per_split;
    int b1 = b0 + blocks_per_split < nb ? b0 + blocks_per_split : nb;
    sj_attend_blocks_lanes<GS>(view, h, q_rot, base + i, scale, b0, b1, st, s, tid, nthreads);
}

// Merges `splits` partial states of one query head and writes the normalised output in the
// model frame (the merged rotated sum un-rotated once). Split `s` of this head is at
// `max[s * stride]` and `acc[s * stride * head_dim]`; `work` is lane-shared scratch of head_dim
// floats.
SJ_HD void sj_merge_lanes(const float* max, const float* sum, const float* acc, int splits,
                          int stride, int head_dim, float* work, float* out, int tid,
                          int nthreads) {
    float m = -SJ_INF_F;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, max[s * stride]);
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) {
        if (max[s * stride] != -SJ_INF_F) total += sum[s * stride] * expf(max[s * stride] - m);
    }
    for (int c = tid; c < head_dim; c += nthreads) {
        float rot = 0.0f;
        for (int s = 0; s < splits; ++s) {
            if (max[s * stride] == -SJ_INF_F) continue;
            float w = expf(max[s * stride] - m);
            rot += acc[(sj_u64)s * (sj_u64)stride * (sj_u64)head_dim + (sj_u64)c] * w;
        }
        work[c] = rot;
    }
    SJ_SYNC();
    sj_rotate_head_lanes(work, head_dim, tid, nthreads);
    float inv = 1.0f / total;
    for (int c = tid; c < head_dim; c += nthreads) out[c] = work[c] * inv;
    SJ_SYNC();
}
