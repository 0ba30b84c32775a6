/* simd.h's vocabulary in NEON instructions (AArch64). A 16-lane vector is four 128-bit
 * registers, register i holding lanes 4i..4i+3: exactly the four 128-bit lanes of an AVX512
 * register, so every shuffle of simd_avx512.h that stays within 128-bit lanes is the same
 * shuffle here, register by register, and every sum is added in the same tree.
 *
 * The "neon" build (-march=armv8-a, any AArch64 CPU) does the arithmetic of x86's "avx512f"
 * build: a bf16 dot product as two fp32 FMAs over the even and odd elements, rounding to bf16
 * with integer instructions, byte dot products with widening multiplies. Its outputs are the
 * bits the avx512f build gives (tests/arm64 checks it under qemu). The "neon_bf16_i8mm" build
 * (-march=armv8.6-a+bf16+i8mm: Neoverse V1/V2, Grace, Graviton 3) takes BFDOT for bf16 dot
 * products, which like x86's VDPBF16PS sums each pair with its own rounding (within the tested
 * tolerance of the exact sums, not bit for bit), and USDOT for byte dot products (exact, so the
 * quantized projections give the same bits in every build). Include simd.h, not this.
 *
 * Lane masks are counts: the first n lanes. A load or store of fewer than a whole vector goes
 * through a small buffer on the stack, so it never touches memory past the n elements. */
#ifndef OUTRIDER_SIMD_NEON_H
#define OUTRIDER_SIMD_NEON_H

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float32x4_t v[4];
} f32x16;
typedef struct {
    int32x4_t v[4];
} i32x16;
typedef struct {
    uint8x16_t v[4];
} u8x64;
/* How many f32x16 the vector registers hold (32 registers of 4 lanes), for tile sizes. */
#define SIMD_F32X16_REGISTERS 8
typedef int lanes16; /* the first n lanes */
typedef int lanes32;

static inline lanes16 lanes16_first(int n) { return n; }
static inline lanes32 lanes32_first(int n) { return n; }

/* All ones in the lanes of register i that are among the first n. */
static inline uint32x4_t lanes_below(int i, int n) {
    const uint32x4_t index = {0, 1, 2, 3};
    return vcltq_u32(vaddq_u32(index, vdupq_n_u32(4u * (uint32_t)i)), vdupq_n_u32((uint32_t)n));
}

static inline f32x16 f32x16_zero(void) {
    const f32x16 r = {{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}};
    return r;
}
static inline f32x16 f32x16_set1(float v) {
    const f32x16 r = {{vdupq_n_f32(v), vdupq_n_f32(v), vdupq_n_f32(v), vdupq_n_f32(v)}};
    return r;
}
static inline f32x16 f32x16_load(const float *p) {
    const f32x16 r = {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}};
    return r;
}
static inline f32x16 f32x16_load_first(const float *p, lanes16 n) {
    if (n >= 16) return f32x16_load(p);
    float part[16] = {0};
    memcpy(part, p, sizeof(float) * (size_t)n);
    return f32x16_load(part);
}
static inline void f32x16_store(float *p, f32x16 a) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, a.v[i]);
}
static inline void f32x16_store_first(float *p, f32x16 a, lanes16 n) {
    if (n >= 16) {
        f32x16_store(p, a);
        return;
    }
    float part[16];
    f32x16_store(part, a);
    memcpy(p, part, sizeof(float) * (size_t)n);
}

#define OUTRIDER_F32X16_OP(name, expr)                 \
    static inline f32x16 name(f32x16 a, f32x16 b) {    \
        f32x16 r;                                      \
        for (int i = 0; i < 4; i++) r.v[i] = (expr);   \
        return r;                                      \
    }
