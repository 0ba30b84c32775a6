/* y = x W^T (+ b) for a weight kept in GGUF's quantized blocks (Q4_0, Q4_1, Q8_0), the rows x
 * fp32 or bf16 (kernels/quant.py lays the weights out, kernels/native.py calls this file).
 *
 * A decode step streams every weight once, so its cost is the weights' bytes: 5 bits a weight
 * for Q4_1, 8.5 for Q8_0, against 16 for bf16. The weights stay as loaded and are never widened
 * in memory; the rows are quantized instead, as llama.cpp does: each block of 32 values of a row
 * becomes 32 int8 q with a scale dx = max|x| / 127 and the sum sx = dx * sum(q). A weight block
 * is w = d * u + m with u unsigned (4 bits: Q4_0 and Q4_1, m = -8 d for Q4_0; 5 bits: Q5_0 and
 * Q5_1, m = -16 d for Q5_0; 8 bits: Q8_0 with its sign bit flipped at load, m = -128 d), so one
 * block's dot product is
 *
 *     sum w x = d dx sum(u q) + m sx
 *
 * and sum(u q) is exact in int32: AVX512-VNNI's VPDPBUSD multiplies 64 unsigned bytes by 64
 * signed ones and adds each four products into an int32 lane (simd.h's `dot_u8s8`, emulated
 * exactly where the CPU lacks it).
 *
 * For Q4_0, Q5_0 and Q8_0, m sx = c d dx sum(q) with c = -8, -16 or -128, an integer correction to sum(u q)
 * before the scaling.
 *
 * Layout (kernels/quant.py). Blocks go in groups of four (the last group may hold fewer): for a
 * group of G blocks, 4-bit weights are GGUF's own 16 G bytes (byte j of a block holds element j
 * in its low nibble, element j + 16 in its high one), 5-bit weights are those 16 G bytes of
 * their low four bits followed by their fifth bits as two 64-bit masks (the first halves', then
 * the second halves', 16 bits a block, zeros past the group's end), 8-bit weights are 16 G bytes of the
 * blocks' first halves then 16 G bytes of their second halves, and the quantized rows are laid
 * as the 8-bit weights are. So the low nibbles (or the first 16 G bytes) of a group meet the
 * rows' first halves, the high nibbles the second halves, and after two VPDPBUSD lanes 4t..4t+3
 * hold block t's partial sums. Outputs go four at a time (a tile): the four weight rows' partial
 * sums are added across so that lane 4t + j holds block t of row j, and the tile's scales (and
 * minimums) are stored in that order, [tile][group][t][j], so one load gives all sixteen. Each
 * input row keeps one fp32 accumulator per tile; at the end, lane j's four blocks are added.
 *
 * Each output is the same computation whatever the number of rows, the tiling or the thread
 * count: the groups in order into its lanes of one accumulator, a fixed sum of those four lanes,
 * then the bias, rounded once to bf16 for bf16 rows. A row's result does not depend on the rest
 * of the batch (tests/unit/test_quant.py checks it bit for bit).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 32  /* weights per quantized block */
#define GROUP 4   /* blocks per group */
#define TILE 4    /* weight rows (outputs) per tile */
#define X_ROWS 8  /* input rows per pass over a tile: one accumulator each */
/* How far ahead a tile's first pass asks for the weights it will need (in tiles): a tile does
 * too little work for the out-of-order core to hide memory's latency on its own. */
#define PREFETCH_TILES 8

/* The quantized rows: q [rows][in] int8 in the grouped layout; per row and group, 16 lanes in
 * the tiles' order (lane 4t + j is block t of the group, whatever j): dx, sx = dx sum(q), and
 * cq = c sum(q) (the integer correction of Q4_0 and Q8_0). */
typedef struct {
    int8_t *q;
    float *dx, *sx;
    int32_t *cq;
    int groups, blocks;
} quantized_rows;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* 16 values of a row from element `at` as fp32. */
static inline __m512 load_row16(const void *x, int x_f32, size_t at) {
    if (x_f32) return _mm512_loadu_ps((const float *)x + at);
    return load_bf16x16((const uint16_t *)x + at, (__mmask16)0xffff);
}

