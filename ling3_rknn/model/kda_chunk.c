/*
 * A prefill piece of a KDA layer for a range of heads: the chunked (WY) delta rule of kda.py's
 * `kda_chunked`, the recurrent state [heads][d][d] updated in place once per chunk.
 *
 * Why C: in numpy a 64-token chunk at full size (16 heads x 128) is ~40 calls over
 * [heads, 16, 16, 128] temporaries and a general LU solve per head, ~2 GFLOP/s on one core:
 * ~1 ms per prompt token and layer, 18 layers, the largest CPU term of a 16K-token prompt
 * after attention. Here a head's chunk stays in L1/L2 (its q, k, v rows, 64 KB of state and
 * the 64 x 64 products), the system is unit lower triangular and solved by forward
 * substitution, and every product is a register-blocked loop on the machine's own vector
 * (native_vec.h). kda.py's numpy path stays the reference the tests hold this to. Math:
 * docs/model.md section 4.
 *
 * Per chunk of c rows with in-chunk cumulative log decay G (rows r, s; channel i):
 *   KK[r][s] = sum_i k_ri k_si e^(G_ri - G_si), QK the same with q_r, for s <= r;
 *   solve (I + diag(beta) strict(KK)) [U | W] = [beta v | beta k e^G];
 *   V' = U - W S;  out = (q e^G) S + QK V';  S <- e^(G_last) S + (k e^(G_last - G))^T V'.
 * Pairs within one LING3_KDA_SUB-row block get their factor e^(G_r - G_s) formed exactly;
 * a pair across blocks factors through the block's last row b, e^(G_r - G_b) e^(G_b - G_s),
 * two factors <= 1 (G falls along the chunk), as kda.py's `_decayed_products` does.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "native_vec.h"

#define SUB LING3_KDA_SUB

/*
 * out[r][0:n] = keep(r) + sum_{j < kn(r)} A[r * lda + j * ak] * B[j * ldb + 0:n] for r < m,
 * where keep(r) is 0 without `acc`, else out[r][0:n] scaled by keep_scale[r] when given,
 * and kn(r) = kdim, or min(kdim, r + 1) when `causal` (A zero above its diagonal).
 * n is a multiple of VN. Blocks of 4 rows x 2 vectors keep 8 accumulators in registers (16
 * ymm on AVX2, 32 on NEON and AVX-512); B's vectors are loaded once per 4 rows.
 */
static void rows_times(int m, int kdim, int n, const float *A, int64_t lda, int64_t ak,
                       const float *B, int64_t ldb, float *out, int64_t ldo, int acc,
                       const float *keep_scale, int causal) {
    int r = 0;
    for (; r + 4 <= m; r += 4) {
        const int kn = causal && r + 4 < kdim ? r + 4 : kdim;
        int c = 0;
        for (; c + 2 * VN <= n; c += 2 * VN) {
            vfn s[4][2];
            for (int i = 0; i < 4; i++)
                for (int v = 0; v < 2; v++)
                    s[i][v] = acc ? vfn_load(out + (r + i) * ldo + c + v * VN) : vfn_splat(0.0f);
            if (keep_scale)
                for (int i = 0; i < 4; i++)
                    for (int v = 0; v < 2; v++) s[i][v] *= vfn_splat(keep_scale[r + i]);
            for (int j = 0; j < kn; j++) {
                const vfn b0 = vfn_load(B + j * ldb + c), b1 = vfn_load(B + j * ldb + c + VN);
                for (int i = 0; i < 4; i++) {
                    const vfn a = vfn_splat(A[(r + i) * lda + j * ak]);
                    s[i][0] += a * b0;
                    s[i][1] += a * b1;
                }
            }
            for (int i = 0; i < 4; i++)
                for (int v = 0; v < 2; v++) vfn_store(out + (r + i) * ldo + c + v * VN, s[i][v]);
        }
        for (; c < n; c += VN) {
            vfn s[4];
            for (int i = 0; i < 4; i++)
                s[i] = acc ? vfn_load(out + (r + i) * ldo + c) : vfn_splat(0.0f);
            if (keep_scale)
                for (int i = 0; i < 4; i++) s[i] *= vfn_splat(keep_scale[r + i]);
            for (int j = 0; j < kn; j++) {
                const vfn b = vfn_load(B + j * ldb + c);
                for (int i = 0; i < 4; i++) s[i] += vfn_splat(A[(r + i) * lda + j * ak]) * b;
            }
            for (int i = 0; i < 4; i++) vfn_store(out + (r + i) * ldo + c, s[i]);
        }
    }
    for (; r < m; r++) {
        const int kn = causal && r + 1 < kdim ? r + 1 : kdim;
        for (int c = 0; c < n; c += VN) {
            vfn s = acc ? vfn_load(out + r * ldo + c) : vfn_splat(0.0f);
            if (keep_scale) s *= vfn_splat(keep_scale[r]);
            for (int j = 0; j < kn; j++)
                s += vfn_splat(A[r * lda + j * ak]) * vfn_load(B + j * ldb + c);
            vfn_store(out + r * ldo + c, s);
        }
    }
}

