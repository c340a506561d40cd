/*
 * Quantized weights times int8-quantized activations (`--activations int8`, opt-in: it changes
 * the math, so the tokens may change). Included at the end of quant_gemv.c (one library, and
 * the fused decode block, decode_block.c, runs the same code).
 *
 * Why: at one row the fp32-activation loops above are compute-bound on this project's AVX2 CPU
 * (every nibble widened to fp32, one FMA per column). Here x is quantized per 32 columns
 * (llama.cpp's Q8 activations: d = max|x| / 127, q = round(x * 127 / max|x|), |q| <= 127) and
 * the codes meet it in 8-bit integer dot products (`maddubs`: 32 byte products a step, summed
 * in pairs to int16, then in pairs to int32), one float multiply-add per 32 columns:
 *
 *   int4: y[o] = sum_b (scale[o, g(b)] * d_b) * sum_{j in b} q[o, j] xq_j  + sum_g min[o, g] * sum_{j in g} x_j
 *   int8: y[o] = sum_b (scale[o, g(b)] * d_b) * sum_{j in b} q[o, j] xq_j
 *
 * b runs over 32-column blocks of x. The min term takes the exact fp32 sum of x per group (not
 * the quantized sum llama.cpp uses). The integer sums are exact (int4: |pair| <= 2 * 15 * 127;
 * int8: |pair| <= 2 * 128 * 127 < 2^15), so the only new error is x's rounding to 8 bits:
 * ~4e-3 of the output's scale (offload/quant/README.md).
 *
 * x's layout: int4 code byte p of a 64-column chunk holds columns 2p (low nibble) and 2p + 1
 * (high) for any group size that is a multiple of 32 (a group of 32 is 16 bytes, two groups a
 * chunk), so quantized x goes per chunk as [32 even columns | 32 odd columns]; a last half
 * chunk (padded_in % 64 == 32) as [16 even | 16 odd]. int8: x in natural order.
 *
 * AVX2 only (also taken on AVX-512 CPUs, which have it: no AVX-512 branch is written that was
 * never run on a CPU here). Elsewhere, or for a group that is not a multiple of 32 columns,
 * offload_a8_taken says 0 and the callers keep the fp32-activation loops.
 *
 * Four output rows at a time (as q4x_rows): the x loads shared, row o always in slot o % 4, and
 * each (x row, output row) the same sequence of operations whatever the call's row range and
 * however many x rows it has: no result depends on how rows are split over threads, and a
 * prompt's row equals that row computed alone (decode). Several x rows: each block of four
 * weight rows is read from memory once and stays in L1 while every x row meets it.
 */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <stdlib.h>

#define A8_MAX_COLUMNS 65536
#define A8_ROWS 4
/* x row [0, n) quantized per 32 columns into xq (int4: chunk layout above) and d per block */
static void a8_quantize(const float *x, int64_t n, int bits, int8_t *xq, float *xd)
{
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float top = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            top = a > top ? a : top;
        }
        xd[b] = top / 127.0f;
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        for (int j = 0; j < 32; j++) {
            const int8_t q = (int8_t)_mm_cvtss_si32(_mm_set_ss(xb[j] * inv));  /* to nearest even */
            const int64_t c = b * 32 + j, chunk = c / 64 * 64, in = c % 64;
            const int64_t half = n - chunk >= 64 ? 32 : 16;  /* a last half chunk: 16 | 16 */
            xq[bits == 8 ? c : chunk + (in % 2) * half + in / 2] = q;
        }
    }
}

