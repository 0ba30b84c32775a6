/* y = x W^T (+ b) for a weight kept in GGUF's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
 * the rows x fp32 or bf16 (kernels/quant.py lays the weights out, kernels/native.py calls this).
 *
 * A decode step streams every weight once, so its cost is the weights' bytes: 5 bits a weight
 * for Q4_1, 8.5 for Q8_0, against 16 for bf16. The weights stay as loaded and are never widened
 * in memory; the rows are quantized instead, as llama.cpp does: each block of 32 values of a row
 * becomes 32 int8 q with a scale dx = max|x| / 127 and the sum sx = dx sum(q). A weight block is
 * w = d u + m with unsigned codes u (4 bits: Q4_0 and Q4_1, m = -8 d for Q4_0; 5 bits: Q5_0 and
 * Q5_1, m = -16 d for Q5_0; 8 bits: Q8_0 with its sign bit flipped at load, m = -128 d), so one
 * block's dot product is
 *
 *     sum w x = d dx sum(u q) + m sx
 *
 * and sum(u q) is exact in int32: AVX512-VNNI's VPDPBUSD multiplies 64 unsigned bytes by 64
 * signed ones and adds each four into an int32 lane (simd.h's `dot_u8s8`: USDOT on arm64 with
 * the int8 matrix extension, emulated exactly where a CPU lacks both). Where m = c d (c = -8, -16, -128), m sx is the integer c sum(q) added to
 * sum(u q) before the scaling.
 *
 * Layout (kernels/quant.py): outputs go sixteen at a time (a panel), and a panel's block of 32
 * input features is laid as VPDPBUSD reads it: eight vectors, vector v holding features
 * 4v..4v+3 of the sixteen outputs side by side (64 bytes, output j's four in bytes 4j..4j+3).
 * One VPDPBUSD of vector v against the row's four int8 at 4v (broadcast) adds those four
 * products into each output's lane, so eight of them give the block's sixteen sums with no
 * horizontal adds, and each weight vector serves every input row of a pass. 8-bit codes are
 * those 512 bytes; 4-bit codes pack vectors v and v + 4 as the low and high nibbles of 256
 * bytes; 5-bit codes are those 256 bytes of low four bits and then eight 64-bit masks of fifth
 * bits (bit 4j + i of mask v: output j's feature 4v + i), added as 16 with a masked byte add. A
 * panel's blocks follow one another, and panels follow one another, so the weights stream as
 * one sequence; the scales (and minimums) are [panel][block][16] fp16 beside them.
 *
 * Each output is the same computation whatever the number of rows, the tiling or the thread
 * count: its lane of one fp32 accumulator takes the blocks in order, then the bias, rounded once
 * to bf16 for bf16 rows. A row's result does not depend on the rest of the batch
 * (tests/unit/test_quant.py checks it bit for bit).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 32  /* weights per quantized block */
#define PANEL 16  /* outputs per panel */
#define X_ROWS 8  /* input rows per pass over a panel: one accumulator each */
/* How far ahead (bytes of codes) a panel's first pass asks for the weights it will need: a
 * block does too little work for the out-of-order core to hide memory's latency alone. */
#define PREFETCH_BYTES 4096

/* The quantized rows: q [rows][in] int8; per row and block: dx, sx = dx sum(q), and cq = c sum(q)
 * (the integer correction where m = c d). */
typedef struct {
    int8_t *q;
    float *dx, *sx;
    int32_t *cq;
    int blocks;
} quantized_rows;

typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;

static inline size_t block_bytes(int bits) { return bits == 8 ? 512 : bits == 5 ? 320 : 256; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 16 values of a row from element `at` as fp32. */
static inline f32x16 load_row16(const void *x, int x_f32, size_t at) {
    if (x_f32) return f32x16_load((const float *)x + at);
    return f32x16_load_bf16((const uint16_t *)x + at, lanes16_first(16));
}

/* One row: each block to int8 with its scale (round to nearest even). */
static void quantize_row(const void *x, int x_f32, int in, int c, int8_t *q, float *dx, float *sx,
                         int32_t *cq) {
    for (int b = 0; b < in / BLOCK; b++) {
        const size_t at = (size_t)b * BLOCK;
        const f32x16 lo = load_row16(x, x_f32, at), hi = load_row16(x, x_f32, at + 16);
        const float amax = f32x16_reduce_max(f32x16_max(f32x16_abs(lo), f32x16_abs(hi)));
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const i32x16 qlo = i32x16_from_f32(f32x16_mul(lo, f32x16_set1(id)));
        const i32x16 qhi = i32x16_from_f32(f32x16_mul(hi, f32x16_set1(id)));
        i32x16_store_i8(q + at, qlo);
        i32x16_store_i8(q + at + 16, qhi);
        const int sum = i32x16_sum(i32x16_add(qlo, qhi));
        dx[b] = d;
        sx[b] = d * (float)sum;
        cq[b] = c * sum;
    }
}

/* A panel's block as eight vectors of unsigned codes (vector v: features 4v..4v+3). */
static inline __attribute__((always_inline)) void unpack_block(const uint8_t *at, int bits,
                                                               u8x64 w[8]) {
    if (bits == 8) {
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) w[v] = u8x64_load(at + 64 * v);
        return;
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        const u8x64 raw = u8x64_load(at + 64 * v);
        w[v] = u8x64_low4(raw);
        w[v + 4] = u8x64_high4(raw);
    }
    if (bits == 5) {
        uint64_t fifth[8];
        memcpy(fifth, at + 256, sizeof fifth);
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) w[v] = u8x64_add16_where(w[v], fifth[v]);
    }
}

