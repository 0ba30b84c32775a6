/* y = x W^T (+ b) in bf16 on AMX tiles (kernels/native.py builds this file; kernels/linear.py
 * calls it for up to AMX_MAX_ROWS rows of a weight packed by `outrider_pack_bf16`).
 *
 * One TDPBF16PS multiplies a tile of up to 16 input rows by 32 input features against 16 output
 * features, in fp32. The weight is re-laid once, at load, in the order the tiles read it (VNNI:
 * for each block of 16 outputs and each 32-feature chunk, 1 KB of feature pairs), so a forward
 * streams it sequentially. Up to 16 rows cost what one row costs: decode and verifying k <= 15
 * drafts are the same price (bench_forward measures it), where AVX512 dot products (linear_bf16.c)
 * grow by ~15% a row.
 *
 * Each output is the same computation whatever the number of rows or threads (a tile row's
 * sums do not see the other rows), so a sequence's projections do not depend on its batch.
 * Needs in % 32 == 0; outputs are padded to a multiple of 16 in the packed weight.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ELEMS 512 /* bf16 in one packed 16 x 32 weight tile */

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* w [out, in] -> packed [ceil(out / 16)][in / 32][16 feature pairs][16 outputs][2]. */
void outrider_pack_bf16(const uint16_t *w, uint16_t *packed, int out, int in) {
    const int chunks = in / 32, blocks = (out + 15) / 16;
    for (int nb = 0; nb < blocks; nb++)
        for (int kc = 0; kc < chunks; kc++) {
            uint16_t *tile = packed + ((size_t)nb * chunks + kc) * TILE_ELEMS;
            for (int pair = 0; pair < 16; pair++)
                for (int n = 0; n < 16; n++) {
                    const int o = nb * 16 + n;
                    const size_t at = (size_t)o * in + (size_t)kc * 32 + 2 * pair;
                    tile[pair * 32 + 2 * n] = o < out ? w[at] : 0;
                    tile[pair * 32 + 2 * n + 1] = o < out ? w[at + 1] : 0;
                }
        }
}

#ifdef __AMX_TILE__
/* Linux hands out the AMX register state only to processes that ask; 0 when granted. */
int outrider_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

/* fp32 tile rows (+ bias) -> bf16 outputs [n0, n0 + width) of `rows` rows. */
static void emit(const float *c, int ldc, const uint16_t *bias, uint16_t *y, int out, int rows,
                 int n0, int width) {
    const __mmask16 m = (__mmask16)((1u << width) - 1u);
    const __m512 b = bias ? f32x16_load_bf16(bias + n0, m) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc), b);
        f32x16_store_bf16(y + (size_t)r * out + n0, v, m);
    }
}

/* Tiles: 0-3 accumulate (rows 0-15 | 16-31) x (weight block 0 | 1), 4-5 hold x's rows 0-15 and
 * 16-31, 6-7 the two weight blocks. `low` and `high` rows (high may be 0). */
static void configure(int low, int high) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int rows[8] = {low, low, high, high, low, high, 16, 16};
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = (uint8_t)rows[i];
        cfg.colsb[i] = rows[i] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* x [rows, in] bf16, packed from outrider_pack_bf16, bias [out] or NULL, y [rows, out] bf16.
 * Threads take whole pairs of 16-output blocks; rows go 32 at a time, so that each weight tile
 * loaded serves two tiles of rows (a forward of 17-32 tokens reads the weights once too). */
void outrider_linear_amx(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *y, int rows, int in, int out, int threads) {
    const int chunks = in / 32, blocks = (out + 15) / 16, pairs = (blocks + 1) / 2;
    if (threads < 1) threads = 1;
    if (threads > pairs) threads = pairs;
#pragma omp parallel num_threads(threads)
    {
        int p0, p1;
        thread_share(pairs, &p0, &p1);
        float sums[32 * 32];
        for (int m0 = 0; m0 < rows; m0 += 32) {
            const int mr = rows - m0 < 32 ? rows - m0 : 32;
            const int low = mr < 16 ? mr : 16, high = mr - low;
            configure(low, high);
            const uint16_t *xm = x + (size_t)m0 * in;
            uint16_t *ym = y + (size_t)m0 * out;
            for (int p = p0; p < p1; p++) {
                const int nb = 2 * p, both = nb + 1 < blocks;
                const uint16_t *w0 = packed + (size_t)nb * chunks * TILE_ELEMS;
                const uint16_t *w1 = w0 + (size_t)chunks * TILE_ELEMS;
                _tile_zero(0);
                _tile_zero(1);
                if (high) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int kc = 0; kc < chunks; kc++) {
                    _tile_loadd(4, xm + kc * 32, in * 2);
                    if (high) _tile_loadd(5, xm + (size_t)16 * in + kc * 32, in * 2);
                    _tile_loadd(6, w0 + (size_t)kc * TILE_ELEMS, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (high) _tile_dpbf16ps(2, 5, 6);
                    if (both) {
                        _tile_loadd(7, w1 + (size_t)kc * TILE_ELEMS, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        if (high) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums, 128);
                _tile_stored(1, sums + 16, 128);
                if (high) {
                    _tile_stored(2, sums + 16 * 32, 128);
                    _tile_stored(3, sums + 16 * 32 + 16, 128);
                }
                const int n0 = nb * 16;
                emit(sums, 32, bias, ym, out, mr, n0, out - n0 < 16 ? out - n0 : 16);
                if (both)
                    emit(sums + 16, 32, bias, ym, out, mr, n0 + 16,
                         out - n0 - 16 < 16 ? out - n0 - 16 : 16);
            }
        }
        _tile_release();
    }
}
#else
/* The build for CPUs without AMX (see simd.h): kernels/native.py never calls the kernel. */
int outrider_amx_init(void) {
    return -1;
}

void outrider_linear_amx(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *y, int rows, int in, int out, int threads) {
    (void)x, (void)packed, (void)bias, (void)y, (void)rows, (void)in, (void)out, (void)threads;
    abort();
}
#endif