OUTRIDER_F32X16_OP(f32x16_add, vaddq_f32(a.v[i], b.v[i]))
OUTRIDER_F32X16_OP(f32x16_sub, vsubq_f32(a.v[i], b.v[i]))
OUTRIDER_F32X16_OP(f32x16_mul, vmulq_f32(a.v[i], b.v[i]))
OUTRIDER_F32X16_OP(f32x16_div, vdivq_f32(a.v[i], b.v[i]))
/* a > b ? a : b, as x86's MAXPS: b where either is NaN (FMAX would give the NaN). */
OUTRIDER_F32X16_OP(f32x16_max, vbslq_f32(vcgtq_f32(a.v[i], b.v[i]), a.v[i], b.v[i]))
#undef OUTRIDER_F32X16_OP

static inline f32x16 f32x16_abs(f32x16 a) {
    for (int i = 0; i < 4; i++) a.v[i] = vabsq_f32(a.v[i]);
    return a;
}
static inline f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 4; i++) c.v[i] = vfmaq_f32(c.v[i], a.v[i], b.v[i]);
    return c;
}
static inline f32x16 f32x16_fnma(f32x16 a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 4; i++) c.v[i] = vfmsq_f32(c.v[i], a.v[i], b.v[i]);
    return c;
}
static inline f32x16 f32x16_add_in(f32x16 acc, f32x16 v, lanes16 n) {
    for (int i = 0; i < 4; i++)
        acc.v[i] = vbslq_f32(lanes_below(i, n), vaddq_f32(acc.v[i], v.v[i]), acc.v[i]);
    return acc;
}
static inline f32x16 f32x16_max_in(f32x16 acc, f32x16 v, lanes16 n) {
    const f32x16 m = f32x16_max(acc, v);
    for (int i = 0; i < 4; i++) acc.v[i] = vbslq_f32(lanes_below(i, n), m.v[i], acc.v[i]);
    return acc;
}
static inline f32x16 f32x16_where_negative(f32x16 g, f32x16 a, f32x16 b) {
    for (int i = 0; i < 4; i++) a.v[i] = vbslq_f32(vcltzq_f32(g.v[i]), a.v[i], b.v[i]);
    return a;
}
static inline f32x16 f32x16_round(f32x16 a) {
    for (int i = 0; i < 4; i++) a.v[i] = vrndnq_f32(a.v[i]);
    return a;
}
/* p 2^n for integral n in [-149, 127], rounded once as VSCALEFPS rounds it: p 2^(n >> 1) is
 * exact (a normal number for |p| near 1), and the second factor 2^(n - (n >> 1)) rounds once. */
static inline f32x16 f32x16_scale2(f32x16 p, f32x16 n) {
    for (int i = 0; i < 4; i++) {
        const int32x4_t k = vcvtq_s32_f32(n.v[i]), k1 = vshrq_n_s32(k, 1), k2 = vsubq_s32(k, k1);
        const int32x4_t bias = vdupq_n_s32(127);
        const float32x4_t f1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, bias), 23));
        const float32x4_t f2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, bias), 23));
        p.v[i] = vmulq_f32(vmulq_f32(p.v[i], f1), f2);
    }
    return p;
}
/* The sum of the lanes in simd_avx512.h's tree: lanes 8-15 added to 0-7, then 4-7 to 0-3, then
 * lanes 2, 3 to 0, 1, then lane 1 to lane 0. */
