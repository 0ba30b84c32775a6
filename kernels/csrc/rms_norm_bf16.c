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
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

static void norm_row(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, float eps,
                     uint16_t *out, uint16_t *sum_out, int dim) {
    const int chunks = (dim + 15) / 16;
    const lanes16 all = lanes16_first(16), tail = lanes16_first(dim % 16 ? dim % 16 : 16);
    const uint16_t *s = x;
    if (residual) {
        for (int c = 0; c < chunks; c++) {
            const lanes16 m = c == chunks - 1 ? tail : all;
            const f32x16 v =
                f32x16_add(f32x16_load_bf16(x + 16 * c, m), f32x16_load_bf16(residual + 16 * c, m));
            f32x16_store_bf16(sum_out + 16 * c, v, m);
        }
        s = sum_out;
    }
    f32x16 squares = f32x16_zero();
    for (int c = 0; c < chunks; c++) {
        const lanes16 m = c == chunks - 1 ? tail : all;
        const f32x16 v = f32x16_load_bf16(s + 16 * c, m);
        squares = f32x16_fma(v, v, squares);
    }
    const float scale = 1.0f / sqrtf(f32x16_sum(squares) / (float)dim + eps);
    const f32x16 k = f32x16_set1(scale);
    for (int c = 0; c < chunks; c++) {
        const lanes16 m = c == chunks - 1 ? tail : all;
        const f32x16 v = f32x16_mul(f32x16_mul(f32x16_load_bf16(s + 16 * c, m), k),
                                    f32x16_load_bf16(weight + 16 * c, m));
        f32x16_store_bf16(out + 16 * c, v, m);
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