/* Input rows [r0, r0 + nx) against panel p (outputs [16 p, 16 p + nw)): nx is a constant at
 * each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_rows(
    const quantized_rows *xq, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
    int bits, const void *bias, int x_f32, void *y, int in, int out, int p, int nw, int r0,
    const int nx, int prefetch) {
    const int blocks = xq->blocks;
    const size_t bb = block_bytes(bits);
    const uint8_t *panel = codes + (size_t)p * blocks * bb;
    const uint16_t *st = scales + (size_t)p * blocks * PANEL;
    const uint16_t *mt = mins ? mins + (size_t)p * blocks * PANEL : NULL;
    f32x16 acc[X_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < X_ROWS; i++) acc[i] = f32x16_zero();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *at = panel + (size_t)b * bb;
        if (prefetch) {
            for (size_t off = 0; off < bb; off += 64) prefetch_l1(at + PREFETCH_BYTES + off);
            if (b % 2 == 0) { /* two blocks' scales a cache line */
                prefetch_l1((const char *)(st + 16 * b) + PREFETCH_BYTES / 8);
                if (mt) prefetch_l1((const char *)(mt + 16 * b) + PREFETCH_BYTES / 8);
            }
        }
        u8x64 w[8];
        unpack_block(at, bits, w);
        const f32x16 d = f32x16_load_f16(st + 16 * b);
        const f32x16 m = mt ? f32x16_load_f16(mt + 16 * b) : f32x16_zero();
#pragma GCC unroll 8
        for (int i = 0; i < nx; i++) {
            const size_t row = (size_t)(r0 + i);
            const int8_t *xb = xq->q + row * in + (size_t)b * BLOCK;
            /* Four int8 at a time, broadcast straight from memory into the dot product. */
            const unaligned_i32 *four = (const unaligned_i32 *)xb;
            /* Two chains of four, added in a fixed order. */
            i32x16 s0 = i32x16_zero(), s1 = i32x16_zero();
#pragma GCC unroll 4
            for (int v = 0; v < 8; v += 2) {
                s0 = dot_u8s8(s0, w[v], four[v]);
                s1 = dot_u8s8(s1, w[v + 1], four[v + 1]);
            }
            i32x16 s = i32x16_add(s0, s1);
            const size_t k = row * blocks + b;
            if (!mt) s = i32x16_add(s, i32x16_set1(xq->cq[k]));
            const f32x16 scale = f32x16_mul(d, f32x16_set1(xq->dx[k]));
            acc[i] = f32x16_fma(f32x16_from_i32(s), scale, acc[i]);
            if (mt) acc[i] = f32x16_fma(m, f32x16_set1(xq->sx[k]), acc[i]);
        }
    }
    const lanes16 mask = lanes16_first(nw);
    const int o = p * PANEL;
#pragma GCC unroll 8
    for (int i = 0; i < nx; i++) {
        const size_t at = (size_t)(r0 + i) * out + o;
        if (x_f32) {
            f32x16 v = acc[i];
            if (bias) v = f32x16_add(v, f32x16_load_first((const float *)bias + o, mask));
            f32x16_store_first((float *)y + at, v, mask);
        } else {
            f32x16 v = acc[i];
            if (bias) v = f32x16_add(v, f32x16_load_bf16((const uint16_t *)bias + o, mask));
            f32x16_store_bf16((uint16_t *)y + at, v, mask);
        }
    }
}

#define PANEL_ROWS(N) \
    panel_rows(xq, codes, scales, mins, bits, bias, x_f32, y, in, out, p, nw, r0, N, pf)

/* Panels [first, last) of every input row. */
static void panels_range(const quantized_rows *xq, const uint8_t *codes, const uint16_t *scales,
                         const uint16_t *mins, int bits, const void *bias, int x_f32, void *y,
                         int rows, int in, int out, int first, int last) {
    /* The first weights, which no earlier block asked for. */
    const size_t panel_bytes = (size_t)xq->blocks * block_bytes(bits);
    const size_t start = (size_t)first * panel_bytes, end = (size_t)last * panel_bytes;
    for (size_t at = start; at < end && at < start + PREFETCH_BYTES; at += 64)
        prefetch_l1(codes + at);
    for (int p = first; p < last; p++) {
        const int nw = out - p * PANEL < PANEL ? out - p * PANEL : PANEL;
        for (int r0 = 0; r0 < rows; r0 += X_ROWS) {
            const int pf = r0 == 0; /* the first pass streams the panel's weights */
            switch (rows - r0 < X_ROWS ? rows - r0 : X_ROWS) {
                case 1: PANEL_ROWS(1); break;
                case 2: PANEL_ROWS(2); break;
                case 3: PANEL_ROWS(3); break;
                case 4: PANEL_ROWS(4); break;
                case 5: PANEL_ROWS(5); break;
                case 6: PANEL_ROWS(6); break;
                case 7: PANEL_ROWS(7); break;
                default: PANEL_ROWS(8); break;
            }
        }
    }
}

