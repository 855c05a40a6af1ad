// Orthonormal Walsh-Hadamard rotation (Sylvester order), the same butterflies as
// `crates/sjkvarn/src/hadamard.rs`: every output is the same sequence of f32 adds, so the result
// is bit-identical whatever the lane count.
#pragma once
#include "sj_common.cuh"

// Rotation length for a head: the head itself up to 256, 256-wide halves for 512.
SJ_HD int sj_rotation_size(int head_dim) { return head_dim > 256 ? 256 : head_dim; }

// In-place transform of `x[0..n)` (n a power of two) with lanes working on disjoint butterflies.
SJ_HD void sj_fwht_lanes(float* x, int n, int tid, int nthreads) {
    for (int half = 1; half < n; half *= 2) {
        for (int p = tid; p < n / 2; p += nthreads) {
            int start = (p / half) * 2 * half;
            int i = start + (p % half);
            float a = x[i];
            float b = x[i + half];
            x[i] = a + b;
            x[i + half] = a - b;
        }
        SJ_SYNC();
    }
    float scale = 1.0f / sqrtf((float)n);
    for (int i = tid; i < n; i += nthreads) x[i] = x[i] * scale;
    SJ_SYNC();
}

// Rotates one head vector of `head_dim` values (two halves for 512).
SJ_HD void sj_rotate_head_lanes(float* x, int head_dim, int tid, int nthreads) {
    int r = sj_rotation_size(head_dim);
    for (int c0 = 0; c0 < head_dim; c0 += r) sj_fwht_lanes(x + c0, r, tid, nthreads);
}
