/*
 * What a built library says about itself: the ABI version it was compiled from and the
 * instruction set the compiler targeted (native.py logs both and `doctor` shows them).
 * The ISA comes from the compiler's predefined macros, i.e. what -march=native (or any other
 * flags) actually enabled, not from what the CPU advertises.
 */
#include "native_abi.h"

int ling3_native_abi(void) { return LING3_NATIVE_ABI; }

const char *ling3_native_isa(void) {
    return
#if defined(__x86_64__)
        "x86_64"
#elif defined(__aarch64__)
        "aarch64"
#else
        "other"
#endif
#if defined(__AVX512F__)
        " avx512f"
#endif
#if defined(__AVX512FP16__)
        " avx512fp16"
#endif
#if defined(__AVX2__)
        " avx2"
#endif
#if defined(__FMA__)
        " fma"
#endif
#if defined(__F16C__)
        " f16c"
#endif
#if defined(__ARM_NEON)
        " neon"
#endif
#if defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC)
        " fp16"
#endif
#if defined(__ARM_FEATURE_DOTPROD)
        " dotprod"
#endif
        "";
}
