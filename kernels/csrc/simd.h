/* Helpers shared by the kernels in this folder: AVX512 arithmetic and OpenMP work sharing.
 *
 * kernels/native.py builds the folder twice over: with AVX512-BF16 (and AMX) for CPUs that have
 * them, and with AVX512F alone for those that do not (Skylake to Ice Lake servers). The bf16
 * helpers below are the one place the two builds differ: `bf16x32_dot` is one VDPBF16PS in the
 * first, two fp32 FMAs over the even and odd elements in the second; `bf16_round16` is
 * VCVTNEPS2BF16 or the same round-to-nearest-even done with integer instructions. Each build
 * computes a given output the same way whatever the batch; the two builds can differ from each
 * other in the last bf16 bit.
 */
#ifndef OUTRIDER_SIMD_H
#define OUTRIDER_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512BF16__
/* 32 bf16 as the dot-product instruction takes them. */
typedef __m512bh bf16x32;

static inline bf16x32 bf16x32_load(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* acc[l] + a[2l] b[2l] + a[2l + 1] b[2l + 1], in fp32. */
static inline __m512 bf16x32_dot(__m512 acc, bf16x32 a, bf16x32 b) {
    return _mm512_dpbf16_ps(acc, a, b);
}

/* 16 fp32 -> 16 bf16, round to nearest even. */
static inline __m256i bf16_round16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* The two bf16 at p, repeated in every pair of lanes. */
static inline bf16x32 bf16x32_pair(const uint16_t *p) {
    int32_t two;
    __builtin_memcpy(&two, p, sizeof two);
    return (__m512bh)_mm512_set1_epi32(two);
}
#else
/* 32 bf16 split into their even and odd elements as fp32 (a bf16 is the high half of an fp32). */
typedef struct {
    __m512 even, odd;
} bf16x32;

static inline bf16x32 bf16x32_load(const uint16_t *p, __mmask32 m) {
    const __m512i raw = _mm512_maskz_loadu_epi16(m, p);
    const bf16x32 r = {_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(~0xffff)))};
    return r;
}

/* The two bf16 at p, repeated in every pair of lanes. */
static inline bf16x32 bf16x32_pair(const uint16_t *p) {
    uint32_t even = (uint32_t)p[0] << 16, odd = (uint32_t)p[1] << 16;
    float e, o;
    __builtin_memcpy(&e, &even, sizeof e);
    __builtin_memcpy(&o, &odd, sizeof o);
    const bf16x32 r = {_mm512_set1_ps(e), _mm512_set1_ps(o)};
    return r;
}

/* acc[l] + a[2l] b[2l] + a[2l + 1] b[2l + 1], in fp32 (the products are exact). */
static inline __m512 bf16x32_dot(__m512 acc, bf16x32 a, bf16x32 b) {
    return _mm512_fmadd_ps(a.odd, b.odd, _mm512_fmadd_ps(a.even, b.even, acc));
}

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

/* acc[l] + the four products u[4l + i] s[4l + i] of unsigned bytes u and signed bytes s, exact
 * in int32: VPDPBUSD where the build has AVX512-VNNI (every AVX512-BF16 CPU), else the bytes
 * split into nibbles so that VPMADDUBSW's 16-bit pair sums cannot saturate. */
static inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
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

/* 32 fp32 (lo: elements 0-15, hi: 16-31) -> 32 bf16. */
static inline __m512i bf16_round32(__m512 lo, __m512 hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_round16(lo)), bf16_round16(hi), 1);
}

/* Sums each of the 16 vectors a[0..15] into lane m of the result (a transposing tree: 45
 * shuffles and adds instead of 16 separate reductions). Every lane's sum is the same sequence
 * of adds over its vector's lanes, whichever vector it is. */
static inline __m512 sum16(const __m512 a[16]) {
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

/* 16 bf16 -> fp32 (masked lanes read as 0). */
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* 16 fp32 -> bf16 at p, rounded to nearest even (masked-off lanes are left as they are). */
static inline void store_bf16x16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, bf16_round16(v));
}

/* e^x to ~1 ulp for x <= 0 down to the fp32 underflow (range reduction by ln 2, degree-6
 * polynomial, exponent by scalef). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* This thread's contiguous share [*first, *last) of n items (empty when *first >= *last), inside
 * an OpenMP parallel region. */
static inline void thread_share(int n, int *first, int *last) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int per = (n + nt - 1) / nt;
    *first = t * per;
    *last = *first + per < n ? *first + per : n;
}

#endif
