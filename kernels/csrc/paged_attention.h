/* The paged attention kernel's body, for kernels/csrc/paged_attention_bf16.c (bf16 queries, cache
 * and output) and paged_attention_f32.c (fp32, with PA_F32 defined): each defines the element
 * type's arithmetic below and includes this once. See paged_attention_bf16.c for what it does;
 * the fp32 build does the same in fp32 throughout (fused multiply-adds over 16 elements where
 * bf16 takes VDPBF16PS over 32), so each output depends on its own query and keys alone in
 * either. */
#ifndef OUTRIDER_PAGED_ATTENTION_H
#define OUTRIDER_PAGED_ATTENTION_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#ifdef PA_F32
typedef float pa_elem;
#define PA_NAME outrider_paged_attention_f32
#else
typedef uint16_t pa_elem;
#define PA_NAME outrider_paged_attention_bf16
#endif

#define MAX_HEAD_DIM 256

typedef struct {
    const pa_elem *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    const int32_t *block_table;        /* this sequence's row */
    int block_size, kv_heads, head_dim;
} cache_view;

/* Walks the rows of one KV head through a sequence's blocks, key after key. */
typedef struct {
    const cache_view *c;
    const pa_elem *cache;
    int block, slot, g;
} row_walk;

static inline row_walk walk_start(const cache_view *c, const pa_elem *cache, int g) {
    row_walk w = {c, cache, 0, 0, g};
    return w;
}

static inline const pa_elem *walk_next(row_walk *w) {
    const cache_view *c = w->c;
    const pa_elem *row =
        w->cache +
        (((size_t)c->block_table[w->block] * c->block_size + w->slot) * c->kv_heads + w->g) *
            c->head_dim;
    if (++w->slot == c->block_size) {
        w->slot = 0;
        w->block++;
    }
    return row;
}

/* A tile: query rows (new tokens x query heads of one KV head) that share their keys and values.
 * Rows come token by token, so their visible key counts never decrease along the tile. */
#define MAX_TILE_ROWS 16
#define VALUE_ROWS 8 /* rows whose value sums share a pass over the values, in registers */

typedef struct {
    const pa_elem *q;
    pa_elem *out;
    int visible; /* keys 0..visible-1 */
} query_row;

#ifdef PA_F32
/* The weighted value sums of RG rows (a constant where it is inlined, so that the 2 RG sums stay
 * in registers) over 32 elements of each value, `d` chunks in, normalized by inv[r] and stored.
 * Row r's sums are the same fused multiply-adds, key after key, as if it were alone. */
static inline __attribute__((always_inline)) void value_sums(const pa_elem *const *vrows,
                                                             const query_row *rows, const int RG,
                                                             const float *scores, int stride,
                                                             int d, const float *inv) {
    f32x16 lo[VALUE_ROWS], hi[VALUE_ROWS];
    for (int r = 0; r < RG; r++) lo[r] = hi[r] = f32x16_zero();
    const int common = rows[0].visible, n = rows[RG - 1].visible;
    for (int t = 0; t < n; t++) {
        const f32x16 vl = f32x16_load(vrows[t] + 32 * d);
        const f32x16 vh = f32x16_load(vrows[t] + 32 * d + 16);
        for (int r = 0; r < RG; r++) {
            if (t >= common && t >= rows[r].visible) continue; /* the last few keys only */
            const f32x16 w = f32x16_set1(scores[(size_t)r * stride + t]);
            lo[r] = f32x16_fma(w, vl, lo[r]);
            hi[r] = f32x16_fma(w, vh, hi[r]);
        }
    }
    for (int r = 0; r < RG; r++) {
        const f32x16 k = f32x16_set1(inv[r]);
        f32x16_store(rows[r].out + 32 * d, f32x16_mul(lo[r], k));
        f32x16_store(rows[r].out + 32 * d + 16, f32x16_mul(hi[r], k));
    }
}

/* The dot products of one query row with keys k[0..m-1] (m <= 16), in lanes 0..m-1 (lanes past
 * m hold 0). CH, the head's chunks of 32, and m are constants where it is inlined for the common
 * cases; each lane is the same sum of fused multiply-adds whatever they are. */