static inline float f32x16_sum(f32x16 a) {
    const float32x4_t t6 = vaddq_f32(vaddq_f32(a.v[3], a.v[1]), vaddq_f32(a.v[2], a.v[0]));
    const float32x4_t t8 = vaddq_f32(t6, vextq_f32(t6, t6, 2));
    return vgetq_lane_f32(t8, 0) + vgetq_lane_f32(t8, 1);
}
static inline float f32x16_reduce_max(f32x16 a) {
    return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[2]), vmaxq_f32(a.v[1], a.v[3])));
}
static inline f32x16 f32x16_repeat4(const float *p, int n) {
    float four[4] = {0};
    memcpy(four, p, sizeof(float) * (size_t)n);
    const float32x4_t v = vld1q_f32(four);
    const f32x16 r = {{v, v, v, v}};
    return r;
}
static inline f32x16 f32x16_from_i32(i32x16 a) {
    f32x16 r;
    for (int i = 0; i < 4; i++) r.v[i] = vcvtq_f32_s32(a.v[i]);
    return r;
}
static inline f32x16 f32x16_load_f16(const uint16_t *p) {
    f32x16 r;
    for (int i = 0; i < 4; i++) r.v[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
    return r;
}

/* bf16 <-> fp32. */
static inline float32x4_t widen_bf16(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }

static inline f32x16 f32x16_load_bf16(const uint16_t *p, lanes16 n) {
    uint16_t part[16] = {0};
    if (n < 16) {
        memcpy(part, p, sizeof(uint16_t) * (size_t)n);
        p = part;
    }
    f32x16 r;
    for (int i = 0; i < 4; i++) r.v[i] = widen_bf16(vld1_u16(p + 4 * i));
    return r;
}
static inline f32x16 f32x16_repeat4_bf16(const uint16_t *p, int n) {
    uint16_t four[4] = {0};
    memcpy(four, p, sizeof(uint16_t) * (size_t)n);
    const float32x4_t v = widen_bf16(vld1_u16(four));
    const f32x16 r = {{v, v, v, v}};
    return r;
}
/* Round to nearest even with integer instructions (NaN stays a quiet NaN), as torch rounds and
 * as x86's avx512f build does. */
static inline uint16x4_t round_bf16(float32x4_t v) {
    const uint32x4_t bits = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7fff)));
    const uint32x4_t quiet = vorrq_u32(bits, vdupq_n_u32(0x00400000));
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
    return vshrn_n_u32(vbslq_u32(nan, quiet, rounded), 16);
}
static inline void f32x16_store_bf16(uint16_t *p, f32x16 a, lanes16 n) {
    uint16_t part[16];
    uint16_t *to = n >= 16 ? p : part;
    for (int i = 0; i < 4; i++) vst1_u16(to + 4 * i, round_bf16(a.v[i]));
    if (n < 16) memcpy(p, part, sizeof(uint16_t) * (size_t)n);
}

/* 32 bf16 (the first n, the rest 0) as eight registers of pairs. */
static inline void load_pairs(const uint16_t *p, lanes32 n, uint32x4_t raw[4]) {
    uint16_t part[32] = {0};
    if (n < 32) {
        memcpy(part, p, sizeof(uint16_t) * (size_t)n);
        p = part;
    }
    for (int i = 0; i < 4; i++) raw[i] = vreinterpretq_u32_u16(vld1q_u16(p + 8 * i));
}
static inline void bf16x32_split(const uint16_t *p, f32x16 *even, f32x16 *odd) {
    uint32x4_t raw[4];
    load_pairs(p, 32, raw);
    for (int i = 0; i < 4; i++) {
        even->v[i] = vreinterpretq_f32_u32(vshlq_n_u32(raw[i], 16));
        odd->v[i] = vreinterpretq_f32_u32(vandq_u32(raw[i], vdupq_n_u32(0xffff0000u)));
    }
}
static inline void f32x16_interleave(f32x16 even, f32x16 odd, f32x16 *lo, f32x16 *hi) {
    for (int i = 0; i < 2; i++) {
        lo->v[2 * i] = vzip1q_f32(even.v[i], odd.v[i]);
        lo->v[2 * i + 1] = vzip2q_f32(even.v[i], odd.v[i]);
        hi->v[2 * i] = vzip1q_f32(even.v[2 + i], odd.v[2 + i]);
        hi->v[2 * i + 1] = vzip2q_f32(even.v[2 + i], odd.v[2 + i]);
    }
}

#ifdef __ARM_FEATURE_BF16_VECTOR_ARITHMETIC
typedef struct {
    bfloat16x8_t v[4];
} bf16x32;

