/*
 * Few-row products with group-wise quantized weights, read once (see offload/quant/cpu.py).
 *
 * Why a hand-written loop: for decode (1-8 rows) the product is bound by reading the weight.
 * torch can only dequantize a chunk into a float buffer and multiply it there: five passes over
 * every weight element (unpack, widen, scale, then the GEMM's read), which on a 2-core AMD EPYC
 * made int4 decode 2.3x slower than dense fp32 (docs/BENCHMARKS.md). Here every code byte is
 * loaded once and widened in registers, with its group's scale (and min) applied there:
 *
 *   int8: w[o, j] = q[o, j] * scale[o, g]             (q int8, groups of `gsize` columns)
 *   int4: w[o, j] = q[o, j] * scale[o, g] + min[o, g]  (q in [0, 15]: column 2b in the low
 *         nibble of byte b, 2b + 1 in the high one)
 *   y[r, o] = sum_j w[o, j] x[r, j]
 *
 * Each group's codes are widened once into a float buffer in L1, with the group's scale (and
 * min) applied there, and each 8-float slice of it feeds R multiply-adds into R vector
 * accumulators that live across the whole row (no per-group horizontal sum): at 8 rows a slice
 * costs 9 loads for 8 FMAs. The first version took one dot product per row and group, with a
 * horizontal sum each, and at 8 rows was half as fast; widening in registers with no buffer
 * (tried) made GCC spill the accumulators and was 2-3x slower at 1 row. R is a compile-time
 * constant in each instance (ROWS_CASE below) so the accumulators stay in registers. GCC/Clang
 * vector extensions, no intrinsics: the same source builds for AVX2, AVX-512 and NEON.
 *
 * x arrives in float32, padded to groups * gsize columns (zeros), and for int4 permuted within
 * each group to [even columns | odd columns], so both nibble streams meet contiguous x. Scales
 * and mins arrive as their stored fp16 bits. Each call computes output rows [o_begin, o_end): the Python side
 * splits the rows over threads (ctypes drops the GIL), as offload/models/kernels.py does.
 * Built with -O3 -fassociative-math (not -ffast-math: offload/quant/cpu.py says why): the sums
 * are reassociated (vectorised); results differ from the
 * dequantize-then-matmul reference by float rounding only, and do not depend on the split.
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8  /* rows per register tile */
#define MAX_GROUP 8192  /* int4 group size limit (int8 takes any: PIECE columns at a time) */
#define PIECE 512

