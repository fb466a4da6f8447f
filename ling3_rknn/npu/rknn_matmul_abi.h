/* The part of librknnrt's matmul ABI that ling3-rknn uses, retyped by hand (not copied:
 * Rockchip's headers are under the RKNN SDK License, which does not allow redistributing
 * them here). Source: airockchip/rknn-toolkit2 @ 59a913d (SDK 2.3.2),
 * rknpu2/runtime/Linux/librknn_api/include/rknn_matmul_api.h and rknn_api.h. Field
 * names, types and order follow those headers, so sizes and offsets agree on every ABI;
 * tests/test_npu_matmul.py pins them against ctypes (ling3_rknn/npu/matmul_abi.py) and,
 * with LING3_RKNN_SDK_INCLUDE set, against the SDK headers themselves.
 * Used by the host stand-in (matmul_standin.c); docs/npu-matmul.md. */
#ifndef LING3_RKNN_MATMUL_ABI_H
#define LING3_RKNN_MATMUL_ABI_H

#include <stdint.h>

#define RKNN_SUCC 0
#define RKNN_ERR_FAIL (-1)
#define RKNN_ERR_MALLOC_FAIL (-4)
#define RKNN_ERR_PARAM_INVALID (-5)
#define RKNN_ERR_CTX_INVALID (-7)
#define RKNN_ERR_INPUT_INVALID (-8)
#define RKNN_ERR_OUTPUT_INVALID (-9)

#define RKNN_MAX_DIMS 16
#define RKNN_MAX_NAME_LEN 256

#ifdef __arm__
typedef uint32_t rknn_context;
#else
typedef uint64_t rknn_context;
#endif
typedef rknn_context rknn_matmul_ctx;

/* rknn_tensor_type (an enum: int-sized) */
typedef int rknn_tensor_type;
#define RKNN_TENSOR_FLOAT32 0
#define RKNN_TENSOR_FLOAT16 1
#define RKNN_TENSOR_INT8 2
#define RKNN_TENSOR_INT32 6

/* rknn_core_mask (an enum) */
typedef int rknn_core_mask;
#define RKNN_NPU_CORE_AUTO 0
#define RKNN_NPU_CORE_0 1
#define RKNN_NPU_CORE_1 2
#define RKNN_NPU_CORE_2 4

/* rknn_matmul_type (an enum): the two this project runs on RK3588 */
typedef int rknn_matmul_type;
#define RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 1
#define RKNN_INT8_MM_INT8_TO_INT32 2

/* rknn_matmul_layout */
#define RKNN_MM_LAYOUT_NORM 0
#define RKNN_MM_LAYOUT_NATIVE 1

#define RKNN_TENSOR_MEMORY_FLAGS_ALLOC_INSIDE 1

typedef struct _rknn_tensor_memory {
    void *virt_addr;
    uint64_t phys_addr;
    int32_t fd;
    int32_t offset;
    uint32_t size;
    uint32_t flags;
    void *priv_data;
} rknn_tensor_mem;

typedef struct _rknn_matmul_tensor_attr {
    char name[RKNN_MAX_NAME_LEN];
    uint32_t n_dims;
    uint32_t dims[RKNN_MAX_DIMS];
    uint32_t size;
    rknn_tensor_type type;
} rknn_matmul_tensor_attr;

typedef struct _rknn_matmul_io_attr {
    rknn_matmul_tensor_attr A;
    rknn_matmul_tensor_attr B;
    rknn_matmul_tensor_attr C;
} rknn_matmul_io_attr;

typedef struct rknn_matmul_info_t {
    int32_t M;
    int32_t K;
    int32_t N;
    rknn_matmul_type type;
    int16_t B_layout;
    int16_t B_quant_type;
    int16_t AC_layout;
    int16_t AC_quant_type;
    int32_t iommu_domain_id;
    int16_t group_size;
    int8_t reserved[34];
} rknn_matmul_info;

/* One shape of a dynamic-shape context (rknn_matmul_create_dynamic_shape's list, and the
 * argument of rknn_matmul_set_dynamic_shape); the SDK lets only M vary. */
typedef struct _rknn_matmul_shape {
    int32_t M;
    int32_t K;
    int32_t N;
} rknn_matmul_shape;

#endif
