/* Causal attention of a few new tokens per sequence over a paged bf16 KV cache, read in place
 * (kernels/native.py builds this file; kernels/attention.py's NativeCpuAttention calls it for
 * decode and verification, where torch would first gather every block and then call SDPA).
 *
 * For each sequence and KV head, every new token of the sequence and every query head of the
 * group: scores over the token's visible keys (bf16 products summed in fp32, 16 keys at a time;
 * VDPBF16PS or its two-FMA stand-in, see simd.h),
 * an fp32 softmax, and the fp32 sum of the values weighted by it, rounded once to bf16. New
 * token j of a sequence with L context tokens and q new ones sits at position L - q + j and sees
 * keys 0..L - q + j. Each output depends only on its own query and keys, so a sequence's result
 * does not depend on its batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define MAX_HEAD_DIM 256

typedef struct {
    const uint16_t *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    const int32_t *block_table;        /* this sequence's row */
    int block_size, kv_heads, head_dim;
} cache_view;

/* Walks the rows of one KV head through a sequence's blocks, key after key. */
typedef struct {
    const cache_view *c;
    const uint16_t *cache;
    int block, slot, g;
} row_walk;

static inline row_walk walk_start(const cache_view *c, const uint16_t *cache, int g) {
    row_walk w = {c, cache, 0, 0, g};
    return w;
}

static inline const uint16_t *walk_next(row_walk *w) {
    const cache_view *c = w->c;
    const uint16_t *row =
        w->cache +
        (((size_t)c->block_table[w->block] * c->block_size + w->slot) * c->kv_heads + w->g) *
            c->head_dim;
    if (++w->slot == c->block_size) {
        w->slot = 0;
        w->block++;
    }
    return row;
}

/* One query head of one token over keys 0..n-1 of KV head g; `scores` holds n floats. */
static void attend_one(const cache_view *c, int g, const uint16_t *q, int n, float scale,
                       float *scores, uint16_t *out) {
    const int chunks = c->head_dim / 32;
    bf16x32 qv[MAX_HEAD_DIM / 32];
    for (int d = 0; d < chunks; d++) qv[d] = bf16x32_load(q + 32 * d, (__mmask32)~0u);
    /* Scores, 16 keys at a time; the lanes past n are never read. */
    __m512 running_max = _mm512_set1_ps(-INFINITY);
    row_walk keys = walk_start(c, c->k_cache, g);
    for (int t0 = 0; t0 < n; t0 += 16) {
        __m512 acc[16];
        const int m = n - t0 < 16 ? n - t0 : 16;
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_setzero_ps();
            if (i < m) {
                const uint16_t *k = walk_next(&keys);
                for (int d = 0; d < chunks; d++)
                    acc[i] = bf16x32_dot(acc[i], bf16x32_load(k + 32 * d, (__mmask32)~0u), qv[d]);
            }
        }
        const __mmask16 valid = (__mmask16)((1u << m) - 1u);
        const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + t0, valid, s);
        running_max = _mm512_mask_max_ps(running_max, valid, running_max, s);
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(running_max));
    __m512 total = _mm512_setzero_ps();
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int m = n - t0 < 16 ? n - t0 : 16;
        const __mmask16 valid = (__mmask16)((1u << m) - 1u);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + t0), max));
        _mm512_mask_storeu_ps(scores + t0, valid, e);
        total = _mm512_mask_add_ps(total, valid, total, e);
    }
    /* Values: a row of 32 bf16 splits into its even and odd elements as fp32 with one shift
     * and one mask, so the sums run on even and odd halves and are interleaved at the end. */
    __m512 even[MAX_HEAD_DIM / 32], odd[MAX_HEAD_DIM / 32];
    for (int d = 0; d < chunks; d++) even[d] = odd[d] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    row_walk values = walk_start(c, c->v_cache, g);
    for (int t = 0; t < n; t++) {
        const __m512 w = _mm512_set1_ps(scores[t]);
        const uint16_t *v = walk_next(&values);
        for (int d = 0; d < chunks; d++) {
            const __m512i raw = _mm512_loadu_si512(v + 32 * d);
            even[d] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), even[d]);
            odd[d] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_and_si512(raw, high)), odd[d]);
        }
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int d = 0; d < chunks; d++) {
        const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(even[d], lo_idx, odd[d]), inv);
        const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(even[d], hi_idx, odd[d]), inv);
        _mm512_storeu_si512(out + 32 * d, bf16_round32(lo, hi));
    }
}

/* q [tokens, num_heads, head_dim] with `q_stride` elements between tokens; out likewise with
 * `out_stride`. Sequence s owns new tokens q_starts[s] .. q_starts[s] + q_lens[s] - 1 and has
 * seq_lens[s] context tokens (the new ones included) in the blocks of row s of block_tables.
 * head_dim must be a multiple of 32 (at most 256), num_heads a multiple of kv_heads. The
 * (token, head) pairs are shared out between `threads` threads. */
void outrider_paged_attention_bf16(const uint16_t *q, int q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int32_t *block_tables,
                                   int table_stride, const int32_t *q_starts, const int32_t *q_lens,
                                   const int32_t *seq_lens, int num_seqs, int num_heads,
                                   int kv_heads, int head_dim, int block_size, float scale,
                                   uint16_t *out, int out_stride, int threads) {
    int longest = 1, items = 0;
    for (int s = 0; s < num_seqs; s++) {
        longest = seq_lens[s] > longest ? seq_lens[s] : longest;
        items += q_lens[s] * num_heads;
    }
    const int group = num_heads / kv_heads;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items;
#pragma omp parallel num_threads(threads)
    {
        float *scores =
            (float *)aligned_alloc(64, (((size_t)longest + 16) * sizeof(float) + 63) / 64 * 64);
        /* Items in order (sequence, new token, head), dealt out in contiguous runs. */
        int first, last;
        thread_share(items, &first, &last);
        int s = 0, base = 0;
        while (s < num_seqs && base + q_lens[s] * num_heads <= first)
            base += q_lens[s++] * num_heads;
        for (int item = first; item < last; item++) {
            while (item - base >= q_lens[s] * num_heads) base += q_lens[s++] * num_heads;
            const int j = (item - base) / num_heads, h = (item - base) % num_heads, g = h / group;
            const cache_view c = {k_cache,    v_cache,  block_tables + (size_t)s * table_stride,
                                  block_size, kv_heads, head_dim};
            const size_t token = (size_t)q_starts[s] + j;
            const int visible = seq_lens[s] - q_lens[s] + j + 1;
            attend_one(&c, g, q + token * q_stride + (size_t)h * head_dim, visible, scale, scores,
                       out + token * out_stride + (size_t)h * head_dim);
        }
        free(scores);
    }
}