typedef float v8 __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float sum8(v8 v)
{
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

/* IEEE half -> float, exactly. Scales and mins arrive as the stored fp16 bits: converting them
 * in torch first (a [out, groups] tensor per call) cost more than the int4 product itself on a
 * 2-core AMD EPYC (torch's CPU half->float ran at ~40 M elements/s). One per group here: one
 * instruction with F16C (x86) or native __fp16 (Arm), else exact bit arithmetic. */
#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__aarch64__)
static inline float half_to_float(uint16_t h) { __fp16 v; memcpy(&v, &h, sizeof v); return (float)v; }
#else
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in float */
        const float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* A piece of one output row, widened with its group's scale (and min) into w[0, n): the same
 * `q * scale (+ min)` in float32 as quant.dequantize. Plain loops the compiler vectorises. */
static inline void widen_q8(const int8_t *q, float s, float *w, int64_t n)
{
    for (int64_t j = 0; j < n; j++) w[j] = (float)q[j] * s;
}

static inline void widen_q4(const uint8_t *q, float s, float m, float *w, int64_t gsize)
{
    /* Groups under 64: 8 code bytes at a time with explicit 8-lane vectors. The
     * auto-vectoriser takes 32 bytes an iteration, so a group of 32 (16 bytes, llama.cpp's Q4)
     * would run in its scalar epilogue: 1.45x slower (8192x2048, 1-8 rows). From 64 on the
     * auto-vectorised loop below is 1.5-2x faster than the explicit one (measured side by side
     * on a 2-core AMD EPYC, GCC 12). */
    const int64_t half = gsize / 2, vec = gsize < 64 ? half & ~(int64_t)7 : 0;
    for (int64_t b = 0; b < vec; b += 8) {
        v8u8 qv;
        memcpy(&qv, q + b, sizeof qv);
        /* through int32 lanes: GCC 12 scalarises a direct uint8 -> float conversion */
        const v8i wide = __builtin_convertvector(qv, v8i);
        const v8 lo = __builtin_convertvector(wide & 15, v8) * s + m;
        const v8 hi = __builtin_convertvector(wide >> 4, v8) * s + m;
        memcpy(w + b, &lo, sizeof lo);
        memcpy(w + half + b, &hi, sizeof hi);
    }
    for (int64_t b = vec; b < half; b++) {
        w[b] = (float)(q[b] & 15) * s + m;
        w[half + b] = (float)(q[b] >> 4) * s + m;
    }
}

/* acc[r] += w[0, n) . x[r][0, n) for R rows (x rows `ld` floats apart); n % 8 == 0. */
static inline __attribute__((always_inline)) void fma_rows(v8 *acc, const float *w, const float *x,
                                                             int64_t ld, int64_t n, const int R)
{
    for (int64_t j = 0; j < n; j += 8) {
        const v8 wv = load8(w + j);
        for (int r = 0; r < R; r++) acc[r] += wv * load8(x + r * ld + j);
    }
}

/* One output row o of R rows. The row is taken in pieces: an int4 piece is one whole group
 * (its columns are permuted within the group); an int8 piece is at most PIECE columns of one
 * group, so per-channel scales (one group as wide as the row) need no row-wide buffer. (Pieces
 * of several 32-column groups, each widened with its scale, measured no faster at 8 rows.) */
static inline __attribute__((always_inline)) void row_product(
    const void *qrow, const uint16_t *sc, const uint16_t *mn, const float *x, float *y,
    int64_t out_f, int64_t o, int64_t padded_in, int64_t gsize, int bits, float *w, const int R)
{
    v8 acc[MAX_ROWS];
    float tail[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = (v8){0}; tail[r] = 0.0f; }
    for (int64_t j0 = 0; j0 < padded_in;) {
        const int64_t g = j0 / gsize, group_end = (g + 1) * gsize;
        int64_t n;
        if (bits == 8) {
            n = group_end - j0 < PIECE ? group_end - j0 : PIECE;
            widen_q8((const int8_t *)qrow + j0, half_to_float(sc[g]), w, n);
        } else {
            n = gsize;
            widen_q4((const uint8_t *)qrow + j0 / 2, half_to_float(sc[g]), half_to_float(mn[g]),
                     w, n);
        }
        const int64_t vec = n & ~(int64_t)7;
        fma_rows(acc, w, x + j0, padded_in, vec, R);
        for (int64_t j = vec; j < n; j++)  /* pieces that are not a multiple of 8 wide */
            for (int r = 0; r < R; r++) tail[r] += w[j] * x[r * padded_in + j0 + j];
        j0 += n;
    }
    for (int r = 0; r < R; r++) y[r * out_f + o] = sum8(acc[r]) + tail[r];
}

/* int8, one row: no buffer -- the int8 widening is one instruction, and through a buffer one
 * row ran 1.7x slower. Groups of a multiple of 8 columns: each group's products gather in 4
 * vector partial sums (independent chains: one chain waits on its multiply-add's latency),
 * the group's scale multiplies them into a vector accumulator, and the row's sum is taken once
 * at its end. A sum per group instead (the loop before: a horizontal sum every 32 columns for
 * llama.cpp's Q8_0 groups) made group-32 int8 1.7x slower than per-channel at one row on the
 * 1B shapes; now 1.4x (docs/benchmarks/int8.md). Other group widths: a scalar dot product per
 * group. */
typedef int8_t v8i8 __attribute__((vector_size(8)));

#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 widen8_q8(const int8_t *q)  /* GCC 12 scalarised the vector-extension form */
{
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}
#else
static inline v8 widen8_q8(const int8_t *q)
{
    v8i8 qv;
    memcpy(&qv, q, sizeof qv);
    return __builtin_convertvector(__builtin_convertvector(qv, v8i), v8);  /* via int32 lanes */
}
#endif

static void q8_one_row(const int8_t *qw, const uint16_t *scales, const float *x, float *y,
                       int64_t padded_in, int64_t gsize, int64_t o_begin, int64_t o_end)
{
    const int64_t groups = padded_in / gsize, wide = gsize & ~(int64_t)31;
    for (int64_t o = o_begin; o < o_end; o++) {
        const int8_t *q = qw + o * padded_in;
        const uint16_t *sc = scales + o * groups;
        if (gsize % 8 == 0) {
            v8 acc = {0};
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j0 = g * gsize;
                v8 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                for (int64_t j = j0; j < j0 + wide; j += 32) {
                    p0 += widen8_q8(q + j) * load8(x + j);
                    p1 += widen8_q8(q + j + 8) * load8(x + j + 8);
                    p2 += widen8_q8(q + j + 16) * load8(x + j + 16);
                    p3 += widen8_q8(q + j + 24) * load8(x + j + 24);
                }
                for (int64_t j = j0 + wide; j < j0 + gsize; j += 8)
                    p0 += widen8_q8(q + j) * load8(x + j);
                acc += ((p0 + p1) + (p2 + p3)) * half_to_float(sc[g]);
            }
            y[o] = sum8(acc);
            continue;
        }
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float part = 0.0f;
            for (int64_t j = g * gsize; j < (g + 1) * gsize; j++) part += (float)q[j] * x[j];
            acc += half_to_float(sc[g]) * part;
        }
        y[o] = acc;
    }
}