static inline bf16x32 bf16x32_load(const uint16_t *p, lanes32 n) {
    uint32x4_t raw[4];
    load_pairs(p, n, raw);
    bf16x32 r;
    for (int i = 0; i < 4; i++) r.v[i] = vreinterpretq_bf16_u32(raw[i]);
    return r;
}
static inline bf16x32 bf16x32_pair(const uint16_t *p) {
    uint32_t two;
    memcpy(&two, p, sizeof two);
    const bfloat16x8_t v = vreinterpretq_bf16_u32(vdupq_n_u32(two));
    const bf16x32 r = {{v, v, v, v}};
    return r;
}
/* BFDOT: acc[l] + a[2l] b[2l] + a[2l + 1] b[2l + 1]. */
static inline f32x16 bf16x32_dot(f32x16 acc, bf16x32 a, bf16x32 b) {
    for (int i = 0; i < 4; i++) acc.v[i] = vbfdotq_f32(acc.v[i], a.v[i], b.v[i]);
    return acc;
}
#else
/* 32 bf16 split into their even and odd elements as fp32 (simd.h: pair, dot). */
typedef struct {
    f32x16 even, odd;
} bf16x32;
#define SIMD_BF16X32_EVEN_ODD

static inline bf16x32 bf16x32_load(const uint16_t *p, lanes32 n) {
    uint32x4_t raw[4];
    load_pairs(p, n, raw);
    bf16x32 r;
    for (int i = 0; i < 4; i++) {
        r.even.v[i] = vreinterpretq_f32_u32(vshlq_n_u32(raw[i], 16));
        r.odd.v[i] = vreinterpretq_f32_u32(vandq_u32(raw[i], vdupq_n_u32(0xffff0000u)));
    }
    return r;
}
#endif

/* simd_avx512.h's transposing tree, register for 128-bit lane. */
static inline f32x16 sum16(const f32x16 a[16]) {
    f32x16 b[8], c[4];
    for (int k = 0; k < 8; k++)
        for (int i = 0; i < 4; i++)
            b[k].v[i] = vaddq_f32(vzip1q_f32(a[2 * k].v[i], a[2 * k + 1].v[i]),
                                  vzip2q_f32(a[2 * k].v[i], a[2 * k + 1].v[i]));
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 4; i++) {
            const float64x2_t x = vreinterpretq_f64_f32(b[2 * k].v[i]);
            const float64x2_t y = vreinterpretq_f64_f32(b[2 * k + 1].v[i]);
            c[k].v[i] = vaddq_f32(vreinterpretq_f32_f64(vzip1q_f64(x, y)),
                                  vreinterpretq_f32_f64(vzip2q_f64(x, y)));
        }
    /* shuffle_f32x4(x, y, 0x88) = x0 x2 y0 y2 and 0xdd = x1 x3 y1 y3, in 128-bit lanes. */
    f32x16 d01, d23, r;
    for (int h = 0; h < 2; h++) {
        d01.v[2 * h] = vaddq_f32(c[h].v[0], c[h].v[1]);
        d01.v[2 * h + 1] = vaddq_f32(c[h].v[2], c[h].v[3]);
        d23.v[2 * h] = vaddq_f32(c[2 + h].v[0], c[2 + h].v[1]);
        d23.v[2 * h + 1] = vaddq_f32(c[2 + h].v[2], c[2 + h].v[3]);
    }
    r.v[0] = vaddq_f32(d01.v[0], d01.v[1]);
    r.v[1] = vaddq_f32(d01.v[2], d01.v[3]);
    r.v[2] = vaddq_f32(d23.v[0], d23.v[1]);
    r.v[3] = vaddq_f32(d23.v[2], d23.v[3]);
    return r;
}