/* kk[jj] = kr . keys[jj], qk[jj] = qr . keys[jj] for jj < n (n <= 4 at a time: 8 chains). */
static void dots_against(const float *kr, const float *qr, const float *keys, int n, int d,
                         float *kk, float *qk) {
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        vfn a[4], b[4];
        for (int t = 0; t < 4; t++) a[t] = b[t] = vfn_splat(0.0f);
        for (int i = 0; i < d; i += VN) {
            const vfn kv = vfn_load(kr + i), qv = vfn_load(qr + i);
            for (int t = 0; t < 4; t++) {
                const vfn key = vfn_load(keys + (int64_t)(j + t) * d + i);
                a[t] += kv * key;
                b[t] += qv * key;
            }
        }
        for (int t = 0; t < 4; t++) {
            kk[j + t] = vfn_sum(a[t]);
            qk[j + t] = vfn_sum(b[t]);
        }
    }
    for (; j < n; j++) {
        vfn a = vfn_splat(0.0f), b = vfn_splat(0.0f);
        for (int i = 0; i < d; i += VN) {
            const vfn key = vfn_load(keys + (int64_t)j * d + i);
            a += vfn_load(kr + i) * key;
            b += vfn_load(qr + i) * key;
        }
        kk[j] = vfn_sum(a);
        qk[j] = vfn_sum(b);
    }
}

/* KK and QK of one chunk, [c][c] each, lower triangle with the diagonal (zero above). */
static void decayed_products(const float *k, const float *q, int64_t ld, const float *g, int c,
                             int d, float *kk, float *qk, float *keys, float *kr, float *qr) {
    memset(kk, 0, sizeof(float) * c * c);
    memset(qk, 0, sizeof(float) * c * c);
    for (int s0 = 0; s0 < c; s0 += SUB) {
        const int s1 = s0 + SUB < c ? s0 + SUB : c;
        for (int r = s0; r < s1; r++) {
            const float *kr_ = k + r * ld, *qr_ = q + r * ld, *gr = g + (int64_t)r * d;
            for (int s = s0; s <= r; s++) {
                const float *ks = k + s * ld, *gs = g + (int64_t)s * d;
                vfn a = vfn_splat(0.0f), b = vfn_splat(0.0f);
                for (int i = 0; i < d; i += VN) {
                    const vfn f = vfn_load(ks + i) * vfn_exp(vfn_load(gr + i) - vfn_load(gs + i));
                    a += vfn_load(kr_ + i) * f;
                    b += vfn_load(qr_ + i) * f;
                }
                kk[r * c + s] = vfn_sum(a);
                qk[r * c + s] = vfn_sum(b);
            }
        }
        if (s1 >= c) break;
        const float *gb = g + (int64_t)(s1 - 1) * d; /* the block's last row */
        for (int s = s0; s < s1; s++)
            for (int i = 0; i < d; i += VN)
                vfn_store(keys + (int64_t)(s - s0) * d + i,
                          vfn_load(k + s * ld + i) *
                              vfn_exp(vfn_load(gb + i) - vfn_load(g + (int64_t)s * d + i)));
        for (int r = s1; r < c; r++) {
            for (int i = 0; i < d; i += VN) {
                const vfn f = vfn_exp(vfn_load(g + (int64_t)r * d + i) - vfn_load(gb + i));
                vfn_store(kr + i, vfn_load(k + r * ld + i) * f);
                vfn_store(qr + i, vfn_load(q + r * ld + i) * f);
            }
            dots_against(kr, qr, keys, s1 - s0, d, kk + r * c + s0, qk + r * c + s0);
        }
    }
}

