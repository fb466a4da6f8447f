/*
 * One decode token of a KDA layer for a range of heads: short conv + SiLU, q/k
 * normalisation, the per-channel decay and the delta-rule read of the recurrent state,
 * in the deferred form kda.py's RecurrentState keeps (S = diag(scale) (body + keys^T
 * deltas)), written into the same arrays.
 *
 * Why C: the numpy form of this step is ~30 small calls per layer, 18 layers a token, each
 * touching arrays the routed experts have just pushed out of the caches; measured in the
 * CPU half of a decode step they cost several times their arithmetic. Here a head's q, k, v
 * channels, its 64 KB state and its queue are read once, in one call per layer (or per
 * thread's share of the heads). Plain C99 with gcc vector extensions (native_vec.h), no
 * intrinsics: the host's AVX-512/AVX2 and the RK3588's NEON from one source. kda.py's numpy path stays the
 * reference the tests hold this to. Math: docs/model.md section 4.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vec.h"

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif

/* Causal conv over k taps + SiLU for channels [c0, c0 + n) of the token's q|k|v row, the
 * k-1 previous inputs in tail[k-1][channels] shifted in place. */
static void conv_silu(const float *restrict x, float *restrict tail, const float *restrict taps,
                      int k, int64_t channels, int64_t c0, int n, float *restrict out) {
    int c = 0;
    for (; c + VN <= n; c += VN) {
        const int64_t ch = c0 + c;
        vfn s = vfn_splat(0.0f);
        for (int j = 0; j < k - 1; j++)
            s += vfn_load(tail + j * channels + ch) * vfn_load(taps + j * channels + ch);
        const vfn xv = vfn_load(x + ch);
        s += xv * vfn_load(taps + (int64_t)(k - 1) * channels + ch);
        vfn_store(out + c, s / (1.0f + vfn_exp(-s)));
        for (int j = 0; j + 1 < k - 1; j++)
            vfn_store(tail + j * channels + ch, vfn_load(tail + (j + 1) * channels + ch));
        if (k > 1) vfn_store(tail + (int64_t)(k - 2) * channels + ch, xv);
    }
    for (; c < n; c++) {
        const int64_t ch = c0 + c;
        float s = 0.0f;
        for (int j = 0; j < k - 1; j++) s += tail[j * channels + ch] * taps[j * channels + ch];
        s += x[ch] * taps[(int64_t)(k - 1) * channels + ch];
        out[c] = s / (1.0f + expf(-s));
        for (int j = 0; j + 1 < k - 1; j++) tail[j * channels + ch] = tail[(j + 1) * channels + ch];
        if (k > 1) tail[(int64_t)(k - 2) * channels + ch] = x[ch];
    }
}

/* a . b over n floats, VN lanes at a time (a plain loop would not vectorise: reordering a
 * float sum needs -ffast-math, which this file avoids). */
