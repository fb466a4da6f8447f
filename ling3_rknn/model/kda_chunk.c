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
 *   V' = U - W S with (I + diag(beta) strict(KK)) [U | W] = [beta v | beta k e^G], solved
 *   here as one system of width d: (I + diag(beta) strict(KK)) V' = beta v - (beta k e^G) S;
 *   out = (q e^G) S + QK V';  S <- e^(G_last) S + (k e^(G_last - G))^T V'.
 * How the decay factors are formed without an exp per pair: chunk_rows.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "native_vec.h"

#define SUB LING3_KDA_SUB

/* The register tile of rows_times: TILE_ROWS rows x TILE_VECS vectors of accumulators, sized
 * to the register file (16 vector registers on SSE/AVX2: 4 x 3, all 16 in use; 32 on AVX-512
 * and NEON), with the tile's column strip of B (kdim x TILE_VECS vectors, <= 16 KB at kdim =
 * 128) kept in L1 while the rows go by. On this AVX-512 host 8 x 2 beat 4 x 4 and 6 x 4, and
 * 4 x 3 beat 4 x 2 and 6 x 2 by ~3-15 % with AVX2 and SSE2 (builds with -DTILE_ROWS= and
 * -DTILE_VECS=, timed as tests/bench/bench_kda_chunk.py does);
 * NEON's 4 x 4 loads 4 vectors of B and 4 floats of A per 16 fmla (by element), unmeasured. */
#ifndef TILE_ROWS
#if VN == 16
#define TILE_ROWS 8
#define TILE_VECS 2
#elif defined(__aarch64__)
#define TILE_ROWS 4
#define TILE_VECS 4
#else
#define TILE_ROWS 4
#define TILE_VECS 3
#endif
#endif

/* One tile of rows_times: rows [r, r + mr) x vectors [c, c + nv * VN), mr and nv constants
 * after inlining, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
    int mr, int nv, int r, int c, int kn, const float *A, int64_t lda, int64_t ak,
    const float *B, int64_t ldb, float *out, int64_t ldo, int acc, const float *keep_scale) {
    vfn s[TILE_ROWS][TILE_VECS];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++)
            s[i][v] = acc ? vfn_load(out + (r + i) * ldo + c + v * VN) : vfn_splat(0.0f);
    if (keep_scale)
        for (int i = 0; i < mr; i++)
            for (int v = 0; v < nv; v++) s[i][v] *= vfn_splat(keep_scale[r + i]);
    const float *a = A + r * lda;
    for (int j = 0; j < kn; j++) {
        vfn b[TILE_VECS];
        for (int v = 0; v < nv; v++) b[v] = vfn_load(B + j * ldb + c + v * VN);
        for (int i = 0; i < mr; i++) {
            const vfn x = vfn_splat(a[i * lda + j * ak]);
            for (int v = 0; v < nv; v++) s[i][v] += x * b[v];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) vfn_store(out + (r + i) * ldo + c + v * VN, s[i][v]);
}

/*
 * out[r][0:n] = keep(r) + sum_{j < kn(r)} A[r * lda + j * ak] * B[j * ldb + 0:n] for r < m,
 * where keep(r) is 0 without `acc`, else out[r][0:n] scaled by keep_scale[r] when given,
 * and kn(r) = kdim, or min(kdim, r + 1) when `causal` (A zero above its diagonal: a tile
 * reads to its last row's diagonal). n is a multiple of VN. Column strips outside, rows
 * inside: a strip of B is read from L2 once, A's rows stream past it.
 */
static void rows_times(int m, int kdim, int n, const float *A, int64_t lda, int64_t ak,
                       const float *B, int64_t ldb, float *out, int64_t ldo, int acc,
                       const float *keep_scale, int causal) {
    for (int c = 0; c < n;) {
        const int nv = n - c >= TILE_VECS * VN ? TILE_VECS : 1;
        int r = 0;
        for (; r + TILE_ROWS <= m; r += TILE_ROWS) {
            const int kn = causal && r + TILE_ROWS < kdim ? r + TILE_ROWS : kdim;
            if (nv == TILE_VECS)
                tile(TILE_ROWS, TILE_VECS, r, c, kn, A, lda, ak, B, ldb, out, ldo, acc, keep_scale);
            else
                tile(TILE_ROWS, 1, r, c, kn, A, lda, ak, B, ldb, out, ldo, acc, keep_scale);
        }
        for (; r < m; r++) {
            const int kn = causal && r + 1 < kdim ? r + 1 : kdim;
            if (nv == TILE_VECS)
                tile(1, TILE_VECS, r, c, kn, A, lda, ak, B, ldb, out, ldo, acc, keep_scale);
            else
                tile(1, 1, r, c, kn, A, lda, ak, B, ldb, out, ldo, acc, keep_scale);
        }
        c += nv * VN;
    }
}

