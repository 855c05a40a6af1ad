// C entry points over the kernel lane functions, run with one lane on the CPU. Each mirrors
// the body of a kernel in cuda/sjkvarn.cu (same lane functions, same arguments).
#include <vector>

#include "sj_attention.cuh"

template <int GS>
static void attend_head(const SjLayerView& view, const float* q, int q_heads, int base, float scale,
                        int splits, int blocks_per_split, int i, int h, float* pmax, float* psum,
                        float* pplain, float* prot) {
    std::vector<float> smem(GS * view.head_dim + sj_attend_scratch_floats(GS));
    for (int split = 0; split < splits; ++split) {
        sj_attend_split_lanes<GS>(view, q, q_heads, base, scale, blocks_per_split, h, split,
                                  splits, i, pmax, psum, pplain, prot, smem.data(), 0, 1);
    }
}

extern "C" {

sj_u16 sj_host_f32_to_f16(float x) { return sj_f32_to_f16(x); }
float sj_host_f16_to_f32(sj_u16 h) { return sj_f16_to_f32(h); }

void sj_host_pack(const sj_u8* codes, sj_u32 n, sj_u32 bits, sj_u8* out) {
    sj_pack_lanes(codes, n, bits, out, 0, 1);
}

void sj_host_fwht(float* x, int n) { sj_fwht_lanes(x, n, 0, 1); }

// sj_append_stage for one ring row: `row` (model frame, modified) -> staged bytes.
int sj_host_stage_row(float* row, int head_dim, const float* table, sj_u8* out) {
    sj_u8 codes[128];
    double norm_slot[2];
    return sj_stage_row_lanes(row, head_dim, table, codes, norm_slot, out, 0, 1);
}

// sj_seal for every half of group `g`, KV head `h`: writes one record (record_bytes).
int sj_host_seal_group(const SjLayerView* view, int g, int h, const SjBalanceSettings* cfg,
                       sj_u8* out) {
    int r = view->rec.width;
    std::vector<sj_u8> scratch(sj_seal_scratch_bytes(r) + 256);
    int status = SJ_OK;
    for (int half = 0; half < view->rec.halves; ++half) {
        SjSealScratch s = sj_seal_scratch(scratch.data(), r);
        int st = sj_seal_group_half_lanes(*view, g, h, half, *cfg, s,
                                          out + half * view->rec.sub_bytes, 0, 1);
        if (st != SJ_OK) status = st;
    }
    return status;
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
    std::vector<float> pmax(states), psum(states), pplain(states * d), prot(states * d);
    for (int i = 0; i < rows; ++i) {
        for (int h = 0; h < view->kv_heads; ++h) {
#define SJ_HOST_GS(G)                                                                          \
    case G:                                                                                    \
        attend_head<G>(*view, q, q_heads, base, scale, splits, per, i, h, pmax.data(),         \
                       psum.data(), pplain.data(), prot.data());                               \
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
            sj_merge_lanes(pmax.data() + at, psum.data() + at, pplain.data() + at * d,
                           prot.data() + at * d, splits, q_heads, d, work.data(),
                           out + ((sj_u64)i * q_heads + head) * d, 0, 1);
        }
    }
    return 0;
}

int sj_host_sizeof_view(void) { return (int)sizeof(SjLayerView); }
int sj_host_sizeof_record_layout(void) { return (int)sizeof(SjRecordLayout); }
int sj_host_sizeof_balance(void) { return (int)sizeof(SjBalanceSettings); }
int sj_host_seal_scratch_bytes(int width) { return (int)sj_seal_scratch_bytes(width); }
}

extern "C" int sj_host_attend_scratch_floats(int gs) { return sj_attend_scratch_floats(gs); }