static float dot(const float *a, const float *b, int n) {
    vfn acc = vfn_splat(0.0f);
    int i = 0;
    for (; i + VN <= n; i += VN) acc += vfn_load(a + i) * vfn_load(b + i);
    float s = vfn_sum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[0..n) += a * x[0..n) */
static void axpy(float *restrict y, float a, const float *restrict x, int n) {
    int i = 0;
    for (; i + VN <= n; i += VN)
        vfn_store(y + i, vfn_load(y + i) + a * vfn_load(x + i));
    for (; i < n; i++) y[i] += a * x[i];
}

/*
 * Heads [h0, h1) of one token. qkv: [3p] (p = heads * d) pre-conv q|k|v; tail [k-1][3p];
 * taps [k][3p]; log_decay [heads][d]; beta [heads]; body [heads][d][d]; scale [heads][d];
 * keys, deltas [heads][queue][d] with `pending` (< queue) entries queued. Writes out
 * [heads][d] (S_new^T q) and queues one more entry per head; the caller counts it and
 * flushes a full queue. Rows whose scale fell below fold_rows_below are folded into the
 * body when any row of the range fell below fold_below (RecurrentState.fold_small_rows).
 * scratch: 3 * (h1 - h0) * d + 4 * d + queue * 2 floats. Returns 1 if rows were folded.
 */
int kda_decode_heads(const float *qkv, float *tail, const float *taps, int k, int heads, int d,
                     const float *log_decay, const float *beta, float *body, float *scale,
                     float *keys, float *deltas, int queue, int pending, float fold_below,
                     float fold_rows_below, float *out, int h0, int h1, float *scratch) {
    const int64_t p = (int64_t)heads * d, channels = 3 * p;
    const int nh = h1 - h0;
    float *q_all = scratch, *k_all = q_all + (int64_t)nh * d, *v_all = k_all + (int64_t)nh * d;
    float *x0 = v_all + (int64_t)nh * d, *x1 = x0 + d, *r0 = x1 + d, *r1 = r0 + d;
    float *c0 = r1 + d, *c1 = c0 + queue;
    const float root_d = sqrtf((float)d);
    float lowest = INFINITY;

    /* pass 1: conv, normalisation, decay of every head's row scales */
    for (int h = h0; h < h1; h++) {
        float *q = q_all + (int64_t)(h - h0) * d, *kk = k_all + (int64_t)(h - h0) * d;
        float *v = v_all + (int64_t)(h - h0) * d;
        conv_silu(qkv, tail, taps, k, channels, (int64_t)h * d, d, q);
        conv_silu(qkv, tail, taps, k, channels, p + (int64_t)h * d, d, kk);
        conv_silu(qkv, tail, taps, k, channels, 2 * p + (int64_t)h * d, d, v);
        const float inv_q = 1.0f / (sqrtf(dot(q, q, d) + 1e-6f) * root_d);
        const float inv_k = 1.0f / sqrtf(dot(kk, kk, d) + 1e-6f);
        for (int i = 0; i < d; i++) {
            q[i] *= inv_q;
            kk[i] *= inv_k;
        }
        float *sc = scale + (int64_t)h * d;
        const float *ld = log_decay + (int64_t)h * d;
        int i = 0;
        for (; i + VN <= d; i += VN) {
            const vfn v = vfn_load(sc + i) * vfn_exp(vfn_load(ld + i));
            vfn_store(sc + i, v);
            const float m = vfn_min(v);
            lowest = m < lowest ? m : lowest;
        }
        for (; i < d; i++) {
            sc[i] *= expf(ld[i]);
            lowest = sc[i] < lowest ? sc[i] : lowest;
        }
    }
    int folded = 0;
    if (lowest < fold_below) {
        for (int h = h0; h < h1; h++)
            for (int i = 0; i < d; i++) {
                float *sc = scale + (int64_t)h * d + i;
                if (!(*sc < fold_rows_below)) continue;
                float *row = body + ((int64_t)h * d + i) * d;
                for (int j = 0; j < d; j++) row[j] *= *sc;
                for (int t = 0; t < pending; t++) keys[((int64_t)h * queue + t) * d + i] *= *sc;
                *sc = 1.0f;
            }
        folded = 1;
    }

    /* pass 2: e = S^T k and S^T q in one read of the body, the queued part, the new entry */
    for (int h = h0; h < h1; h++) {
        const float *q = q_all + (int64_t)(h - h0) * d, *kk = k_all + (int64_t)(h - h0) * d;
        const float *v = v_all + (int64_t)(h - h0) * d;
        const float *sc = scale + (int64_t)h * d;
        const float *b = body + (int64_t)h * d * d;
        for (int i = 0; i < d; i++) {
            x0[i] = kk[i] * sc[i];
            x1[i] = q[i] * sc[i];
            r0[i] = 0.0f;
            r1[i] = 0.0f;
        }
        for (int i = 0; i < d; i++) {
            const float *row = b + (int64_t)i * d;
            /* PREFETCH_ROWS rows ahead (into the next head's body at the end: the body is one
             * array), so the memory stream never waits for the hardware prefetcher to
             * notice the pattern again after the queue and output work of every head */
            for (int l = 0; l < d; l += 16) __builtin_prefetch(row + PREFETCH_ROWS * d + l);
            axpy(r0, x0[i], row, d);
            axpy(r1, x1[i], row, d);
        }
        const float *hk = keys + (int64_t)h * queue * d, *hd = deltas + (int64_t)h * queue * d;
        for (int t = 0; t < pending; t++) {
            c0[t] = dot(x0, hk + (int64_t)t * d, d);
            c1[t] = dot(x1, hk + (int64_t)t * d, d);
        }
        for (int t = 0; t < pending; t++) {
            axpy(r0, c0[t], hd + (int64_t)t * d, d);
            axpy(r1, c1[t], hd + (int64_t)t * d, d);
        }
        const float qk = dot(q, kk, d);
        float *delta = deltas + ((int64_t)h * queue + pending) * d;
        float *key = keys + ((int64_t)h * queue + pending) * d;
        float *o = out + (int64_t)h * d;
        const float bh = beta[h];
        for (int j = 0; j < d; j++) {
            delta[j] = (v[j] - r0[j]) * bh;
            o[j] = r1[j] + qk * delta[j];
            key[j] = kk[j] / sc[j];
        }
    }
    return folded;
}
