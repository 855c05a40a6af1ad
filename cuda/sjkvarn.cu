// sjkvarn kernels: append (rotate + stage), seal (balance + scalar rounding or Viterbi), decode/prefill
// attention (split-K over sink + body + ring) and the split merge. Each kernel only computes its
// pointers and calls a lane function from the headers, which the host tests run on the CPU.
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
// Tokens before the sink end become fp16 in `sink_out` ([sink_tokens][kv_heads][head_dim], K then
// V halves); the others are rotated and tq6_0-coded into `staged` ([ring_tokens][kv_heads][2][rb]).
// Nothing outside these two scratch buffers is written, so a failed append changes no cache state.
extern "C" __global__ void sj_append_stage(const float* k, const float* v, int start, int kv_heads,
                                           int head_dim, const float* tq_table, sj_u8* staged,
                                           sj_u16* sink_out, int sink_tokens, int* status) {
    __shared__ float row[SJ_MAX_HEAD_DIM];
    __shared__ sj_u8 codes[128];
    __shared__ double norm_slot[2];
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
    if (pos < SJ_SINK) {
        sj_u16* dst = sink_out + ((sj_u64)value * sink_tokens * kv_heads + (sj_u64)t * kv_heads + h) * head_dim;
        code = sj_block_status(sj_sink_row_lanes(row, head_dim, dst, tid, nthreads), &flag);
        if (tid == 0) sj_report(status, code);
        return;
    }
    int first_ring = start > SJ_SINK ? start : SJ_SINK;
    int rb = sj_tq_row_bytes(head_dim);
    sj_u8* out = staged + (((sj_u64)(pos - first_ring) * kv_heads + h) * 2 + value) * rb;
    int st = sj_stage_row_lanes(row, head_dim, tq_table, codes, norm_slot, out, tid, nthreads);
    if (st != SJ_OK && tid == 0) sj_report(status, st);
}

// Grid (groups, kv_heads, halves), SJ_SEAL_THREADS lanes (four Viterbi groups of 64 for trellis
// bodies). Seals group `groups[x]` of the ring into pool slot
// `slots[x]`; `workspace` holds sj_seal_scratch_bytes(width) per block.
extern "C" __global__ void __launch_bounds__(SJ_SEAL_THREADS, 1) sj_seal(SjLayerView view, const sj_u32* groups,
                                          const sj_u32* slots, sj_u8* pool, SjBalanceSettings cfg,
                                          sj_u8* workspace, int* status) {
    int gi = blockIdx.x, h = blockIdx.y, half = blockIdx.z;
    int tid = threadIdx.x, nthreads = blockDim.x;
    int r = view.rec.width;
    sj_u64 block_linear = ((sj_u64)gi * gridDim.y + h) * gridDim.z + half;
    SjSealScratch s = sj_seal_scratch(workspace + block_linear * sj_seal_scratch_bytes(r), r);
    sj_u8* out = pool + (sj_u64)slots[gi] * view.slot_bytes + (sj_u64)h * view.rec.record_bytes +
                 (sj_u64)half * view.rec.sub_bytes;
    int st = sj_seal_group_half_lanes(view, (int)groups[gi], h, half, cfg, s, out, tid, nthreads);
    if (tid == 0) sj_report(status, st);
}

// Grid (kv_heads, splits, query rows). Query row i sits at position `base + i`; q is
// [rows][q_heads][head_dim] f32 in the model frame. Partial states go to
// pmax/psum [rows][splits][q_heads] and pplain/prot [rows][splits][q_heads][head_dim]; the body
// is sj_attend_split_lanes. Dynamic shared memory: GS * head_dim + sj_attend_scratch_floats(GS).
template <int GS>
__device__ void sj_attend_body(SjLayerView view, const float* q, int q_heads, int base, float scale,
                               int blocks_per_split, float* pmax, float* psum, float* pplain,
                               float* prot) {
    extern __shared__ float smem[];
    sj_attend_split_lanes<GS>(view, q, q_heads, base, scale, blocks_per_split, blockIdx.x,
                              blockIdx.y, gridDim.y, blockIdx.z, pmax, psum, pplain, prot, smem,
                              threadIdx.x, blockDim.x);
}

#define SJ_ATTEND_KERNEL(GS)                                                                   \
    extern "C" __global__ void __launch_bounds__(SJ_ATTEND_THREADS, 1)                            \
        sj_attend_gs##GS(SjLayerView view, const float* q, int q_heads, int base, float scale,   \
                         int blocks_per_split, float* pmax, float* psum, float* pplain,         \
                         float* prot) {                                                          \
        sj_attend_body<GS>(view, q, q_heads, base, scale, blocks_per_split, pmax, psum, pplain,  \
                           prot);                                                                \
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
                                           const float* pplain, const float* prot, int splits,
                                           int q_heads, int head_dim, float* out) {
    __shared__ float work[SJ_MAX_HEAD_DIM];
    int i = blockIdx.x, head = blockIdx.y;
    sj_u64 at = (sj_u64)i * splits * q_heads + head;
    sj_merge_lanes(pmax + at, psum + at, pplain + at * head_dim, prot + at * head_dim, splits,
                   q_heads, head_dim, work, out + ((sj_u64)i * q_heads + head) * head_dim,
                   threadIdx.x, blockDim.x);
}
