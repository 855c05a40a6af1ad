// sjkvarn kernels: append (rotate + stage), seal (one SJ-KVaRN record per block: balance + scalar
// rounding or Viterbi), decode/prefill attention (split-K over sink + body + ring, rotated frame)
// and the split merge. Each kernel only computes its pointers and calls a lane function from the
// headers, which the host tests run on the CPU.
#include "sj_attention.cuh"
#include "sj_common.cuh"
#include "sj_hadamard.cuh"
#include "sj_seal.cuh"
#include "sj_staging.cuh"

#define SJ_APPEND_THREADS 128
#define SJ_SEAL_THREADS 256
#define SJ_ATTEND_THREADS 128
#define SJ_MAX_HEAD_DIM 512

__device__ void sj_report(int* status, int code) {
    if (code != SJ_OK) atomicCAS(status, SJ_OK, code);
}

// Block reduction of "any lane failed": every lane returns the first non-OK code seen.
__device__ int sj_block_status(int code, int* shared_flag) {
    if (threadIdx.x == 0) *shared_flag = SJ_OK;
    __syncthreads();
    if (code != SJ_OK) atomicCAS(shared_flag, SJ_OK, code);
    __syncthreads();
    int out = *shared_flag;
    __syncthreads();
    return out;
}

// Grid (tokens, kv_heads, 2 = K/V); K and V are [tokens][kv_heads][head_dim] f32, model frame.
// Every row is rotated (`codec::rotation`). Tokens before the sink end become rotated fp16 in
// `sink_out` ([sink_tokens][kv_heads][head_dim], K then V halves); the others are staged
// (`staging`: tq6_0 or fp16, `row_bytes` each) into `staged` ([ring_tokens][kv_heads][2][rb]).
// Nothing outside these two scratch buffers is written, so a failed append changes no cache
// state.
extern "C" __global__ void sj_append_stage(const float* k, const float* v, int start, int kv_heads,
                                           int head_dim, int staging, int row_bytes,
                                           const float* tq_table, sj_u8* staged, sj_u16* sink_out,
                                           int sink_tokens, int* status) {
    __shared__ float row[SJ_MAX_HEAD_DIM];
    __shared__ sj_u8 codes[128];
    __shared__ float slot[2];
    __shared__ int flag;
    int t = blockIdx.x, h = blockIdx.y, value = blockIdx.z;
    int tid = threadIdx.x, nthreads = blockDim.x;
    const float* src = (value ? v : k) + ((sj_u64)t * kv_heads + h) * head_dim;
    int pos = start + t;
    int code = SJ_OK;
    for (int c = tid; c < head_dim; c += nthreads) {
        float x = src[c];
        if (!sj_isfinite(x)) code = SJ_ERR_NONFINITE;
        row[c] = x;
    }
    code = sj_block_status(code, &flag);
    if (code != SJ_OK) {
        if (tid == 0) sj_report(status, code);
        return;
    }
    sj_rotate_head_lanes(row, head_dim, tid, nthreads);
    if (pos < SJ_SINK) {
        sj_u16* dst = sink_out + ((sj_u64)value * sink_tokens * kv_heads + (sj_u64)t * kv_heads + h) * head_dim;
        code = sj_block_status(sj_f16_row_lanes(row, head_dim, dst, tid, nthreads), &flag);
        if (tid == 0) sj_report(status, code);
        return;
    }
    int first_ring = start > SJ_SINK ? start : SJ_SINK;
    sj_u8* out = staged + (((sj_u64)(pos - first_ring) * kv_heads + h) * 2 + value) * row_bytes;
    if (staging == SJ_STAGING_F16) {
        code = sj_block_status(sj_f16_row_lanes(row, head_dim, (sj_u16*)out, tid, nthreads), &flag);
        if (tid == 0) sj_report(status, code);
        return;
    }
    int st = sj_tq_row_lanes(row, head_dim, tq_table, codes, slot, out, tid, nthreads);
    if (st != SJ_OK && tid == 0) sj_report(status, st);
}

