/* y = x W^T (+ b) for bf16 rows on an AVX512 CPU (kernels/native.py builds this file and
 * kernels/linear.py calls it).
 *
 * Decode multiplies one row (verification a few) by every weight of the model, so its cost is
 * streaming the weights from memory. kernels/linear.py sends rows here when the weight is not
 * packed for the AMX kernel (linear_amx.c): up to NATIVE_MAX_ROWS on an AVX512-BF16 CPU, any
 * number where the CPU has AVX512F alone and torch's bf16 GEMM is slower still. The loop below
 * takes the rows ROW_TILE at a time and, for each tile, reads each weight once: a block of four
 * weight rows is streamed (with the next block prefetched) and dotted with every row of the
 * tile while it sits in L1. Products and sums are fp32 (VDPBF16PS, or two FMAs without it: see
 * simd.h), each output rounded once to bf16 (round to nearest even).
 *
 * Each output element is the same computation whatever the number of rows, threads or its
 * place in a block: 16 fp32 lanes accumulate the 32-element chunks of the dot product in order
 * and are then summed in a fixed tree. So a row's result does not depend on what else is in the
 * batch (tests/unit/test_native_kernels.py checks it bit for bit).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#define ROW_BLOCK 4 /* weight rows streamed together */
#define X_GROUP 4   /* input rows dotted with them at once (16 fp32 accumulators) */
/* Input rows per pass over the weights: a tile of rows stays in L2 while the weights stream. */
#define ROW_TILE 32

/* Input rows [r0, r0 + nx) against weight rows [o, o + nw): nx is a constant at each call
 * site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_group(const uint16_t *x,
                                                            const uint16_t *const wr[ROW_BLOCK],
                                                            const uint16_t *bias, uint16_t *y,
                                                            int in, int out, int o, int nw, int r0,
                                                            const int nx, int prefetch) {
    const int chunks = (in + 31) / 32;
    const __mmask32 tail = (in % 32) ? (__mmask32)((1u << (in % 32)) - 1u) : (__mmask32)~0u;
    __m512 acc[X_GROUP * ROW_BLOCK];
#pragma GCC unroll 8
    for (int i = 0; i < X_GROUP; i++)
#pragma GCC unroll 8
        for (int j = 0; j < ROW_BLOCK; j++) acc[ROW_BLOCK * i + j] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const __mmask32 m = c == chunks - 1 ? tail : (__mmask32)~0u;
        const size_t at = (size_t)c * 32;
        bf16x32 wv[ROW_BLOCK];
#pragma GCC unroll 8
        for (int j = 0; j < ROW_BLOCK; j++) {
            wv[j] = bf16x32_load(wr[j] + at, m);
            if (prefetch)
                _mm_prefetch((const char *)(wr[j] + (size_t)ROW_BLOCK * in + at), _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int i = 0; i < nx; i++) {
            const bf16x32 xv = bf16x32_load(x + (size_t)(r0 + i) * in + at, m);
#pragma GCC unroll 8
            for (int j = 0; j < ROW_BLOCK; j++)
                acc[ROW_BLOCK * i + j] = bf16x32_dot(acc[ROW_BLOCK * i + j], wv[j], xv);
        }
    }
    /* Lane 4i + j of the sums is input row i against weight row j. */
    __m512 sums = sum16(acc);
    if (bias) {
        const __m128i b4 = _mm_maskz_loadu_epi16((__mmask8)((1u << nw) - 1u), bias + o);
        const __m512 b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_broadcastq_epi64(b4)), 16));
        sums = _mm512_add_ps(sums, b);
    }
    const __m256i out16 = bf16_round16(sums);
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, out16);
    for (int i = 0; i < nx; i++)
        __builtin_memcpy(y + (size_t)(r0 + i) * out + o, lanes + 4 * i,
                         (size_t)nw * sizeof(uint16_t));
}

/* Output rows [o0, o1) of every input row. */
static void rows_block(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int rows, int in, int out, int o0, int o1) {
    for (int o = o0; o < o1; o += ROW_BLOCK) {
        const int nw = (o1 - o) < ROW_BLOCK ? (o1 - o) : ROW_BLOCK;
        const uint16_t *wr[ROW_BLOCK];
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

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out]; all contiguous bf16. Output rows
 * are split between `threads` threads in whole blocks (the OpenMP runtime is torch's own: it is
 * loaded when this library is); each thread takes the input rows a tile at a time. */
void outrider_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                          int rows, int in, int out, int threads) {
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
