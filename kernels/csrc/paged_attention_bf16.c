/* Causal attention of each sequence's new tokens over a paged bf16 KV cache, read in place
 * (kernels/native.py builds this file; kernels/attention.py's NativeCpuAttention calls it for
 * every forward, where torch would first gather every block and then call SDPA). The body is
 * paged_attention.h's, shared with the fp32 build (paged_attention_f32.c).
 *
 * For each new token of a sequence and each query head: scores over the token's visible keys
 * (bf16 products summed in fp32, 16 keys at a time; VDPBF16PS or its two-FMA stand-in, see
 * simd.h), an fp32 softmax, and the fp32 sum of the values weighted by it, rounded once to
 * bf16. New token j of a sequence with L context tokens and q new ones sits at position
 * L - q + j and sees keys 0..L - q + j. The query heads of one KV head and a sequence's new
 * tokens are taken together in tiles that share each key and value they load: one token's
 * rows alone would stream the head's keys and values from L2 (at 16 new tokens attention cost
 * ~4x its one-token time that way). Each output depends only on its own query and keys, and is
 * computed the same way whatever its tile, so a sequence's result does not depend on its batch.
 */
#include "paged_attention.h"