// Grid (groups, kv_heads), SJ_SEAL_THREADS lanes (four Viterbi groups of 64 for trellis
// bodies). Seals group `groups[x]` of the ring into pool slot `slots[x]` (head h at
// h * rec.bytes); `workspace` holds sj_seal_workspace_bytes(head_dim) per block.
extern "C" __global__ void __launch_bounds__(SJ_SEAL_THREADS, 1) sj_seal(SjLayerView view, const sj_u32* groups,
                                          const sj_u32* slots, sj_u8* pool, int iters,
                                          sj_u8* workspace, int* status) {
    int gi = blockIdx.x, h = blockIdx.y;
    int tid = threadIdx.x, nthreads = blockDim.x;
    sj_u64 block_linear = (sj_u64)gi * gridDim.y + h;
    sj_u64 per_block = (sj_seal_scratch_bytes(view.head_dim) + 255u) / 256u * 256u;
    SjSealScratch s = sj_seal_scratch(workspace + block_linear * per_block, view.head_dim);
    sj_u8* out = pool + (sj_u64)slots[gi] * view.slot_bytes + (sj_u64)h * view.rec.bytes;
    int st = sj_seal_group_lanes(view, (int)groups[gi], h, iters, s, out, tid, nthreads);
    if (tid == 0) sj_report(status, st);
}

// Grid (kv_heads, splits, query rows). Query row i sits at position `base + i`; q is
// [rows][q_heads][head_dim] f32 in the model frame. Partial states go to
// pmax/psum [rows][splits][q_heads] and pacc [rows][splits][q_heads][head_dim] (rotated frame);
// the body is sj_attend_split_lanes. Dynamic shared memory: GS * head_dim +
// sj_attend_scratch_floats(GS) floats.
template <int GS>
__device__ void sj_attend_body(SjLayerView view, const float* q, int q_heads, int base, float scale,
                               int blocks_per_split, float* pmax, float* psum, float* pacc) {
    extern __shared__ float smem[];
    sj_attend_split_lanes<GS>(view, q, q_heads, base, scale, blocks_per_split, blockIdx.x,
                              blockIdx.y, gridDim.y, blockIdx.z, pmax, psum, pacc, smem,
                              threadIdx.x, blockDim.x);
}

#define SJ_ATTEND_KERNEL(GS)                                                                   \
    extern "C" __global__ void __launch_bounds__(SJ_ATTEND_THREADS, 1)                            \
        sj_attend_gs##GS(SjLayerView view, const float* q, int q_heads, int base, float scale,   \
                         int blocks_per_split, float* pmax, float* psum, float* pacc) {         \
        sj_attend_body<GS>(view, q, q_heads, base, scale, blocks_per_split, pmax, psum, pacc);   \
    }

SJ_ATTEND_KERNEL(1)
SJ_ATTEND_KERNEL(2)
SJ_ATTEND_KERNEL(3)
SJ_ATTEND_KERNEL(4)
SJ_ATTEND_KERNEL(5)
SJ_ATTEND_KERNEL(6)
SJ_ATTEND_KERNEL(7)
SJ_ATTEND_KERNEL(8)
SJ_ATTEND_KERNEL(16)

// Grid (query rows, q_heads): merges the splits of one query head into out [rows][q_heads][d].
extern "C" __global__ void sj_attend_merge(const float* pmax, const float* psum,
                                           const float* pacc, int splits, int q_heads,
                                           int head_dim, float* out) {
    __shared__ float work[SJ_MAX_HEAD_DIM];
    int i = blockIdx.x, head = blockIdx.y;
    sj_u64 at = (sj_u64)i * splits * q_heads + head;
    sj_merge_lanes(pmax + at, psum + at, pacc + at * head_dim, splits, q_heads, head_dim, work,
                   out + ((sj_u64)i * q_heads + head) * head_dim, threadIdx.x, blockDim.x);
}
