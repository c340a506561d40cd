/*
 * One-pass CPU AdamW step over flat buffers (see offload/optim/adamw.py for the contract).
 *
 * Why a hand-written loop: torch's fused AdamW reads and writes master, exp_avg and
 * exp_avg_sq once (24 B/param), but the engine's gradient arrives in 16 bits and the
 * device wants 16-bit weights back. With torch ops that means an upcast pass
 * (2 B read + 4 B write + 4 B re-read) before and a copy-out pass (4 B read + 2 B
 * write) after. Here every element is loaded once, updated in registers and stored
 * once: 2 B grad + 24 B state + 2 B out16 = 28 B/param, the minimum.
 *
 * Exactness: the arithmetic mirrors torch.optim.AdamW's single-tensor path op by op,
 * including where ATen's CPU kernels use a fused multiply-add (lerp is written with
 * an explicit vec::fmadd; addcmul's `self + value*t1*t2` is contracted to an FMA
 * by the compiler that builds torch) and where they do not (true division, not a
 * multiply by a reciprocal). This file must therefore be compiled with
 * -ffp-contract=off so that the compiler adds no FMAs of its own; the FMAs we want
 * are spelled out with fmaf(). (-fno-trapping-math is needed too, for speed only: it
 * lets the compiler turn the selects in the 16-bit conversions into vector blends.)
 * The scalar coefficients (bias corrections, step
 * size, ...) are computed in double precision by the Python caller exactly as torch
 * computes them and arrive here already rounded to float, as ATen rounds scalars.
 *
 * Threads: the caller passes the thread count (torch.get_num_threads()). The block is
 * cut into 64 Ki-element chunks (256 KiB per fp32 stream: long enough for the hardware
 * prefetchers, 64-element aligned so two threads never write one cache line of out16)
 * that the threads claim from a shared atomic counter. A static split would make the
 * whole step wait for the slowest thread; on a shared machine a thread that loses its
 * core for a time slice would stall the step by that slice, whereas with claimed
 * chunks the others simply take its share. pthreads rather than OpenMP because torch
 * ships its own OpenMP runtime; a second one would leave idle threads spinning on the
 * same cores.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

enum { DT_NONE = 0, DT_F32 = 1, DT_BF16 = 2, DT_F16 = 3 };

typedef struct {
    float grad_scale;      /* g = float(grad) * grad_scale                        */
    float decay;           /* 1 - lr*weight_decay (1.0 and unused when wd == 0)   */
    float lerp_weight;     /* 1 - beta1                                           */
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;        /* sqrt(1 - beta2**step)                               */
    float eps;
    float neg_step_size;   /* -lr / (1 - beta1**step)                             */
    int apply_decay;
} coeffs_t;

typedef struct {
    float *master, *exp_avg, *exp_avg_sq;
    const void *grad;
    void *out16;
    const float *sqrt_v;   /* phase 2: torch's sqrt(exp_avg_sq), see offload_cpu_adamw_phase */
    int phase;             /* 0: the whole update; 1: up to exp_avg_sq; 2: from sqrt on */
    int64_t n, chunk;
    _Atomic int64_t next_chunk;   /* the next unclaimed chunk index */
    int grad_dtype, out_dtype;
    const coeffs_t *c;
} job_t;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* Round to nearest even on the bit pattern: adding 0x7FFF plus the lowest kept bit
 * carries into bit 16 exactly when the dropped half is > 0.5 ulp, or == 0.5 ulp with
 * an odd kept part. NaN becomes the canonical quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

