/*
 * MLA decode attention over the latent cache: one token's H heads against every cached row,
 * one pass over the cache with a running softmax max (flash-decoding's inner loop).
 *
 * Why C: at decode the work is two skinny products per layer, scores = rows . q (576-wide
 * rows against H = 16 query columns) and ctx += p^T rows, about 35 kFLOP per cached row.
 * Through numpy they become OpenBLAS GEMMs with 16 columns, which reach 20-45 GFLOP/s on
 * the host where this was measured (~145 GFLOP/s for a square sgemm): the time is spent
 * packing and in edge kernels, not in FMAs. Here the 16 heads are the vector lanes and a
 * few rows (or channels) share every query load, so the loop is bound by the FMA units.
 * The code is plain C99 that gcc vectorises for the machine it is built on (AVX-512,
 * AVX2, NEON): no intrinsics, so one source serves the host and the RK3588's A76 cores.
 * The numpy path in mla.py stays the reference the tests compare this against.
 * Layout and math: docs/model.md (MLA attention) and docs/performance.md.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vec.h"

#define HEADS VF_LANES /* Ling-3.0-tiny's 16 heads: the vectorised path; others generic */
#define GROUP 64 /* rows scored before their context is accumulated: ~147 KB, in L2 */

#if defined(__AVX512F__)
#define ROWS 8 /* scores: rows sharing each query load (accumulators: ROWS x 16 floats) */
#define CHANNELS 8
#else
#define ROWS 4
#define CHANNELS 4
#endif

/* out[j][h] = rows[j] . qT[:, h] for n rows; qT is [d][HEADS] (head-minor). */
static void scores16(const float *restrict qT, int d, const float *restrict rows,
                     int64_t stride, int n, float *restrict out) {
    int j = 0;
    for (; j + ROWS <= n; j += ROWS) {
        vf16 acc[ROWS];
        for (int a = 0; a < ROWS; a++) acc[a] = (vf16){0};
        const float *rp = rows + (int64_t)j * stride;
        for (int c = 0; c < d; c++) {
            if (c % 16 == 0) /* the rows GROUP ahead, one cache line each per 16 channels */
                for (int a = 0; a < ROWS; a++)
                    __builtin_prefetch(rp + (int64_t)(a + GROUP) * stride + c);
            const vf16 q = vf16_load(qT + (int64_t)c * HEADS);
            for (int a = 0; a < ROWS; a++) acc[a] += rp[(int64_t)a * stride + c] * q;
        }
        memcpy(out + (int64_t)j * HEADS, acc, sizeof acc);
    }
    for (; j < n; j++) {
        vf16 acc = {0};
        const float *rp = rows + (int64_t)j * stride;
        for (int c = 0; c < d; c++) acc += rp[c] * vf16_load(qT + (int64_t)c * HEADS);
        memcpy(out + (int64_t)j * HEADS, &acc, sizeof acc);
    }
}

/* ctxT[c][h] += sum_j p[j][h] * rows[j][c] for the first r channels; p is [n][HEADS]. */
static void context16(const float *restrict p, const float *restrict rows, int64_t stride,
                      int n, int r, float *restrict ctxT) {
    int c = 0;
    for (; c + CHANNELS <= r; c += CHANNELS) {
        vf16 acc[CHANNELS];
        memcpy(acc, ctxT + (int64_t)c * HEADS, sizeof acc);
        for (int j = 0; j < n; j++) {
            const vf16 pj = vf16_load(p + (int64_t)j * HEADS);
            const float *rj = rows + (int64_t)j * stride + c;
            for (int a = 0; a < CHANNELS; a++) acc[a] += rj[a] * pj;
        }
        memcpy(ctxT + (int64_t)c * HEADS, acc, sizeof acc);
    }
    for (; c < r; c++) {
        vf16 acc = vf16_load(ctxT + (int64_t)c * HEADS);
        for (int j = 0; j < n; j++)
            acc += rows[(int64_t)j * stride + c] * vf16_load(p + (int64_t)j * HEADS);
        memcpy(ctxT + (int64_t)c * HEADS, &acc, sizeof acc);
    }
}

/* The same two products for any head count (the small test models). */
static void scores_any(const float *qT, int heads, int d, const float *rows, int64_t stride,
                       int n, float *out) {
    for (int j = 0; j < n; j++) {
        float *o = out + (int64_t)j * heads;
        for (int h = 0; h < heads; h++) o[h] = 0.0f;
        const float *rp = rows + (int64_t)j * stride;
        for (int c = 0; c < d; c++) {
            const float x = rp[c];
            const float *q = qT + (int64_t)c * heads;
            for (int h = 0; h < heads; h++) o[h] += x * q[h];
        }
    }
}

static void context_any(const float *p, int heads, const float *rows, int64_t stride, int n,
                        int r, float *ctxT) {
    for (int j = 0; j < n; j++) {
        const float *pj = p + (int64_t)j * heads;
        const float *rj = rows + (int64_t)j * stride;
        for (int c = 0; c < r; c++) {
            const float x = rj[c];
            float *out = ctxT + (int64_t)c * heads;
            for (int h = 0; h < heads; h++) out[h] += x * pj[h];
        }
    }
}

/* One group's scores [n][heads] become weights e^(s - max) in place, with the running max,
 * the denominator and the context so far rescaled when the max grows. Loops run with the
 * heads innermost so they vectorise like the products. maxes, factors: heads floats. */