/* int4, one row, x in its natural column order: no buffer and no permuted copy of x. Per group,
 * sum(q * x) gathers in two vector partial sums straight from the codes: byte j of a group
 * holds columns 2j (low nibble) and 2j + 1 (high nibble), so 16 columns of x are loaded and
 * split into their even and odd lanes in registers. The group's scale multiplies its sum once;
 * the mins add min * sum(x over the group), those sums taken once per call. (The 8-row tiles
 * apply scale and min to every element, store and reload it, and take x permuted per group by
 * the caller: for one row that cost 2-3x the int8 loop.) Groups of a multiple of 16 columns. */
#if defined(__clang__)
#define EVENS(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#define ODDS(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15)
#else
#define EVENS(a, b) __builtin_shuffle(a, b, (v8i){0, 2, 4, 6, 8, 10, 12, 14})
#define ODDS(a, b) __builtin_shuffle(a, b, (v8i){1, 3, 5, 7, 9, 11, 13, 15})
#endif
/* 8 code bytes (16 columns) into the even / odd partial sums: via int32 lanes (see widen_q4) */
#define Q4_STEP(qp, xp, pe, po)                                                  \
    do {                                                                         \
        v8u8 qv_;                                                                \
        memcpy(&qv_, (qp), sizeof qv_);                                          \
        const v8i w_ = __builtin_convertvector(qv_, v8i);                        \
        const v8 x0_ = load8(xp), x1_ = load8((xp) + 8);                         \
        pe += __builtin_convertvector(w_ & 15, v8) * EVENS(x0_, x1_);            \
        po += __builtin_convertvector(w_ >> 4, v8) * ODDS(x0_, x1_);             \
    } while (0)
#define Q4_ONE_ROW_MAX_GROUPS 4096  /* its per-call group sums live on the stack */

static int q4_one_row(const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                      const float *x, float *y, int64_t padded_in, int64_t gsize,
                      int64_t o_begin, int64_t o_end)
{
    const int64_t groups = padded_in / gsize, half = gsize / 2;
    if (gsize % 16 || groups > Q4_ONE_ROW_MAX_GROUPS) return 1;
    float xsum[Q4_ONE_ROW_MAX_GROUPS];
    for (int64_t g = 0; g < groups; g++) {
        float t = 0.0f;
        for (int64_t j = g * gsize; j < (g + 1) * gsize; j++) t += x[j];
        xsum[g] = t;
    }
    for (int64_t o = o_begin; o < o_end; o++) {
        const uint8_t *q = qw + o * (padded_in / 2);
        const uint16_t *sc = scales + o * groups, *mn = mins + o * groups;
        v8 acc = {0};
        float offset = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *qg = q + g * half;
            const float *xg = x + g * gsize;
            /* four independent chains (one waits on its multiply-add's latency), 32 columns a
             * step; a group of 16 columns (or an odd 16 at the end) takes a half step */
            v8 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
            int64_t b = 0;
            for (; b + 16 <= half; b += 16) {
                Q4_STEP(qg + b, xg + 2 * b, p0, p1);
                Q4_STEP(qg + b + 8, xg + 2 * b + 16, p2, p3);
            }
            if (b < half) Q4_STEP(qg + b, xg + 2 * b, p0, p1);
            acc += ((p0 + p1) + (p2 + p3)) * half_to_float(sc[g]);
            offset += half_to_float(mn[g]) * xsum[g];
        }
        y[o] = sum8(acc) + offset;
    }
    return 0;
}