/* IEEE binary16 -> binary32, exact. Subnormal halves are m * 2^-24, computed in
 * float arithmetic (m < 1024 is exact); the other classes are bit moves. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t expo = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t normal = ((expo + 112u) << 23) | (mant << 13);
    uint32_t infnan = 0x7F800000u | (mant << 13);
    uint32_t sub = f2u((float)mant * 0x1p-24f);
    uint32_t mag = expo == 0x1Fu ? infnan : (expo == 0u ? sub : normal);
    return u2f(sign | mag);
}

/* binary32 -> binary16, round to nearest even, overflow to inf, NaN kept quiet with
 * its sign and top payload bits (what F16C's vcvtps2ph does, which torch uses).
 *  - normal results: rebias the exponent on the bit pattern, then round the 13
 *    dropped mantissa bits with the same carry trick as bf16;
 *  - subnormal results (|f| < 2^-14): |f| + 0.5f lands on the grid of 2^-24 (one
 *    float ulp at 0.5), so the FPU's own round-to-nearest-even does the rounding;
 *    the bit distance from 0.5f is the half's mantissa (0x400 = smallest normal). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t rebased = a - 0x38000000u; /* (127 - 15) << 23 */
    uint32_t normal = (rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13;
    uint32_t sub = f2u(u2f(a) + 0.5f) - 0x3F000000u;
    uint32_t nan = 0x7E00u | ((a >> 13) & 0x3FFu);
    uint32_t mag = a > 0x7F800000u ? nan
                 : a >= 0x477FF000u ? 0x7C00u /* rounds to >= 65520: inf */
                 : a >= 0x38800000u ? normal
                 : sub;
    return (uint16_t)(sign | mag);
}

/* The per-element update. GD/OD are compile-time constants at every call site so
 * the compiler emits one branch-free, vectorised loop per dtype combination. */
static inline __attribute__((always_inline)) void adamw_range(
    float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq,
    const void *restrict grad, void *restrict out16, int64_t begin, int64_t end,
    const coeffs_t *cp, const int GD, const int OD) {
    const coeffs_t c = *cp;
    /* lerp(m, g, w): ATen picks the form by |w| < 0.5 to keep the result exact at
     * w = 0 and w = 1:  w < 0.5 -> fma(w, g-m, m);  else fma(w-1, g-m, g). */
    const int small_w = fabsf(c.lerp_weight) < 0.5f;
    const float lerp_coeff = small_w ? c.lerp_weight : c.lerp_weight - 1.0f;
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    uint16_t *o16 = (uint16_t *)out16;
    for (int64_t i = begin; i < end; ++i) {
        float g = GD == DT_F32 ? g32[i] : (GD == DT_BF16 ? bf16_to_f32(g16[i]) : f16_to_f32(g16[i]));
        g = g * c.grad_scale;
        float p = master[i];
        if (c.apply_decay) p = p * c.decay;
        float m = exp_avg[i];
        float diff = g - m;
        m = fmaf(lerp_coeff, diff, small_w ? m : g);
        float v = exp_avg_sq[i] * c.beta2;
        v = fmaf(c.one_minus_beta2 * g, g, v);
        float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
        p = p + (c.neg_step_size * m) / denom;
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (OD == DT_BF16) o16[i] = f32_to_bf16(p);
        else if (OD == DT_F16) o16[i] = f32_to_f16(p);
    }
}

/* Phase 1 of the exact mode: everything before the square root (decay, both moments). */
static inline __attribute__((always_inline)) void adamw_pre_range(
    float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq,
    const void *restrict grad, int64_t begin, int64_t end, const coeffs_t *cp, const int GD) {
    const coeffs_t c = *cp;
    const int small_w = fabsf(c.lerp_weight) < 0.5f;
    const float lerp_coeff = small_w ? c.lerp_weight : c.lerp_weight - 1.0f;
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    for (int64_t i = begin; i < end; ++i) {
        float g = GD == DT_F32 ? g32[i] : (GD == DT_BF16 ? bf16_to_f32(g16[i]) : f16_to_f32(g16[i]));
        g = g * c.grad_scale;
        if (c.apply_decay) master[i] = master[i] * c.decay;
        float m = exp_avg[i];
        float diff = g - m;
        exp_avg[i] = fmaf(lerp_coeff, diff, small_w ? m : g);
        exp_avg_sq[i] = fmaf(c.one_minus_beta2 * g, g, exp_avg_sq[i] * c.beta2);
    }
}

