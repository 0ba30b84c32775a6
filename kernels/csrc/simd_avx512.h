/* simd.h's vocabulary in AVX512 instructions (x86-64). The "avx512_bf16" build (-mavx512bf16
 * -mavx512vnni) takes VDPBF16PS for a bf16 dot product, VCVTNEPS2BF16 for rounding to bf16 and
 * VPDPBUSD for byte dot products; the "avx512f" build does the first as two fp32 FMAs over the
 * even and odd elements, the second with integer instructions and the third with VPMADDUBSW
 * over nibbles (exact). Include simd.h, not this. */
#ifndef OUTRIDER_SIMD_AVX512_H
#define OUTRIDER_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

typedef __m512 f32x16;
typedef __m512i i32x16;
typedef __m512i u8x64;
/* How many f32x16 the vector registers hold (zmm registers), for tile sizes. */
#define SIMD_F32X16_REGISTERS 32
typedef __mmask16 lanes16;
typedef __mmask32 lanes32;

static inline lanes16 lanes16_first(int n) { return (lanes16)((1u << n) - 1u); }
static inline lanes32 lanes32_first(int n) { return n >= 32 ? (lanes32)~0u : (lanes32)((1u << n) - 1u); }

static inline f32x16 f32x16_zero(void) { return _mm512_setzero_ps(); }
static inline f32x16 f32x16_set1(float v) { return _mm512_set1_ps(v); }
static inline f32x16 f32x16_load(const float *p) { return _mm512_loadu_ps(p); }
/* Lanes past the first n read as 0 (and their memory is not touched). */
static inline f32x16 f32x16_load_first(const float *p, lanes16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void f32x16_store(float *p, f32x16 v) { _mm512_storeu_ps(p, v); }
static inline void f32x16_store_first(float *p, f32x16 v, lanes16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline f32x16 f32x16_add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
static inline f32x16 f32x16_sub(f32x16 a, f32x16 b) { return _mm512_sub_ps(a, b); }
static inline f32x16 f32x16_mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
static inline f32x16 f32x16_div(f32x16 a, f32x16 b) { return _mm512_div_ps(a, b); }
/* max(a, b); b where a is NaN. */
static inline f32x16 f32x16_max(f32x16 a, f32x16 b) { return _mm512_max_ps(a, b); }
static inline f32x16 f32x16_abs(f32x16 a) { return _mm512_abs_ps(a); }
/* a b + c and c - a b, each rounded once. */
static inline f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline f32x16 f32x16_fnma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fnmadd_ps(a, b, c); }
/* acc op v in the lanes of m, acc elsewhere. */
static inline f32x16 f32x16_add_in(f32x16 acc, f32x16 v, lanes16 m) { return _mm512_mask_add_ps(acc, m, acc, v); }
static inline f32x16 f32x16_max_in(f32x16 acc, f32x16 v, lanes16 m) { return _mm512_mask_max_ps(acc, m, acc, v); }
/* a where g < 0, b elsewhere. */
static inline f32x16 f32x16_where_negative(f32x16 g, f32x16 a, f32x16 b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
/* To the nearest integer, ties to even. */
static inline f32x16 f32x16_round(f32x16 a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p 2^n for integral n in [-149, 127], rounded once (VSCALEFPS). */
static inline f32x16 f32x16_scale2(f32x16 p, f32x16 n) { return _mm512_scalef_ps(p, n); }
/* The sum of the lanes: the upper 8 added to the lower 8, then 4 to 4, 2 to 2, 1 to 1 (GCC's
 * _mm512_reduce_add_ps; simd_neon.h adds in the same tree). */
static inline float f32x16_sum(f32x16 a) { return _mm512_reduce_add_ps(a); }
static inline float f32x16_reduce_max(f32x16 a) { return _mm512_reduce_max_ps(a); }
/* Lanes 4i + j = p[j] for j < n (0 past n): four values repeated in every group of four. */
static inline f32x16 f32x16_repeat4(const float *p, int n) {
    return _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((__mmask8)((1u << n) - 1u), p));
}
static inline f32x16 f32x16_from_i32(i32x16 a) { return _mm512_cvtepi32_ps(a); }
/* 16 fp16 -> fp32 (exact). */
static inline f32x16 f32x16_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* bf16 <-> fp32. A bf16 is the high half of an fp32, so widening is exact. */
static inline f32x16 f32x16_load_bf16(const uint16_t *p, lanes16 m) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
/* Lanes 4i + j = p[j] for j < n (0 past n), from bf16. */
static inline f32x16 f32x16_repeat4_bf16(const uint16_t *p, int n) {
    const __m128i b4 = _mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1u), p);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_broadcastq_epi64(b4)), 16));
}

#ifdef __AVX512BF16__
/* 16 fp32 -> 16 bf16, round to nearest even. */
static inline __m256i bf16_round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
/* 16 fp32 -> 16 bf16, round to nearest even (NaN stays a quiet NaN), as torch rounds. */
static inline __m256i bf16_round16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif

