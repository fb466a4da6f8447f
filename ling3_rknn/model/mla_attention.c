/*
 * MLA attention over the latent cache, compiled: a decode token's H heads against every
 * cached row (mla_decode_attend), and a prefill chunk's query columns against the rows each
 * may see (mla_prefill_attend); one pass over the cache with a running softmax max
 * (flash-attention's inner loop).
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

#define HEADS LING3_LANES /* Ling-3.0-tiny's 16 heads: the vectorised path; others generic */
#define GROUP LING3_MLA_GROUP /* rows scored before their context is accumulated */

/* Register blocking: ROWS rows (CHANNELS channels) share each load of the 16 query lanes
 * (weights), so ROWS x NV accumulators, NV query vectors and the broadcast row values must
 * fit the register file: 8 x 1 + 1 + 1 of AVX-512's 32, 6 x 2 + 2 + 1 of AVX2's 16, and on
 * NEON, whose by-element FMA keeps each row's value in a register of its own, 4 x 4 + 4 + 4
 * of 32 (6 rows spilled two accumulators per channel). Measured: docs/performance.md. */
#if defined(__AVX512F__)
#define ROWS 8
#define CHANNELS 8
#elif defined(__AVX__)
#define ROWS 6
#define CHANNELS 6
#else
#define ROWS 4
#define CHANNELS 4
#endif

/* out[a][h] = rows[a] . qT[:, h] for `count` rows (a constant where inlined, so the
 * accumulators stay in registers); qT is [d][HEADS] (head-minor). */
static inline __attribute__((always_inline)) void score_rows(
        const float *restrict qT, int d, const float *restrict rp, int64_t stride,
        float *restrict out, const int count) {
    vfn acc[ROWS][NV];
    for (int a = 0; a < count; a++)
        for (int v = 0; v < NV; v++) acc[a][v] = vfn_splat(0.0f);
    for (int c = 0; c < d; c++) {
        if (c % 16 == 0) /* the rows GROUP ahead, one cache line each per 16 channels */
            for (int a = 0; a < count; a++)
                __builtin_prefetch(rp + (int64_t)(a + GROUP) * stride + c);
        vfn q[NV];
        for (int v = 0; v < NV; v++) q[v] = vfn_load(qT + (int64_t)c * HEADS + v * VN);
        for (int a = 0; a < count; a++) {
            const vfn x = vfn_splat(rp[(int64_t)a * stride + c]);
            for (int v = 0; v < NV; v++) acc[a][v] += x * q[v];
        }
    }
    for (int a = 0; a < count; a++)
        for (int v = 0; v < NV; v++) vfn_store(out + (int64_t)a * HEADS + v * VN, acc[a][v]);
}

/* out[j][h] = rows[j] . qT[:, h] for n rows. */
static void scores16(const float *restrict qT, int d, const float *restrict rows,
                     int64_t stride, int n, float *restrict out) {
    int j = 0;
    for (; j + ROWS <= n; j += ROWS)
        score_rows(qT, d, rows + (int64_t)j * stride, stride, out + (int64_t)j * HEADS, ROWS);
    for (; j + 2 <= n; j += 2)
        score_rows(qT, d, rows + (int64_t)j * stride, stride, out + (int64_t)j * HEADS, 2);
    if (j < n) score_rows(qT, d, rows + (int64_t)j * stride, stride, out + (int64_t)j * HEADS, 1);
}

/* ctxT[c + a][h] += sum_j p[j][h] * rows[j][c + a] for `count` channels from c. */
static inline __attribute__((always_inline)) void context_channels(
        const float *restrict p, const float *restrict rows, int64_t stride, int n, int c,
        float *restrict ctxT, const int count) {
    vfn acc[CHANNELS][NV];
    for (int a = 0; a < count; a++)
        for (int v = 0; v < NV; v++) acc[a][v] = vfn_load(ctxT + (int64_t)(c + a) * HEADS + v * VN);
    for (int j = 0; j < n; j++) {
        vfn pj[NV];
        for (int v = 0; v < NV; v++) pj[v] = vfn_load(p + (int64_t)j * HEADS + v * VN);
        const float *rj = rows + (int64_t)j * stride + c;
        for (int a = 0; a < count; a++) {
            const vfn x = vfn_splat(rj[a]);
            for (int v = 0; v < NV; v++) acc[a][v] += x * pj[v];
        }
    }
    for (int a = 0; a < count; a++)
        for (int v = 0; v < NV; v++) vfn_store(ctxT + (int64_t)(c + a) * HEADS + v * VN, acc[a][v]);
}

