/* SwiGLU's silu(gate) * up in one call (kernels/native.py builds this file; kernels/activation.py
 * calls it). torch runs it as a split, a silu and a multiply, each rounding to bf16; here each
 * element is computed in fp32 and rounded once. Rows are independent.
 */
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

/* silu(gate) * up of rows [gate | up] (`inter` bf16 each, rows `in_stride` elements apart) into
 * out [rows, inter], in fp32, rounded once to bf16. silu(g) = g sigmoid(g), with the sigmoid
 * from e^-|g| so that the exponential never overflows. */
void outrider_silu_mul_bf16(const uint16_t *gate_up, int in_stride, int rows, int inter,
                            uint16_t *out, int threads) {
    if (threads < 1 || rows < 64) threads = 1;
    const int chunks = (inter + 15) / 16;
    const lanes16 all = lanes16_first(16), tail = lanes16_first(inter % 16 ? inter % 16 : 16);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (size_t)r * in_stride, *up = gate + inter;
        uint16_t *o = out + (size_t)r * inter;
        for (int c = 0; c < chunks; c++) {
            const lanes16 m = c == chunks - 1 ? tail : all;
            const f32x16 g = f32x16_load_bf16(gate + 16 * c, m);
            const f32x16 e = exp_ps(f32x16_sub(f32x16_zero(), f32x16_abs(g)));
            const f32x16 one = f32x16_set1(1.0f);
            /* sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below */
            const f32x16 numerator = f32x16_where_negative(g, e, one);
            const f32x16 sigmoid = f32x16_div(numerator, f32x16_add(one, e));
            const f32x16 y = f32x16_mul(f32x16_mul(g, sigmoid), f32x16_load_bf16(up + 16 * c, m));
            f32x16_store_bf16(o + 16 * c, y, m);
        }
    }
}
