/* simd.h's vocabulary in SVE instructions with 256-bit vectors (AArch64 with SVE, BF16 and
 * I8MM: Neoverse V1, as Graviton 3 has it), for the "sve256_bf16_i8mm" build (-march=armv8.6-a
 * +sve+bf16+i8mm -msve-vector-bits=256: fixed-length vectors, so a 16-lane vector is two
 * registers and a library built so runs only where the vector length is 256 bits;
 * kernels/native_build.py checks it). Grace's SVE2 vectors are 128 bits, NEON's width: it
 * takes simd_neon.h's BF16/I8MM build, whose instructions are the same.
 *
 * Register i holds lanes 8i..8i+7. Loads and stores of the first n lanes are predicated
 * (nothing past them is touched). Elementwise arithmetic is the IEEE arithmetic of the other
 * builds (FMLA/FMLS fused, FSCALE rounded once, conversions to nearest even), and every sum
 * is added in simd_avx512.h's tree, so outside the bf16 dot products (BFDOT rounds as it goes)
 * this build gives the avx512f build's bits; byte dot products (USDOT) are exact. Include
 * simd.h, not this. */
#ifndef OUTRIDER_SIMD_SVE_H
#define OUTRIDER_SIMD_SVE_H

#include <arm_sve.h>
#include <stdint.h>
#include <string.h>

#if __ARM_FEATURE_SVE_BITS != 256
#error "simd_sve.h is for -msve-vector-bits=256"
#endif

#define SVE_LANES 8 /* fp32 lanes a register */

typedef svfloat32_t sve_f32 __attribute__((arm_sve_vector_bits(256)));
typedef svint32_t sve_i32 __attribute__((arm_sve_vector_bits(256)));
typedef svuint32_t sve_u32 __attribute__((arm_sve_vector_bits(256)));
typedef svuint8_t sve_u8 __attribute__((arm_sve_vector_bits(256)));
typedef svbfloat16_t sve_bf16 __attribute__((arm_sve_vector_bits(256)));

typedef struct {
    sve_f32 v[2];
} f32x16;
typedef struct {
    sve_i32 v[2];
} i32x16;
typedef struct {
    sve_u8 v[2];
} u8x64;
typedef struct {
    sve_bf16 v[2];
} bf16x32;
/* How many f32x16 the vector registers hold (32 registers of 8 lanes), for tile sizes. */
#define SIMD_F32X16_REGISTERS 16
typedef int lanes16; /* the first n lanes */
typedef int lanes32;

static inline lanes16 lanes16_first(int n) { return n; }
static inline lanes32 lanes32_first(int n) { return n; }

/* The lanes of register i that are among the first n. */
static inline svbool_t sve_first(int i, int n) { return svwhilelt_b32(SVE_LANES * i, n); }

static inline f32x16 f32x16_zero(void) {
    const f32x16 r = {{svdup_n_f32(0.0f), svdup_n_f32(0.0f)}};
    return r;
}
static inline f32x16 f32x16_set1(float v) {
    const f32x16 r = {{svdup_n_f32(v), svdup_n_f32(v)}};
    return r;
}
static inline f32x16 f32x16_load_first(const float *p, lanes16 n) {
    f32x16 r;
    for (int i = 0; i < 2; i++) r.v[i] = svld1_f32(sve_first(i, n), p + SVE_LANES * i);
    return r;
}
static inline f32x16 f32x16_load(const float *p) { return f32x16_load_first(p, 16); }
static inline void f32x16_store_first(float *p, f32x16 a, lanes16 n) {
    for (int i = 0; i < 2; i++) svst1_f32(sve_first(i, n), p + SVE_LANES * i, a.v[i]);
}
static inline void f32x16_store(float *p, f32x16 a) { f32x16_store_first(p, a, 16); }

#define OUTRIDER_F32X16_OP(name, expr)                 \
    static inline f32x16 name(f32x16 a, f32x16 b) {    \
        const svbool_t all = svptrue_b32();            \
        f32x16 r;                                      \
        for (int i = 0; i < 2; i++) r.v[i] = (expr);   \
        return r;                                      \
    }