#define ROWS_CASE(R)                                                                        \
    case R:                                                                                 \
        for (int64_t o = ob; o < oe; o++)                                                   \
            row_product(q + o * row_bytes, scales + o * groups, mins ? mins + o * groups : 0, \
                        xt, yt, out_f, o, padded_in, gsize, bits, w, R);                    \
        break;

/* Rows beyond MAX_ROWS go in tiles of MAX_ROWS over blocks of O_BLOCK output rows, so a tile
 * after the first finds the block's codes in L2 instead of reading them from memory again. */
#define O_BLOCK 64

static int rows_product(int bits, const uint8_t *q, const uint16_t *scales, const uint16_t *mins,
                        const float *x, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                        int64_t gsize, int64_t o_begin, int64_t o_end)
{
    if (rows < 1 || gsize < 1 || padded_in % gsize ||
        (bits == 4 && (gsize % 2 || gsize > MAX_GROUP))) return 1;
    const int64_t groups = padded_in / gsize, row_bytes = bits == 8 ? padded_in : padded_in / 2;
    if (bits == 8 && rows == 1) {
        q8_one_row((const int8_t *)q, scales, x, y, padded_in, gsize, o_begin, o_end);
        return 0;
    }
    float w[MAX_GROUP];  /* one piece of one output row, widened and scaled */
    for (int64_t ob = o_begin; ob < o_end; ob += O_BLOCK) {
        const int64_t oe = ob + O_BLOCK < o_end ? ob + O_BLOCK : o_end;
        for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            const float *xt = x + r0 * padded_in;
            float *yt = y + r0 * out_f;
            switch (rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS) {
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
                ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
            }
        }
    }
    return 0;
}

/* ---- 9 to 64 rows: register-blocked over output rows and x rows ----
 *
 * The tiles above read all R x rows for every output row: at 8 rows a 2048-wide x tile is 64
 * KiB, twice this CPU's L1, so each 8-float slice of the widened weight costs 8 loads of x from
 * L2 for its 8 multiply-adds, and the weight is widened again for every tile of 8 rows (4 times
 * at 32). Here a block of OB output rows is widened once per piece of the row (at most KC
 * columns, whole groups) for all x rows, packed 8 columns at a time, and each OB x RB tile of
 * the product keeps its 12 accumulators in registers across the piece: per 8 columns RB + OB
 * = 8 loads (x from L2, w from L1) for 12 fused multiply-adds. The accumulators' 8 lanes are
 * added into `part` piece by piece and summed once per output row at the end; each (r, o) sum
 * is the same sequence of operations whatever the tile shape, so no result depends on how the
 * output rows are split over threads. Measured on the 1B shapes at 32-64 rows, 2 threads
 * (docs/BENCHMARKS.md): 1.4-2.9x faster than the 8-row tiles, 0.7-1.2x the time of the dense
 * fp32 product in its faster (transposed) form.
 * Tried and measured no faster: 4 x 2, 5 x 2, 3 x 3 and 4 x 3 tiles, KC of 128, 256 and 1024;
 * the broadcast form (x transposed, each weight element broadcast against 8 rows at once) was
 * 1.2-1.3x slower. */
#define KC 512  /* columns per piece (whole groups; int8 slices wider groups) */
#define OB 6    /* output rows per block (quant/cpu.py TILE_OUT_ROWS) */
#define RB 2    /* x rows per tile (quant/cpu.py TILE_X_ROWS) */
#define BLOCKED_ROWS_MAX 64  /* quant/cpu.py ROWS_MEASURED_MAX */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

/* GCC 12 folds every use of a loaded vector into its multiply-add as a memory operand: the
 * 6 x 2 tile then loads each weight slice twice (14 loads for 12 multiply-adds, and the load
 * ports, not the FMA units, set the pace). An empty asm that claims to change the value pins
 * it in a register after one load (8 loads; checked in the generated assembly). */
#if defined(__GNUC__) && defined(__AVX__)  /* a 32-byte vector fits one register */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

