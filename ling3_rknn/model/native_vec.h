/*
 * Shared by the decode kernels: a 16-float vector type and e^x on it.
 *
 * gcc and clang lower `vf16` to the machine's vectors (one zmm, two ymm, four NEON
 * registers), so loops written on it vectorise on the host and on the RK3588 from one
 * source, without intrinsics. e^x is Cephes' expf (range reduction by ln 2 in two parts,
 * degree-5 polynomial, 2^n from the exponent bits): within 1e-7 relative of e^x on
 * [-87, 88], clamped outside (e^-87 ~ 1.6e-38 stands in for 0, which no float32 sum with a
 * term near 1 can see). glibc's expf is a call per element, which cost ~40 % of the
 * attention kernel before this.
 */
#ifndef LING3_NATIVE_VEC_H
#define LING3_NATIVE_VEC_H

#include <stdint.h>
#include <string.h>

#include "native_abi.h"

#define VF_LANES LING3_LANES
typedef float vf16 __attribute__((vector_size(VF_LANES * sizeof(float))));
typedef int32_t vi16 __attribute__((vector_size(VF_LANES * sizeof(int32_t))));

static inline vf16 vf16_load(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vf16_store(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

static inline vf16 vf16_splat(float x) { return (vf16){0} + x; }

/* Lane-wise a where mask (-1) else b: vector comparisons give -1 per true lane. */
static inline vf16 vf16_select(vi16 mask, vf16 a, vf16 b) {
    return (vf16)((mask & (vi16)a) | (~mask & (vi16)b));
}

static inline vf16 vf16_exp(vf16 x) {
    const vf16 lo = vf16_splat(-87.0f), hi = vf16_splat(88.0f);
    x = vf16_select(x < lo, lo, x);
    x = vf16_select(x > hi, hi, x);
    const vf16 fx = x * 1.44269504088896341f + 0.5f;
    vi16 n = __builtin_convertvector(fx, vi16);
    n += __builtin_convertvector(n, vf16) > fx; /* truncation -> floor: adds -1 */
    const vf16 nf = __builtin_convertvector(n, vf16);
    x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    const vf16 z = x * x;
    vf16 y = vf16_splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    return y * (vf16)((n + 127) << 23);
}

#endif
