"""What the bit-exact quantizers share (quant.iqk_quantize, iq12_quantize, iq3_quantize,
ktquants): the scalar f32 primitives their Numba kernels use to reproduce ik_llama.cpp's fused
multiply-adds and f16 rounding, and the checks of their NumPy entry points.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .types import TypeInfo

MAGIC = np.float32(12582912.0)   # 1.5 * 2^23: x + MAGIC rounds x to an integer (|x| < 2^22)


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a*b + c in f32 with one rounding (llvm.fma.f32: the hardware FMA where there is one)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        flt = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [flt], ir.FunctionType(flt, [flt, flt, flt]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bit pattern of f32 x as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def f16_bits(typingctx, x):
    """IEEE half bit pattern of f32 x, rounded to nearest even (as GGML_FP32_TO_FP16 / F16C)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(h, ir.IntType(16)), ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def nint_fma(a, b):
    """ik's nearest_int(a*b) with the product fused into the + 1.5*2^23: round half to even.
    (For |a*b| < 2^22; the sum then lies in [2^23, 2^24) where subtracting back is exact.)"""
    v = fma_f32(a, b, MAGIC)
    return np.int32(v - MAGIC)


def quantizer_rows(x: np.ndarray, imatrix: np.ndarray | None, ti: TypeInfo,
                   block: int = 256) -> tuple[np.ndarray, np.ndarray | None]:
    """A quantizer's input as (C-contiguous f32 rows (nrows, n_per_row), the checked imatrix (n,) or
    None).  x: (..., n_per_row), or flat: one row, or rows of len(imatrix) when one is given.
    ValueError with one line for rows that do not split or are not whole blocks, or a wrong-size
    imatrix."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        n = x.size if imatrix is None else np.asarray(imatrix).size
        if n == 0 or x.size % n:
            raise ValueError(f"{ti.name}: {x.size} values do not split into rows of {n}")
        x = x.reshape(-1, n)
    else:
        x = x.reshape(-1, x.shape[-1])
    x = np.ascontiguousarray(x)
    n = x.shape[1]
    if n % block:
        raise ValueError(f"{ti.name}: row length {n} is not a multiple of {block}")
    if imatrix is None:
        return x, None
    im = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
    if im.size != n:
        raise ValueError(f"{ti.name}: imatrix has {im.size} values for rows of {n}")
    return x, im
