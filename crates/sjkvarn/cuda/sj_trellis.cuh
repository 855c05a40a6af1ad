// The SJ-KVaRN trellis on the device: the 64-state Viterbi search of `codec::trellis::Viterbi`
// (backward over the run, start state 0, single-rounded f32 costs `d * d + M[w >> bits]`, codes
// tried in ascending order with a strict `<` so ties keep the smaller code) and the
// moment-matching refit of `codec::record::Sealer::refit` (f64 sums in index order).
//
// A group of lanes searches one run: lane l owns states l, l + lanes, ...; metrics are
// double-buffered in lane-shared scratch and every step ends with SJ_SYNC. Several groups share
// a block, each on its own run; all groups pass every barrier. Each state's arithmetic is the
// reference's, so the codes do not depend on the lane count.
#pragma once
#include "sj_common.cuh"
#include "sj_layer.cuh"

// Viterbi lane groups one seal block may run (256 lanes / 64 states).
#define SJ_SEAL_GROUPS 4
// Bytes of one group's scratch: metrics [2][64] f32, targets [128] f32, choices [128][64] u8.
#define SJ_VITERBI_BYTES (2 * SJ_STATES * 4 + SJ_GROUP * 4 + SJ_GROUP * SJ_STATES)

struct SjViterbiScratch {
    float* metric;  // [2][64]
    float* y;       // [run]
    sj_u8* choice;  // [run][64]
};

SJ_HD SjViterbiScratch sj_viterbi_scratch(sj_u8* base) {
    SjViterbiScratch v;
    v.metric = (float*)base;
    v.y = (float*)(base + 2 * SJ_STATES * 4);
    v.choice = base + 2 * SJ_STATES * 4 + SJ_GROUP * 4;
    return v;
}

// Least-squares codes of `v.y[0..n)` against the f32 codebook `cb` (2^(6+bits) entries) into
// `codes[0..n)`. `active` is false for groups without a run this round (they still pass every
// barrier).
SJ_HD void sj_viterbi_lanes(SjViterbiScratch v, int n, int bits, const float* cb, sj_u8* codes,
                            bool active, int lane, int lanes) {
    if (active) {
        for (int s = lane; s < SJ_STATES; s += lanes) v.metric[s] = 0.0f;
    }
    SJ_SYNC();
    int fan = 1 << bits;
    for (int k = 0; k < n; ++k) {
        int i = n - 1 - k;
        const float* from = v.metric + (k & 1) * SJ_STATES;
        float* to = v.metric + ((k + 1) & 1) * SJ_STATES;
        if (active) {
            float target = v.y[i];
            for (int s = lane; s < SJ_STATES; s += lanes) {
                float best = SJ_INF_F;
                int arg = 0;
                for (int j = 0; j < fan; ++j) {
                    int w = SJ_STATES * j + s;
                    float d = target - cb[w];
                    float c = d * d + from[w >> bits];
                    if (c < best) {
                        best = c;
                        arg = j;
                    }
                }
                to[s] = best;
                v.choice[i * SJ_STATES + s] = (sj_u8)arg;
            }
        }
        SJ_SYNC();
    }
    if (active && lane == 0) {
        int s = 0;
        for (int i = 0; i < n; ++i) {
            int j = v.choice[i * SJ_STATES + s];
            codes[i] = (sj_u8)j;
            s = (s + SJ_STATES * j) >> bits;
        }
    }
    SJ_SYNC();
}
