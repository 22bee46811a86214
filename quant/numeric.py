"""Byte- and float-level helpers shared by every type family (the bottom of quant/: it imports
only quant.types).  NumPy helpers for the reference codecs, and the f16 lookup every Numba
decoder reads block scales through.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .types import type_info

QK = 32  # weights per block of the 32-value types (Q8_0, Q4_0, ...)

# f16 bit pattern -> f32, for Numba code (it has no float16 type)
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, fastmath=True, nogil=True)
def f16_at(buf, o, lut):
    """f32 value of the little-endian f16 stored at byte offset o of buf (lut: F16_TO_F32)."""
    return lut[np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)]


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf, elementwise, without the float error of floor(|v| + 0.5)."""
    a = np.abs(v)
    t = np.floor(a)
    t = t + (a - t >= 0.5)  # a - t is exact for floats
    return np.copysign(t, v)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet = (u >> 16) | 64
    return np.where(is_nan, quiet, rounded).astype(np.uint16)


def bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def blocks(x: np.ndarray, size: int = QK) -> np.ndarray:
    """f32 values (any shape, C order) as (n_blocks, size)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if x.size % size:
        raise ValueError(f"{x.size} values is not a multiple of the block size {size}")
    return x.reshape(-1, size)


def raw_bytes(raw: np.ndarray, qtype: int, n: int) -> np.ndarray:
    """The flat bytes of the first n values of raw (checked to be long enough)."""
    ti = type_info(qtype)
    nbytes = ti.row_bytes(n)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size < nbytes:
        raise ValueError(f"{raw.size} bytes is less than the {nbytes} needed for {n} {ti.name} values")
    return raw[:nbytes]


def f16_field(b: np.ndarray) -> np.ndarray:
    """(nb, 2) bytes -> (nb, 1) f32 of the little-endian f16 they hold."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def inv_or_zero(d: np.ndarray) -> np.ndarray:
    """1 / d in f32, 0 where d is 0 (ggml's `id = d ? 1.0f/d : 0.0f`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def fma32(a, b, c) -> np.ndarray:
    """a*b + c rounded once to f32, as where ik_llama.cpp's build fuses it.  The product of two
    f32 is exact in f64; the sum's double rounding (f64, then f32) differs from an FMA's single
    rounding only on exact f32 ties, which these inputs practically never hit."""
    f64 = np.float64
    return (np.asarray(a, f64) * np.asarray(b, f64) + np.asarray(c, f64)).astype(np.float32)


def rows(x: np.ndarray) -> np.ndarray:
    """x as f32 rows (nrows, n_per_row): a 2-d (or more) array by its last axis, else one row."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)
