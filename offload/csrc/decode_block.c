/*
 * One decoder block's batch-1 decode step in one call (offload/models/decode_step.py): the
 * Llama block with int8 / int4 projections, computed in float32 on the calling thread.
 *
 * Why: a batch-1 decode step of SmolLM2-135M spent about half its time outside the projection
 * kernels -- some 60 torch ops per block (norms, reshapes, RoPE's chunks and concatenations,
 * the cache writes and slices, SDPA's dispatch, the SwiGLU), each a few microseconds of
 * dispatch for a few hundred floats of work. Here the block is one ctypes call:
 *
 *   x = rmsnorm(h) * ln1;  q, k, v = x Wq^T, x Wk^T, x Wv^T
 *   q, k rotated (pairs (i, i + D/2), cos/sin of this position); k, v written at `pos`
 *   per head: softmax(q . K[0..pos] * scale) . V[0..pos]  (its group's kv head)
 *   h += attn Wo^T;  x = rmsnorm(h) * ln2;  h += (silu(x Wg^T) * x Wu^T) Wd^T
 *
 * The projections are quant_gemv.c's one-row loops (with int8 activations, quant_a8.c's, which
 * quant_gemv.c includes; included below, so they are the same
 * code the unfused path runs, bit for bit: the same x gives the same y); the rest follows
 * RMSNorm / apply_rotary / SDPA / F.silu in llama.py, to float rounding (sums reassociated
 * and vectorised, exp from libm). Shapes the Python side has not checked are refused (1).
 */
#include "quant_gemv.c"

#include <math.h>

typedef struct {
    const void *qweight;     /* int8 [out, padded_in] or packed int4 [out, padded_in / 2] */
    const uint16_t *scales;  /* fp16 bits [out, groups] */
    const uint16_t *mins;    /* int4: fp16 bits [out, groups]; int8: unused */
    int64_t bits, out_f, in_f, padded_in, gsize;
    int64_t act_bits;        /* 8: x quantized per 32 columns where quant_a8.c takes it; 32: as given */
} proj_t;

typedef struct {
    proj_t q, k, v, o, gate, up, down;
    const float *ln1, *ln2;       /* [hidden] */
    const float *cos, *sin;       /* [head_dim] for this position */
    float *k_cache, *v_cache;     /* [kv_heads, max_len, head_dim], this layer's, batch 1 */
    float *hidden;                /* [hidden], updated in place */
    float *scratch;               /* decode_step.scratch_floats(...) floats */
    int64_t hidden_size, inter, heads, kv_heads, head_dim, max_len, pos;
    double eps, scale;            /* every field 8 bytes: decode_step.run fills an int64 array */
} block_t;

/* y[0, out_f) = x[0, in_f) W^T; xpad holds x padded with zeros to padded_in */
static int project(const proj_t *p, const float *x, float *xpad, float *y)
{
    const float *xin = x;
    if (p->padded_in != p->in_f) {
        memcpy(xpad, x, (size_t)p->in_f * sizeof(float));
        memset(xpad + p->in_f, 0, (size_t)(p->padded_in - p->in_f) * sizeof(float));
        xin = xpad;
    }
    /* the same choice as the unfused path (quant/cpu.py asks offload_a8_taken too) */
    if (p->act_bits == 8 && a8_taken((int)p->bits, p->padded_in, p->gsize))
        return a8_product((int)p->bits, (const uint8_t *)p->qweight, p->scales, p->mins, xin, y, 1,
                          p->out_f, p->padded_in, p->gsize, 0, p->out_f);
    if (p->bits == 8) {
        q8_one_row((const int8_t *)p->qweight, p->scales, xin, y, p->padded_in, p->gsize, 0, p->out_f);
        return 0;
    }
    return offload_q4_row_natural((const uint8_t *)p->qweight, p->scales, p->mins, xin, y, 1,
                                  p->out_f, p->padded_in, p->gsize, 0, p->out_f);
}

