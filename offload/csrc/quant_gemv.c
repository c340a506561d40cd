/*
 * Few-row products with group-wise quantized weights, read once (see offload/quant_cpu.py).
 *
 * Why a hand-written loop: for decode (1-8 rows) the product is bound by reading the weight.
 * torch can only dequantize a chunk into a float buffer and multiply it there: five passes over
 * every weight element (unpack, widen, scale, then the GEMM's read), which on a 2-core AMD EPYC
 * made int4 decode 2.3x slower than dense fp32 (docs/BENCHMARKS.md). Here every code byte is
 * loaded once, widened in registers and multiplied into per-row accumulators; the scale (and
 * the int4 min, through the per-group sum of x) is applied once per group.
 *
 *   int8: w[o, j] = q[o, j] * scale[o, g]           (q int8, groups of `gsize` columns)
 *   int4: w[o, j] = q[o, j] * scale[o, g] + min[o, g]   (q in [0, 15]: column 2b in the low
 *         nibble of byte b, 2b + 1 in the high one)
 *   y[r, o] = sum_g scale[o, g] * sum_{j in g} q[o, j] x[r, j]  (+ min[o, g] * xsum[r, g])
 *
 * x arrives in float32, padded to groups * gsize columns (zeros), and for int4 permuted within
 * each group to [even columns | odd columns], so both nibble streams meet contiguous x. Scales
 * and mins arrive as float32. Each call computes output rows [o_begin, o_end): the Python side
 * splits the rows over threads (ctypes drops the GIL), as offload/models/kernels.py does.
 * Built with -O3 -ffast-math: the sums are reassociated (vectorised); results differ from the
 * dequantize-then-matmul reference by float rounding only, and do not depend on the split.
 */
#include <stdint.h>

#define MAX_ROWS 8
#define MAX_GROUP 8192  /* int4 group size limit (a row's width for per-row groups) */

int offload_q8_rows(const int8_t *qw, const float *scales, const float *x, float *y,
                    int64_t rows, int64_t out_f, int64_t padded_in, int64_t gsize,
                    int64_t o_begin, int64_t o_end)
{
    if (rows < 1 || rows > MAX_ROWS || gsize < 1 || padded_in % gsize) return 1;
    const int64_t groups = padded_in / gsize;
    for (int64_t o = o_begin; o < o_end; o++) {
        const int8_t *q = qw + o * padded_in;
        float acc[MAX_ROWS] = {0};
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *qg = q + g * gsize;
            const float s = scales[o * groups + g];
            for (int64_t r = 0; r < rows; r++) {
                const float *xg = x + r * padded_in + g * gsize;
                float part = 0.0f;
                for (int64_t j = 0; j < gsize; j++) part += (float)qg[j] * xg[j];
                acc[r] += s * part;
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * out_f + o] = acc[r];
    }
    return 0;
}

int offload_q4_rows(const uint8_t *qw, const float *scales, const float *mins, const float *x,
                    const float *xsum, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                    int64_t gsize, int64_t o_begin, int64_t o_end)
{
    if (rows < 1 || rows > MAX_ROWS || gsize < 2 || gsize % 2 || gsize > MAX_GROUP ||
        padded_in % gsize) return 1;
    const int64_t groups = padded_in / gsize, half = gsize / 2, row_bytes = padded_in / 2;
    float w[MAX_GROUP];  /* one group's codes widened: [even columns | odd columns], as x */
    for (int64_t o = o_begin; o < o_end; o++) {
        const uint8_t *q = qw + o * row_bytes;
        float acc[MAX_ROWS] = {0};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *qg = q + g * half;
            /* two plain loops the compiler vectorises: widen, then one dot product per row */
            for (int64_t b = 0; b < half; b++) {
                w[b] = (float)(qg[b] & 15);
                w[half + b] = (float)(qg[b] >> 4);
            }
            const float s = scales[o * groups + g], m = mins[o * groups + g];
            for (int64_t r = 0; r < rows; r++) {
                const float *xg = x + r * padded_in + g * gsize;
                float part = 0.0f;
                for (int64_t j = 0; j < gsize; j++) part += w[j] * xg[j];
                acc[r] += s * part + m * xsum[r * groups + g];
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * out_f + o] = acc[r];
    }
    return 0;
}