/* One tile: part[r * OB + o] += the 8-lane partial sums of w[o, :] x[r, :] over n columns
 * (n % 8 == 0), for o < O, r < R; both operands packed 8 columns at a time: w as
 * [n / 8][OB][8], x as [n / 8][RB][8], so the loop walks two pointers and every load is at a
 * constant offset from one of them (with a pointer per row GCC ran out of registers and
 * spilled x). */
static inline __attribute__((always_inline)) void tile_product(
    const float *w, const float *x, int64_t n, v8 *part, const int O, const int R)
{
    v8 acc[OB][RB];
    for (int o = 0; o < O; o++)
        for (int r = 0; r < R; r++) acc[o][r] = (v8){0};
    for (int64_t c = 0; c < n / 8; c++, w += OB * 8, x += RB * 8) {
        v8 xv[RB];
        for (int r = 0; r < R; r++) {
            xv[r] = load8(x + r * 8);
            KEEP_IN_REGISTER(xv[r]);
        }
        for (int o = 0; o < O; o++) {
            v8 wv = load8(w + o * 8);
            KEEP_IN_REGISTER(wv);
            for (int r = 0; r < R; r++) acc[o][r] = fma8(wv, xv[r], acc[o][r]);
        }
    }
    for (int o = 0; o < O; o++)
        for (int r = 0; r < R; r++) part[r * OB + o] += acc[o][r];
}

/* x arrives packed by the caller: [tiles][padded_in / 8][RB][8], tiles = ceil(rows / RB), rows
 * past `rows` zero. Needs gsize % 8 == 0 (so every piece starts and ends on 8 columns). */
static int rows_blocked(int bits, const uint8_t *q, const uint16_t *scales, const uint16_t *mins,
                        const float *xpk, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                        int64_t gsize, int64_t o_begin, int64_t o_end)
{
    if (rows < 1 || rows > BLOCKED_ROWS_MAX || gsize < 8 || gsize % 8 || padded_in % gsize ||
        (bits == 4 && gsize > MAX_GROUP))
        return 1;
    const int64_t groups = padded_in / gsize, row_bytes = bits == 8 ? padded_in : padded_in / 2;
    /* a piece: whole groups up to KC columns; a wider int8 group in KC slices; a wider int4
     * group whole (its columns are permuted within the group) */
    const int64_t per = gsize <= KC ? (KC / gsize) * gsize : (bits == 8 ? KC : gsize);
    float row[MAX_GROUP];       /* one output row's piece, widened */
    float wp[OB * MAX_GROUP];   /* OB such rows, packed [n / 8][OB][8] */
    v8 part[BLOCKED_ROWS_MAX * OB];  /* [rows][OB]: each sum's 8 lanes, summed at the block's end */
    for (int64_t ob = o_begin; ob < o_end; ob += OB) {
        const int O = o_end - ob < OB ? (int)(o_end - ob) : OB;
        for (int64_t i = 0; i < rows * OB; i++) part[i] = (v8){0};
        for (int64_t j0 = 0; j0 < padded_in;) {
            int64_t n = per;
            if (gsize > KC && bits == 8) {
                const int64_t group_end = (j0 / gsize + 1) * gsize;
                n = group_end - j0 < KC ? group_end - j0 : KC;
            } else if (padded_in - j0 < n) {
                n = padded_in - j0;
            }
            for (int o = 0; o < O; o++) {
                const uint8_t *qrow = q + (ob + o) * row_bytes;
                const uint16_t *sc = scales + (ob + o) * groups, *mn = mins ? mins + (ob + o) * groups : 0;
                if (bits == 8) {
                    for (int64_t j = j0; j < j0 + n;) {  /* each group's part of the piece */
                        const int64_t g = j / gsize, end = (g + 1) * gsize < j0 + n ? (g + 1) * gsize : j0 + n;
                        widen_q8((const int8_t *)qrow + j, half_to_float(sc[g]), row + (j - j0), end - j);
                        j = end;
                    }
                } else {
                    for (int64_t j = j0; j < j0 + n; j += gsize)
                        widen_q4(qrow + j / 2, half_to_float(sc[j / gsize]), half_to_float(mn[j / gsize]),
                                 row + (j - j0), gsize);
                }
                for (int64_t c = 0; c < n / 8; c++) memcpy(wp + (c * OB + o) * 8, row + c * 8, 8 * sizeof(float));
            }
            for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                const int R = rows - r0 < RB ? (int)(rows - r0) : RB;
                const float *xt = xpk + (r0 / RB) * padded_in * RB + j0 * RB;
                v8 *pt = part + r0 * OB;
                if (O == OB && R == RB) {
                    tile_product(wp, xt, n, pt, OB, RB);
                } else {  /* the edges: fewer rows of either */
                    for (int o = 0; o < O; o++)
                        for (int r = 0; r < R; r++) tile_product(wp + o * 8, xt + r * 8, n, pt + r * OB + o, 1, 1);
                }
            }
            j0 += n;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int o = 0; o < O; o++) y[r * out_f + ob + o] = sum8(part[r * OB + o]);
    }
    return 0;
}