/* Sum of a vector's lanes by halves: log2(VN) vector adds where vfn_sum takes VN - 1 in
 * order. The halves are built from constant lane indices, which gcc compiles to register
 * extracts (a memcpy of the halves would make the summed vector addressable and keep the
 * callers' accumulators on the stack). */
static inline float lanes_sum(vfn v) {
    typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
#if VN == 16
    typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
    const v8 h8 = (v8){v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]} +
                  (v8){v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
    const v4 h4 = (v4){h8[0], h8[1], h8[2], h8[3]} + (v4){h8[4], h8[5], h8[6], h8[7]};
#elif VN == 8
    const v4 h4 = (v4){v[0], v[1], v[2], v[3]} + (v4){v[4], v[5], v[6], v[7]};
#else
    const v4 h4 = v;
#endif
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* One row r of a diagonal block against ns (<= 4) earlier rows of it: w[t] = k_s e^(G_(r-1)
 * - G_s) becomes k_s e^(G_r - G_s) (times a = e^(G_r - G_(r-1))), kk_out[t] = k_r . w[t],
 * qk_out[t] = q_r . w[t]. Rows of w sit d apart. 2 ns independent sums per channel vector. */
static inline __attribute__((always_inline)) void chain_step(
    int ns, float *w, const float *a, const float *kr, const float *qr, int d, float *kk_out,
    float *qk_out) {
    vfn sk[4], sq[4];
    for (int t = 0; t < ns; t++) sk[t] = sq[t] = vfn_splat(0.0f);
    for (int i = 0; i < d; i += VN) {
        const vfn f = vfn_load(a + i), kv = vfn_load(kr + i), qv = vfn_load(qr + i);
#pragma GCC unroll 4
        for (int t = 0; t < ns; t++) {
            const vfn x = vfn_load(w + (int64_t)t * d + i) * f;
            vfn_store(w + (int64_t)t * d + i, x);
            sk[t] += kv * x;
            sq[t] += qv * x;
        }
    }
    for (int t = 0; t < ns; t++) {
        kk_out[t] = lanes_sum(sk[t]);
        qk_out[t] = lanes_sum(sq[t]);
    }
}

/*
 * The first pass over a chunk's rows: KK and QK ([c][c] each, lower triangle with the
 * diagonal, zero above), x = [beta v | -beta k e^G] ([c][2d]; negated so that the solve's
 * right-hand side beta v - (beta k e^G) S is one accumulating product), qe = q e^G ([c][d]),
 * keys_t[i][s] = k_si e^(G_(c-1),i - G_si) ([d][c], the state update's keys) and
 * e = e^(G_(c-1)) ([d]).
 * Scratch: w [min(c, SUB)][d], gsum, a and p [d].
 *
 * Pairs inside a diagonal block of SUB rows: w_s = k_s e^(G_r - G_s) is carried down the
 * block's rows, one product with a_r = e^(G_r - G_(r-1)) per row (one exp per row and
 * channel, not one per pair; every factor <= 1, so w_s only falls), and kk[r][s] =
 * k_r . w_s, qk[r][s] = q_r . w_s. Pairs across blocks factor through the row b = r0 - 1
 * before r's block: (k_r e^(G_r - G_b)) . (k_s e^(G_b - G_s)), both factors <= 1, one
 * register-blocked product of the block's rows and the earlier keys, laid out [d][s]
 * (rows_times). Neither side takes an exp of its own: the block's rows are scaled by the
 * running product p_r = e^(G_r - G_b) of its a_r (then by e^(G_b), one exp per block and
 * channel, into W and qe), and the keys for the next block are the earlier ones times the
 * block's whole decay p (a factor per channel, one row of keys_t) and the block's own w_s at
 * its last row, k_s e^(G_(r1 - 1) - G_s), transposed in; after the last block they are the
 * state update's. Each factor is a product of at most 2 SUB + c / SUB factors <= 1, each
 * rounded (a_r also within e^x's 1e-7): ~50 ulps at most, inside the per-token share d + c
 * of tests/fp_bounds.py's delta_rule_error; e^(G_r - G_s) from the float cumulative sums
 * (kda.py's) loses |G| ulps to the subtraction, hundreds at fast decay.
 */
static void chunk_rows(const float *k, const float *q, const float *v, const float *lc,
                       int64_t ld, const float *bt, int c, int d, float *kk, float *qk,
                       float *x, float *qe, float *keys_t, float *e, float *w, float *gsum,
                       float *a, float *p) {
    const int64_t xd = 2 * (int64_t)d;
    memset(kk, 0, sizeof(float) * c * c);
    memset(qk, 0, sizeof(float) * c * c);
    memset(gsum, 0, sizeof(float) * d);
    for (int r0 = 0; r0 < c; r0 += SUB) {
        const int r1 = r0 + SUB < c ? r0 + SUB : c;
        for (int i = 0; i < d; i += VN) vfn_store(e + i, vfn_exp(vfn_load(gsum + i))); /* e^G_b */
        for (int r = r0; r < r1; r++) {
            const float *kr = k + r * ld, *qr = q + r * ld, *vr = v + r * ld, *lr = lc + r * ld;
            float *wr = w + (int64_t)(r - r0) * d, *xr = x + r * xd, *qer = qe + (int64_t)r * d;
            const vfn b = vfn_splat(bt[r]);
            vfn dk = vfn_splat(0.0f), dq = vfn_splat(0.0f);
            for (int i = 0; i < d; i += VN) {
                const vfn key = vfn_load(kr + i), query = vfn_load(qr + i), l = vfn_load(lr + i);
                const vfn f = vfn_exp(l);
                const vfn pf = r == r0 ? f : vfn_load(p + i) * f;
                vfn_store(gsum + i, vfn_load(gsum + i) + l);
                vfn_store(wr + i, key);
                vfn_store(a + i, f);
                vfn_store(p + i, pf);
                vfn_store(xr + i, b * vfn_load(vr + i));
                vfn_store(xr + d + i, key * pf); /* the block's rows, to scale below */
                vfn_store(qer + i, query * pf);
                dk += key * key;
                dq += query * key;
            }
            kk[r * c + r] = lanes_sum(dk);
            qk[r * c + r] = lanes_sum(dq);
            for (int s = r0; s < r; s += 4) {
                float *ws = w + (int64_t)(s - r0) * d, *ko = kk + r * c + s, *qo = qk + r * c + s;
                switch (r - s < 4 ? r - s : 4) {
                case 1: chain_step(1, ws, a, kr, qr, d, ko, qo); break;
                case 2: chain_step(2, ws, a, kr, qr, d, ko, qo); break;
                case 3: chain_step(3, ws, a, kr, qr, d, ko, qo); break;
                default: chain_step(4, ws, a, kr, qr, d, ko, qo); break;
                }
            }
        }
        if (r0) {
            rows_times(r1 - r0, d, r0, x + r0 * xd + d, xd, 1, keys_t, c, kk + r0 * c, c, 0,
                       NULL, 0);
            rows_times(r1 - r0, d, r0, qe + (int64_t)r0 * d, d, 1, keys_t, c, qk + r0 * c, c, 0,
                       NULL, 0);
        }
        for (int r = r0; r < r1; r++) { /* e^(G_r - G_b) e^G_b = e^G_r */
            float *xr = x + r * xd + d, *qer = qe + (int64_t)r * d;
            const vfn nb = vfn_splat(-bt[r]);
            for (int i = 0; i < d; i += VN) {
                const vfn eb = vfn_load(e + i);
                vfn_store(xr + i, nb * eb * vfn_load(xr + i));
                vfn_store(qer + i, eb * vfn_load(qer + i));
            }
        }
        for (int i = 0; i < d; i++) {
            float *row = keys_t + (int64_t)i * c;
            const vfn m = vfn_splat(p[i]);
            for (int s = 0; s < r0; s += VN) vfn_store(row + s, m * vfn_load(row + s));
            for (int s = r0; s < r1; s++) row[s] = w[(int64_t)(s - r0) * d + i];
        }
    }
    for (int i = 0; i < d; i += VN) vfn_store(e + i, vfn_exp(vfn_load(gsum + i)));
}

/*
 * Rows of x [c][w] (rows ldx apart, w a multiple of VN) made x[r] -= beta[r] * sum_{s < r}
 * kk[r][s] x[s]: the forward substitution of the unit lower triangular system. kk's strict
 * lower triangle is made -beta[r] kk[r][s] on the way. By blocks of SUB rows: a block's rows
 * take the earlier blocks' (solved) rows in one register-blocked product, then its own
 * triangle by substitution, 4 vectors of columns at a time so a row's running value stays
 * in registers.
 */
static void forward_substitute(float *x, int64_t ldx, int c, int w, float *kk,
                               const float *beta) {
    for (int r = 1; r < c; r++)
        for (int s = 0; s < r; s++) kk[r * c + s] *= -beta[r];
    for (int r0 = 0; r0 < c; r0 += SUB) {
        const int r1 = r0 + SUB < c ? r0 + SUB : c;
        if (r0)
            rows_times(r1 - r0, r0, w, kk + r0 * c, c, 1, x, ldx, x + r0 * ldx, ldx, 1, NULL, 0);
        int col = 0;
        for (; col + 4 * VN <= w; col += 4 * VN)
            for (int r = r0 + 1; r < r1; r++) {
                float *p = x + r * ldx + col;
                vfn s[4];
                for (int v = 0; v < 4; v++) s[v] = vfn_load(p + v * VN);
                for (int j = r0; j < r; j++) {
                    const vfn m = vfn_splat(kk[r * c + j]);
                    for (int v = 0; v < 4; v++)
                        s[v] += m * vfn_load(x + j * ldx + col + v * VN);
                }
                for (int v = 0; v < 4; v++) vfn_store(p + v * VN, s[v]);
            }
        for (; col < w; col += VN)
            for (int r = r0 + 1; r < r1; r++) {
                float *p = x + r * ldx + col;
                vfn s = vfn_load(p);
                for (int j = r0; j < r; j++)
                    s += vfn_splat(kk[r * c + j]) * vfn_load(x + j * ldx + col);
                vfn_store(p, s);
            }
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
    /* scratch (native_abi.h's size; [chunk][d] of it is w's, at most [SUB][d] used) */
    float *w = scratch;          /* [min(chunk, SUB)][d]: the in-block keys */
    float *x = w + cm * d;       /* [chunk][2d]: beta v | -beta k e^G, then V' | (spent) */
    float *qe = x + cm * 2 * d;  /* [chunk][d]: q e^G */
    float *keys_t = qe + cm * d; /* [d][chunk]: k e^(G_last - G), transposed */
    float *kk = keys_t + cm * d; /* [chunk][chunk] */
    float *qk = kk + cm * cm;    /* [chunk][chunk] */
    float *gsum = qk + cm * cm, *e = gsum + d; /* [d] each, of [SUB][d] */
    float *a = gsum + (int64_t)SUB * d, *p = a + d, *bt = p + d; /* [d], [d], [chunk] */
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
            for (int r = 0; r < c; r++) bt[r] = beta[(int64_t)(t0 + r) * heads + h];
            chunk_rows(kc, qc, vc, lc, ld, bt, c, d, kk, qk, x, qe, keys_t, e, w, gsum, a, p);
            /* V' = U - W S = solve(beta v - beta k e^G S): the product before the solve, so
             * the solve is d wide, not 2d ([U | W] at once) */
            rows_times(c, d, d, x + d, 2 * d, 1, S, d, x, 2 * d, 1, NULL, 0);
            forward_substitute(x, 2 * d, c, d, kk, bt);
            float *oc = out + base; /* out = (q e^G) S + QK V' */
            rows_times(c, d, d, qe, d, 1, S, d, oc, ld, 0, NULL, 0);
            rows_times(c, c, d, qk, c, 1, x, 2 * d, oc, ld, 1, NULL, 1);
            /* S <- e^(G_last) S + (k e^(G_last - G))^T V' */
            rows_times(d, c, d, keys_t, c, 1, x, 2 * d, S, d, 1, e, 0);
        }
    }
    return 0;
}
