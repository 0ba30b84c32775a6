/* Rows of a weight kept in GGUF's quantized blocks, dequantized to fp32: an embedding lookup
 * (kernels/quant.py `QuantizedWeight.rows`). The layout is linear_quant.c's (panels of 16
 * outputs; a panel's block of 32 input features is eight vectors v of four features 4v..4v+3 of
 * each output; 4-bit codes hold vectors v and v + 4 as low and high nibbles, 5-bit codes add a
 * 64-bit mask of fifth bits per vector; scales and minimums [panel][block][16] fp16).
 *
 * Each value is w = d u + m, the product rounded to fp32 and then the sum, as the torch
 * reference computes it (`_dequantize_rows`): the same bits, so the function is compiled without
 * fused multiply-adds. One call replaces the reference's twenty-odd torch ops (a decode step's
 * lookup of one row took ~80 us of Python and op dispatch).
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define PANEL 16

/* IEEE half to float, exactly (every half is a float). */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (!mantissa) {
        bits = sign; /* zero */
    } else { /* subnormal: normalise it */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 32 unsigned codes of output j of one block (block bytes at `b`), features in order. */
static void block_codes(const uint8_t *b, int bits, int j, uint8_t u[BLOCK]) {
    for (int v = 0; v < 8; v++) {
        for (int i = 0; i < 4; i++) {
            const int feature = 4 * v + i;
            if (bits == 8) {
                u[feature] = b[64 * v + 4 * j + i];
                continue;
            }
            const uint8_t pair = b[64 * (v & 3) + 4 * j + i];
            uint8_t code = v < 4 ? pair & 0x0f : pair >> 4;
            if (bits == 5) {
                const int bit = 4 * j + i; /* of mask v: eight bytes, least significant first */
                code |= (uint8_t)(((b[256 + 8 * v + bit / 8] >> (bit % 8)) & 1) << 4);
            }
            u[feature] = code;
        }
    }
}

/* out [n][in] fp32: rows ids[0..n) (each 0 <= id < the weight's outputs: the caller checks) of
 * the weight `codes`/`scales`/`mins` (mins NULL: m = min_per_scale d). */
__attribute__((optimize("fp-contract=off"))) void outrider_quant_rows(
    const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int min_per_scale,
    int bits, int in, const int64_t *ids, int n, float *out) {
    const int blocks = in / BLOCK;
    const size_t block_bytes = bits == 8 ? 512 : bits == 5 ? 320 : 256;
    for (int r = 0; r < n; r++) {
        const int64_t id = ids[r];
        const int64_t panel = id / PANEL;
        const int j = (int)(id % PANEL);
        const uint8_t *panel_codes = codes + (size_t)panel * blocks * block_bytes;
        const size_t panel_scales = (size_t)panel * blocks * PANEL;
        float *row = out + (size_t)r * in;
        for (int blk = 0; blk < blocks; blk++) {
            uint8_t u[BLOCK];
            block_codes(panel_codes + blk * block_bytes, bits, j, u);
            const size_t at = panel_scales + (size_t)blk * PANEL + j;
            const float d = half_to_float(scales[at]);
            const float m = mins ? half_to_float(mins[at]) : d * (float)min_per_scale;
            for (int k = 0; k < BLOCK; k++) {
                const float scaled = (float)u[k] * d;
                row[blk * BLOCK + k] = scaled + m;
            }
        }
    }
}