static inline __attribute__((always_inline)) f32x16 block_scores(const pa_elem *const *k,
                                                                 const pa_elem *q, const int CH,
                                                                 const int m) {
    f32x16 qv[MAX_HEAD_DIM / 16];
    for (int d = 0; d < 2 * CH; d++) qv[d] = f32x16_load(q + 16 * d);
    f32x16 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        a[i] = f32x16_zero();
        if (i < m)
            for (int d = 0; d < 2 * CH; d++)
                a[i] = f32x16_fma(f32x16_load(k[i] + 16 * d), qv[d], a[i]);
    }
    return sum16(a);
}

#else
/* The weighted value sums of RG rows (a constant where it is inlined, so that the 2 RG sums stay
 * in registers) over 32 elements of each value, `d` chunks in, normalized by inv[r] and stored
 * rounded to bf16. Row r's sums are the same fused multiply-adds, key after key, as if it were
 * alone. A row of 32 bf16 splits into its even and odd elements as fp32 with one shift and one
 * mask, so the sums run on even and odd halves and are interleaved at the end. */
static inline __attribute__((always_inline)) void value_sums(const pa_elem *const *vrows,
                                                             const query_row *rows, const int RG,
                                                             const float *scores, int stride,
                                                             int d, const float *inv) {
    f32x16 even[VALUE_ROWS], odd[VALUE_ROWS];
    for (int r = 0; r < RG; r++) even[r] = odd[r] = f32x16_zero();
    const int common = rows[0].visible, n = rows[RG - 1].visible;
    for (int t = 0; t < n; t++) {
        f32x16 ve, vo;
        bf16x32_split(vrows[t] + 32 * d, &ve, &vo);
        for (int r = 0; r < RG; r++) {
            if (t >= common && t >= rows[r].visible) continue; /* the last few keys only */
            const f32x16 w = f32x16_set1(scores[(size_t)r * stride + t]);
            even[r] = f32x16_fma(w, ve, even[r]);
            odd[r] = f32x16_fma(w, vo, odd[r]);
        }
    }
    for (int r = 0; r < RG; r++) {
        const f32x16 k = f32x16_set1(inv[r]);
        f32x16 lo, hi;
        f32x16_interleave(even[r], odd[r], &lo, &hi);
        f32x16_store_bf16_all(rows[r].out + 32 * d, f32x16_mul(lo, k));
        f32x16_store_bf16_all(rows[r].out + 32 * d + 16, f32x16_mul(hi, k));
    }
}

/* The dot products of one query row with keys k[0..m-1] (m <= 16), in lanes 0..m-1 (lanes past
 * m hold 0). CH, the head's chunks of 32, and m are constants where it is inlined for the common
 * cases; each lane is the same sum of VDPBF16PS products whatever they are. */
static inline __attribute__((always_inline)) f32x16 block_scores(const pa_elem *const *k,
                                                                 const pa_elem *q, const int CH,
                                                                 const int m) {
    const lanes32 all = lanes32_first(32);
    bf16x32 qv[MAX_HEAD_DIM / 32];
    for (int d = 0; d < CH; d++) qv[d] = bf16x32_load(q + 32 * d, all);
    f32x16 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        a[i] = f32x16_zero();
        if (i < m)
            for (int d = 0; d < CH; d++)
                a[i] = bf16x32_dot(a[i], bf16x32_load(k[i] + 32 * d, all), qv[d]);
    }
    return sum16(a);
}

#endif

/* Every row of the tile over its visible keys of KV head g. Each row's result is computed
 * exactly as it would be alone (the same operations on the same values in the same order): the
 * tile only shares the walk through the blocks and the loads of each key and value, which stay
 * in L1 while the rows use them, where a row alone streams them from L2. `scores` holds
 * rows x stride floats and `krows`, `vrows` stride pointers (stride >= the last row's visible
 * count rounded up to 16). */