/* The lanes of m to bf16 at p, rounded to nearest even (memory past them is left as it is). */
static inline void f32x16_store_bf16(uint16_t *p, f32x16 v, lanes16 m) {
    _mm256_mask_storeu_epi16(p, m, bf16_round16(v));
}

/* 32 bf16 as fp32: even (elements 0, 2, .., 30) and odd (1, 3, .., 31) in lanes 0..15. */
static inline void bf16x32_split(const uint16_t *p, f32x16 *even, f32x16 *odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The lanes of even and odd interleaved: lo = e0 o0 e1 o1 .. e7 o7, hi = e8 o8 .. e15 o15. */
static inline void f32x16_interleave(f32x16 even, f32x16 odd, f32x16 *lo, f32x16 *hi) {
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    *lo = _mm512_permutex2var_ps(even, lo_idx, odd);
    *hi = _mm512_permutex2var_ps(even, hi_idx, odd);
}

#ifdef __AVX512BF16__
typedef __m512bh bf16x32;

static inline bf16x32 bf16x32_load(const uint16_t *p, lanes32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* acc[l] + a[2l] b[2l] + a[2l + 1] b[2l + 1], in fp32. */
static inline f32x16 bf16x32_dot(f32x16 acc, bf16x32 a, bf16x32 b) { return _mm512_dpbf16_ps(acc, a, b); }

/* The two bf16 at p, repeated in every pair of lanes. */
static inline bf16x32 bf16x32_pair(const uint16_t *p) {
    int32_t two;
    __builtin_memcpy(&two, p, sizeof two);
    return (__m512bh)_mm512_set1_epi32(two);
}
#else
/* 32 bf16 split into their even and odd elements as fp32 (simd.h: pair, dot). */
typedef struct {
    __m512 even, odd;
} bf16x32;
#define SIMD_BF16X32_EVEN_ODD

static inline bf16x32 bf16x32_load(const uint16_t *p, lanes32 m) {
    const __m512i raw = _mm512_maskz_loadu_epi16(m, p);
    const bf16x32 r = {_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(~0xffff)))};
    return r;
}

#endif

/* Sums each of the 16 vectors a[0..15] into lane m of the result (a transposing tree: 45
 * shuffles and adds instead of 16 separate reductions). Every lane's sum is the same sequence
 * of adds over its vector's lanes, whichever vector it is. */
static inline f32x16 sum16(const f32x16 a[16]) {
    __m512 b[8], c[4];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512d lo =
            _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
        const __m512d hi =
            _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
        c[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* c[k] holds, in each 128-bit lane, partial sums of a[4k..4k+3]; add the four lanes. */
    const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                     _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                     _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88),
                         _mm512_shuffle_f32x4(d01, d23, 0xdd));
}

/* Integers, for the quantized projection. */
static inline i32x16 i32x16_zero(void) { return _mm512_setzero_si512(); }
static inline i32x16 i32x16_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline i32x16 i32x16_add(i32x16 a, i32x16 b) { return _mm512_add_epi32(a, b); }
static inline int32_t i32x16_sum(i32x16 a) { return _mm512_reduce_add_epi32(a); }
/* fp32 -> int32, to the nearest, ties to even. */
static inline i32x16 i32x16_from_f32(f32x16 a) { return _mm512_cvtps_epi32(a); }
/* 16 int32 -> int8 at p, saturated. */
static inline void i32x16_store_i8(int8_t *p, i32x16 a) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(a));
}

static inline u8x64 u8x64_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
/* The low and the high four bits of each byte. */
static inline u8x64 u8x64_low4(u8x64 a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0f)); }
static inline u8x64 u8x64_high4(u8x64 a) {
    return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0f));
}
/* 16 added to byte b where bit b of `bits` is set. */
static inline u8x64 u8x64_add16_where(u8x64 a, uint64_t bits) {
    return _mm512_mask_add_epi8(a, (__mmask64)bits, a, _mm512_set1_epi8(16));
}

/* acc[l] + the four products u[4l + i] s[i] of unsigned bytes u and the signed bytes of `four`
 * (in memory order), exact in int32: VPDPBUSD where the build has AVX512-VNNI (every
 * AVX512-BF16 CPU), else the bytes split into nibbles so that VPMADDUBSW's 16-bit pair sums
 * cannot saturate. */
static inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t four) {
    const __m512i s = _mm512_set1_epi32(four);
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    const __m512i nibble = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi16(1);
    const __m512i lo = _mm512_maddubs_epi16(_mm512_and_si512(u, nibble), s);
    const __m512i hi = _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(u, 4), nibble), s);
    const __m512i sum = _mm512_add_epi32(_mm512_madd_epi16(lo, ones),
                                         _mm512_slli_epi32(_mm512_madd_epi16(hi, ones), 4));
    return _mm512_add_epi32(acc, sum);
#endif
}

static inline void prefetch_l1(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

#endif