static void softmax_group(float *restrict scores, int n, int heads, int r,
                          float *restrict ctxT, float *restrict denom,
                          float *restrict runmax, float *restrict maxes,
                          float *restrict factors) {
    for (int h = 0; h < heads; h++) maxes[h] = runmax[h];
    for (int j = 0; j < n; j++)
        for (int h = 0; h < heads; h++) {
            const float s = scores[(int64_t)j * heads + h];
            maxes[h] = s > maxes[h] ? s : maxes[h];
        }
    int grew = 0;
    for (int h = 0; h < heads; h++) {
        factors[h] = 1.0f;
        if (maxes[h] > runmax[h]) { /* rescale what was accumulated under the old max */
            factors[h] = expf(runmax[h] - maxes[h]);
            denom[h] *= factors[h];
            runmax[h] = maxes[h];
            grew = 1;
        }
    }
    if (grew)
        for (int c = 0; c < r; c++)
            for (int h = 0; h < heads; h++) ctxT[(int64_t)c * heads + h] *= factors[h];
    if (heads == HEADS) {
        const vf16 m = vf16_load(maxes);
        vf16 sum = vf16_load(denom);
        for (int j = 0; j < n; j++) {
            const vf16 e = vf16_exp(vf16_load(scores + (int64_t)j * HEADS) - m);
            memcpy(scores + (int64_t)j * HEADS, &e, sizeof e);
            sum += e;
        }
        memcpy(denom, &sum, sizeof sum);
        return;
    }
    for (int j = 0; j < n; j++)
        for (int h = 0; h < heads; h++) {
            const float e = expf(scores[(int64_t)j * heads + h] - maxes[h]);
            scores[(int64_t)j * heads + h] = e;
            denom[h] += e;
        }
}

/* Rows of a float16 cache as float32, so the products above serve both caches: the cache
 * is read from memory at half the bytes, the arithmetic stays float32. The one place with
 * intrinsics: gcc 12 does not vectorise _Float16 -> float on x86 without AVX512-FP16 (a
 * scalar conversion per value made the float16 path 3.5x slower than float32), so x86
 * uses F16C's vcvtph2ps directly; aarch64 (the RK3588) converts with the compiler's own
 * _Float16, which it vectorises. Without either, a float16 cache is left to numpy (-2). */
#if defined(__F16C__)
#include <immintrin.h>
#define HAVE_FLOAT16 1
static void widen_rows(const uint16_t *restrict src, int64_t count, float *restrict dst) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= count; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < count; i++) dst[i] = _cvtsh_ss(src[i]);
}
#elif defined(__FLT16_MAX__) && !defined(__x86_64__)
#define HAVE_FLOAT16 1
static void widen_rows(const uint16_t *restrict src, int64_t count, float *restrict dst) {
    const _Float16 *restrict h = (const _Float16 *)src;
    for (int64_t i = 0; i < count; i++) dst[i] = (float)h[i];
}
#endif

/*
 * Softmax attention state of one token's heads over the rows of n_blocks blocks
 * (block b holds lengths[b] rows of `stride` values, float32 or, with `half`, float16; a row
 * is [c_kv (r) | k_rope]). qT: [d][heads], the scaled query, d = r + rope width <= stride.
 * Writes the un-normalised context ctxT [r][heads], the softmax denominator and the running
 * max [heads]: the same triple as mla._attend, so partial states merge the same way.
 * scratch: (GROUP + 2) * heads floats, plus GROUP * stride with `half`.
 * Returns 0; -1 if there is no row at all; -2 for a float16 cache this build cannot read.
 */
int mla_decode_attend(const float *qT, int heads, int d, int r, const void *const *blocks,
                      const int64_t *lengths, int n_blocks, int64_t stride, int half,
                      float *ctxT, float *denom, float *runmax, float *scratch) {
#ifndef HAVE_FLOAT16
    if (half) return -2;
#endif
    int64_t total = 0;
    for (int b = 0; b < n_blocks; b++) total += lengths[b];
    if (total <= 0) return -1;
    memset(ctxT, 0, sizeof(float) * (size_t)r * (size_t)heads);
    for (int h = 0; h < heads; h++) {
        denom[h] = 0.0f;
        runmax[h] = -INFINITY;
    }
    float *maxes = scratch + (int64_t)GROUP * heads, *factors = maxes + heads;
#ifdef HAVE_FLOAT16
    float *wide = factors + heads; /* GROUP rows as float32, for a float16 cache */
#endif
    for (int b = 0; b < n_blocks; b++) {
        for (int64_t j0 = 0; j0 < lengths[b]; j0 += GROUP) {
            const int n = (int)(lengths[b] - j0 < GROUP ? lengths[b] - j0 : GROUP);
            const float *rows = (const float *)blocks[b] + j0 * stride;
#ifdef HAVE_FLOAT16
            if (half) {
                widen_rows((const uint16_t *)blocks[b] + j0 * stride, n * stride, wide);
                rows = wide;
            }
#endif
            if (heads == HEADS)
                scores16(qT, d, rows, stride, n, scratch);
            else
                scores_any(qT, heads, d, rows, stride, n, scratch);
            softmax_group(scratch, n, heads, r, ctxT, denom, runmax, maxes, factors);
            if (heads == HEADS)
                context16(scratch, rows, stride, n, r, ctxT);
            else
                context_any(scratch, heads, rows, stride, n, r, ctxT);
        }
    }
    return 0;
}

int ling3_native_abi(void) { return LING3_NATIVE_ABI; }