/* x [rows, in] (fp32 when x_f32, else bf16); codes [panels][blocks][block bytes] and scales
 * [panels][blocks][16] fp16 (kernels/quant.py); mins likewise (Q4_1, Q5_1) or NULL, then
 * min_per_scale (-8, -16 or -128) says m = min_per_scale d; bias [out] in x's dtype or NULL; y
 * [rows, out] in x's dtype. in % 32 == 0. Returns 0, or 1 when the rows' scratch could not be
 * allocated. Panels are split between `threads` threads (the OpenMP runtime is torch's own). */
int outrider_linear_quant(const void *x, int x_f32, const uint8_t *codes, const uint16_t *scales,
                          const uint16_t *mins, int min_per_scale, int bits, const void *bias,
                          void *y, int rows, int in, int out, int threads) {
    quantized_rows xq;
    xq.blocks = in / BLOCK;
    const size_t q_bytes = ((size_t)rows * in + 63) & ~(size_t)63;
    const size_t per_block = sizeof(float) * (size_t)rows * xq.blocks;
    char *scratch = aligned_alloc(64, q_bytes + 3 * per_block + 64);
    if (!scratch) return 1;
    xq.q = (int8_t *)scratch;
    xq.dx = (float *)(scratch + q_bytes);
    xq.sx = (float *)(scratch + q_bytes + per_block);
    xq.cq = (int32_t *)(scratch + q_bytes + 2 * per_block);
    const size_t x_row = (size_t)in * (x_f32 ? 4 : 2);
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) if (rows >= 16)
    for (int r = 0; r < rows; r++)
        quantize_row((const char *)x + r * x_row, x_f32, in, mins ? 0 : min_per_scale,
                     xq.q + (size_t)r * in, xq.dx + (size_t)r * xq.blocks,
                     xq.sx + (size_t)r * xq.blocks, xq.cq + (size_t)r * xq.blocks);
    const int panels = (out + PANEL - 1) / PANEL;
    if (threads > panels) threads = panels;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(panels, &first, &last);
        if (first < last)
            panels_range(&xq, codes, scales, mins, bits, bias, x_f32, y, rows, in, out, first,
                         last);
    }
    free(scratch);
    return 0;
}

/* The rows as outrider_linear_quant quantizes them (for tests): q [rows][in] int8, dx and sx
 * [rows][in / 32]. */
void outrider_quantize_rows(const void *x, int x_f32, int rows, int in, int8_t *q, float *dx,
                            float *sx) {
    int32_t *cq = malloc(sizeof(int32_t) * (size_t)(in / BLOCK));
    if (!cq) return;
    for (int r = 0; r < rows; r++)
        quantize_row((const char *)x + (size_t)r * in * (x_f32 ? 4 : 2), x_f32, in, 0,
                     q + (size_t)r * in, dx + (size_t)r * (in / BLOCK),
                     sx + (size_t)r * (in / BLOCK), cq);
    free(cq);
}

void outrider_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                            float eps, uint16_t *out, uint16_t *sum_out, int rows, int dim,
                            int threads);
void outrider_silu_mul_bf16(const uint16_t *gate_up, int in_stride, int rows, int inter,
                            uint16_t *out, int threads);

/* outrider_linear_quant of bf16 rows that another of our kernels makes first, in one call
 * (a decode step makes ninety fewer): with `prologue` 1, the RMSNorm of a + residual
 * (rms_norm_bf16.c: a [rows, in], residual [rows, in] or NULL, norm_weight [in]; the sum is
 * written to sum_out unless residual is NULL); with 2, silu(gate) * up of a = [rows, 2 in]
 * (silu_mul_bf16.c). The rows are the bits those kernels write, so the result is the same as
 * calling them and then outrider_linear_quant. Returns 0, or 1 when scratch was not had. */
int outrider_linear_quant_after(int prologue, const uint16_t *a, const uint16_t *residual,
                                const uint16_t *norm_weight, float eps, uint16_t *sum_out,
                                const uint8_t *codes, const uint16_t *scales,
                                const uint16_t *mins, int min_per_scale, int bits,
                                const void *bias, void *y, int rows, int in, int out,
                                int threads) {
    uint16_t *x = aligned_alloc(64, ((sizeof(uint16_t) * (size_t)rows * in) + 63) & ~(size_t)63);
    if (!x) return 1;
    if (prologue == 1)
        outrider_rms_norm_bf16(a, residual, norm_weight, eps, x, sum_out, rows, in, threads);
    else
        outrider_silu_mul_bf16(a, 2 * in, rows, in, x, threads);
    const int code = outrider_linear_quant(x, 0, codes, scales, mins, min_per_scale, bits, bias,
                                           y, rows, in, out, threads);
    free(x);
    return code;
}
