/* SwiGLU's silu(gate) * up in one call (kernels/native.py builds this file; kernels/activation.py
 * calls it). torch runs it as a split, a silu and a multiply, each rounding to bf16; here each
 * element is computed in fp32 and rounded once. Rows are independent.
 */
#include <immintrin.h>
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
    const __mmask16 tail =
        (inter % 16) ? (__mmask16)((1u << (inter % 16)) - 1u) : (__mmask16)0xffff;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (size_t)r * in_stride, *up = gate + inter;
        uint16_t *o = out + (size_t)r * inter;
        for (int c = 0; c < chunks; c++) {
            const __mmask16 m = c == chunks - 1 ? tail : (__mmask16)0xffff;
            const __m512 g = load_bf16x16(gate + 16 * c, m);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            const __m512 one = _mm512_set1_ps(1.0f);
            /* sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below */
            const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
            const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), load_bf16x16(up + 16 * c, m));
            store_bf16x16(o + 16 * c, y, m);
        }
    }
}