static inline float a8_sum(__m256 v)
{
    float t[8];
    _mm256_storeu_ps(t, v);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

/* 4 weight rows, one quantized x row: y[rows[r]] for the slots whose row is base + r */
static inline __attribute__((always_inline)) void q4a8_rows(
    const uint8_t *qw, const uint16_t *scales, const uint16_t *mins, const int8_t *xq,
    const float *xd, const float *xsum, float *y, const int64_t *rows, int64_t base,
    int64_t padded_in, int64_t gsize)
{
    const int64_t groups = padded_in / gsize, row_bytes = padded_in / 2, chunks = padded_in / 64;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[A8_ROWS], off[A8_ROWS];
    for (int r = 0; r < A8_ROWS; r++) { acc[r] = _mm256_setzero_ps(); off[r] = _mm256_setzero_ps(); }
    for (int64_t c = 0; c < chunks; c++) {
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(xq + c * 64));
        const __m256i xo = _mm256_loadu_si256((const __m256i *)(xq + c * 64 + 32));
        /* lanes 0-3: columns 0-31 of the chunk (block 2c), lanes 4-7: block 2c + 1 */
        const __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadl_pi(
            _mm_setzero_ps(), (const __m64 *)(xd + 2 * c))), halves);
        const int64_t g0 = c * 64 / gsize;
        for (int r = 0; r < A8_ROWS; r++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(qw + rows[r] * row_bytes + c * 32));
            const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            const __m256i s32 = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo)), ones);
            const uint16_t *sr = scales + rows[r] * groups + g0;
            __m256 sv;
            if (gsize == 32) {  /* the chunk's two groups */
                int32_t two;
                memcpy(&two, sr, sizeof two);
                sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two))), halves);
            } else {
                sv = _mm256_set1_ps(half_to_float(sr[0]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(sv, dv), acc[r]);
        }
    }
    if (padded_in % 64) {  /* the last 32 columns: 16 code bytes, [16 even | 16 odd] of x */
        const int64_t c = chunks;
        const __m128i xe = _mm_loadu_si128((const __m128i *)(xq + c * 64));
        const __m128i xo = _mm_loadu_si128((const __m128i *)(xq + c * 64 + 16));
        const float d = xd[2 * c];
        for (int r = 0; r < A8_ROWS; r++) {
            const __m128i w = _mm_loadu_si128((const __m128i *)(qw + rows[r] * row_bytes + c * 32));
            const __m128i m = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(w, m), hi = _mm_and_si128(_mm_srli_epi16(w, 4), m);
            const __m128i s32 = _mm_madd_epi16(
                _mm_add_epi16(_mm_maddubs_epi16(lo, xe), _mm_maddubs_epi16(hi, xo)), _mm_set1_epi16(1));
            const float s = half_to_float(scales[rows[r] * groups + (padded_in - 32) / gsize]);
            const __m256i wide = _mm256_inserti128_si256(_mm256_setzero_si256(), s32, 0);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(s * d), acc[r]);
        }
    }
    /* the min term, 8 groups a step: sum_g min * sum(x over g) */
    const int64_t gvec = groups & ~(int64_t)7;
    for (int r = 0; r < A8_ROWS; r++) {
        const uint16_t *mr = mins + rows[r] * groups;
        for (int64_t g = 0; g < gvec; g += 8)
            off[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr + g))),
                                     _mm256_loadu_ps(xsum + g), off[r]);
        float tail = 0.0f;
        for (int64_t g = gvec; g < groups; g++) tail += half_to_float(mr[g]) * xsum[g];
        if (rows[r] == base + r) y[base + r] = a8_sum(acc[r]) + (a8_sum(off[r]) + tail);
    }
}

/* One int4 weight row o against R quantized x rows (a prompt): the row's codes unpacked and its
 * scales converted once per chunk for all R, each (x row, o) the same operations in the same
 * order as q4a8_rows' slot (so a prompt's row gives its decode's bits). Measured, loaded: the
 * per-x-row loop (q4a8_rows for each x row) made a 29-token prompt 0.6x the fp32 loops' speed. */
