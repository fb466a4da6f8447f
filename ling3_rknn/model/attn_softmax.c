/*
 * The CPU's share of prefill attention on the NPU (mla_npu.py, docs/model.md 5.5): between
 * the NPU's Q.K^T and P.V of one piece of cached rows, the online softmax of the piece's
 * scores. numpy would pass over the [queries, rows] scores five times (mask, max, subtract,
 * exp, float16); at 16K prompt tokens that is ~1.3e10 scores per prompt, the CPU residue
 * the NPU then waits on. Here it is one pass per row for the maximum and one for the rest.
 */
#include <float.h>
#include <math.h>

#include "native_vec.h"

/* float -> float16 (round to nearest even) -> float: dst gets the half bits, back the value
 * they hold, which the sum must see (the NPU multiplies the rounded P, not the exact one).
 * x86: F16C's vcvtps2ph; aarch64: the compiler's _Float16, which it vectorises. */
#if defined(__F16C__)
#include <immintrin.h>
#define HAVE_FLOAT16 1
static void narrow_row(const float *restrict src, int n, uint16_t *restrict dst,
                       float *restrict back) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + i), h);
        _mm256_storeu_ps(back + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) {
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        back[i] = _cvtsh_ss(dst[i]);
    }
}
#elif defined(__FLT16_MAX__) && !defined(__x86_64__)
#define HAVE_FLOAT16 1
static void narrow_row(const float *restrict src, int n, uint16_t *restrict dst,
                       float *restrict back) {
    _Float16 *restrict h = (_Float16 *)dst;
    for (int i = 0; i < n; i++) {
        h[i] = (_Float16)src[i];
        back[i] = (float)h[i];
    }
}
#endif

static float row_max(const float *restrict s, int n) {
    vfn best = vfn_splat(-FLT_MAX);
    int j = 0;
    for (; j + VN <= n; j += VN) {
        vfn x = vfn_load(s + j);
        best = vfn_select(x > best, x, best);
    }
    float m = -FLT_MAX;
    for (int i = 0; i < VN; i++) m = best[i] > m ? best[i] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* exp(s - shift) for n values into e (vectorised; the tail through one padded vector). */
static void exp_row(const float *restrict s, int n, float shift, float *restrict e) {
    const vfn sh = vfn_splat(shift);
    int j = 0;
    for (; j + VN <= n; j += VN) vfn_store(e + j, vfn_exp(vfn_load(s + j) - sh));
    if (j < n) {
        float tmp[VN];
        for (int i = 0; i < VN; i++) tmp[i] = j + i < n ? s[j + i] : shift;
        vfn_store(tmp, vfn_exp(vfn_load(tmp) - sh));
        for (int i = 0; j + i < n; i++) e[j + i] = tmp[i];
    }
}

int attn_softmax_piece(const float *scores, int m, int n, const int32_t *limit, float *run_max,
                       float *denom, float *acc, int dv, uint16_t *p, float *scratch) {
#ifndef HAVE_FLOAT16
    (void)scores, (void)m, (void)n, (void)limit, (void)run_max, (void)denom, (void)acc;
    (void)dv, (void)p, (void)scratch;
    return -2;
#else
    float *e = scratch, *back = scratch + n;
    for (int i = 0; i < m; i++) {
        const float *s = scores + (int64_t)i * n;
        uint16_t *pi = p + (int64_t)i * n;
        int lim = limit[i];
        if (lim < 0 || lim > n) return -1;
        memset(pi + lim, 0, (size_t)(n - lim) * sizeof *pi);
        if (lim == 0) continue;
        float top = row_max(s, lim);
        float old = run_max[i];
        float shift = top > old ? top : old;
        if (shift > old) {
            /* old == -FLT_MAX (no key yet): the factor underflows to 0 with an empty acc */
            float factor = expf(old - shift);
            float *a = acc + (int64_t)i * dv;
            for (int c = 0; c < dv; c++) a[c] *= factor;
            denom[i] *= factor;
            run_max[i] = shift;
        }
        exp_row(s, lim, shift, e);
        narrow_row(e, lim, pi, back);
        vfn total = vfn_splat(0.0f);
        int j = 0;
        for (; j + VN <= lim; j += VN) total += vfn_load(back + j);
        float sum = vfn_sum(total);
        for (; j < lim; j++) sum += back[j];
        denom[i] += sum;
    }
    return 0;
#endif
}
