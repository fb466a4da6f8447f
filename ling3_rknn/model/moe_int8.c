/*
 * The CPU's share of the routed experts when their matmuls run on the NPU in int8
 * (docs/performance.md, "Prefill budget"): around each expert's two int8 x int8 -> int32
 * matmuls, the activations are quantised per token before, dequantised after, SwiGLU'd
 * between, and the outputs weighted and added back per token. In numpy that is ~10 passes
 * over [tokens x 8, 1536] arrays per MoE layer (a gather, abs, max, divide, round, cast;
 * then a cast, two products, an exp...), 6.5 ms per prompt token on one x86 core: more
 * than everything else the CPU keeps. Here each step is one pass.
 *
 * Quantisation is symmetric per row: scale = max|x| / 127, q = round(x / scale) (half away
 * from zero), a zero row gets scale 0 and q = 0. A product of row i and column j comes
 * back as c_ij * row_scale_i * col_scale_j.
 */
#include <math.h>

#include "native_vec.h"

static inline float row_absmax(const float *restrict x, int n) {
    vfn best = vfn_splat(0.0f);
    int j = 0;
    for (; j + VN <= n; j += VN) {
        vfn v = vfn_load(x + j);
        v = vfn_select(v < 0.0f, -v, v);
        best = vfn_select(v > best, v, best);
    }
    float m = 0.0f;
    for (int i = 0; i < VN; i++) m = best[i] > m ? best[i] : m;
    for (; j < n; j++) m = fabsf(x[j]) > m ? fabsf(x[j]) : m;
    return m;
}

/* q = round(x * inv), half away from zero; |x * inv| <= 127 by construction. */
static inline void quantize_row(const float *restrict x, int n, float inv, int8_t *restrict q) {
    const vfn s = vfn_splat(inv);
    int j = 0;
    for (; j + VN <= n; j += VN) {
        vfn y = vfn_load(x + j) * s;
        y += vfn_select(y < 0.0f, vfn_splat(-0.5f), vfn_splat(0.5f));
        vin r = __builtin_convertvector(y, vin); /* truncation: with the 0.5, rounding */
        for (int i = 0; i < VN; i++) q[j + i] = (int8_t)r[i];
    }
    for (; j < n; j++) {
        float y = x[j] * inv;
        q[j] = (int8_t)(y < 0.0f ? y - 0.5f : y + 0.5f);
    }
}

static inline void quantize(const float *restrict x, int n, int8_t *restrict q, float *scale) {
    float m = row_absmax(x, n);
    *scale = m / 127.0f;
    quantize_row(x, n, m > 0.0f ? 127.0f / m : 0.0f, q);
}

int moe_quantize_rows(const float *src, int d, const int64_t *rows, int m, int8_t *dst,
                      float *scales) {
    for (int i = 0; i < m; i++)
        quantize(src + rows[i] * (int64_t)d, d, dst + (int64_t)i * d, scales + i);
    return 0;
}

int moe_swiglu_quantize(const int32_t *c, int m, int inter, const float *row_scale,
                        const float *col_scale, int8_t *dst, float *dst_scale, float *scratch) {
    float *h = scratch; /* one row of the intermediate, float32 */
    for (int r = 0; r < m; r++) {
        const int32_t *gate = c + (int64_t)r * 2 * inter, *up = gate + inter;
        const float rs = row_scale[r];
        int j = 0;
        for (; j + VN <= inter; j += VN) {
            vin gi, ui;
            memcpy(&gi, gate + j, sizeof gi);
            memcpy(&ui, up + j, sizeof ui);
            vfn g = __builtin_convertvector(gi, vfn) * (vfn_load(col_scale + j) * rs);
            vfn u = __builtin_convertvector(ui, vfn) * (vfn_load(col_scale + inter + j) * rs);
            vfn_store(h + j, g / (1.0f + vfn_exp(-g)) * u);
        }
        for (; j < inter; j++) {
            float g = (float)gate[j] * col_scale[j] * rs;
            float u = (float)up[j] * col_scale[inter + j] * rs;
            h[j] = g / (1.0f + expf(-g)) * u;
        }
        quantize(h, inter, dst + (int64_t)r * inter, dst_scale + r);
    }
    return 0;
}

int moe_scatter_add(const int32_t *c, int m, int d, const float *row_scale,
                    const float *col_scale, const float *weight, const int64_t *rows,
                    float *out) {
    for (int r = 0; r < m; r++) {
        const int32_t *src = c + (int64_t)r * d;
        float *dst = out + rows[r] * (int64_t)d;
        const vfn w = vfn_splat(row_scale[r] * weight[r]);
        int j = 0;
        for (; j + VN <= d; j += VN) {
            vin ci;
            memcpy(&ci, src + j, sizeof ci);
            vfn_store(dst + j, vfn_load(dst + j) +
                      __builtin_convertvector(ci, vfn) * vfn_load(col_scale + j) * w);
        }
        for (; j < d; j++) dst[j] += (float)src[j] * col_scale[j] * (row_scale[r] * weight[r]);
    }
    return 0;
}