static void attend_tile(const cache_view *c, int g, const query_row *rows, int nrows, float scale,
                        float *scores, int stride, const pa_elem **krows,
                        const pa_elem **vrows) {
    const int chunks = c->head_dim / 32;
    const int n = rows[nrows - 1].visible;
    row_walk keys = walk_start(c, c->k_cache, g), values = walk_start(c, c->v_cache, g);
    for (int t = 0; t < n; t++) {
        krows[t] = walk_next(&keys);
        vrows[t] = walk_next(&values);
    }
    /* Scores, 16 keys at a time; the lanes past a row's visible keys are never read. */
    f32x16 running_max[MAX_TILE_ROWS];
    for (int r = 0; r < nrows; r++) running_max[r] = f32x16_set1(-INFINITY);
    int first = 0; /* rows before it see none of this block's keys */
    for (int t0 = 0; t0 < n; t0 += 16) {
        while (rows[first].visible <= t0) first++;
        for (int r = first; r < nrows; r++) {
            const int left = rows[r].visible - t0, m = left < 16 ? left : 16;
            f32x16 s;
            if (m == 16 && chunks == 2) /* the common cases, unrolled */
                s = block_scores(krows + t0, rows[r].q, 2, 16);
            else if (m == 16 && chunks == 4)
                s = block_scores(krows + t0, rows[r].q, 4, 16);
            else
                s = block_scores(krows + t0, rows[r].q, chunks, m);
            const lanes16 valid = lanes16_first(m);
            s = f32x16_mul(s, f32x16_set1(scale));
            f32x16_store_first(scores + (size_t)r * stride + t0, s, valid);
            running_max[r] = f32x16_max_in(running_max[r], s, valid);
        }
    }
    float inv[MAX_TILE_ROWS];
    for (int r = 0; r < nrows; r++) {
        float *sc = scores + (size_t)r * stride;
        const int vis = rows[r].visible;
        const f32x16 max = f32x16_set1(f32x16_reduce_max(running_max[r]));
        f32x16 total = f32x16_zero();
        for (int t0 = 0; t0 < vis; t0 += 16) {
            const int m = vis - t0 < 16 ? vis - t0 : 16;
            const lanes16 valid = lanes16_first(m);
            const f32x16 e = exp_ps(f32x16_sub(f32x16_load_first(sc + t0, valid), max));
            f32x16_store_first(sc + t0, e, valid);
            total = f32x16_add_in(total, e, valid);
        }
        inv[r] = 1.0f / f32x16_sum(total);
    }
    for (int r0 = 0; r0 < nrows; r0 += VALUE_ROWS) {
        const int rg = nrows - r0 < VALUE_ROWS ? nrows - r0 : VALUE_ROWS;
        const float *sc = scores + (size_t)r0 * stride;
        for (int d = 0; d < chunks; d++) {
            switch (rg) {
#define VALUE_CASE(k)                                                  \
    case k:                                                            \
        value_sums(vrows, rows + r0, k, sc, stride, d, inv + r0);      \
        break;
                VALUE_CASE(1)
                VALUE_CASE(2)
                VALUE_CASE(3)
                VALUE_CASE(4)
                VALUE_CASE(5)
                VALUE_CASE(6)
                VALUE_CASE(7)
                VALUE_CASE(8)
#undef VALUE_CASE
            }
        }
    }
}

/* How a sequence's work is cut into tiles: `heads` query heads of one KV head by `tokens` new
 * tokens at most, and how many tiles that makes. */
typedef struct {
    int heads, tokens, head_tiles;
} tiling;

static inline int seq_tiles(const tiling *t, int kv_heads, int q_len) {
    return kv_heads * t->head_tiles * ((q_len + t->tokens - 1) / t->tokens);
}

/* q [tokens, num_heads, head_dim] with `q_stride` elements between tokens; out likewise with
 * `out_stride`. Sequence s owns new tokens q_starts[s] .. q_starts[s] + q_lens[s] - 1 and has
 * seq_lens[s] context tokens (the new ones included) in the blocks of row s of block_tables.
 * head_dim must be a multiple of 32 (at most 256), num_heads a multiple of kv_heads. The
 * work is cut into tiles (query heads of one KV head by new tokens of one sequence), small
 * enough that every thread gets a few, and the tiles are shared out between `threads`
 * threads; a row's result does not depend on its tile. */