OUTRIDER_F32X16_OP(f32x16_add, svadd_f32_x(all, a.v[i], b.v[i]))
OUTRIDER_F32X16_OP(f32x16_sub, svsub_f32_x(all, a.v[i], b.v[i]))
OUTRIDER_F32X16_OP(f32x16_mul, svmul_f32_x(all, a.v[i], b.v[i]))
OUTRIDER_F32X16_OP(f32x16_div, svdiv_f32_x(all, a.v[i], b.v[i]))
/* a > b ? a : b, as x86's MAXPS (b where either is NaN). */
OUTRIDER_F32X16_OP(f32x16_max, svsel_f32(svcmpgt_f32(all, a.v[i], b.v[i]), a.v[i], b.v[i]))
#undef OUTRIDER_F32X16_OP

static inline f32x16 f32x16_abs(f32x16 a) {
    for (int i = 0; i < 2; i++) a.v[i] = svabs_f32_x(svptrue_b32(), a.v[i]);
    return a;
}
static inline f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 2; i++) c.v[i] = svmla_f32_x(svptrue_b32(), c.v[i], a.v[i], b.v[i]);
    return c;
}
static inline f32x16 f32x16_fnma(f32x16 a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 2; i++) c.v[i] = svmls_f32_x(svptrue_b32(), c.v[i], a.v[i], b.v[i]);
    return c;
}
static inline f32x16 f32x16_add_in(f32x16 acc, f32x16 v, lanes16 n) {
    for (int i = 0; i < 2; i++) acc.v[i] = svadd_f32_m(sve_first(i, n), acc.v[i], v.v[i]);
    return acc;
}
static inline f32x16 f32x16_max_in(f32x16 acc, f32x16 v, lanes16 n) {
    const f32x16 m = f32x16_max(acc, v);
    for (int i = 0; i < 2; i++) acc.v[i] = svsel_f32(sve_first(i, n), m.v[i], acc.v[i]);
    return acc;
}
static inline f32x16 f32x16_where_negative(f32x16 g, f32x16 a, f32x16 b) {
    for (int i = 0; i < 2; i++)
        a.v[i] = svsel_f32(svcmplt_n_f32(svptrue_b32(), g.v[i], 0.0f), a.v[i], b.v[i]);
    return a;
}
static inline f32x16 f32x16_round(f32x16 a) {
    for (int i = 0; i < 2; i++) a.v[i] = svrintn_f32_x(svptrue_b32(), a.v[i]);
    return a;
}
/* p 2^n for integral n (FSCALE: rounded once, as VSCALEFPS). */
static inline f32x16 f32x16_scale2(f32x16 p, f32x16 n) {
    const svbool_t all = svptrue_b32();
    for (int i = 0; i < 2; i++) p.v[i] = svscale_f32_x(all, p.v[i], svcvt_s32_f32_x(all, n.v[i]));
    return p;
}
/* The sum of the lanes in simd_avx512.h's tree (rows, attention totals: not the inner loops). */
static inline float f32x16_sum(f32x16 a) {
    float l[16];
    f32x16_store(l, a);
    float u[4];
    for (int i = 0; i < 4; i++) u[i] = (l[12 + i] + l[4 + i]) + (l[8 + i] + l[i]);
    return (u[0] + u[2]) + (u[1] + u[3]);
}
static inline float f32x16_reduce_max(f32x16 a) {
    const svbool_t all = svptrue_b32();
    return svmaxv_f32(all, svmax_f32_x(all, a.v[0], a.v[1]));
}
static inline f32x16 f32x16_repeat4(const float *p, int n) {
    float four[4] = {0};
    memcpy(four, p, sizeof(float) * (size_t)n);
    const sve_f32 v = svld1rq_f32(svptrue_b32(), four);
    const f32x16 r = {{v, v}};
    return r;
}
static inline f32x16 f32x16_from_i32(i32x16 a) {
    f32x16 r;
    for (int i = 0; i < 2; i++) r.v[i] = svcvt_f32_s32_x(svptrue_b32(), a.v[i]);
    return r;
}
/* fp16 in the low half of each 32-bit container, converted (exact). */
static inline f32x16 f32x16_load_f16(const uint16_t *p) {
    const svbool_t all = svptrue_b32();
    f32x16 r;
    for (int i = 0; i < 2; i++) {
        const svuint32_t h = svld1uh_u32(all, p + SVE_LANES * i);
        r.v[i] = svcvt_f32_f16_x(all, svreinterpret_f16_u32(h));
    }
    return r;
}