/* Phase 2: from sqrt(exp_avg_sq) — computed between the phases by torch itself — on. */
static inline __attribute__((always_inline)) void adamw_post_range(
    float *restrict master, const float *restrict exp_avg, const float *restrict sqrt_v,
    void *restrict out16, int64_t begin, int64_t end, const coeffs_t *cp, const int OD) {
    const coeffs_t c = *cp;
    uint16_t *o16 = (uint16_t *)out16;
    for (int64_t i = begin; i < end; ++i) {
        float denom = sqrt_v[i] / c.bc2_sqrt + c.eps;
        float p = master[i] + (c.neg_step_size * exp_avg[i]) / denom;
        master[i] = p;
        if (OD == DT_BF16) o16[i] = f32_to_bf16(p);
        else if (OD == DT_F16) o16[i] = f32_to_f16(p);
    }
}

#define ADAMW_CASE(GD, OD)                                                              \
    adamw_range(j->master, j->exp_avg, j->exp_avg_sq, j->grad, j->out16, begin, end, j->c, \
                GD, OD)

static void run_chunk(const job_t *j, int64_t begin, int64_t end) {
    if (j->phase == 1) {
        switch (j->grad_dtype) {
            case DT_F32: adamw_pre_range(j->master, j->exp_avg, j->exp_avg_sq, j->grad, begin, end, j->c, DT_F32); break;
            case DT_BF16: adamw_pre_range(j->master, j->exp_avg, j->exp_avg_sq, j->grad, begin, end, j->c, DT_BF16); break;
            case DT_F16: adamw_pre_range(j->master, j->exp_avg, j->exp_avg_sq, j->grad, begin, end, j->c, DT_F16); break;
            default: break;
        }
        return;
    }
    if (j->phase == 2) {
        switch (j->out_dtype) {
            case DT_NONE: adamw_post_range(j->master, j->exp_avg, j->sqrt_v, j->out16, begin, end, j->c, DT_NONE); break;
            case DT_BF16: adamw_post_range(j->master, j->exp_avg, j->sqrt_v, j->out16, begin, end, j->c, DT_BF16); break;
            case DT_F16: adamw_post_range(j->master, j->exp_avg, j->sqrt_v, j->out16, begin, end, j->c, DT_F16); break;
            default: break;
        }
        return;
    }
    switch (j->grad_dtype * 4 + j->out_dtype) {
        case DT_F32 * 4 + DT_NONE: ADAMW_CASE(DT_F32, DT_NONE); break;
        case DT_F32 * 4 + DT_BF16: ADAMW_CASE(DT_F32, DT_BF16); break;
        case DT_F32 * 4 + DT_F16: ADAMW_CASE(DT_F32, DT_F16); break;
        case DT_BF16 * 4 + DT_NONE: ADAMW_CASE(DT_BF16, DT_NONE); break;
        case DT_BF16 * 4 + DT_BF16: ADAMW_CASE(DT_BF16, DT_BF16); break;
        case DT_BF16 * 4 + DT_F16: ADAMW_CASE(DT_BF16, DT_F16); break;
        case DT_F16 * 4 + DT_NONE: ADAMW_CASE(DT_F16, DT_NONE); break;
        case DT_F16 * 4 + DT_BF16: ADAMW_CASE(DT_F16, DT_BF16); break;
        case DT_F16 * 4 + DT_F16: ADAMW_CASE(DT_F16, DT_F16); break;
        default: break;
    }
}

static void *adamw_worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (;;) {
        /* relaxed is enough: chunks are disjoint and pthread_join orders all writes
         * before the caller returns. */
        int64_t k = atomic_fetch_add_explicit(&j->next_chunk, 1, memory_order_relaxed);
        int64_t begin = k * j->chunk;
        if (begin >= j->n) break;
        int64_t end = begin + j->chunk < j->n ? begin + j->chunk : j->n;
        run_chunk(j, begin, end);
    }
    return 0;
}

#define MAX_THREADS 256
#define CHUNK_ELEMS (64 * 1024)

/* Returns 0 on success, -1 on bad dtype codes. Thread-creation failures only mean fewer
 * helpers: the calling thread keeps claiming chunks until none are left. */
