/* y = x W^T (+ b) for a few bf16 rows against a weight packed by `outrider_pack_bf16`
 * (linear_amx.c), with AVX512 instructions: for CPUs without AMX (AMD Zen 4, say).
 * kernels/native.py builds this file and kernels/linear.py calls it.
 *
 * The pack holds, for each block of 16 outputs, the input features in pairs, each pair of the
 * 16 outputs side by side: [out / 16][in / 2][16][2]. One VDPBF16PS then takes a pair of one
 * input row's features (broadcast) against that pair of 16 outputs and adds both products into
 * the 16 outputs' fp32 sums: no horizontal sums, and every weight loaded is used by every row of
 * the tile. A tile is up to 8 rows against up to 4 blocks (at most 24 sums in registers); the
 * first row tile streams a block group's weights from memory and the others find them in L2.
 * Up to about 8 rows the weights' streaming sets the pace, as it does for one (linear_bf16.c's
 * dot products grow dearer with every row, torch's GEMM is dearer still at few rows).
 *
 * Each output is one fp32 sum over the input pairs in order, rounded once to bf16 (after the
 * bias): the same computation whatever the number of rows, the tiling or the thread count, so a
 * row's result does not depend on the rest of the batch (tests/unit/test_native_kernels.py
 * checks it bit for bit).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define BLOCK 16 /* outputs per packed block */
#if SIMD_F32X16_REGISTERS >= 32
#define MAX_ROWS 8   /* input rows per tile */
#define MAX_BLOCKS 4 /* blocks per tile */
/* Blocks per tile for a tile of nr rows: as many as keep the sums within 24 registers. */
static inline int tile_blocks(int nr) { return nr <= 6 ? 4 : 3; }
#else
/* Fewer vector registers (NEON's 32 hold 8 f32x16, SVE's at 256 bits 16): tiles of up to 4
 * rows by 2 blocks, whose sums and weights fit in them. The tiling changes no output. */
#define MAX_ROWS 4
#define MAX_BLOCKS 2
static inline int tile_blocks(int nr) { return nr <= 2 ? 2 : 1; }
#endif

/* Rows [r0, r0 + nr) against blocks [b0, b0 + nb): nr and nb are constants at each call site,
 * so the sums stay in registers. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *packed,
                                                       const uint16_t *bias, uint16_t *y, int in,
                                                       int out, int b0, const int nb, int r0,
                                                       const int nr) {
    const size_t panel = (size_t)in * BLOCK; /* bf16 per block */
    const int pairs = in / 2;
    f32x16 acc[MAX_ROWS][MAX_BLOCKS];
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++) acc[i][j] = f32x16_zero();
    const uint16_t *w = packed + (size_t)b0 * panel;
    const uint16_t *xr = x + (size_t)r0 * in;
    for (int p = 0; p < pairs; p++) {
        bf16x32 wv[MAX_BLOCKS];
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++)
            wv[j] = bf16x32_load(w + (size_t)j * panel + (size_t)p * 2 * BLOCK, lanes32_first(32));
#pragma GCC unroll 8
        for (int i = 0; i < nr; i++) {
            const bf16x32 xv = bf16x32_pair(xr + (size_t)i * in + 2 * (size_t)p);
#pragma GCC unroll 4
            for (int j = 0; j < nb; j++) acc[i][j] = bf16x32_dot(acc[i][j], wv[j], xv);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++) {
        const int o = (b0 + j) * BLOCK;
        const int width = out - o < BLOCK ? out - o : BLOCK;
        const lanes16 m = lanes16_first(width);
        const f32x16 b = bias ? f32x16_load_bf16(bias + o, m) : f32x16_zero();
#pragma GCC unroll 8
        for (int i = 0; i < nr; i++) {
            f32x16_store_bf16(y + (size_t)(r0 + i) * out + o,
                              bias ? f32x16_add(acc[i][j], b) : acc[i][j], m);
        }
    }
}

#define TILE(NB, NR) tile(x, packed, bias, y, in, out, b0, NB, r0, NR)
#if MAX_ROWS == 8
#define TILE_ROWS(NB)                                                                    \
    switch (nr) {                                                                        \
        case 1: TILE(NB, 1); break;                                                      \
        case 2: TILE(NB, 2); break;                                                      \
        case 3: TILE(NB, 3); break;                                                      \
        case 4: TILE(NB, 4); break;                                                      \
        case 5: TILE(NB, 5); break;                                                      \
        case 6: TILE(NB, 6); break;                                                      \
        case 7: TILE(NB, 7); break;                                                      \
        default: TILE(NB, 8); break;                                                     \
    }
#else
#define TILE_ROWS(NB)                                                                    \
    switch (nr) {                                                                        \
        case 1: TILE(NB, 1); break;                                                      \
        case 2: TILE(NB, 2); break;                                                      \
        case 3: TILE(NB, 3); break;                                                      \
        default: TILE(NB, 4); break;                                                     \
    }
#endif

/* Blocks [first, last) of every input row. */
static void blocks_range(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *y, int rows, int in, int out, int first, int last) {
    const int width = tile_blocks(rows < MAX_ROWS ? rows : MAX_ROWS);
    for (int b0 = first; b0 < last; b0 += width) {
        const int nb = last - b0 < width ? last - b0 : width;
        for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            const int nr = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
            switch (nb) {
                case 1: TILE_ROWS(1); break;
#if MAX_BLOCKS == 4
                case 2: TILE_ROWS(2); break;
                case 3: TILE_ROWS(3); break;
                default: TILE_ROWS(4); break;
#else
                default: TILE_ROWS(2); break;
#endif
            }
        }
    }
}

/* x [rows, in], packed (outrider_pack_bf16 of w [out, in]; in % 32 == 0), bias [out] or NULL,
 * y [rows, out]; bf16. The blocks of outputs are split between `threads` threads. */
void outrider_linear_packed(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                            uint16_t *y, int rows, int in, int out, int threads) {
    const int blocks = (out + BLOCK - 1) / BLOCK;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = blocks;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(blocks, &first, &last);
        if (first < last) blocks_range(x, packed, bias, y, rows, in, out, first, last);
    }
}
