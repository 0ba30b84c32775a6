/* One decoder layer of a Llama-style model (quantized projections, bf16 rows, our paged
 * attention) in one call: the six kernels the model's Python calls one after another for a
 * layer (workers/model/transformer.py DecoderLayer), called here in the same order with the
 * same arguments, so the bits are those of the six calls. What it saves is the Python around
 * them: at one sequence's decode step, half a step's time on two cores went to the interpreter,
 * torch and ctypes between kernels (workers/model/native_layers.py calls this). */
#include <stddef.h>
#include <stdint.h>

int outrider_linear_quant(const void *x, int x_f32, const uint8_t *codes, const uint16_t *scales,
                          const uint16_t *mins, int min_per_scale, int bits, const void *bias,
                          void *y, int rows, int in, int out, int threads);
int outrider_linear_quant_after(int prologue, const uint16_t *a, const uint16_t *residual,
                                const uint16_t *norm_weight, float eps, uint16_t *sum_out,
                                const uint8_t *codes, const uint16_t *scales,
                                const uint16_t *mins, int min_per_scale, int bits,
                                const void *bias, void *y, int rows, int in, int out,
                                int threads);
int outrider_rotary_kv_bf16(uint16_t *qkv, int qkv_stride, int tokens, int num_heads, int kv_heads,
                            int head_dim, const int64_t *positions, const float *cos,
                            const float *sin, int64_t table_rows, const int64_t *slots,
                            int64_t num_slots, uint16_t *k_cache, uint16_t *v_cache, int threads);
void outrider_paged_attention_bf16(const uint16_t *q, int q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int32_t *block_tables,
                                   int table_stride, const int32_t *q_starts,
                                   const int32_t *q_lens, const int32_t *seq_lens, int num_seqs,
                                   int num_heads, int kv_heads, int head_dim, int block_size,
                                   float scale, uint16_t *out, int out_stride, int threads);

/* A quantized projection as outrider_linear_quant takes it (kernels/native_quant.py
 * QuantKernelArgs), with its bf16 bias or NULL. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    const uint16_t *mins;
    const uint16_t *bias;
    int min_per_scale, bits, in, out;
} od_projection;

/* What a layer holds: its projections, its two norms' weights, its attention's shape. */
typedef struct {
    od_projection qkv, o, gate_up, down;
    const uint16_t *input_norm, *post_norm;
    float eps, scale;
    int num_heads, kv_heads, head_dim;
} od_layer;

/* What every layer of one forward shares: the rows' positions and cache slots, the sequences'
 * block tables (NativeCpuAttention's plan), and scratch rows for the layer's intermediates. */
typedef struct {
    int rows, threads, num_seqs, table_stride, block_size;
    int64_t table_rows, num_slots;
    const int64_t *positions, *slots;
    const float *cos, *sin;
    const int32_t *block_tables, *q_starts, *q_lens, *seq_lens;
    uint16_t *stream;  /* [rows, hidden]: h + residual before the attention */
    uint16_t *qkv;     /* [rows, qkv.out] */
    uint16_t *attn;    /* [rows, num_heads * head_dim] */
    uint16_t *attn_o;  /* [rows, hidden] */
    uint16_t *gate_up; /* [rows, gate_up.out] */
} od_forward;

static int project(const od_projection *p, const od_forward *f, const uint16_t *x, uint16_t *y) {
    return outrider_linear_quant(x, 0, p->codes, p->scales, p->mins, p->min_per_scale, p->bits,
                                 p->bias, y, f->rows, p->in, p->out, f->threads);
}

static int project_after(int prologue, const od_projection *p, const od_forward *f,
                         const uint16_t *a, const uint16_t *residual, const uint16_t *norm,
                         float eps, uint16_t *sum_out, uint16_t *y) {
    return outrider_linear_quant_after(prologue, a, residual, norm, eps, sum_out, p->codes,
                                       p->scales, p->mins, p->min_per_scale, p->bits, p->bias, y,
                                       f->rows, p->in, p->out, f->threads);
}

/* h [rows, hidden] is the last layer's MLP output, residual the stream before it (NULL at the
 * first layer, where the stream is h). Writes this layer's MLP output over h and its stream
 * before the MLP over residual (into residual_out at the first layer), as DecoderLayer.forward
 * returns them. Returns 0; 1 where scratch was not had; 2 where a position or a slot is outside
 * the rotary tables or the cache (nothing of the layer is then written but the norm's sum). */
int outrider_decoder_layer(const od_layer *l, const od_forward *f, uint16_t *k_cache,
                           uint16_t *v_cache, uint16_t *h, uint16_t *residual,
                           uint16_t *residual_out) {
    const uint16_t *stream = residual ? f->stream : h;
    if (project_after(1, &l->qkv, f, h, residual, l->input_norm, l->eps, residual ? f->stream : NULL,
                      f->qkv))
        return 1;
    if (outrider_rotary_kv_bf16(f->qkv, l->qkv.out, f->rows, l->num_heads, l->kv_heads,
                                l->head_dim, f->positions, f->cos, f->sin, f->table_rows, f->slots,
                                f->num_slots, k_cache, v_cache, f->threads))
        return 2;
    const int q_size = l->num_heads * l->head_dim;
    outrider_paged_attention_bf16(f->qkv, l->qkv.out, k_cache, v_cache, f->block_tables,
                                  f->table_stride, f->q_starts, f->q_lens, f->seq_lens,
                                  f->num_seqs, l->num_heads, l->kv_heads, l->head_dim,
                                  f->block_size, l->scale, f->attn, q_size, f->threads);
    if (project(&l->o, f, f->attn, f->attn_o)) return 1;
    uint16_t *sum = residual ? residual : residual_out;
    if (project_after(1, &l->gate_up, f, f->attn_o, stream, l->post_norm, l->eps, sum,
                      f->gate_up))
        return 1;
    return project_after(2, &l->down, f, f->gate_up, NULL, NULL, 0.0f, NULL, h);
}
