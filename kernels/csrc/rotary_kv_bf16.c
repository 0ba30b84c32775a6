/* Rotary embedding of Q and K in place, and the K/V cache write, in one call per layer
 * (kernels/native.py builds this file; kernels/rotary.py's rotate_and_store calls it).
 *
 * A layer's fused QKV projection gives each token a row [q heads | k heads | v heads]. torch
 * turns that into a dozen small ops a layer (gather the angles, cast, negate, concatenate,
 * multiply, add, split, two index copies), ~30 us for one token: as much as a tenth of a
 * one-token forward of the bundled model. Here each Q and K head of a token is rotated in the
 * Hugging Face ("neox", rotate-half) layout, in fp32 from the fp32 angle tables, rounded once
 * to bf16 and written back into the row; the token's rotated K heads and its V heads are then
 * copied into its cache slot. Tokens are independent, so a token's result does not depend on
 * its batch.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* x[i] cos[i] - x[i + half] sin[i] and x[i + half] cos[i + half] + x[i] sin[i + half], for one
 * head of head_dim elements (half a multiple of 16). */
static void rotate_head(uint16_t *x, const float *cos, const float *sin, int head_dim) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i += 16) {
        const lanes16 all = lanes16_first(16);
        const f32x16 lo = f32x16_load_bf16(x + i, all);
        const f32x16 hi = f32x16_load_bf16(x + half + i, all);
        const f32x16 new_lo = f32x16_fnma(hi, f32x16_load(sin + i),
                                          f32x16_mul(lo, f32x16_load(cos + i)));
        const f32x16 new_hi = f32x16_fma(lo, f32x16_load(sin + half + i),
                                         f32x16_mul(hi, f32x16_load(cos + half + i)));
        f32x16_store_bf16(x + i, new_lo, all);
        f32x16_store_bf16(x + half + i, new_hi, all);
    }
}

/* qkv: [tokens] rows `qkv_stride` elements apart, each [num_heads + 2 kv_heads, head_dim] bf16;
 * cos, sin: [table_rows, head_dim] fp32; positions, slots: [tokens]; k_cache, v_cache:
 * [num_slots, kv_heads, head_dim] bf16 (the blocks' slots one after another). head_dim must be
 * a multiple of 32. Returns 0, or without writing anything 1 where a position is outside the
 * tables and 2 where a slot is outside the cache. */
int outrider_rotary_kv_bf16(uint16_t *qkv, int qkv_stride, int tokens, int num_heads, int kv_heads,
                            int head_dim, const int64_t *positions, const float *cos,
                            const float *sin, int64_t table_rows, const int64_t *slots,
                            int64_t num_slots, uint16_t *k_cache, uint16_t *v_cache, int threads) {
    for (int t = 0; t < tokens; t++) {
        if (positions[t] < 0 || positions[t] >= table_rows) return 1;
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
    }
    const size_t kv_row = (size_t)kv_heads * head_dim;
    if (threads < 1 || tokens < 64) threads = 1; /* a few tokens: not worth waking a thread */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tokens; t++) {
        uint16_t *row = qkv + (size_t)t * qkv_stride;
        const float *c = cos + (size_t)positions[t] * head_dim;
        const float *s = sin + (size_t)positions[t] * head_dim;
        for (int h = 0; h < num_heads + kv_heads; h++)
            rotate_head(row + (size_t)h * head_dim, c, s, head_dim);
        const size_t slot = (size_t)slots[t] * kv_row;
        memcpy(k_cache + slot, row + (size_t)num_heads * head_dim, kv_row * sizeof(uint16_t));
        memcpy(v_cache + slot, row + (size_t)(num_heads + kv_heads) * head_dim,
               kv_row * sizeof(uint16_t));
    }
    return 0;
}
