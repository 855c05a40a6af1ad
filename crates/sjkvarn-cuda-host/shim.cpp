// C entry points over the kernel lane functions, run with one lane on the CPU. Each mirrors
// the body of a kernel in crates/sjkvarn/cuda/sjkvarn.cu (same lane functions, same arguments).
#include <vector>

#include "sj_attention.cuh"
#include "sj_seal.cuh"

template <int GS>
static void attend_head(const SjLayerView& view, const float* q, int q_heads, int base, float scale,
                        int splits, int blocks_per_split, int i, int h, float* pmax, float* psum,
                        float* pacc) {
    std::vector<float> smem(GS * view.head_dim + sj_attend_scratch_floats(GS));
    for (int split = 0; split < splits; ++split) {
        sj_attend_split_lanes<GS>(view, q, q_heads, base, scale, blocks_per_split, h, split,
                                  splits, i, pmax, psum, pacc, smem.data(), 0, 1);
    }
}

extern "C" {

sj_u16 sj_host_f32_to_f16(float x) { return sj_f32_to_f16(x); }
float sj_host_f16_to_f32(sj_u16 h) { return sj_f16_to_f32(h); }

void sj_host_pack(const sj_u8* codes, sj_u32 n, sj_u32 bits, sj_u8* out) {
    sj_pack_lanes(codes, n, bits, out, 0, 1);
}

void sj_host_fwht(float* x, int n) { sj_fwht_lanes(x, n, 0, 1); }

// The ring half of sj_append_stage: `row` (model frame, rotated in place) -> tq6_0 bytes.
int sj_host_stage_row(float* row, int head_dim, const float* tables, sj_u8* out) {
    sj_u8 codes[128];
    float slot[2];
    return sj_stage_row_lanes(row, head_dim, tables, codes, slot, out, 0, 1);
}

// tq6_0 coding of an already rotated row.
int sj_host_tq_row(const float* row, int head_dim, const float* tables, sj_u8* out) {
    sj_u8 codes[128];
    float slot[2];
    return sj_tq_row_lanes(row, head_dim, tables, codes, slot, out, 0, 1);
}

float sj_host_tq_row_value(const sj_u8* row, int head_dim, const float* tables, int c) {
    return sj_tq_row_value(row, head_dim, tables, c);
}

void sj_host_record_layout(int head_dim, int bits_k, int bits_v, int body, SjRecordLayout* out) {
    *out = sj_record_layout(head_dim, bits_k, bits_v, body);
}

int sj_host_code_bit(const SjRecordLayout* l, int t, int d, int is_v) {
    return sj_code_bit(*l, t, d, is_v);
}
int sj_host_k_slot(const SjRecordLayout* l, int d) { return sj_k_slot(*l, d); }
int sj_host_v_slot(const SjRecordLayout* l, int d) { return sj_v_slot(*l, d); }

float sj_host_record_q(const SjRecordLayout* l, const sj_u8* rec, const float* cb, int t, int d,
                       int is_v) {
    return sj_record_q(*l, rec, cb, t, d, is_v);
}

// sj_seal's record seal on explicit fp16 rows (row t at t * stride).
int sj_host_seal_record(const SjRecordLayout* l, const sj_u16* k, const sj_u16* v, int stride,
                        int iters, const float* cb_k, const float* cb_v, sj_u8* out) {
    std::vector<sj_u8> scratch(sj_seal_scratch_bytes(l->head_dim) + 64);
    SjSealScratch s = sj_seal_scratch(scratch.data(), l->head_dim);
    return sj_seal_record_lanes(*l, k, v, stride, iters, cb_k, cb_v, s, out, 0, 1);
}

// sj_seal for group `g`, KV head `h` of a layer view: gathers from the ring, writes one record.
int sj_host_seal_group(const SjLayerView* view, int g, int h, int iters, sj_u8* out) {
    std::vector<sj_u8> scratch(sj_seal_scratch_bytes(view->head_dim) + 64);
    SjSealScratch s = sj_seal_scratch(scratch.data(), view->head_dim);
    return sj_seal_group_lanes(*view, g, h, iters, s, out, 0, 1);
}

// sj_attend_gs* over every (KV head, split, query row) and then sj_attend_merge.
// Returns -1 for a query-group size with no kernel.
int sj_host_attend(const SjLayerView* view, const float* q, int rows, int q_heads, int base,
                   float scale, int splits, float* out) {
    int gs = q_heads / view->kv_heads;
    int d = view->head_dim;
    int nb = sj_cache_blocks(*view);
    int per = (nb + splits - 1) / splits;
    if (per < 1) per = 1;
    sj_u64 states = (sj_u64)rows * splits * q_heads;
    std::vector<float> pmax(states), psum(states), pacc(states * d);
    for (int i = 0; i < rows; ++i) {
        for (int h = 0; h < view->kv_heads; ++h) {
#define SJ_HOST_GS(G)                                                                          \
    case G:                                                                                    \
        attend_head<G>(*view, q, q_heads, base, scale, splits, per, i, h, pmax.data(),         \
                       psum.data(), pacc.data());                                              \
        break;
            switch (gs) {
                SJ_HOST_GS(1) SJ_HOST_GS(2) SJ_HOST_GS(3) SJ_HOST_GS(4) SJ_HOST_GS(5)
                SJ_HOST_GS(6) SJ_HOST_GS(7) SJ_HOST_GS(8) SJ_HOST_GS(16)
                default:
                    return -1;
            }
        }
    }
    std::vector<float> work(d);
    for (int i = 0; i < rows; ++i) {
        for (int head = 0; head < q_heads; ++head) {
            sj_u64 at = (sj_u64)i * splits * q_heads + head;
            sj_merge_lanes(pmax.data() + at, psum.data() + at, pacc.data() + at * d, splits,
                           q_heads, d, work.data(), out + ((sj_u64)i * q_heads + head) * d, 0, 1);
        }
    }
    return 0;
}

int sj_host_sizeof_view(void) { return (int)sizeof(SjLayerView); }
int sj_host_sizeof_record_layout(void) { return (int)sizeof(SjRecordLayout); }
int sj_host_seal_scratch_bytes(int head_dim) { return (int)sj_seal_scratch_bytes(head_dim); }
int sj_host_attend_scratch_floats(int gs) { return sj_attend_scratch_floats(gs); }
}
