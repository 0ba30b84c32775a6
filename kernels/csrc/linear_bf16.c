/* y = x W^T (+ b) for bf16 rows on an AVX512 CPU (kernels/native.py builds this file and
 * kernels/linear.py calls it).
 *
 * Decode multiplies one row (verification a few) by every weight of the model, so its cost is
 * streaming the weights from memory. kernels/linear.py sends rows here when the weight is not
 * packed for the AMX kernel (linear_amx.c): up to NATIVE_MAX_ROWS on an AVX512-BF16 CPU, any
 * number where the CPU has AVX512F alone and torch's bf16 GEMM is slower still. The loop below
 * takes the rows ROW_TILE at a time and, for each tile, reads each weight once: a block of four
 * weight rows is streamed (with the next block prefetched) and dotted with every row of the
 * tile while it sits in L1. Products and sums are fp32 (VDPBF16PS, or two FMAs without it: see
 * simd.h), each output rounded once to bf16 (round to nearest even).
 *
 * Each output element is the same computation whatever the number of rows, threads or its
 * place in a block: 16 fp32 lanes accumulate the 32-element chunks of the dot product in order
 * and are then summed in a fixed tree. So a row's result does not depend on what else is in the
 * batch (tests/unit/test_native_kernels.py checks it bit for bit). The body is linear_rows.h's,
 * shared with the fp32 build (linear_f32.c).
 */
#include "linear_rows.h"
