/* The vector vocabulary the kernels in this folder are written in, and OpenMP work sharing.
 *
 * Each kernel's arithmetic is written once, against the types and operations below; three
 * headers give them instructions: simd_avx512.h on x86-64 (AVX512, with AVX512-BF16/VNNI where the build
 * has them), simd_neon.h on AArch64 (NEON, with the BF16 and int8 matrix extensions where the
 * build has them) and simd_sve.h on AArch64 with 256-bit SVE. Each holds a vector of 16 fp32
 * lanes (`f32x16`: one zmm register, four NEON registers, two SVE ones) and does each
 * operation on the same lanes in the same order, so where builds use plain fp32 instructions
 * (fused multiply-adds, the fixed reduction trees) they give the same bits, and integer block
 * dot products are exact in all.
 *
 *   f32x16, i32x16    16 fp32 / int32 lanes
 *   u8x64             64 bytes, lane l of an i32x16 being bytes 4l..4l+3
 *   bf16x32           32 bf16 as the bf16 dot product takes them (pairs 2l, 2l + 1 in lane l)
 *   lanes16, lanes32  the first n lanes of an f32x16 or a bf16x32 (for the tails of a row)
 *
 * kernels/native_build.py builds the folder in these builds: on x86-64 "avx512_bf16"
 * (VDPBF16PS, VCVTNEPS2BF16, VPDPBUSD, AMX) and "avx512f" (a bf16 dot product is two fp32 FMAs
 * over the even and odd elements, rounding and byte dots are integer instructions); on AArch64
 * "neon_bf16_i8mm" (BFDOT, USDOT: Armv8.6, as Grace and Neoverse V1/V2 have them), "neon" (the
 * avx512f build's arithmetic in NEON: the same bits) and "sve256_bf16_i8mm" (simd_sve.h: the
 * first's instructions on 256-bit SVE vectors, for Neoverse V1).
 * Each build computes a given output the same way whatever the batch.
 */
#ifndef OUTRIDER_SIMD_H
#define OUTRIDER_SIMD_H

#include <stdint.h>

#if defined(__x86_64__)
#include "simd_avx512.h"
#elif defined(__aarch64__) && defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
#include "simd_sve.h"
#elif defined(__aarch64__)
#include "simd_neon.h"
#else
#error "kernels/csrc builds for x86-64 (AVX512) and AArch64 (NEON, SVE) only"
#endif

#ifdef SIMD_BF16X32_EVEN_ODD
/* Builds without bf16 dot-product instructions hold 32 bf16 as their even and odd elements in
 * fp32 (a bf16 is the high half of an fp32, so exactly). */

/* The two bf16 at p, repeated in every pair of lanes. */
static inline bf16x32 bf16x32_pair(const uint16_t *p) {
    const uint32_t even = (uint32_t)p[0] << 16, odd = (uint32_t)p[1] << 16;
    float e, o;
    __builtin_memcpy(&e, &even, sizeof e);
    __builtin_memcpy(&o, &odd, sizeof o);
    const bf16x32 r = {f32x16_set1(e), f32x16_set1(o)};
    return r;
}

/* acc[l] + a[2l] b[2l] + a[2l + 1] b[2l + 1]: two fused multiply-adds, the even products
 * first (the products are exact). */
static inline f32x16 bf16x32_dot(f32x16 acc, bf16x32 a, bf16x32 b) {
    return f32x16_fma(a.odd, b.odd, f32x16_fma(a.even, b.even, acc));
}
#endif

/* 16 fp32 -> bf16 in lanes 0..15 of out, round to nearest even (NaN stays a quiet NaN). */
static inline void f32x16_store_bf16_all(uint16_t *out, f32x16 v) {
    f32x16_store_bf16(out, v, lanes16_first(16));
}

/* e^x to ~1 ulp for x <= 0 down to the fp32 underflow (range reduction by ln 2, degree-6
 * polynomial, exponent by f32x16_scale2: x 2^n rounded once). */
static inline f32x16 exp_ps(f32x16 x) {
    x = f32x16_max(x, f32x16_set1(-103.0f));
    const f32x16 n = f32x16_round(f32x16_mul(x, f32x16_set1(1.44269504088896341f)));
    f32x16 r = f32x16_fnma(n, f32x16_set1(0.693145751953125f), x);
    r = f32x16_fnma(n, f32x16_set1(1.428606765330187045e-06f), r);
    f32x16 p = f32x16_set1(1.0f / 720);
    p = f32x16_fma(p, r, f32x16_set1(1.0f / 120));
    p = f32x16_fma(p, r, f32x16_set1(1.0f / 24));
    p = f32x16_fma(p, r, f32x16_set1(1.0f / 6));
    p = f32x16_fma(p, r, f32x16_set1(0.5f));
    p = f32x16_fma(p, r, f32x16_set1(1.0f));
    p = f32x16_fma(p, r, f32x16_set1(1.0f));
    return f32x16_scale2(p, n);
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
