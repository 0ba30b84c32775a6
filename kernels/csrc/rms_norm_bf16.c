/* RMSNorm of bf16 rows, optionally after adding a residual (kernels/native.py builds this file
 * and workers/model/transformer.py calls it through kernels.native.rms_norm_bf16).
 *
 *   s = x + residual (rounded to bf16, as torch's bf16 add does; s = x without a residual)
 *   y = s / sqrt(mean(s^2) + eps) * weight (in fp32, rounded once to bf16)
 *
 * torch runs this as half a dozen ops of a few microseconds each, on a [1, hidden] row as on a
 * prefill chunk; twice a layer, that was ~10% of a decode forward of the bundled model. Rows are
 * independent and each is summed in the same order whatever the batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

static void norm_row(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, float eps,
                     uint16_t *out, uint16_t *sum_out, int dim) {
    const int chunks = (dim + 15) / 16;
    const __mmask16 tail = (dim % 16) ? (__mmask16)((1u << (dim % 16)) - 1u) : (__mmask16)0xffff;
    const uint16_t *s = x;
    if (residual) {
        for (int c = 0; c < chunks; c++) {
            const __mmask16 m = c == chunks - 1 ? tail : (__mmask16)0xffff;
            const __m512 v =
                _mm512_add_ps(load_bf16x16(x + 16 * c, m), load_bf16x16(residual + 16 * c, m));
            store_bf16x16(sum_out + 16 * c, v, m);
        }
        s = sum_out;
    }
    __m512 squares = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const __mmask16 m = c == chunks - 1 ? tail : (__mmask16)0xffff;
        const __m512 v = load_bf16x16(s + 16 * c, m);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps);
    const __m512 k = _mm512_set1_ps(scale);
    for (int c = 0; c < chunks; c++) {
        const __mmask16 m = c == chunks - 1 ? tail : (__mmask16)0xffff;
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load_bf16x16(s + 16 * c, m), k),
                                       load_bf16x16(weight + 16 * c, m));
        store_bf16x16(out + 16 * c, v, m);
    }
}

/* x, residual (or NULL), out, sum_out (or NULL): [rows, dim]; weight: [dim]; all bf16. */
void outrider_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                            float eps, uint16_t *out, uint16_t *sum_out, int rows, int dim,
                            int threads) {
    if (threads < 1 || rows < 64) threads = 1; /* a few rows: not worth waking a thread */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const size_t at = (size_t)r * dim;
        norm_row(x + at, residual ? residual + at : NULL, weight, eps, out + at,
                 sum_out ? sum_out + at : NULL, dim);
    }
}
