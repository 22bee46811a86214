"""The float family: F32, F16 and BF16 (ggml's row layouts: one value per element).

F16 rounds to nearest even (what F16C and ggml's software path do); BF16 keeps the upper 16
bits of the f32, rounded to nearest even, with NaN forced quiet (ggml's fp32_to_bf16).
Their rows are decoded by quant.kernels itself.
"""
from __future__ import annotations

import numpy as np

from .numeric import bf16_bits_to_f32, f32_to_bf16_bits, raw_bytes

F32_ID, F16_ID, BF16_ID = 0, 1, 30
TYPES = frozenset({F32_ID, F16_ID, BF16_ID})


def quantize_row(x: np.ndarray, qtype: int) -> np.ndarray:
    """f32 values (any shape, C order) -> flat bytes of qtype."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if qtype == F32_ID:
        return x.view(np.uint8).copy()
    if qtype == F16_ID:
        return x.astype(np.float16).view(np.uint8)
    if qtype == BF16_ID:
        return f32_to_bf16_bits(x).view(np.uint8)
    raise ValueError(f"type id {qtype} is not a float type")


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk for the float types: a conversion; the imatrix is ignored, as ik does."""
    return quantize_row(x, qtype)


def dequantize(raw: np.ndarray, qtype: int, n: int) -> np.ndarray:
    """The first n values of the flat bytes raw as f32."""
    raw = raw_bytes(raw, qtype, n)
    if qtype == F32_ID:
        return raw.view(np.float32).copy()
    if qtype == F16_ID:
        return raw.view(np.float16).astype(np.float32)
    if qtype == BF16_ID:
        return bf16_bits_to_f32(raw.view(np.uint16))
    raise ValueError(f"type id {qtype} is not a float type")
