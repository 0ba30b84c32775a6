/* The paged attention kernel of paged_attention_bf16.c in fp32 (queries, cache and output), for
 * kernels/attention.py's NativeCpuAttention in fp32: each token's attention from its own query
 * and keys alone, so an fp32 token's result does not depend on its batch, its draft or its
 * prompt's chunks either (torch's SDPA reduces in an order that does). */
#define PA_F32
#include "paged_attention.h"