/* The exported entry points: int8 and int4 (with mins), as the 8-row tiles and as the blocked
 * loop (quant/cpu.py _Lib binds all four). */
#define ENTRY_POINTS(suffix, impl)                                                                \
    int offload_q8_rows##suffix(const int8_t *qw, const uint16_t *scales, const float *x, float *y, \
                                int64_t rows, int64_t out_f, int64_t padded_in, int64_t gsize,     \
                                int64_t o_begin, int64_t o_end)                                    \
    {                                                                                             \
        return impl(8, (const uint8_t *)qw, scales, 0, x, y, rows, out_f, padded_in, gsize,       \
                    o_begin, o_end);                                                              \
    }                                                                                             \
    int offload_q4_rows##suffix(const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,  \
                                const float *x, float *y, int64_t rows, int64_t out_f,            \
                                int64_t padded_in, int64_t gsize, int64_t o_begin, int64_t o_end) \
    {                                                                                             \
        return impl(4, qw, scales, mins, x, y, rows, out_f, padded_in, gsize, o_begin, o_end);    \
    }

ENTRY_POINTS(, rows_product)
ENTRY_POINTS(_blocked, rows_blocked)

/* int4, one row, x86 with AVX2 or AVX-512 (groups of a multiple of 32 columns): x is permuted
 * here, once per call, into [even columns | odd columns] per group, so a code byte's two nibbles
 * meet contiguous x with no shuffle: per 16 code bytes (32 columns) one zero-extension to 32-bit
 * lanes, a mask, a shift, two conversions and two multiply-adds (AVX-512; twice that in 8-lane
 * AVX2). Four output rows at a time: four independent accumulator chains, and the group's x
 * loaded from L1 once for all four. Scale and min as in q4_one_row. Against the loop above
 * (which splits x into even and odd lanes in registers at every step), side by side on the
 * 2-core AVX2 AMD EPYC: 0.47-0.62x its time on SmolLM2's shapes (docs/benchmarks/quant.md,
 * scripts/bench_kernel_ab.py). */