/* bf16 <-> fp32. */
static inline f32x16 f32x16_load_bf16(const uint16_t *p, lanes16 n) {
    f32x16 r;
    for (int i = 0; i < 2; i++) {
        const svuint32_t h = svld1uh_u32(sve_first(i, n), p + SVE_LANES * i);
        r.v[i] = svreinterpret_f32_u32(svlsl_n_u32_x(svptrue_b32(), h, 16));
    }
    return r;
}
static inline f32x16 f32x16_repeat4_bf16(const uint16_t *p, int n) {
    float four[4] = {0};
    for (int j = 0; j < n; j++) {
        const uint32_t bits = (uint32_t)p[j] << 16;
        memcpy(four + j, &bits, sizeof bits);
    }
    return f32x16_repeat4(four, 4);
}
/* Round to nearest even with integer instructions (NaN stays a quiet NaN), as torch does. */
static inline void f32x16_store_bf16(uint16_t *p, f32x16 a, lanes16 n) {
    const svbool_t all = svptrue_b32();
    for (int i = 0; i < 2; i++) {
        const svuint32_t bits = svreinterpret_u32_f32(a.v[i]);
        const svuint32_t odd = svand_n_u32_x(all, svlsr_n_u32_x(all, bits, 16), 1);
        const svuint32_t rounded = svadd_u32_x(all, bits, svadd_n_u32_x(all, odd, 0x7fff));
        const svuint32_t quiet = svorr_n_u32_x(all, bits, 0x00400000);
        const svbool_t nan = svcmpuo_f32(all, a.v[i], a.v[i]);
        const svuint32_t out = svlsr_n_u32_x(all, svsel_u32(nan, quiet, rounded), 16);
        svst1h_u32(sve_first(i, n), p + SVE_LANES * i, out);
    }
}
static inline void bf16x32_split(const uint16_t *p, f32x16 *even, f32x16 *odd) {
    const svbool_t all = svptrue_b32();
    for (int i = 0; i < 2; i++) {
        const svuint32_t raw = svreinterpret_u32_u16(svld1_u16(svptrue_b16(), p + 16 * i));
        even->v[i] = svreinterpret_f32_u32(svlsl_n_u32_x(all, raw, 16));
        odd->v[i] = svreinterpret_f32_u32(svand_n_u32_x(all, raw, 0xffff0000u));
    }
}
static inline void f32x16_interleave(f32x16 even, f32x16 odd, f32x16 *lo, f32x16 *hi) {
    lo->v[0] = svzip1_f32(even.v[0], odd.v[0]);
    lo->v[1] = svzip2_f32(even.v[0], odd.v[0]);
    hi->v[0] = svzip1_f32(even.v[1], odd.v[1]);
    hi->v[1] = svzip2_f32(even.v[1], odd.v[1]);
}

static inline bf16x32 bf16x32_load(const uint16_t *p, lanes32 n) {
    bf16x32 r;
    for (int i = 0; i < 2; i++)
        r.v[i] = svld1_bf16(svwhilelt_b16(16 * i, n), (const bfloat16_t *)p + 16 * i);
    return r;
}
static inline bf16x32 bf16x32_pair(const uint16_t *p) {
    uint32_t two;
    memcpy(&two, p, sizeof two);
    const sve_bf16 v = svreinterpret_bf16_u32(svdup_n_u32(two));
    const bf16x32 r = {{v, v}};
    return r;
}
/* BFDOT: acc[l] + a[2l] b[2l] + a[2l + 1] b[2l + 1]. */
static inline f32x16 bf16x32_dot(f32x16 acc, bf16x32 a, bf16x32 b) {
    for (int i = 0; i < 2; i++) acc.v[i] = svbfdot_f32(acc.v[i], a.v[i], b.v[i]);
    return acc;
}

/* Lane m of the result: the sum of a[m]'s lanes in simd_avx512.h's tree. The sixteen vectors
 * are transposed through memory (lane j of every a[m] gathered into one vector), then added
 * as the x86 tree adds: within each group of four lanes (0 with 2, 1 with 3, then the two),
 * then groups 0 with 1 and 2 with 3, then the two halves. */