/* One row: each block to int8 with its scale (round to nearest even), in the grouped layout. */
static void quantize_row(const void *x, int x_f32, int in, int c, int8_t *q, float *dx, float *sx,
                         int32_t *cq) {
    const int blocks = in / BLOCK, groups = (blocks + GROUP - 1) / GROUP;
    memset(dx, 0, sizeof(float) * 16 * (size_t)groups);
    memset(sx, 0, sizeof(float) * 16 * (size_t)groups);
    memset(cq, 0, sizeof(int32_t) * 16 * (size_t)groups);
    for (int b = 0; b < blocks; b++) {
        const size_t at = (size_t)b * BLOCK;
        const __m512 lo = load_row16(x, x_f32, at), hi = load_row16(x, x_f32, at + 16);
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        const int g = b / GROUP, t = b % GROUP;
        const int in_group = blocks - g * GROUP < GROUP ? blocks - g * GROUP : GROUP;
        int8_t *base = q + (size_t)g * GROUP * BLOCK;
        _mm_storeu_si128((__m128i *)(base + 16 * t), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(base + 16 * in_group + 16 * t), _mm512_cvtsepi32_epi8(qhi));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        for (int j = 0; j < TILE; j++) {
            dx[16 * g + 4 * t + j] = d;
            sx[16 * g + 4 * t + j] = d * (float)sum;
            cq[16 * g + 4 * t + j] = c * sum;
        }
    }
}

/* Bytes of a weight row's group g (from the row's start), and of the whole row. */
static inline size_t group_offset(int bits, int g) {
    return (size_t)g * (bits == 5 ? 80 : GROUP * BLOCK * bits / 8);
}

static inline size_t row_bytes_of(int in, int bits) {
    const int blocks = in / BLOCK, tail = blocks % GROUP;
    return group_offset(bits, blocks / GROUP) +
           (tail ? (bits == 5 ? 16 * (size_t)tail + 16 : (size_t)tail * BLOCK * bits / 8) : 0);
}

/* Group g of a weight row as two vectors of unsigned bytes: the elements meeting the rows'
 * first halves, and those meeting the second halves (zeros past the group's end). */
static inline __attribute__((always_inline)) void load_group(const uint8_t *row, int bits, int g,
                                                             __mmask64 m, int in_group,
                                                             __m512i *lo, __m512i *hi) {
    /* Whole groups take plain loads: masked ones keep the hardware prefetcher from following
     * the rows on some CPUs (a third of the bandwidth on AMD Zen 5). */
    if (bits != 8) {
        const uint8_t *at = row + group_offset(bits, g);
        const __m512i raw = in_group == GROUP ? _mm512_loadu_si512(at)
                                              : _mm512_maskz_loadu_epi8(m, at);
        const __m512i nibble = _mm512_set1_epi8(0x0f);
        *lo = _mm512_and_si512(raw, nibble);
        *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        if (bits == 5) { /* the fifth bits: + 16 where set */
            __mmask64 fifth[2];
            memcpy(fifth, at + 16 * in_group, sizeof fifth);
            const __m512i sixteen = _mm512_set1_epi8(16);
            *lo = _mm512_mask_add_epi8(*lo, fifth[0], *lo, sixteen);
            *hi = _mm512_mask_add_epi8(*hi, fifth[1], *hi, sixteen);
        }
    } else {
        const uint8_t *at = row + (size_t)g * GROUP * BLOCK;
        if (in_group == GROUP) {
            *lo = _mm512_loadu_si512(at);
            *hi = _mm512_loadu_si512(at + 64);
        } else {
            *lo = _mm512_maskz_loadu_epi8(m, at);
            *hi = _mm512_maskz_loadu_epi8(m, at + 16 * in_group);
        }
    }
}

/* Four rows' partial sums (lanes 4t..4t+3 of s[j] are block t of row j) -> lane 4t + j holds
 * all of block t of row j (each 128-bit lane is one block: a 4 x 4 transpose-and-add in it). */
static inline __m512i across4(__m512i s0, __m512i s1, __m512i s2, __m512i s3) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