void PA_NAME(const pa_elem *q, int q_stride, const pa_elem *k_cache,
                                   const pa_elem *v_cache, const int32_t *block_tables,
                                   int table_stride, const int32_t *q_starts, const int32_t *q_lens,
                                   const int32_t *seq_lens, int num_seqs, int num_heads,
                                   int kv_heads, int head_dim, int block_size, float scale,
                                   pa_elem *out, int out_stride, int threads) {
    int longest = 1, total_rows = 0;
    for (int s = 0; s < num_seqs; s++) {
        longest = seq_lens[s] > longest ? seq_lens[s] : longest;
        total_rows += q_lens[s] * num_heads;
    }
    if (threads < 1) threads = 1;
    const int group = num_heads / kv_heads;
    /* Rows per tile: as many as fit, but at least two tiles per thread where there are rows
     * enough. */
    int per_tile = total_rows / (2 * threads);
    per_tile = per_tile < 1 ? 1 : per_tile > MAX_TILE_ROWS ? MAX_TILE_ROWS : per_tile;
    tiling tl;
    tl.heads = group < per_tile ? group : per_tile;
    tl.tokens = per_tile / tl.heads;
    tl.head_tiles = (group + tl.heads - 1) / tl.heads;
    int items = 0;
    for (int s = 0; s < num_seqs; s++) items += seq_tiles(&tl, kv_heads, q_lens[s]);
    if (items == 0) return;
    if (threads > items) threads = items;
    const int stride = (longest + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
    {
        float *scores = (float *)aligned_alloc(
            64, ((size_t)MAX_TILE_ROWS * stride * sizeof(float) + 63) / 64 * 64);
        const pa_elem **krows = (const pa_elem **)malloc(2 * (size_t)stride * sizeof(void *));
        const pa_elem **vrows = krows + stride;
        query_row rows[MAX_TILE_ROWS];
        /* Tiles in order (sequence, KV head, head tile, token tile), dealt out in contiguous
         * runs. */
        int first, last;
        thread_share(items, &first, &last);
        int s = 0, base = 0;
        while (s < num_seqs && base + seq_tiles(&tl, kv_heads, q_lens[s]) <= first)
            base += seq_tiles(&tl, kv_heads, q_lens[s++]);
        for (int item = first; item < last; item++) {
            while (item - base >= seq_tiles(&tl, kv_heads, q_lens[s]))
                base += seq_tiles(&tl, kv_heads, q_lens[s++]);
            const int token_tiles = (q_lens[s] + tl.tokens - 1) / tl.tokens;
            const int local = item - base, tt = local % token_tiles;
            const int ht = (local / token_tiles) % tl.head_tiles;
            const int g = local / token_tiles / tl.head_tiles;
            const int h0 = g * group + ht * tl.heads;
            const int h1 = h0 + tl.heads < (g + 1) * group ? h0 + tl.heads : (g + 1) * group;
            const int j0 = tt * tl.tokens;
            const int j1 = j0 + tl.tokens < q_lens[s] ? j0 + tl.tokens : q_lens[s];
            int nrows = 0;
            for (int j = j0; j < j1; j++) {
                const size_t token = (size_t)q_starts[s] + j;
                for (int h = h0; h < h1; h++) {
                    rows[nrows].q = q + token * q_stride + (size_t)h * head_dim;
                    rows[nrows].out = out + token * out_stride + (size_t)h * head_dim;
                    rows[nrows].visible = seq_lens[s] - q_lens[s] + j + 1;
                    nrows++;
                }
            }
            const cache_view c = {k_cache,    v_cache,  block_tables + (size_t)s * table_stride,
                                  block_size, kv_heads, head_dim};
            attend_tile(&c, g, rows, nrows, scale, scores, stride, krows, vrows);
        }
        free(krows);
        free(scores);
    }
}

#endif