static inline f32x16 sum16(const f32x16 a[16]) {
    float rows[16 * 16];
    for (int m = 0; m < 16; m++) f32x16_store(rows + 16 * m, a[m]);
    const svbool_t all = svptrue_b32();
    const sve_u32 idx[2] = {svindex_u32(0, 16), svindex_u32(16 * SVE_LANES, 16)};
    f32x16 s[16];
    for (int j = 0; j < 16; j++)
        for (int i = 0; i < 2; i++) s[j].v[i] = svld1_gather_u32index_f32(all, rows + j, idx[i]);
    f32x16 g[4];
    for (int k = 0; k < 4; k++)
        g[k] = f32x16_add(f32x16_add(s[4 * k], s[4 * k + 2]), f32x16_add(s[4 * k + 1], s[4 * k + 3]));
    return f32x16_add(f32x16_add(g[0], g[1]), f32x16_add(g[2], g[3]));
}

/* Integers, for the quantized projection. */
static inline i32x16 i32x16_zero(void) {
    const i32x16 r = {{svdup_n_s32(0), svdup_n_s32(0)}};
    return r;
}
static inline i32x16 i32x16_set1(int32_t v) {
    const i32x16 r = {{svdup_n_s32(v), svdup_n_s32(v)}};
    return r;
}
static inline i32x16 i32x16_add(i32x16 a, i32x16 b) {
    for (int i = 0; i < 2; i++) a.v[i] = svadd_s32_x(svptrue_b32(), a.v[i], b.v[i]);
    return a;
}
static inline int32_t i32x16_sum(i32x16 a) {
    const svbool_t all = svptrue_b32();
    return (int32_t)svaddv_s32(all, svadd_s32_x(all, a.v[0], a.v[1]));
}
static inline i32x16 i32x16_from_f32(f32x16 a) {
    const svbool_t all = svptrue_b32();
    i32x16 r;
    for (int i = 0; i < 2; i++) r.v[i] = svcvt_s32_f32_x(all, svrintn_f32_x(all, a.v[i]));
    return r;
}
static inline void i32x16_store_i8(int8_t *p, i32x16 a) {
    const svbool_t all = svptrue_b32();
    for (int i = 0; i < 2; i++) {
        const sve_i32 clamped = svmax_n_s32_x(all, svmin_n_s32_x(all, a.v[i], 127), -128);
        svst1b_s32(all, p + SVE_LANES * i, clamped);
    }
}

static inline u8x64 u8x64_load(const uint8_t *p) {
    const u8x64 r = {{svld1_u8(svptrue_b8(), p), svld1_u8(svptrue_b8(), p + 32)}};
    return r;
}
static inline u8x64 u8x64_low4(u8x64 a) {
    for (int i = 0; i < 2; i++) a.v[i] = svand_n_u8_x(svptrue_b8(), a.v[i], 0x0f);
    return a;
}
static inline u8x64 u8x64_high4(u8x64 a) {
    for (int i = 0; i < 2; i++) a.v[i] = svlsr_n_u8_x(svptrue_b8(), a.v[i], 4);
    return a;
}
static inline u8x64 u8x64_add16_where(u8x64 a, uint64_t bits) {
    const svbool_t all = svptrue_b8();
    const svuint8_t lane = svindex_u8(0, 1);
    const svuint8_t bit = svlsl_u8_x(all, svdup_n_u8(1), svand_n_u8_x(all, lane, 7));
    for (int i = 0; i < 2; i++) {
        /* byte lane b takes byte b / 8 of this register's 32 bits, then tests its bit b % 8 */
        const svuint8_t four = svreinterpret_u8_u32(svdup_n_u32((uint32_t)(bits >> (32 * i))));
        const svuint8_t mine = svtbl_u8(four, svlsr_n_u8_x(all, lane, 3));
        const svbool_t set = svcmpne_n_u8(all, svand_u8_x(all, mine, bit), 0);
        a.v[i] = svadd_n_u8_m(set, a.v[i], 16);
    }
    return a;
}

/* acc[l] + the four products u[4l + i] s[i] (USDOT: exact in int32). */
static inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t four) {
    const svint8_t s = svreinterpret_s8_s32(svdup_n_s32(four));
    for (int i = 0; i < 2; i++) acc.v[i] = svusdot_s32(acc.v[i], u.v[i], s);
    return acc;
}

static inline void prefetch_l1(const void *p) { __builtin_prefetch(p, 0, 3); }

#endif