/* One projection as the block runs it (decode_step.py's self-check holds it to the same math) */
int offload_block_project(const proj_t *p, const float *x, float *xpad, float *y)
{
    return project(p, x, xpad, y);
}

/* out = w * (h * rsqrt(mean(h^2) + eps)), as RMSNorm's "llama" style in fp32 */
static void rms_norm(const float *h, const float *w, float *out, int64_t n, float eps)
{
    float ss = 0.0f;
    for (int64_t j = 0; j < n; j++) ss += h[j] * h[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = w[j] * (h[j] * r);
}

/* x [heads][D] rotated in place: x * cos + cat(-x2, x1) * sin */
static void rotate(float *x, const float *cos, const float *sin, int64_t heads, int64_t d)
{
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++, x += d)
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cos[i] - x2 * sin[i];
            x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
        }
}

/* out [heads][D]: each head's softmax-weighted sum over positions 0..pos of its kv head */
static void attend(const block_t *b, const float *q, float *out, float *scores)
{
    const int64_t d = b->head_dim, n = b->pos + 1, group = b->heads / b->kv_heads;
    for (int64_t h = 0; h < b->heads; h++) {
        const float *qh = q + h * d;
        const float *kh = b->k_cache + (h / group) * b->max_len * d;
        const float *vh = b->v_cache + (h / group) * b->max_len * d;
        float top = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < n; s++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += qh[i] * kh[s * d + i];
            scores[s] = dot * (float)b->scale;
            top = scores[s] > top ? scores[s] : top;
        }
        for (int64_t s = 0; s < n; s++) {
            scores[s] = expf(scores[s] - top);
            total += scores[s];
        }
        float *oh = out + h * d;
        for (int64_t i = 0; i < d; i++) oh[i] = 0.0f;
        for (int64_t s = 0; s < n; s++) {
            const float p = scores[s] / total;
            for (int64_t i = 0; i < d; i++) oh[i] += p * vh[s * d + i];
        }
    }
}

int offload_decode_block(const block_t *b)
{
    const int64_t hs = b->hidden_size, d = b->head_dim, qs = b->heads * d, kvs = b->kv_heads * d;
    if (b->pos < 0 || b->pos >= b->max_len || d % 2 || b->heads % b->kv_heads) return 1;
    /* scratch: x | q | k | v | attn | gate | up | scores | xpad (decode_step.scratch_floats) */
    float *x = b->scratch, *q = x + hs, *k = q + qs, *v = k + kvs, *attn = v + kvs;
    float *gate = attn + qs, *up = gate + b->inter, *scores = up + b->inter, *xpad = scores + b->max_len;
    rms_norm(b->hidden, b->ln1, x, hs, (float)b->eps);
    if (project(&b->q, x, xpad, q) || project(&b->k, x, xpad, k) || project(&b->v, x, xpad, v))
        return 1;
    rotate(q, b->cos, b->sin, b->heads, d);
    rotate(k, b->cos, b->sin, b->kv_heads, d);
    for (int64_t h = 0; h < b->kv_heads; h++) {
        memcpy(b->k_cache + (h * b->max_len + b->pos) * d, k + h * d, (size_t)d * sizeof(float));
        memcpy(b->v_cache + (h * b->max_len + b->pos) * d, v + h * d, (size_t)d * sizeof(float));
    }
    attend(b, q, attn, scores);
    if (project(&b->o, attn, xpad, x)) return 1;
    for (int64_t j = 0; j < hs; j++) b->hidden[j] += x[j];
    rms_norm(b->hidden, b->ln2, x, hs, (float)b->eps);
    if (project(&b->gate, x, xpad, gate) || project(&b->up, x, xpad, up)) return 1;
    for (int64_t j = 0; j < b->inter; j++) gate[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    if (project(&b->down, gate, xpad, x)) return 1;
    for (int64_t j = 0; j < hs; j++) b->hidden[j] += x[j];
    return 0;
}