#define Q4X_MAX_COLUMNS 16384  /* x's permuted copy and its group sums live on the stack */
#define Q4X_ROWS 4
#if defined(__AVX512F__)
#define Q4X_LANES 16
typedef __m512 q4x_vec;
static inline q4x_vec q4x_zero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) q4x_vec q4x_step(const uint8_t *q, const float *xe,
                                                             const float *xo, q4x_vec p)
{   /* 16 code bytes: columns 2b (low nibbles) against xe, 2b + 1 (high) against xo */
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15))),
                        _mm512_loadu_ps(xe), p);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4)), _mm512_loadu_ps(xo), p);
}
static inline q4x_vec q4x_fma(q4x_vec a, float s, q4x_vec c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(s), c); }
static inline float q4x_sum(q4x_vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define Q4X_LANES 8
typedef __m256 q4x_vec;
static inline q4x_vec q4x_zero(void) { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) q4x_vec q4x_step(const uint8_t *q, const float *xe,
                                                             const float *xo, q4x_vec p)
{   /* 8 code bytes */
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15))),
                        _mm256_loadu_ps(xe), p);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)), _mm256_loadu_ps(xo), p);
}
static inline q4x_vec q4x_fma(q4x_vec a, float s, q4x_vec c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), c); }
static inline float q4x_sum(q4x_vec v)
{
    float t[8];
    _mm256_storeu_ps(t, v);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
#endif

#if defined(Q4X_LANES)
/* Four output rows, base + [0, 4), of which those in [o_begin, o_end) are stored (the others
 * compute a row of the range again, and are dropped): y[o] = sum_g scale * (codes . x) + min *
 * sum(x). Always four, and row o always in slot o % 4: compiled with reassociated sums, a 1-row
 * instance or another slot (the four horizontal sums are vectorised together) may add in
 * another order, and no result may depend on how the rows are split over threads
 * (tests/test_quant.py::test_c_rows_kernel_split_over_threads). */
static inline __attribute__((always_inline)) void q4x_rows(
    const uint8_t *qw, const uint16_t *scales, const uint16_t *mins, const float *xp,
    const float *xsum, float *y, int64_t base, int64_t o_begin, int64_t o_end, int64_t groups,
    int64_t half)
{
    int64_t rows[Q4X_ROWS];
    for (int r = 0; r < Q4X_ROWS; r++)
        rows[r] = base + r < o_begin ? o_begin : base + r >= o_end ? o_end - 1 : base + r;
    q4x_vec acc[Q4X_ROWS];
    float off[Q4X_ROWS];
    for (int r = 0; r < Q4X_ROWS; r++) { acc[r] = q4x_zero(); off[r] = 0.0f; }
    for (int64_t g = 0; g < groups; g++) {
        const float *xe = xp + 2 * g * half, *xo = xe + half;
        for (int r = 0; r < Q4X_ROWS; r++) {
            const uint8_t *qg = qw + rows[r] * groups * half + g * half;
            q4x_vec p = q4x_zero();
            for (int64_t b = 0; b < half; b += Q4X_LANES) p = q4x_step(qg + b, xe + b, xo + b, p);
            const int64_t k = rows[r] * groups + g;
            acc[r] = q4x_fma(p, half_to_float(scales[k]), acc[r]);
            off[r] += half_to_float(mins[k]) * xsum[g];
        }
    }
    for (int r = 0; r < Q4X_ROWS; r++)
        if (rows[r] == base + r) y[base + r] = q4x_sum(acc[r]) + off[r];
}

static int q4_one_row_x(const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                        const float *x, float *y, int64_t padded_in, int64_t gsize,
                        int64_t o_begin, int64_t o_end)
{
    const int64_t groups = padded_in / gsize, half = gsize / 2;
    if (gsize % 32 || padded_in > Q4X_MAX_COLUMNS) return 1;
    float xp[padded_in], xsum[groups];
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * gsize;
        float *pe = xp + g * gsize, *po = pe + half, t = 0.0f;
        for (int64_t b = 0; b < half; b++) {
            pe[b] = xg[2 * b];
            po[b] = xg[2 * b + 1];
        }
        for (int64_t j = 0; j < gsize; j++) t += xg[j];
        xsum[g] = t;
    }
    for (int64_t base = o_begin - o_begin % Q4X_ROWS; base < o_end; base += Q4X_ROWS)
        q4x_rows(qw, scales, mins, xp, xsum, y, base, o_begin, o_end, groups, half);
    return 0;
}
#else
static int q4_one_row_x(const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                        const float *x, float *y, int64_t padded_in, int64_t gsize,
                        int64_t o_begin, int64_t o_end)
{
    (void)qw; (void)scales; (void)mins; (void)x; (void)y; (void)padded_in; (void)gsize;
    (void)o_begin; (void)o_end;
    return 1;  /* no x86 vector unit: q4_one_row */
}
#endif

/* int4, one row of x in natural column order (quant/cpu.py takes it where the group size is a
 * multiple of 16): 1 when the shape is not one it takes. */
int offload_q4_row_natural(const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
                           const float *x, float *y, int64_t rows, int64_t out_f, int64_t padded_in,
                           int64_t gsize, int64_t o_begin, int64_t o_end)
{
    (void)out_f;
    if (rows != 1 || gsize < 1 || padded_in % gsize) return 1;
    if (q4_one_row_x(qw, scales, mins, x, y, padded_in, gsize, o_begin, o_end) == 0) return 0;
    return q4_one_row(qw, scales, mins, x, y, padded_in, gsize, o_begin, o_end);
}

/* int8-quantized activations (opt-in, --activations int8): their own file, one library */
#include "quant_a8.c"