/* Input rows [r0, r0 + nx) against tile `tile` (outputs [4 tile, 4 tile + nw)): nx is a constant
 * at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_rows(
    const quantized_rows *xq, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
    int bits, const void *bias, int x_f32, void *y, int in, int out, int tile, int nw, int r0,
    const int nx, int prefetch) {
    const size_t row_bytes = row_bytes_of(in, bits);
    const int groups = xq->groups, blocks = xq->blocks;
    const int o = tile * TILE;
    const uint8_t *wr[TILE];
    for (int j = 0; j < TILE; j++) wr[j] = codes + (size_t)(o + (j < nw ? j : 0)) * row_bytes;
    const uint16_t *st = scales + (size_t)tile * groups * 16;
    const uint16_t *mt = mins ? mins + (size_t)tile * groups * 16 : NULL;
    if (prefetch) {
        const size_t ahead = (size_t)PREFETCH_TILES * groups * 16;
        for (size_t at = 0; at < (size_t)groups * 32; at += 64) {
            _mm_prefetch((const char *)(st + ahead) + at, _MM_HINT_T0);
            if (mt) _mm_prefetch((const char *)(mt + ahead) + at, _MM_HINT_T0);
        }
    }
    __m512 acc[X_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < X_ROWS; i++) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int in_group = blocks - g * GROUP < GROUP ? blocks - g * GROUP : GROUP;
        const __mmask64 mk =
            in_group == GROUP ? ~(__mmask64)0 : ((__mmask64)1 << (16 * in_group)) - 1;
        __m512i wlo[TILE], whi[TILE];
#pragma GCC unroll 4
        for (int j = 0; j < TILE; j++) {
            if (prefetch) {
                const char *ahead = (const char *)(wr[j] + PREFETCH_TILES * TILE * row_bytes) +
                                    group_offset(bits, g);
                _mm_prefetch(ahead, _MM_HINT_T0);
                if (bits != 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
            }
            load_group(wr[j], bits, g, mk, in_group, &wlo[j], &whi[j]);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + 16 * g)));
        const __m512 m =
            mt ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + 16 * g)))
               : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < nx; i++) {
            const size_t row = (size_t)(r0 + i);
            const int8_t *xg = xq->q + row * in + (size_t)g * GROUP * BLOCK;
            const int whole = in_group == GROUP;
            const __m512i xlo = whole ? _mm512_loadu_si512(xg) : _mm512_maskz_loadu_epi8(mk, xg);
            const __m512i xhi = whole ? _mm512_loadu_si512(xg + 64)
                                      : _mm512_maskz_loadu_epi8(mk, xg + 16 * in_group);
            __m512i s[TILE];
#pragma GCC unroll 4
            for (int j = 0; j < TILE; j++)
                s[j] = dot_u8s8(dot_u8s8(_mm512_setzero_si512(), wlo[j], xlo), whi[j], xhi);
            __m512i sums = across4(s[0], s[1], s[2], s[3]);
            const size_t lanes = (row * groups + g) * 16;
            if (!mt) sums = _mm512_add_epi32(sums, _mm512_loadu_si512(xq->cq + lanes));
            const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(xq->dx + lanes));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[i]);
            if (mt) acc[i] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xq->sx + lanes), acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nx; i++) {
        /* Lane j: blocks (t0 + t2) + (t1 + t3) of every group of row j. */
        __m512 a = _mm512_add_ps(acc[i], _mm512_shuffle_f32x4(acc[i], acc[i], 0x4e));
        a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xb1));
        float four[4];
        _mm_storeu_ps(four, _mm512_castps512_ps128(a));
        const size_t at = (size_t)(r0 + i) * out + o;
        for (int j = 0; j < nw; j++) {
            float v = four[j];
            if (x_f32) {
                if (bias) v += ((const float *)bias)[o + j];
                ((float *)y)[at + j] = v;
            } else {
                if (bias) v += bf16_to_f32(((const uint16_t *)bias)[o + j]);
                ((uint16_t *)y)[at + j] = f32_to_bf16(v);
            }
        }
    }
}

#define TILE_ROWS(N) \
    tile_rows(xq, codes, scales, mins, bits, bias, x_f32, y, in, out, t, nw, r0, N, pf)