static inline __attribute__((always_inline)) void q4a8_xrows(
    const uint8_t *qw, const uint16_t *scales, const uint16_t *mins, const int8_t *xq,
    const float *xd, const float *xsum, float *y, int64_t o, int64_t out_f, int64_t padded_in,
    int64_t gsize, const int R)
{
    const int64_t groups = padded_in / gsize, row_bytes = padded_in / 2, chunks = padded_in / 64;
    const int64_t blocks = padded_in / 32;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const uint8_t *q = qw + o * row_bytes;
    const uint16_t *sr = scales + o * groups, *mr = mins + o * groups;
    __m256 acc[4], off[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = _mm256_setzero_ps(); }
    for (int64_t c = 0; c < chunks; c++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + c * 32));
        const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        const int64_t g0 = c * 64 / gsize;
        __m256 sv;
        if (gsize == 32) {
            int32_t two;
            memcpy(&two, sr + g0, sizeof two);
            sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two))), halves);
        } else {
            sv = _mm256_set1_ps(half_to_float(sr[g0]));
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * padded_in + c * 64;
            const __m256i s32 = _mm256_madd_epi16(_mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)),
                _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32)))), ones);
            const __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadl_pi(
                _mm_setzero_ps(), (const __m64 *)(xd + r * blocks + 2 * c))), halves);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(sv, dv), acc[r]);
        }
    }
    if (padded_in % 64) {  /* the last 32 columns, as q4a8_rows */
        const int64_t c = chunks;
        const __m128i w = _mm_loadu_si128((const __m128i *)(q + c * 32));
        const __m128i m = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(w, m), hi = _mm_and_si128(_mm_srli_epi16(w, 4), m);
        const float s = half_to_float(sr[(padded_in - 32) / gsize]);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * padded_in + c * 64;
            const __m128i s32 = _mm_madd_epi16(_mm_add_epi16(
                _mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)xr)),
                _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)(xr + 16)))), _mm_set1_epi16(1));
            const __m256i wide = _mm256_inserti128_si256(_mm256_setzero_si256(), s32, 0);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(s * xd[r * blocks + 2 * c]), acc[r]);
        }
    }
    const int64_t gvec = groups & ~(int64_t)7;
    for (int r = 0; r < R; r++) {
        const float *xs = xsum + r * groups;
        for (int64_t g = 0; g < gvec; g += 8)
            off[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr + g))),
                                     _mm256_loadu_ps(xs + g), off[r]);
        float tail = 0.0f;
        for (int64_t g = gvec; g < groups; g++) tail += half_to_float(mr[g]) * xs[g];
        y[r * out_f + o] = a8_sum(acc[r]) + (a8_sum(off[r]) + tail);
    }
}

/* int8 weight rows, one quantized x row (natural order): 32 columns a step, one row at a time
 * (four rows interleaved, as int4, read the 49152 x 576 head from memory 1.7x slower than the
 * fp32-activation loop's one stream; one row at a time, with two accumulator chains, not) */
static inline __attribute__((always_inline)) void q8a8_rows(
    const int8_t *qw, const uint16_t *scales, const int8_t *xq, const float *xd, float *y,
    const int64_t *rows, int64_t base, int64_t padded_in, int64_t gsize)
{
    const int64_t groups = padded_in / gsize, blocks = padded_in / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < A8_ROWS; r++) {
        if (rows[r] != base + r) continue;
        const int8_t *q = qw + rows[r] * padded_in;
        const uint16_t *sr = scales + rows[r] * groups;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < blocks; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            const __m256i w = _mm256_loadu_si256((const __m256i *)(q + b * 32));
            /* maddubs takes unsigned x signed: |w| against x with w's sign */
            const __m256i s32 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
            const float s = half_to_float(sr[b * 32 / gsize]) * xd[b];
            acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(s), acc[b & 1]);
        }
        y[base + r] = a8_sum(_mm256_add_ps(acc[0], acc[1]));
    }
}

/* One int8 weight row o against R quantized x rows: |w| once per block for all R, each (x row,
 * o) the same operations in the same order as q8a8_rows (a prompt's row gives its decode's bits) */
static inline __attribute__((always_inline)) void q8a8_xrows(
    const int8_t *qw, const uint16_t *scales, const int8_t *xq, const float *xd, float *y,
    int64_t o, int64_t out_f, int64_t padded_in, int64_t gsize, const int R)
{
    const int64_t groups = padded_in / gsize, blocks = padded_in / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *q = qw + o * padded_in;
    const uint16_t *sr = scales + o * groups;
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + b * 32));
        const __m256i aw = _mm256_sign_epi8(w, w);
        const float s = half_to_float(sr[b * 32 / gsize]);
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * padded_in + b * 32));
            const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
            acc[r][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(s * xd[r * blocks + b]),
                                            acc[r][b & 1]);
        }
    }
    for (int r = 0; r < R; r++) y[r * out_f + o] = a8_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

static int a8_taken(int bits, int64_t padded_in, int64_t gsize)
{
    return (bits == 4 || bits == 8) && gsize >= 32 && gsize % 32 == 0 && padded_in % gsize == 0 &&
           padded_in <= A8_MAX_COLUMNS;
}

