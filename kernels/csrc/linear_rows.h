/* The projection kernel's body, for kernels/csrc/linear_bf16.c (bf16 rows, weight and output)
 * and linear_f32.c (fp32, with LR_F32 defined): each includes this once. See linear_bf16.c for
 * what it does; the fp32 build does the same in fp32 throughout (a fused multiply-add over 16
 * features where bf16 takes VDPBF16PS over 32, no rounding of the output), so in either each
 * output is the same computation whatever the number of rows or threads.
 */
#ifndef OUTRIDER_LINEAR_ROWS_H
#define OUTRIDER_LINEAR_ROWS_H

#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#ifdef LR_F32
typedef float lr_elem;
#define LR_NAME outrider_linear_f32
#define LR_CHUNK 16 /* input features per step of the dot products */
typedef f32x16 lr_vec;
typedef lanes16 lr_mask;
#define lr_first lanes16_first

static inline lr_vec lr_load(const float *p, lanes16 m) { return f32x16_load_first(p, m); }

static inline f32x16 lr_dot(f32x16 acc, f32x16 a, f32x16 b) { return f32x16_fma(a, b, acc); }

/* The biases of outputs o..o + nw - 1, repeated in every group of four lanes. */
static inline f32x16 lr_bias4(const float *bias, int o, int nw) { return f32x16_repeat4(bias + o, nw); }

/* Lane 4i + j of `sums` to y[r0 + i][o + j], for i < nx and j < nw. */
static inline void lr_store(float *y, int out, int o, int nw, int r0, int nx, f32x16 sums) {
    float lanes[16];
    f32x16_store(lanes, sums);
    for (int i = 0; i < nx; i++)
        __builtin_memcpy(y + (size_t)(r0 + i) * out + o, lanes + 4 * i, (size_t)nw * sizeof(float));
}
#else
typedef uint16_t lr_elem;
#define LR_NAME outrider_linear_bf16
#define LR_CHUNK 32
typedef bf16x32 lr_vec;
typedef lanes32 lr_mask;
#define lr_first lanes32_first
#define lr_load bf16x32_load
#define lr_dot bf16x32_dot

static inline f32x16 lr_bias4(const lr_elem *bias, int o, int nw) {
    return f32x16_repeat4_bf16(bias + o, nw);
}

static inline void lr_store(lr_elem *y, int out, int o, int nw, int r0, int nx, f32x16 sums) {
    uint16_t lanes[16];
    f32x16_store_bf16_all(lanes, sums);
    for (int i = 0; i < nx; i++)
        __builtin_memcpy(y + (size_t)(r0 + i) * out + o, lanes + 4 * i,
                         (size_t)nw * sizeof(uint16_t));
}
#endif

#define ROW_BLOCK 4 /* weight rows streamed together */
#define X_GROUP 4   /* input rows dotted with them at once (16 fp32 accumulators) */
/* Input rows per pass over the weights: a tile of rows stays in L2 while the weights stream. */
#define ROW_TILE 32

/* Input rows [r0, r0 + nx) against weight rows [o, o + nw): nx is a constant at each call
 * site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_group(const lr_elem *x,
                                                            const lr_elem *const wr[ROW_BLOCK],
                                                            const lr_elem *bias, lr_elem *y,
                                                            int in, int out, int o, int nw, int r0,
                                                            const int nx, int prefetch) {
    const int chunks = (in + LR_CHUNK - 1) / LR_CHUNK;
    const lr_mask all = lr_first(LR_CHUNK);
    const lr_mask tail = lr_first(in % LR_CHUNK ? in % LR_CHUNK : LR_CHUNK);
    f32x16 acc[X_GROUP * ROW_BLOCK];
#pragma GCC unroll 8
    for (int i = 0; i < X_GROUP; i++)
#pragma GCC unroll 8
        for (int j = 0; j < ROW_BLOCK; j++) acc[ROW_BLOCK * i + j] = f32x16_zero();
    for (int c = 0; c < chunks; c++) {
        const lr_mask m = c == chunks - 1 ? tail : all;
        const size_t at = (size_t)c * LR_CHUNK;
        lr_vec wv[ROW_BLOCK];
#pragma GCC unroll 8
        for (int j = 0; j < ROW_BLOCK; j++) {
            wv[j] = lr_load(wr[j] + at, m);
            if (prefetch) prefetch_l1(wr[j] + (size_t)ROW_BLOCK * in + at);
        }
#pragma GCC unroll 8
        for (int i = 0; i < nx; i++) {
            const lr_vec xv = lr_load(x + (size_t)(r0 + i) * in + at, m);
#pragma GCC unroll 8
            for (int j = 0; j < ROW_BLOCK; j++)
                acc[ROW_BLOCK * i + j] = lr_dot(acc[ROW_BLOCK * i + j], wv[j], xv);
        }
    }
    /* Lane 4i + j of the sums is input row i against weight row j. */
    f32x16 sums = sum16(acc);
    if (bias) sums = f32x16_add(sums, lr_bias4(bias, o, nw));
    lr_store(y, out, o, nw, r0, nx, sums);
}

/* Output rows [o0, o1) of every input row. */
static void rows_block(const lr_elem *x, const lr_elem *w, const lr_elem *bias, lr_elem *y,
                       int rows, int in, int out, int o0, int o1) {
    for (int o = o0; o < o1; o += ROW_BLOCK) {
        const int nw = (o1 - o) < ROW_BLOCK ? (o1 - o) : ROW_BLOCK;
        const lr_elem *wr[ROW_BLOCK];
        for (int j = 0; j < ROW_BLOCK; j++) wr[j] = w + (size_t)(o + (j < nw ? j : 0)) * in;
        /* The first group streams the block from memory and prefetches the next one. */
        const int prefetch = o + 2 * ROW_BLOCK <= o1;
        for (int r0 = 0; r0 < rows; r0 += X_GROUP) {
            const int pf = prefetch && r0 == 0;
            switch (rows - r0 < X_GROUP ? rows - r0 : X_GROUP) {
                case 1:
                    dot_group(x, wr, bias, y, in, out, o, nw, r0, 1, pf);
                    break;
                case 2:
                    dot_group(x, wr, bias, y, in, out, o, nw, r0, 2, pf);
                    break;
                case 3:
                    dot_group(x, wr, bias, y, in, out, o, nw, r0, 3, pf);
                    break;
                default:
                    dot_group(x, wr, bias, y, in, out, o, nw, r0, 4, pf);
                    break;
            }
        }
    }
}

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out]; all contiguous. Output rows
 * are split between `threads` threads in whole blocks (the OpenMP runtime is torch's own: it is
 * loaded when this library is); each thread takes the input rows a tile at a time. */
void LR_NAME(const lr_elem *x, const lr_elem *w, const lr_elem *bias, lr_elem *y, int rows, int in,
             int out, int threads) {
    const int blocks = (out + ROW_BLOCK - 1) / ROW_BLOCK;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = blocks;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(blocks, &first, &last);
        const int o0 = first * ROW_BLOCK, o1 = last * ROW_BLOCK < out ? last * ROW_BLOCK : out;
        for (int r = 0; o0 < o1 && r < rows; r += ROW_TILE)
            rows_block(x + (size_t)r * in, w, bias, y + (size_t)r * out,
                       rows - r < ROW_TILE ? rows - r : ROW_TILE, in, out, o0, o1);
    }
}

#endif