/* Tiles [first, last) of every input row. */
static void tiles_range(const quantized_rows *xq, const uint8_t *codes, const uint16_t *scales,
                        const uint16_t *mins, int bits, const void *bias, int x_f32, void *y,
                        int rows, int in, int out, int first, int last) {
    /* The first tiles' weights, which no earlier tile asked for. */
    const size_t row_bytes = row_bytes_of(in, bits), lanes = (size_t)xq->groups * 16;
    const int ahead_end = first + PREFETCH_TILES < last ? first + PREFETCH_TILES : last;
    const size_t code_end = (size_t)(ahead_end * TILE < out ? ahead_end * TILE : out) * row_bytes;
    for (size_t at = (size_t)first * TILE * row_bytes; at < code_end; at += 64)
        _mm_prefetch((const char *)codes + at, _MM_HINT_T0);
    for (size_t at = (size_t)first * lanes * 2; at < (size_t)ahead_end * lanes * 2; at += 64) {
        _mm_prefetch((const char *)scales + at, _MM_HINT_T0);
        if (mins) _mm_prefetch((const char *)mins + at, _MM_HINT_T0);
    }
    for (int t = first; t < last; t++) {
        const int nw = out - t * TILE < TILE ? out - t * TILE : TILE;
        for (int r0 = 0; r0 < rows; r0 += X_ROWS) {
            const int pf = r0 == 0; /* the first pass streams the tile's weights */
            switch (rows - r0 < X_ROWS ? rows - r0 : X_ROWS) {
                case 1: TILE_ROWS(1); break;
                case 2: TILE_ROWS(2); break;
                case 3: TILE_ROWS(3); break;
                case 4: TILE_ROWS(4); break;
                case 5: TILE_ROWS(5); break;
                case 6: TILE_ROWS(6); break;
                case 7: TILE_ROWS(7); break;
                default: TILE_ROWS(8); break;
            }
        }
    }
}

/* x [rows, in] (fp32 when x_f32, else bf16); codes [out][row bytes] in the grouped layout;
 * scales [tiles][groups][4][4] fp16 (kernels/quant.py); mins likewise (Q4_1) or NULL, then
 * min_per_scale (-8, -16 or -128) says m = min_per_scale d; bias [out] in x's dtype or NULL; y
 * [rows, out] in x's dtype. in % 32 == 0. Returns 0, or 1 when the rows' scratch could not be
 * allocated. Tiles are split between `threads` threads (the OpenMP runtime is torch's own). */
int outrider_linear_quant(const void *x, int x_f32, const uint8_t *codes, const uint16_t *scales,
                          const uint16_t *mins, int min_per_scale, int bits, const void *bias,
                          void *y, int rows, int in, int out, int threads) {
    quantized_rows xq;
    xq.blocks = in / BLOCK;
    xq.groups = (xq.blocks + GROUP - 1) / GROUP;
    const size_t q_bytes = ((size_t)rows * in + 63) & ~(size_t)63;
    const size_t lane_bytes = sizeof(float) * 16 * (size_t)rows * xq.groups;
    char *scratch = aligned_alloc(64, q_bytes + 3 * lane_bytes);
    if (!scratch) return 1;
    xq.q = (int8_t *)scratch;
    xq.dx = (float *)(scratch + q_bytes);
    xq.sx = (float *)(scratch + q_bytes + lane_bytes);
    xq.cq = (int32_t *)(scratch + q_bytes + 2 * lane_bytes);
    const size_t x_row = (size_t)in * (x_f32 ? 4 : 2);
    const size_t lanes = 16 * (size_t)xq.groups;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) if (rows >= 16)
    for (int r = 0; r < rows; r++)
        quantize_row((const char *)x + r * x_row, x_f32, in, mins ? 0 : min_per_scale,
                     xq.q + (size_t)r * in, xq.dx + r * lanes, xq.sx + r * lanes,
                     xq.cq + r * lanes);
    const int tiles = (out + TILE - 1) / TILE;
    if (threads > tiles) threads = tiles;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(tiles, &first, &last);
        if (first < last)
            tiles_range(&xq, codes, scales, mins, bits, bias, x_f32, y, rows, in, out, first, last);
    }
    free(scratch);
    return 0;
}

/* The rows as outrider_linear_quant quantizes them (for tests): q [rows][in] int8 in the
 * grouped layout, dx and sx [rows][in / 32]. */
void outrider_quantize_rows(const void *x, int x_f32, int rows, int in, int8_t *q, float *dx,
                            float *sx) {
    const int blocks = in / BLOCK, groups = (blocks + GROUP - 1) / GROUP;
    float *lanes = malloc(sizeof(float) * 16 * 3 * (size_t)groups);
    if (!lanes) return;
    for (int r = 0; r < rows; r++) {
        quantize_row((const char *)x + (size_t)r * in * (x_f32 ? 4 : 2), x_f32, in, 0,
                     q + (size_t)r * in, lanes, lanes + 16 * groups,
                     (int32_t *)(lanes + 32 * groups));
        for (int b = 0; b < blocks; b++) {
            dx[(size_t)r * blocks + b] = lanes[16 * (b / GROUP) + 4 * (b % GROUP)];
            sx[(size_t)r * blocks + b] = lanes[16 * groups + 16 * (b / GROUP) + 4 * (b % GROUP)];
        }
    }
    free(lanes);
}
