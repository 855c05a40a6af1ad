// The SJ-KVaRN rotation: the orthonormal Sylvester-Hadamard transform over the whole head, the
// same butterflies as `codec::rotation` (strides 1, 2, 4, ... then one multiply by
// `1.0f / sqrtf(n)`): every output is the same sequence of f32 operations, so the result is
// bit-identical whatever the lane count. A 512-wide head is one 512-point transform.
#pragma once
#include "sj_common.cuh"

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

// Rotates (or un-rotates: the transform is its own inverse) one head vector.
SJ_HD void sj_rotate_head_lanes(float* x, int head_dim, int tid, int nthreads) {
    sj_fwht_lanes(x, head_dim, tid, nthreads);
}
