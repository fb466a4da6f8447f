/*
 * The CPU's share of prefill attention on the NPU (mla_npu.py, docs/model.md 5.5): between
 * the NPU's Q.K^T and P.V of one piece of cached rows, the online softmax of the piece's
 * scores. At 16K prompt tokens that is ~1.3e10 scores per prompt, the largest part of the
 * CPU residue the NPU then waits on, so each score costs as few vector operations as the
 * float16 result allows: one pass per row for the maximum (the scores come from DRAM once,
 * the row then sits in L1) and one fused pass for e^x, the float16 rounding, the store and
 * the sum.
 */
#include <float.h>
#include <math.h>

#include "native_vec.h"

/* VN lanes of float -> float16 (round to nearest even), the bits stored at dst, and back to
 * float: the sum must see the rounded values (the NPU multiplies the rounded P, not the
 * exact one). x86: F16C's vcvtps2ph at the vector's width; aarch64: the compiler's _Float16
 * vector conversion (fcvtn / fcvtl). */
#if defined(__F16C__)
#include <immintrin.h>
#define HAVE_FLOAT16 1
static inline vfn narrow_store(vfn e, uint16_t *dst) {
#if VN == 16
    __m256i h = _mm512_cvtps_ph((__m512)e, _MM_FROUND_TO_NEAREST_INT);
    memcpy(dst, &h, sizeof h);
    return (vfn)_mm512_cvtph_ps(h);
#elif VN == 8
    __m128i h = _mm256_cvtps_ph((__m256)e, _MM_FROUND_TO_NEAREST_INT);
    memcpy(dst, &h, sizeof h);
    return (vfn)_mm256_cvtph_ps(h);
#else
    __m128i h = _mm_cvtps_ph((__m128)e, _MM_FROUND_TO_NEAREST_INT);
    memcpy(dst, &h, 8);
    return (vfn)_mm_cvtph_ps(h);
#endif
}
#elif defined(__FLT16_MAX__) && !defined(__x86_64__)
#define HAVE_FLOAT16 1
typedef _Float16 vhn __attribute__((vector_size(VN * sizeof(_Float16))));
static inline vfn narrow_store(vfn e, uint16_t *dst) {
    vhn h = __builtin_convertvector(e, vhn);
    memcpy(dst, &h, sizeof h);
    return __builtin_convertvector(h, vfn);
}
#endif

/*
 * e^x for x <= 0, good to 2^-18 relative: enough for a value rounded to float16 next (half a
 * step is 2^-12 .. 2^-11 relative), about half the operations of vfn_exp's float32-exact
 * form. x = n ln2 + r with n = round(x / ln2) (adding 1.5 * 2^23 rounds to an integer and
 * leaves n in the low mantissa bits), |r| <= ln2 / 2; e^r = 1 + r (c1 + r (c2 + r (c3 + r
 * c4))), coefficients fitted for least maximal relative error on that interval: 2.8e-6 in
 * exact arithmetic, plus ~4 float32 roundings (2^-24 each) of Horner's steps and the
 * reduction. Clamped at -87 (e^-87 ~ 1.6e-38 stands in for 0; float16 flushes it anyway),
 * so 2^n stays a normal float.
 */
#define EXP16_C1 0.99996686f
#define EXP16_C2 0.50003016f
#define EXP16_C3 0.16787475f
#define EXP16_C4 0.04151384f
static inline vfn exp_for_half(vfn x) {
    const vfn lo = vfn_splat(-87.0f), round = vfn_splat(12582912.0f); /* 1.5 * 2^23 */
    x = vfn_select(x < lo, lo, x);
    const vfn t = x * 1.44269504088896341f + round;
    const vfn nf = t - round;
    const vin n = (vin)t - (vin)round;
    const vfn r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln 2 in two parts */
    vfn y = r * EXP16_C4 + EXP16_C3;
    y = y * r + EXP16_C2;
    y = y * r + EXP16_C1;
    y = y * r + 1.0f;
    return y * (vfn)((n + 127) << 23);
}

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

#ifdef HAVE_FLOAT16
/* p[0:n] = float16(e^(s - shift)); returns the sum of the rounded values. */
static float exp_row_half(const float *restrict s, int n, float shift, uint16_t *restrict p) {
    const vfn sh = vfn_splat(shift);
    vfn total = vfn_splat(0.0f);
    int j = 0;
    for (; j + VN <= n; j += VN) total += narrow_store(exp_for_half(vfn_load(s + j) - sh), p + j);
    float sum = vfn_sum(total);
    if (j < n) { /* the tail through one padded vector */
        float tail[VN];
        uint16_t half[VN];
        for (int i = 0; i < VN; i++) tail[i] = j + i < n ? s[j + i] : shift;
        vfn back = narrow_store(exp_for_half(vfn_load(tail) - sh), half);
        for (int i = 0; j + i < n; i++) {
            p[j + i] = half[i];
            sum += back[i];
        }
    }
    return sum;
}
#endif

int attn_softmax_piece(const float *scores, int m, int n, const int32_t *limit, float *run_max,
                       float *denom, float *acc, int dv, uint16_t *p) {
#ifndef HAVE_FLOAT16
    (void)scores, (void)m, (void)n, (void)limit, (void)run_max, (void)denom, (void)acc;
    (void)dv, (void)p;
    return -2;
#else
    for (int i = 0; i < m; i++)
        if (limit[i] < 0 || limit[i] > n) return -1;
    for (int i = 0; i < m; i++) {
        const float *s = scores + (int64_t)i * n;
        uint16_t *pi = p + (int64_t)i * n;
        int lim = limit[i];
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
        denom[i] += exp_row_half(s, lim, shift, pi);
    }
    return 0;
#endif
}

/* The NPU's float16 operands from float32 arrays (queries, contexts, projected rows): numpy's
 * float16 conversion takes ~2.4 ns per value on an x86 core, as long as the matmuls these
 * operands feed took on the CPU; here it is a vector conversion, once per value. */
int half_rows(const float *src, int rows, int cols, int64_t src_stride, float scale,
              uint16_t *dst, int64_t dst_stride) {
#ifndef HAVE_FLOAT16
    (void)src, (void)rows, (void)cols, (void)src_stride, (void)scale, (void)dst;
    (void)dst_stride;
    return -2;
#else
    const vfn k = vfn_splat(scale);
    for (int i = 0; i < rows; i++) {
        const float *s = src + (int64_t)i * src_stride;
        uint16_t *d = dst + (int64_t)i * dst_stride;
        int j = 0;
        for (; j + VN <= cols; j += VN) narrow_store(vfn_load(s + j) * k, d + j);
        if (j < cols) {
            float tail[VN] = {0};
            uint16_t half[VN];
            for (int c = 0; j + c < cols; c++) tail[c] = s[j + c];
            narrow_store(vfn_load(tail) * k, half);
            memcpy(d + j, half, (size_t)(cols - j) * sizeof *d);
        }
    }
    return 0;
#endif
}
