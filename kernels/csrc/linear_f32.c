/* The projection kernel of linear_bf16.c in fp32 (rows, weight, bias and output), for
 * kernels/linear.py's fp32 rows: each output one fp32 sum in a fixed order, so a row's result
 * does not depend on its batch, its draft or its prompt's chunks (torch's fp32 GEMM blocks by
 * the number of rows, and one row takes a GEMV that sums in another order again). */
#define LR_F32
#include "linear_rows.h"