/* Rows of x [c][w] (w a multiple of VN) made x[r] -= beta[r] * sum_{s < r} kk[r][s] x[s]:
 * the forward substitution of the unit lower triangular system, 4 vectors of columns at a
 * time so a row's running value stays in registers. */
static void forward_substitute(float *x, int c, int w, const float *kk, const float *beta) {
    int col = 0;
    for (; col + 4 * VN <= w; col += 4 * VN)
        for (int r = 1; r < c; r++) {
            vfn s[4];
            for (int v = 0; v < 4; v++) s[v] = vfn_splat(0.0f);
            for (int j = 0; j < r; j++) {
                const vfn m = vfn_splat(kk[r * c + j]);
                for (int v = 0; v < 4; v++) s[v] += m * vfn_load(x + (int64_t)j * w + col + v * VN);
            }
            const vfn b = vfn_splat(beta[r]);
            for (int v = 0; v < 4; v++) {
                float *p = x + (int64_t)r * w + col + v * VN;
                vfn_store(p, vfn_load(p) - b * s[v]);
            }
        }
    for (; col < w; col += VN)
        for (int r = 1; r < c; r++) {
            vfn s = vfn_splat(0.0f);
            for (int j = 0; j < r; j++)
                s += vfn_splat(kk[r * c + j]) * vfn_load(x + (int64_t)j * w + col);
            float *p = x + (int64_t)r * w + col;
            vfn_store(p, vfn_load(p) - vfn_splat(beta[r]) * s);
        }
}

/* Prefetch the rows of q, k, v and log_decay one (head, chunk) will read. A head's rows sit
 * heads * d floats apart (8 KB at full size), each in a page of its own, which the hardware
 * prefetchers do not follow: the first touch of every row waited on memory (in `perf
 * annotate` the loops that first read them held ~23 % of the kernel's samples, ~17 % with
 * this prefetch). */
static void prefetch_chunk(const float *const *arrays, int64_t ld, int64_t base, int c, int d) {
    for (int a = 0; a < 4; a++)
        for (int r = 0; r < c; r++)
            for (int i = 0; i < d; i += 16) __builtin_prefetch(arrays[a] + base + r * ld + i);
}

/*
 * Tokens [0, t_len) of heads [h0, h1). q, k, v, log_decay: [t_len][heads][d] (q already
 * scaled, k normalised); beta [t_len][heads]; state [heads][d][d] (S, row i = key channel
 * i), updated in place; out [t_len][heads][d]. 1 <= chunk <= LING3_KDA_MAX_CHUNK; d a
 * multiple of LING3_KDA_D_MULTIPLE. scratch: see native_abi.h. Returns 0, or -1 for a shape
 * it does not take (nothing touched).
 */
