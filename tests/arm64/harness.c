/* Runs a script of calls into our kernels (kernels/csrc), built with them for any architecture:
 * tests/arm64/cross.py writes the script on x86, runs this program natively and, built for
 * AArch64, under qemu-user, and compares what the calls wrote.
 *
 *   harness SCRIPT OUTPUT
 *
 * SCRIPT (little-endian): u32 buffer count; per buffer u64 bytes, u8 has_data, the bytes when
 * has_data (else zeros); u32 call count; per call u16 name length, the name, u8 argument count,
 * per argument a kind byte: 'p' u32 buffer u64 offset (a pointer into a buffer), 'n' (NULL),
 * 'i' i64, 'f' f32; then u32 count and the buffers to write back. OUTPUT: each call's i64
 * result (0 for a void kernel), then the buffers asked for, one after another. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void outrider_linear_bf16(const void *, const void *, const void *, void *, int, int, int, int);
void outrider_linear_f32(const void *, const void *, const void *, void *, int, int, int, int);
void outrider_linear_packed(const void *, const void *, const void *, void *, int, int, int, int);
void outrider_pack_bf16(const void *, void *, int, int);
void outrider_rms_norm_bf16(const void *, const void *, const void *, float, void *, void *, int,
                            int, int);
void outrider_silu_mul_bf16(const void *, int, int, int, void *, int);
int outrider_rotary_kv_bf16(void *, int, int, int, int, int, const void *, const void *,
                            const void *, int64_t, const void *, int64_t, void *, void *, int);
void outrider_paged_attention_bf16(const void *, int, const void *, const void *, const void *,
                                   int, const void *, const void *, const void *, int, int, int,
                                   int, int, float, void *, int, int);
void outrider_paged_attention_f32(const void *, int, const void *, const void *, const void *,
                                  int, const void *, const void *, const void *, int, int, int,
                                  int, int, float, void *, int, int);
int outrider_linear_quant(const void *, int, const void *, const void *, const void *, int, int,
                          const void *, void *, int, int, int, int);
int outrider_linear_quant_after(int, const void *, const void *, const void *, float, void *,
                                const void *, const void *, const void *, int, int, const void *,
                                void *, int, int, int, int);
void outrider_quantize_rows(const void *, int, int, int, void *, void *, void *);

#define MAX_ARGS 24

typedef struct {
    void *p;
    int64_t i;
    float f;
} arg;

static FILE *in;

static void fail(const char *what) {
    fprintf(stderr, "harness: %s\n", what);
    exit(2);
}

static void take(void *to, size_t n) {
    if (n && fread(to, 1, n, in) != n) fail("the script ends early");
}

static uint64_t take_u(int bytes) {
    uint64_t v = 0;
    take(&v, (size_t)bytes);
    return v;
}

/* One call by name; returns its result (0 for a void kernel). */
static int64_t call(const char *name, const arg *a, int n) {
#define P(k) (a[k].p)
#define I(k) ((int)a[k].i)
#define L(k) (a[k].i)
#define F(k) (a[k].f)
#define NEEDS(count) \
    if (n != (count)) fail("wrong argument count")
    if (!strcmp(name, "outrider_linear_bf16")) {
        NEEDS(8);
        outrider_linear_bf16(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    } else if (!strcmp(name, "outrider_linear_f32")) {
        NEEDS(8);
        outrider_linear_f32(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    } else if (!strcmp(name, "outrider_linear_packed")) {
        NEEDS(8);
        outrider_linear_packed(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    } else if (!strcmp(name, "outrider_pack_bf16")) {
        NEEDS(4);
        outrider_pack_bf16(P(0), P(1), I(2), I(3));
    } else if (!strcmp(name, "outrider_rms_norm_bf16")) {
        NEEDS(9);
        outrider_rms_norm_bf16(P(0), P(1), P(2), F(3), P(4), P(5), I(6), I(7), I(8));
    } else if (!strcmp(name, "outrider_silu_mul_bf16")) {
        NEEDS(6);
        outrider_silu_mul_bf16(P(0), I(1), I(2), I(3), P(4), I(5));
    } else if (!strcmp(name, "outrider_rotary_kv_bf16")) {
        NEEDS(15);
        return outrider_rotary_kv_bf16(P(0), I(1), I(2), I(3), I(4), I(5), P(6), P(7), P(8), L(9),
                                       P(10), L(11), P(12), P(13), I(14));
    } else if (!strcmp(name, "outrider_paged_attention_bf16") ||
               !strcmp(name, "outrider_paged_attention_f32")) {
        NEEDS(18);
        (strcmp(name, "outrider_paged_attention_f32") ? outrider_paged_attention_bf16
                                                          : outrider_paged_attention_f32)(
            P(0), I(1), P(2), P(3), P(4), I(5), P(6), P(7), P(8), I(9), I(10), I(11), I(12),
            I(13), F(14), P(15), I(16), I(17));
    } else if (!strcmp(name, "outrider_linear_quant")) {
        NEEDS(13);
        return outrider_linear_quant(P(0), I(1), P(2), P(3), P(4), I(5), I(6), P(7), P(8), I(9),
                                     I(10), I(11), I(12));
    } else if (!strcmp(name, "outrider_linear_quant_after")) {
        NEEDS(17);
        return outrider_linear_quant_after(I(0), P(1), P(2), P(3), F(4), P(5), P(6), P(7), P(8),
                                           I(9), I(10), P(11), P(12), I(13), I(14), I(15), I(16));
    } else if (!strcmp(name, "outrider_quantize_rows")) {
        NEEDS(7);
        outrider_quantize_rows(P(0), I(1), I(2), I(3), P(4), P(5), P(6));
    } else {
        fprintf(stderr, "harness: no kernel %s\n", name);
        exit(2);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) fail("usage: harness SCRIPT OUTPUT");
    in = fopen(argv[1], "rb");
    if (!in) fail("cannot open the script");
    const uint32_t nbuf = (uint32_t)take_u(4);
    char **buf = calloc(nbuf ? nbuf : 1, sizeof *buf);
    uint64_t *size = calloc(nbuf ? nbuf : 1, sizeof *size);
    for (uint32_t b = 0; b < nbuf; b++) {
        size[b] = take_u(8);
        buf[b] = aligned_alloc(64, (size[b] + 63) / 64 * 64 + 64);
        if (!buf[b]) fail("out of memory");
        if (take_u(1))
            take(buf[b], size[b]);
        else
            memset(buf[b], 0, size[b]);
    }
    const uint32_t ncalls = (uint32_t)take_u(4);
    int64_t *results = calloc(ncalls ? ncalls : 1, sizeof *results);
    for (uint32_t c = 0; c < ncalls; c++) {
        char name[64] = {0};
        const uint16_t len = (uint16_t)take_u(2);
        if (len >= sizeof name) fail("a kernel name is too long");
        take(name, len);
        const int n = (int)take_u(1);
        if (n > MAX_ARGS) fail("too many arguments");
        arg a[MAX_ARGS];
        memset(a, 0, sizeof a);
        for (int k = 0; k < n; k++) {
            const int kind = (int)take_u(1);
            if (kind == 'p') {
                const uint32_t b = (uint32_t)take_u(4);
                const uint64_t offset = take_u(8);
                if (b >= nbuf || offset > size[b]) fail("a pointer outside the buffers");
                a[k].p = buf[b] + offset;
            } else if (kind == 'i') {
                a[k].i = (int64_t)take_u(8);
            } else if (kind == 'f') {
                take(&a[k].f, 4);
            } else if (kind != 'n') {
                fail("an unknown argument kind");
            }
        }
        results[c] = call(name, a, n);
    }
    FILE *out = fopen(argv[2], "wb");
    if (!out) fail("cannot write the output");
    fwrite(results, sizeof *results, ncalls, out);
    const uint32_t nout = (uint32_t)take_u(4);
    for (uint32_t k = 0; k < nout; k++) {
        const uint32_t b = (uint32_t)take_u(4);
        if (b >= nbuf) fail("an output outside the buffers");
        fwrite(buf[b], 1, size[b], out);
    }
    return fclose(out) == 0 ? 0 : 1;
}
