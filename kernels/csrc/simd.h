/* Helpers shared by the kernels in this folder: AVX512 arithmetic and OpenMP work sharing. */
#ifndef OUTRIDER_SIMD_H
#define OUTRIDER_SIMD_H

#include <immintrin.h>
#include <stdint.h>

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