/* Integers, for the quantized projection. */
static inline i32x16 i32x16_zero(void) {
    const i32x16 r = {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}};
    return r;
}
static inline i32x16 i32x16_set1(int32_t v) {
    const i32x16 r = {{vdupq_n_s32(v), vdupq_n_s32(v), vdupq_n_s32(v), vdupq_n_s32(v)}};
    return r;
}
static inline i32x16 i32x16_add(i32x16 a, i32x16 b) {
    for (int i = 0; i < 4; i++) a.v[i] = vaddq_s32(a.v[i], b.v[i]);
    return a;
}
static inline int32_t i32x16_sum(i32x16 a) {
    return vaddvq_s32(vaddq_s32(vaddq_s32(a.v[0], a.v[1]), vaddq_s32(a.v[2], a.v[3])));
}
static inline i32x16 i32x16_from_f32(f32x16 a) {
    i32x16 r;
    for (int i = 0; i < 4; i++) r.v[i] = vcvtnq_s32_f32(a.v[i]);
    return r;
}
static inline void i32x16_store_i8(int8_t *p, i32x16 a) {
    const int16x8_t lo = vcombine_s16(vqmovn_s32(a.v[0]), vqmovn_s32(a.v[1]));
    const int16x8_t hi = vcombine_s16(vqmovn_s32(a.v[2]), vqmovn_s32(a.v[3]));
    vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}

static inline u8x64 u8x64_load(const uint8_t *p) {
    const u8x64 r = {{vld1q_u8(p), vld1q_u8(p + 16), vld1q_u8(p + 32), vld1q_u8(p + 48)}};
    return r;
}
static inline u8x64 u8x64_low4(u8x64 a) {
    for (int i = 0; i < 4; i++) a.v[i] = vandq_u8(a.v[i], vdupq_n_u8(0x0f));
    return a;
}
static inline u8x64 u8x64_high4(u8x64 a) {
    for (int i = 0; i < 4; i++) a.v[i] = vshrq_n_u8(a.v[i], 4);
    return a;
}
static inline u8x64 u8x64_add16_where(u8x64 a, uint64_t bits) {
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    for (int i = 0; i < 4; i++) {
        const uint16_t sixteen_bits = (uint16_t)(bits >> (16 * i));
        const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)sixteen_bits),
                                              vdup_n_u8((uint8_t)(sixteen_bits >> 8)));
        const uint8x16_t set = vtstq_u8(spread, bit);
        a.v[i] = vaddq_u8(a.v[i], vandq_u8(set, vdupq_n_u8(16)));
    }
    return a;
}

/* acc[l] + the four products u[4l + i] s[i] of unsigned bytes u and the signed bytes of `four`,
 * exact in int32: USDOT with the int8 matrix extension, else widening multiplies (a product of
 * a byte and a signed byte fits in 16 bits) summed in pairs and pairs of pairs. */
static inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t four) {
    const int8x16_t s = vreinterpretq_s8_s32(vdupq_n_s32(four));
#ifdef __ARM_FEATURE_MATMUL_INT8
    for (int i = 0; i < 4; i++) acc.v[i] = vusdotq_s32(acc.v[i], u.v[i], s);
#else
    const int16x8_t s16 = vmovl_s8(vget_low_s8(s)); /* s0 s1 s2 s3 s0 s1 s2 s3 */
    for (int i = 0; i < 4; i++) {
        const int16x8_t lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(u.v[i])));
        const int16x8_t hi = vreinterpretq_s16_u16(vmovl_high_u8(u.v[i]));
        const int32x4_t pairs_lo = vpaddlq_s16(vmulq_s16(lo, s16));
        const int32x4_t pairs_hi = vpaddlq_s16(vmulq_s16(hi, s16));
        acc.v[i] = vaddq_s32(acc.v[i], vpaddq_s32(pairs_lo, pairs_hi));
    }
#endif
    return acc;
}

static inline void prefetch_l1(const void *p) { __builtin_prefetch(p, 0, 3); }

#endif
