/*
 * Shared by the kernels: the machine's own float vector (`vfn`, VN lanes) and e^x on it.
 *
 * VN is the widest vector the build targets: 16 floats with AVX-512, 8 with AVX/AVX2, 4 with
 * NEON (the RK3588's A76) or SSE. gcc and clang map `vfn` onto one register, so loops
 * written on it vectorise on the host and on the board from one source, without
 * intrinsics. The kernels' 16-wide quantities (MLA's heads, a prefill tile's columns) are
 * NV = 16 / VN of these, held in arrays the compiler keeps in registers.
 *
 * Why not one 16-float vector type everywhere (what this header had first): gcc lowers a
 * generic vector wider than the target's registers piece by piece, through the stack and
 * general registers (vpinsrq, spills). On an AVX2 host the MLA kernels ran at 6.7 GFLOP/s
 * with it, 0.08x that host's sgemm; on AVX-512, where 16 floats are one register, the same
 * source was fine. docs/performance.md has the figures.
 *
 * e^x is Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, 2^n from
 * the exponent bits): within 1e-7 relative of e^x on [-87, 88], clamped outside (e^-87 ~
 * 1.6e-38 stands in for 0, which no float32 sum with a term near 1 can see). glibc's expf is
 * a call per element, which cost ~40 % of the attention kernel before this.
 */
#ifndef LING3_NATIVE_VEC_H
#define LING3_NATIVE_VEC_H

#include <stdint.h>
#include <string.h>

#include "native_abi.h"

#if defined(__AVX512F__)
#define VN 16
#elif defined(__AVX__)
#define VN 8
#else
#define VN 4
#endif
#define NV (LING3_LANES / VN) /* native vectors per 16 lanes */

typedef float vfn __attribute__((vector_size(VN * sizeof(float))));
typedef int32_t vin __attribute__((vector_size(VN * sizeof(int32_t))));

static inline vfn vfn_load(const float *p) {
    vfn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vfn_store(float *p, vfn v) { memcpy(p, &v, sizeof v); }

/* x in every lane. Not `(vfn){0} + x`: without -ffast-math that is a real addition (kept
 * for x = -0.0), an add per broadcast in the kernels' inner loops; nor a loop over the lanes
 * (gcc builds that with one insert per lane). x - 0 is x for every x, so it folds to a
 * broadcast. */
static inline vfn vfn_splat(float x) { return x - (vfn){0}; }

/* Lane-wise a where mask (-1) else b: vector comparisons give -1 per true lane. */
static inline vfn vfn_select(vin mask, vfn a, vfn b) {
    return (vfn)((mask & (vin)a) | (~mask & (vin)b));
}

static inline vfn vfn_exp(vfn x) {
    const vfn lo = vfn_splat(-87.0f), hi = vfn_splat(88.0f);
    x = vfn_select(x < lo, lo, x);
    x = vfn_select(x > hi, hi, x);
    const vfn fx = x * 1.44269504088896341f + 0.5f;
    vin n = __builtin_convertvector(fx, vin);
    n += __builtin_convertvector(n, vfn) > fx; /* truncation -> floor: adds -1 */
    const vfn nf = __builtin_convertvector(n, vfn);
    x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    const vfn z = x * x;
    vfn y = vfn_splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    return y * (vfn)((n + 127) << 23);
}

/* Sum of a vector's lanes. */
static inline float vfn_sum(vfn v) {
    float s = 0.0f;
    for (int i = 0; i < VN; i++) s += v[i];
    return s;
}

/* Smallest lane. */
static inline float vfn_min(vfn v) {
    float m = v[0];
    for (int i = 1; i < VN; i++) m = v[i] < m ? v[i] : m;
    return m;
}

#endif
