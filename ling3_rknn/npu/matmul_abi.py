"""ctypes mirror of librknnrt's matmul ABI (SDK 2.3.2), and the prototypes bound to it.

The fields follow ``rknn_matmul_api.h`` / ``rknn_api.h`` of airockchip/rknn-toolkit2 @
59a913d (SDK 2.3.2), retyped by hand in ``rknn_matmul_abi.h`` (the SDK's license does not
let us ship its headers); tests/test_npu_matmul.py compiles that header and compares every
size and offset with these classes, so a field out of place fails a test, not a board.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

MAX_DIMS = 16
MAX_NAME_LEN = 256

# rknn_context: uint32 on 32-bit ARM (``__arm__``), uint64 elsewhere.
_ARM32 = ctypes.sizeof(ctypes.c_void_p) == 4 and platform.machine().startswith(("arm", "aarch"))
Context = ctypes.c_uint32 if _ARM32 else ctypes.c_uint64

# rknn_matmul_type
FLOAT16_MM_FLOAT16_TO_FLOAT32 = 1
INT8_MM_INT8_TO_INT32 = 2
# rknn_matmul_layout
LAYOUT_NORM = 0
LAYOUT_NATIVE = 1
# rknn_tensor_type
TENSOR_FLOAT32 = 0
TENSOR_FLOAT16 = 1
TENSOR_INT8 = 2
TENSOR_INT32 = 6

ERRORS = {
    -1: "RKNN_ERR_FAIL", -2: "RKNN_ERR_TIMEOUT", -3: "RKNN_ERR_DEVICE_UNAVAILABLE",
    -4: "RKNN_ERR_MALLOC_FAIL", -5: "RKNN_ERR_PARAM_INVALID", -6: "RKNN_ERR_MODEL_INVALID",
    -7: "RKNN_ERR_CTX_INVALID", -8: "RKNN_ERR_INPUT_INVALID", -9: "RKNN_ERR_OUTPUT_INVALID",
    -10: "RKNN_ERR_DEVICE_UNMATCH",
}


def error_name(code: int) -> str:
    return f"{ERRORS.get(code, 'error')} ({code})"


class TensorMem(ctypes.Structure):
    """``rknn_tensor_mem``: one buffer the runtime allocated (``rknn_create_mem``)."""

    _fields_ = [
        ("virt_addr", ctypes.c_void_p),
        ("phys_addr", ctypes.c_uint64),
        ("fd", ctypes.c_int32),
        ("offset", ctypes.c_int32),
        ("size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("priv_data", ctypes.c_void_p),
    ]


class MatmulTensorAttr(ctypes.Structure):
    """``rknn_matmul_tensor_attr``: what the runtime says about A, B or C."""

    _fields_ = [
        ("name", ctypes.c_char * MAX_NAME_LEN),
        ("n_dims", ctypes.c_uint32),
        ("dims", ctypes.c_uint32 * MAX_DIMS),
        ("size", ctypes.c_uint32),
        ("type", ctypes.c_int),  # rknn_tensor_type
    ]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.dims[: self.n_dims])


class MatmulIoAttr(ctypes.Structure):
    """``rknn_matmul_io_attr``: filled by ``rknn_matmul_create``."""

    _fields_ = [("A", MatmulTensorAttr), ("B", MatmulTensorAttr), ("C", MatmulTensorAttr)]


class MatmulInfo(ctypes.Structure):
    """``rknn_matmul_info``: the shape, type, layouts and IOMMU domain asked for."""

    _fields_ = [
        ("M", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("type", ctypes.c_int),  # rknn_matmul_type
        ("B_layout", ctypes.c_int16),
        ("B_quant_type", ctypes.c_int16),
        ("AC_layout", ctypes.c_int16),
        ("AC_quant_type", ctypes.c_int16),
        ("iommu_domain_id", ctypes.c_int32),
        ("group_size", ctypes.c_int16),
        ("reserved", ctypes.c_int8 * 34),
    ]


class DynamicShape(ctypes.Structure):
    """``rknn_matmul_shape``: one (M, K, N) of a dynamic-shape context."""

    _fields_ = [("M", ctypes.c_int32), ("K", ctypes.c_int32), ("N", ctypes.c_int32)]


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "rknn_tensor_mem": TensorMem,
    "rknn_matmul_tensor_attr": MatmulTensorAttr,
    "rknn_matmul_io_attr": MatmulIoAttr,
    "rknn_matmul_info": MatmulInfo,
    "rknn_matmul_shape": DynamicShape,
}

_MemP = ctypes.POINTER(TensorMem)
PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "rknn_matmul_create": (ctypes.c_int, [ctypes.POINTER(Context), ctypes.POINTER(MatmulInfo),
                                          ctypes.POINTER(MatmulIoAttr)]),
    "rknn_matmul_set_core_mask": (ctypes.c_int, [Context, ctypes.c_int]),
    "rknn_create_mem": (_MemP, [Context, ctypes.c_uint32]),
    "rknn_destroy_mem": (ctypes.c_int, [Context, _MemP]),
    "rknn_matmul_set_io_mem": (ctypes.c_int, [Context, _MemP,
                                              ctypes.POINTER(MatmulTensorAttr)]),
    "rknn_matmul_run": (ctypes.c_int, [Context]),
    "rknn_matmul_destroy": (ctypes.c_int, [Context]),
    "rknn_B_normal_layout_to_native_layout": (
        ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                       ctypes.POINTER(MatmulInfo)]),
}
# The dynamic-shape pair (one context, several M over one B): bound when the library has
# them, so a librknnrt without them still runs the static contexts.
DYNAMIC_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "rknn_matmul_create_dynamic_shape": (
        ctypes.c_int, [ctypes.POINTER(Context), ctypes.POINTER(MatmulInfo), ctypes.c_int,
                       ctypes.POINTER(DynamicShape), ctypes.POINTER(MatmulIoAttr)]),
    "rknn_matmul_set_dynamic_shape": (ctypes.c_int, [Context, ctypes.POINTER(DynamicShape)]),
}


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Set every prototype on ``library`` (raises AttributeError for a missing symbol of
    ``PROTOTYPES``; a missing ``DYNAMIC_PROTOTYPES`` pair leaves ``has_dynamic`` false)."""
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(library, name)
        fn.restype = restype
        fn.argtypes = argtypes
    for name, (restype, argtypes) in DYNAMIC_PROTOTYPES.items():
        fn = getattr(library, name, None)
        if fn is not None:
            fn.restype = restype
            fn.argtypes = argtypes
    return library


def has_dynamic(library: ctypes.CDLL) -> bool:
    """Whether ``library`` exports the dynamic-shape pair."""
    return all(hasattr(library, name) for name in DYNAMIC_PROTOTYPES)