/* ctxT[c][h] += sum_j p[j][h] * rows[j][c] for the first r channels; p is [n][HEADS]. */
static void context16(const float *restrict p, const float *restrict rows, int64_t stride,
                      int n, int r, float *restrict ctxT) {
    int c = 0;
    for (; c + CHANNELS <= r; c += CHANNELS)
        context_channels(p, rows, stride, n, c, ctxT, CHANNELS);
    for (; c + 2 <= r; c += 2) context_channels(p, rows, stride, n, c, ctxT, 2);
    if (c < r) context_channels(p, rows, stride, n, c, ctxT, 1);
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
        for (int v = 0; v < NV; v++) {
            const vfn m = vfn_load(maxes + v * VN);
            vfn sum = vfn_load(denom + v * VN);
            for (int j = 0; j < n; j++) {
                float *sj = scores + (int64_t)j * HEADS + v * VN;
                const vfn e = vfn_exp(vfn_load(sj) - m);
                vfn_store(sj, e);
                sum += e;
            }
            vfn_store(denom + v * VN, sum);
        }
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

/* n rows of a block from row j0 on, as float32: in place for a float32 cache, widened into
 * `wide` (GROUP * stride floats) for a float16 one. */
static const float *group_rows(const void *block, int64_t j0, int n, int64_t stride, int half,
                               float *wide) {
#ifdef HAVE_FLOAT16
    if (half) {
        widen_rows((const uint16_t *)block + j0 * stride, n * stride, wide);
        return wide;
    }
#else
    (void)half;
    (void)wide;
    (void)n;
#endif
    return (const float *)block + j0 * stride;
}

/* Rows in a cache of n_blocks blocks, or the kernels' error: -1 if there is no row at all,
 * -2 for a float16 cache this build cannot read. */
static int64_t cache_rows(const int64_t *lengths, int n_blocks, int half) {
#ifndef HAVE_FLOAT16
    if (half) return -2;
#else
    (void)half;
#endif
    int64_t total = 0;
    for (int b = 0; b < n_blocks; b++) total += lengths[b];
    return total > 0 ? total : -1;
}

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
    const int64_t total = cache_rows(lengths, n_blocks, half);
    if (total < 0) return (int)total;
    memset(ctxT, 0, sizeof(float) * (size_t)r * (size_t)heads);
    for (int h = 0; h < heads; h++) {
        denom[h] = 0.0f;
        runmax[h] = -INFINITY;
    }
    float *maxes = scratch + (int64_t)GROUP * heads, *factors = maxes + heads;
    float *wide = factors + heads; /* GROUP rows as float32, for a float16 cache */
    for (int b = 0; b < n_blocks; b++) {
        for (int64_t j0 = 0; j0 < lengths[b]; j0 += GROUP) {
            const int n = (int)(lengths[b] - j0 < GROUP ? lengths[b] - j0 : GROUP);
            const float *rows = group_rows(blocks[b], j0, n, stride, half, wide);
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

/*
 * Causal attention of a prefill chunk. Its query columns (one per (token, head) pair, in any
 * order) come in tiles of 16, the vector lanes: qT [tiles][d][16], each column the scaled
 * query [c_kv part (r) | rope part] of one head of one token, lane_pos [tiles * 16] its
 * position (a padding lane: any position, its result is discarded). Key row k is seen by a
 * column at position p iff k <= p; rows below `mask_from` are seen by every column.
 * Scores read channels [score_offset, score_offset + d) of a row, the context its first r:
 * the absorbed form's latent rows [c_kv | k_rope] take offset 0 (the context is c_kv), the
 * expanded form's per-head rows [v | k_nope | k_rope] offset r (docs/model.md, MLA).
 *
 * Why: a 64-token chunk over a deep cache is the same two products as decode with 64x the
 * columns. Through numpy they are skinny GEMMs (K = 576 or N = 16 x heads) plus separate
 * passes for the mask, the max and e^x over a [rows, columns] score matrix. Here the decode
 * kernel's register-blocked products run per tile while a 64-row group of the cache stays in
 * L2 (each group is read from memory once per block of tiles, not once per token), the
 * softmax state lives in registers' worth of lanes, and nothing of size rows x columns is
 * ever written. Tiles are independent: callers split them over threads with no merge.
 *
 * Writes the normalised context ctxT [tiles][r][16]. scratch: TILE_BLOCK * (GROUP + 2) * 16
 * + 2 * 16 floats, plus GROUP * stride with `half` (native_abi.h).
 * Returns 0; -1 if there is no row; -2 for a float16 cache this build cannot read.
 */
#define TILE_BLOCK LING3_MLA_TILE_BLOCK /* tiles sharing each group of rows */

int mla_prefill_attend(const float *qT, const int32_t *lane_pos, int tiles, int d, int r,
                       int score_offset, const void *const *blocks, const int64_t *lengths,
                       int n_blocks, int64_t stride, int half, int64_t mask_from,
                       float *ctxT, float *scratch) {
    const int64_t total = cache_rows(lengths, n_blocks, half);
    if (total < 0) return (int)total;
    float *scores = scratch;                                  /* [TILE_BLOCK][GROUP][16] */
    float *denom = scores + (int64_t)TILE_BLOCK * GROUP * HEADS; /* [TILE_BLOCK][16] */
    float *runmax = denom + TILE_BLOCK * HEADS;                /* [TILE_BLOCK][16] */
    float *maxes = runmax + TILE_BLOCK * HEADS, *factors = maxes + HEADS;
    float *wide = factors + HEADS; /* as above */
    for (int t0 = 0; t0 < tiles; t0 += TILE_BLOCK) {
        const int nt = tiles - t0 < TILE_BLOCK ? tiles - t0 : TILE_BLOCK;
        int64_t seen = 0; /* rows any tile of the block sees */
        for (int i = 0; i < nt * HEADS; i++) {
            const int64_t p = (int64_t)lane_pos[(int64_t)t0 * HEADS + i] + 1;
            seen = p > seen ? p : seen;
        }
        seen = seen < total ? seen : total;
        memset(ctxT + (int64_t)t0 * r * HEADS, 0, sizeof(float) * (size_t)nt * r * HEADS);
        for (int i = 0; i < nt * HEADS; i++) {
            denom[i] = 0.0f;
            runmax[i] = -INFINITY;
        }
        int64_t key = 0;
        for (int b = 0; b < n_blocks && key < seen; b++) {
            for (int64_t j0 = 0; j0 < lengths[b] && key < seen; j0 += GROUP) {
                int64_t left = lengths[b] - j0 < seen - key ? lengths[b] - j0 : seen - key;
                const int n = (int)(left < GROUP ? left : GROUP);
                const float *rows = group_rows(blocks[b], j0, n, stride, half, wide);
                for (int t = 0; t < nt; t++) {
                    const float *q = qT + (int64_t)(t0 + t) * d * HEADS;
                    float *s = scores + (int64_t)t * GROUP * HEADS;
                    scores16(q, d, rows + score_offset, stride, n, s);
                    if (key + n > mask_from) { /* rows some column of the chunk must not see */
                        const int32_t *pos = lane_pos + (int64_t)(t0 + t) * HEADS;
                        const int64_t first = mask_from > key ? mask_from - key : 0;
                        for (int64_t j = first; j < n; j++)
                            for (int h = 0; h < HEADS; h++)
                                if (key + j > pos[h]) s[j * HEADS + h] = -INFINITY;
                    }
                    float *ctx = ctxT + (int64_t)(t0 + t) * r * HEADS;
                    softmax_group(s, n, HEADS, r, ctx, denom + t * HEADS, runmax + t * HEADS,
                                  maxes, factors);
                    context16(s, rows, stride, n, r, ctx);
                }
                key += n;
            }
        }
        for (int t = 0; t < nt; t++) { /* normalise: every lane saw row 0, so denom > 0 */
            float *ctx = ctxT + (int64_t)(t0 + t) * r * HEADS;
            for (int c = 0; c < r; c++)
                for (int h = 0; h < HEADS; h++) ctx[(int64_t)c * HEADS + h] /= denom[t * HEADS + h];
        }
    }
    return 0;
}
