// Shared definitions for the sjkvarn kernels and their host builds.
//
// Every function here is `SJ_HD`: NVRTC compiles it for the device, a host C++ compiler compiles
// the same text for the CPU tests, which compare it with the Rust reference. Kernel bodies are
// written as "lane" functions taking (tid, nthreads) with SJ_SYNC() between phases; the host runs
// them with one lane, which performs exactly the same arithmetic in the same order.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SJ_DEVICE_BUILD 1
#define SJ_HD __host__ __device__ __forceinline__
#define SJ_SYNC() __syncthreads()
#define SJ_UNROLL _Pragma("unroll")
typedef unsigned char sj_u8;
typedef unsigned short sj_u16;
typedef unsigned int sj_u32;
typedef unsigned long long sj_u64;
typedef int sj_i32;
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define SJ_HD inline
#define SJ_SYNC() ((void)0)
#define SJ_UNROLL
typedef uint8_t sj_u8;
typedef uint16_t sj_u16;
typedef uint32_t sj_u32;
typedef uint64_t sj_u64;
typedef int32_t sj_i32;
#endif

// Positions 0..SJ_SINK-1 are the fp16 sink; body groups hold SJ_GROUP tokens.
#define SJ_SINK 128
#define SJ_GROUP 128

// Error codes a kernel reports through its status word (first error wins).
#define SJ_OK 0
#define SJ_ERR_NONFINITE 1
#define SJ_ERR_F16_OVERFLOW 2

SJ_HD sj_u32 sj_float_bits(float f) {
#ifdef SJ_DEVICE_BUILD
    return __float_as_uint(f);
#else
    sj_u32 u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

SJ_HD float sj_bits_float(sj_u32 u) {
#ifdef SJ_DEVICE_BUILD
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

SJ_HD double sj_bits_double(sj_u64 u) {
#ifdef SJ_DEVICE_BUILD
    return __longlong_as_double((long long)u);
#else
    double d;
    memcpy(&d, &u, 8);
    return d;
#endif
}

#define SJ_INF_F sj_bits_float(0x7f800000u)
#define SJ_INF_D sj_bits_double(0x7ff0000000000000ull)

SJ_HD bool sj_isfinite(float f) { return (sj_float_bits(f) & 0x7f800000u) != 0x7f800000u; }

// IEEE binary16 from binary32, round to nearest even (bit-exact with Rust's `half` crate).
SJ_HD sj_u16 sj_f32_to_f16(float f) {
    sj_u32 x = sj_float_bits(f);
    sj_u32 sign = (x >> 16) & 0x8000u;
    sj_u32 exp = (x >> 23) & 0xffu;
    sj_u32 man = x & 0x7fffffu;
    if (exp == 0xffu) {
        // NaN is stored as the quiet pattern 0x7E00 with the input's sign (`codec::fp16`).
        return (sj_u16)(sign | (man ? 0x7e00u : 0x7c00u));
    }
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (sj_u16)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (sj_u16)sign;
        man |= 0x800000u;
        int shift = 14 - e;
        sj_u32 half_man = man >> shift;
        sj_u32 round_bit = 1u << (shift - 1);
        if ((man & round_bit) && (man & (3u * round_bit - 1u))) half_man += 1;
        return (sj_u16)(sign | half_man);
    }
    sj_u32 h = sign | ((sj_u32)e << 10) | (man >> 13);
    if ((man & 0x1000u) && (man & 0x2fffu)) h += 1;
    return (sj_u16)h;
}

SJ_HD float sj_f16_to_f32(sj_u16 h) {
    sj_u32 sign = ((sj_u32)h & 0x8000u) << 16;
    sj_u32 exp = ((sj_u32)h >> 10) & 0x1fu;
    sj_u32 man = (sj_u32)h & 0x3ffu;
    if (exp == 0x1fu) return sj_bits_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return sj_bits_float(sign);
        // Subnormal: value = man * 2^-24, exact in f32.
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return sj_bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

SJ_HD bool sj_f16_finite(sj_u16 h) { return (h & 0x7c00u) != 0x7c00u; }

SJ_HD sj_u16 sj_load_u16_le(const sj_u8* p) { return (sj_u16)(p[0] | ((sj_u16)p[1] << 8)); }

SJ_HD void sj_store_u16_le(sj_u8* p, sj_u16 v) {
    p[0] = (sj_u8)(v & 0xffu);
    p[1] = (sj_u8)(v >> 8);
}

// Bytes for `count` codes of `bits` bits, LSB-first.
SJ_HD sj_u32 sj_packed_len(sj_u32 count, sj_u32 bits) { return (count * bits + 7u) / 8u; }

// Code `index` of an LSB-first packed stream (bits <= 8).
SJ_HD sj_u32 sj_code_at(const sj_u8* packed, sj_u32 bits, sj_u32 index) {
    sj_u32 bit = index * bits;
    sj_u32 byte = bit >> 3;
    sj_u32 shift = bit & 7u;
    sj_u32 word = packed[byte];
    if (shift + bits > 8u) word |= (sj_u32)packed[byte + 1] << 8;
    return (word >> shift) & ((1u << bits) - 1u);
}

// Output byte `b` of packing `n` codes: every code overlapping it contributes its bits, so
// threads can write whole bytes independently.
SJ_HD sj_u8 sj_packed_byte(const sj_u8* codes, sj_u32 n, sj_u32 bits, sj_u32 b) {
    sj_u32 first_bit = b * 8u;
    sj_u32 i0 = first_bit / bits;
    sj_u32 i1 = (first_bit + 7u) / bits;
    sj_u32 out = 0;
    sj_u32 mask = (1u << bits) - 1u;
    for (sj_u32 i = i0; i <= i1 && i < n; ++i) {
        sj_u32 start = i * bits;
        sj_u32 code = codes[i] & mask;
        if (start >= first_bit) {
            out |= code << (start - first_bit);
        } else {
            out |= code >> (first_bit - start);
        }
    }
    return (sj_u8)(out & 0xffu);
}

// Packs `n` codes into `out` (sj_packed_len bytes), one output byte per lane step.
SJ_HD void sj_pack_lanes(const sj_u8* codes, sj_u32 n, sj_u32 bits, sj_u8* out, int tid,
                         int nthreads) {
    sj_u32 bytes = sj_packed_len(n, bits);
    for (sj_u32 b = (sj_u32)tid; b < bytes; b += (sj_u32)nthreads) {
        out[b] = sj_packed_byte(codes, n, bits, b);
    }
}

// The reference's min/max: `b < a ? b : a` and `a < b ? b : a` (first argument on ties and
// NaN), as `codec::balance::{min_f32, max_f32}`.
SJ_HD float sj_minf(float a, float b) { return b < a ? b : a; }
SJ_HD float sj_maxf(float a, float b) { return a < b ? b : a; }
SJ_HD double sj_mind(double a, double b) { return b < a ? b : a; }
SJ_HD double sj_maxd(double a, double b) { return a < b ? b : a; }

// `bits` bits (<= 8) at bit offset `bit` of an LSB-first stream (`codec::layout::unpack`).
SJ_HD sj_u32 sj_unpack_bits(const sj_u8* stream, sj_u32 bit, sj_u32 bits) {
    sj_u32 byte = bit >> 3, shift = bit & 7u;
    sj_u32 w = stream[byte];
    if (shift + bits > 8u) w |= (sj_u32)stream[byte + 1] << 8;
    return (w >> shift) & ((1u << bits) - 1u);
}