static int run_job(int phase, float *master, float *exp_avg, float *exp_avg_sq,
                   const float *sqrt_v, const void *grad, int grad_dtype, void *out16,
                   int out_dtype, int64_t n, float grad_scale, float decay, int apply_decay,
                   float lerp_weight, float beta2, float one_minus_beta2, float bc2_sqrt,
                   float eps, float neg_step_size, int num_threads,
                   int64_t min_elems_per_thread);

int offload_cpu_adamw(float *master, float *exp_avg, float *exp_avg_sq, const void *grad,
                      int grad_dtype, void *out16, int out_dtype, int64_t n,
                      float grad_scale, float decay, int apply_decay, float lerp_weight,
                      float beta2, float one_minus_beta2, float bc2_sqrt, float eps,
                      float neg_step_size, int num_threads, int64_t min_elems_per_thread) {
    return run_job(0, master, exp_avg, exp_avg_sq, 0, grad, grad_dtype, out16, out_dtype, n,
                   grad_scale, decay, apply_decay, lerp_weight, beta2, one_minus_beta2,
                   bc2_sqrt, eps, neg_step_size, num_threads, min_elems_per_thread);
}

/* The exact mode in two calls around torch's own sqrt (see offload/optim/adamw.py): phase 1
 * updates master (decay), exp_avg and exp_avg_sq; phase 2 reads sqrt_v = sqrt(exp_avg_sq)
 * and finishes master and out16. Called on cache-sized pieces, so the extra passes stay in
 * cache and DRAM traffic is still ~28 B/param. */
int offload_cpu_adamw_phase(int phase, float *master, float *exp_avg, float *exp_avg_sq,
                            const float *sqrt_v, const void *grad, int grad_dtype, void *out16,
                            int out_dtype, int64_t n, float grad_scale, float decay,
                            int apply_decay, float lerp_weight, float beta2,
                            float one_minus_beta2, float bc2_sqrt, float eps,
                            float neg_step_size, int num_threads, int64_t min_elems_per_thread) {
    if (phase != 1 && phase != 2) return -2;
    return run_job(phase, master, exp_avg, exp_avg_sq, sqrt_v, grad, grad_dtype, out16,
                   out_dtype, n, grad_scale, decay, apply_decay, lerp_weight, beta2,
                   one_minus_beta2, bc2_sqrt, eps, neg_step_size, num_threads,
                   min_elems_per_thread);
}

static int run_job(int phase, float *master, float *exp_avg, float *exp_avg_sq,
                   const float *sqrt_v, const void *grad, int grad_dtype, void *out16,
                   int out_dtype, int64_t n, float grad_scale, float decay, int apply_decay,
                   float lerp_weight, float beta2, float one_minus_beta2, float bc2_sqrt,
                   float eps, float neg_step_size, int num_threads,
                   int64_t min_elems_per_thread) {
    if (grad_dtype < DT_F32 || grad_dtype > DT_F16 || out_dtype < DT_NONE || out_dtype > DT_F16)
        return -1;
    if (n <= 0) return 0;
    coeffs_t c = {grad_scale, decay, lerp_weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size, apply_decay};
    if (min_elems_per_thread < 1) min_elems_per_thread = 1;
    int64_t useful = n / min_elems_per_thread;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > useful) threads = useful < 1 ? 1 : (int)useful;

    job_t job = {master, exp_avg, exp_avg_sq, grad, out16, sqrt_v, phase, n, CHUNK_ELEMS, 0,
                 grad_dtype, out_dtype, &c};
    /* Aim for >= 4 chunks per thread so a late thread's share can be spread out, but
     * never below 4 Ki elements (the counter would then cost more than it saves). */
    int64_t want = (n / ((int64_t)threads * 4) + 63) / 64 * 64;
    if (want < job.chunk) job.chunk = want < 4096 ? 4096 : want;
    atomic_init(&job.next_chunk, 0);

    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    /* The calling thread works too rather than sleeping in join: T threads, T busy cores. */
    for (int t = 1; t < threads; ++t)
        started[t] = pthread_create(&tids[t], 0, adamw_worker, &job) == 0;
    adamw_worker(&job);
    for (int t = 1; t < threads; ++t)
        if (started[t]) pthread_join(tids[t], 0);
    return 0;
}