/* rows x rows [rows][padded_in] float32 -> y [rows][out_f], output rows [o_begin, o_end) */
static int a8_product(int bits, const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                      const float *x, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                      int64_t gsize, int64_t o_begin, int64_t o_end)
{
    if (rows < 1 || !a8_taken(bits, padded_in, gsize)) return 1;
    const int64_t groups = padded_in / gsize, blocks = padded_in / 32;
    /* per x row: its codes, its blocks' d, its groups' sums (int4's min term) */
    int8_t *xq = malloc((size_t)(rows * padded_in));
    float *xd = malloc((size_t)(rows * blocks) * sizeof(float));
    float *xsum = malloc((size_t)(rows * groups) * sizeof(float));
    if (!xq || !xd || !xsum) { free(xq); free(xd); free(xsum); return 2; }
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * padded_in;
        a8_quantize(xr, padded_in, bits, xq + r * padded_in, xd + r * blocks);
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.0f;
            for (int64_t j = g * gsize; j < (g + 1) * gsize; j++) t += xr[j];
            xsum[r * groups + g] = t;
        }
    }
    if (rows > 1) {  /* a prompt: each weight row once against 4 x rows at a time */
        const int8_t *q8 = (const int8_t *)qw;
        for (int64_t o = o_begin; o < o_end; o++)
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const int64_t n = rows - r0 < 4 ? rows - r0 : 4;
                const int8_t *xr = xq + r0 * padded_in;
                const float *dr = xd + r0 * blocks, *sr = xsum + r0 * groups;
                float *yr = y + r0 * out_f;
#define A8_XROWS(R)                                                                               \
    do {                                                                                          \
        if (bits == 4) q4a8_xrows(qw, scales, mins, xr, dr, sr, yr, o, out_f, padded_in, gsize, R); \
        else q8a8_xrows(q8, scales, xr, dr, yr, o, out_f, padded_in, gsize, R);                   \
    } while (0)
                switch (n) {
                case 1: A8_XROWS(1); break;
                case 2: A8_XROWS(2); break;
                case 3: A8_XROWS(3); break;
                default: A8_XROWS(4);
                }
#undef A8_XROWS
            }
        free(xq); free(xd); free(xsum);
        return 0;
    }
    for (int64_t base = o_begin - o_begin % A8_ROWS; base < o_end; base += A8_ROWS) {
        int64_t slot[A8_ROWS];  /* rows outside the range compute one inside again (dropped) */
        for (int r = 0; r < A8_ROWS; r++)
            slot[r] = base + r < o_begin ? o_begin : base + r >= o_end ? o_end - 1 : base + r;
        for (int64_t r = 0; r < rows; r++) {  /* the 4 weight rows stay in L1 across x rows */
            if (bits == 4)
                q4a8_rows(qw, scales, mins, xq + r * padded_in, xd + r * blocks, xsum + r * groups,
                          y + r * out_f, slot, base, padded_in, gsize);
            else
                q8a8_rows((const int8_t *)qw, scales, xq + r * padded_in, xd + r * blocks,
                          y + r * out_f, slot, base, padded_in, gsize);
        }
    }
    free(xq); free(xd); free(xsum);
    return 0;
}
#else
static int a8_taken(int bits, int64_t padded_in, int64_t gsize)
{
    (void)bits; (void)padded_in; (void)gsize;
    return 0;  /* no AVX2: the fp32-activation loops */
}

static int a8_product(int bits, const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                      const float *x, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                      int64_t gsize, int64_t o_begin, int64_t o_end)
{
    (void)bits; (void)qw; (void)scales; (void)mins; (void)x; (void)y; (void)rows; (void)out_f;
    (void)padded_in; (void)gsize; (void)o_begin; (void)o_end;
    return 1;
}
#endif

/* 1 where the int8-activation loops take this weight (quant/cpu.py and decode_block.c ask
 * before choosing: the same answer, so fused and unfused steps compute the same) */
int offload_a8_taken(int64_t bits, int64_t padded_in, int64_t gsize)
{
    return a8_taken((int)bits, padded_in, gsize);
}

int offload_q4_rows_a8(const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                       const float *x, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                       int64_t gsize, int64_t o_begin, int64_t o_end)
{
    return a8_product(4, qw, scales, mins, x, y, rows, out_f, padded_in, gsize, o_begin, o_end);
}

int offload_q8_rows_a8(const int8_t *qw, const uint16_t *scales, const float *x, float *y,
                       int64_t rows, int64_t out_f, int64_t padded_in, int64_t gsize,
                       int64_t o_begin, int64_t o_end)
{
    return a8_product(8, (const uint8_t *)qw, scales, 0, x, y, rows, out_f, padded_in, gsize,
                      o_begin, o_end);
}