int kda_chunk_heads(const float *q, const float *k, const float *v, const float *log_decay,
                    const float *beta, int t_len, int heads, int d, int chunk, float *state,
                    float *out, int h0, int h1, float *scratch) {
    if (d < VN || d % LING3_KDA_D_MULTIPLE || d % VN || chunk < 1 || chunk > LING3_KDA_MAX_CHUNK)
        return -1;
    const int64_t ld = (int64_t)heads * d; /* one token's row of q, k, v, out */
    const int64_t cm = chunk;
    float *g = scratch;          /* [chunk][d] cumulative log decay */
    float *x = g + cm * d;       /* [chunk][2d]: U | W, then V' | W */
    float *qe = x + cm * 2 * d;  /* [chunk][d]: q e^G, then k e^(G_last - G) */
    float *ws = qe + cm * d;     /* [chunk][d]: W S */
    float *kk = ws + cm * d;     /* [chunk][chunk] */
    float *qk = kk + cm * cm;    /* [chunk][chunk] */
    float *keys = qk + cm * cm;  /* [SUB][d] */
    float *kr = keys + (int64_t)SUB * d, *qr = kr + d, *bt = qr + d; /* [d], [d], [chunk] */
    for (int h = h0; h < h1; h++) {
        float *S = state + (int64_t)h * d * d;
        for (int t0 = 0; t0 < t_len; t0 += chunk) {
            const int c = t_len - t0 < chunk ? t_len - t0 : chunk;
            const int64_t base = (int64_t)t0 * ld + (int64_t)h * d;
            const float *qc = q + base, *kc = k + base, *vc = v + base, *lc = log_decay + base;
            { /* the next (head, chunk)'s rows, while this one computes */
                const int nt = t0 + chunk < t_len ? t0 + chunk : 0, nh = nt ? h : h + 1;
                if (nh < h1) {
                    const int nc = t_len - nt < chunk ? t_len - nt : chunk;
                    const float *const arrays[4] = {q, k, v, log_decay};
                    prefetch_chunk(arrays, ld, (int64_t)nt * ld + (int64_t)nh * d, nc, d);
                }
            }
            for (int r = 0; r < c; r++) {
                bt[r] = beta[(int64_t)(t0 + r) * heads + h];
                for (int i = 0; i < d; i += VN) {
                    const vfn prev = r ? vfn_load(g + (int64_t)(r - 1) * d + i) : vfn_splat(0.0f);
                    vfn_store(g + (int64_t)r * d + i, prev + vfn_load(lc + r * ld + i));
                }
            }
            decayed_products(kc, qc, ld, g, c, d, kk, qk, keys, kr, qr);
            for (int r = 0; r < c; r++) {
                const vfn b = vfn_splat(bt[r]);
                float *xr = x + (int64_t)r * 2 * d;
                for (int i = 0; i < d; i += VN) {
                    const vfn e = vfn_exp(vfn_load(g + (int64_t)r * d + i));
                    vfn_store(xr + i, b * vfn_load(vc + r * ld + i));
                    vfn_store(xr + d + i, b * vfn_load(kc + r * ld + i) * e);
                    vfn_store(qe + (int64_t)r * d + i, vfn_load(qc + r * ld + i) * e);
                }
            }
            forward_substitute(x, c, 2 * d, kk, bt);
            rows_times(c, d, d, x + d, 2 * d, 1, S, d, ws, d, 0, NULL, 0); /* W S */
            for (int r = 0; r < c; r++) /* V' = U - W S, in place of U */
                for (int i = 0; i < d; i += VN) {
                    float *u = x + (int64_t)r * 2 * d + i;
                    vfn_store(u, vfn_load(u) - vfn_load(ws + (int64_t)r * d + i));
                }
            float *oc = out + base; /* out = (q e^G) S + QK V' */
            rows_times(c, d, d, qe, d, 1, S, d, oc, ld, 0, NULL, 0);
            rows_times(c, c, d, qk, c, 1, x, 2 * d, oc, ld, 1, NULL, 1);
            /* S <- e^(G_last) S + (k e^(G_last - G))^T V' */
            const float *gl = g + (int64_t)(c - 1) * d;
            for (int r = 0; r < c; r++)
                for (int i = 0; i < d; i += VN)
                    vfn_store(qe + (int64_t)r * d + i,
                              vfn_load(kc + r * ld + i) *
                                  vfn_exp(vfn_load(gl + i) - vfn_load(g + (int64_t)r * d + i)));
            for (int i = 0; i < d; i += VN) vfn_store(kr + i, vfn_exp(vfn_load(gl + i)));
            rows_times(d, c, d, qe, 1, d, x, 2 * d, S, d, 1, kr, 0);
        }
    }
    return 0;
}
