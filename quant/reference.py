"""Plain-NumPy quantize / dequantize for the compute types (F32, F16, BF16, Q8_0, Q4_0).

These are the slow, obviously-correct versions: they define what the Numba kernels must
produce and what a GGUF file written by ikcli contains.  `quantize` reproduces ggml's
reference quantizers (quantize_row_*_ref) bit for bit:

* F16   — IEEE half, round to nearest even (what F16C / ggml's software path do).
* BF16  — upper 16 bits of the f32, round to nearest even, NaN forced quiet.
* Q8_0  — blocks of 32: d = amax/127 stored as f16, q = roundf(x / d) (half away from 0),
          where the division is done as a multiplication by the f32 reciprocal of the
          *unrounded* d.
* Q4_0  — blocks of 32: m = the element of largest magnitude (first one on ties),
          d = m / -8 stored as f16, q = min(15, trunc(x / d + 8.5)); byte j of the block
          holds element j in its low nibble and element j+16 in its high nibble.
          Value = (q - 8) * d.
* Q6_0  — (ik_llama.cpp) blocks of 32: 6-bit q = trunc(x / d + 32.5) capped at 63 with
          d = m / -32 from the largest-magnitude element, then d is refitted by weighted least
          squares (weights (x/d)^2, sums in element order).  Bytes: f16 d, 8 bytes qh, 16 bytes
          qs; qs[j] holds the low nibbles of elements j and j+16, and qh[j % 8] holds their two
          high bits at bit 4*(j // 8) (element j) and 4*(j // 8) + 2 (element j+16).
"""
from __future__ import annotations

import numpy as np

from .types import BF16, F16, F32, Q4_0, Q6_0, Q8_0, type_info

QK = 32  # weights per block of Q8_0 and Q4_0

REFERENCE_TYPES = frozenset({F32, F16, BF16, Q8_0, Q4_0, Q6_0})


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


def _blocks(x: np.ndarray, size: int = QK) -> np.ndarray:
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


def _rows(x: np.ndarray) -> np.ndarray:
    """x as f32 rows (nrows, n_per_row): a 2-d (or more) array by its last axis, else one row."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)


# the types whose quantizer reads the imatrix in ik (ggml_quantize_chunk); F32/F16/BF16/Q8_0 ignore it
_LEGACY_CHUNK = (Q4_0, 3, 6, 7, Q6_0, 20)                   # Q4_0, Q4_1, Q5_0, Q5_1, Q6_0, IQ4_NL
_KQUANTS = (10, 11, 12, 13, 14, 23)                          # Q2_K .. Q6_K, IQ4_XS


# inputs of at least this many values go to the Numba kernels of quant.kquants_fast (same bytes)
FAST_MIN_VALUES = 1 << 16
_FAST = (Q8_0, Q4_0, 10, 11, 12, 13, 14, 20, 23)             # Q8_0, Q4_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None,
             fast: bool | None = None) -> np.ndarray:
    """Quantize f32 rows x to the raw bytes of `qtype` exactly as ik_llama.cpp's
    ggml_quantize_chunk(qtype, x, ..., nrows, n_per_row, imatrix) writes them.

    x: (nrows, n_per_row) (any ndim >= 2: rows along the last axis) or flat (one row).
    imatrix: None or n_per_row f32 importance weights (an imatrix file's mean squared
    activations of the columns), the same for every row.  F32, F16, BF16 and Q8_0 ignore it,
    as ik does.  Returns a flat uint8 array of nrows * row_bytes(n_per_row) bytes.
    fast: use quant.kquants_fast's Numba kernels where it has the type (the same bytes);
    None: for inputs of FAST_MIN_VALUES values or more; False: always the NumPy references.
    (The KV cache's conversion, ggml's from_float, is `quantize_row`.)
    """
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        n = np.shape(x)[-1] if np.ndim(x) >= 2 else np.size(x)
        if imatrix.size != n:
            raise ValueError(f"imatrix has {imatrix.size} values but the rows have {n} columns")
    if type_info(qtype).interleave:                            # ik's _R4/_R8 layouts: base type, repacked
        from . import interleaved
        return interleaved.quantize(x, qtype, imatrix)
    if fast is None:
        fast = np.size(x) >= FAST_MIN_VALUES
    if fast and qtype in _FAST and not (qtype == Q4_0 and imatrix is not None):
        from . import kquants_fast
        return kquants_fast.quantize(_rows(x), qtype, imatrix)
    if qtype in _LEGACY_CHUNK and (imatrix is not None or qtype in (Q6_0, 20)):
        from . import legacy
        return legacy.quantize_chunk(_rows(x), qtype, imatrix)
    if qtype in _KQUANTS:
        from . import kquants
        return kquants.quantize(_rows(x), qtype, imatrix)
    if qtype in (137, 138, 139, 140, 141, 144, 145, 146):      # ik's IQK types (quant.iqk)
        from . import iqk_quantize
        return iqk_quantize.quantize(_rows(x), qtype, imatrix)
    return quantize_row(x, qtype)


def quantize_row(x: np.ndarray, qtype: int) -> np.ndarray:
    """Quantize f32 values (any shape, flattened in C order) with ggml's quantize_row_<type>_ref
    (what the KV cache's from_float does; for every type but Q6_0 and IQ4_NL the same bytes as
    `quantize` without imatrix).  Returns a flat uint8 array of n // block_size * type_size bytes.
    """
    if qtype == F32:
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint8).copy()
    if qtype == F16:
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1).astype(np.float16).view(np.uint8)
    if qtype == BF16:
        return f32_to_bf16_bits(np.asarray(x).reshape(-1)).view(np.uint8)
    if qtype == Q8_0:
        b = _blocks(x)
        d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
        inv = inv_or_zero(d)
        q = round_half_away(b * inv).astype(np.int8)
        out = np.empty((b.shape[0], 34), dtype=np.uint8)
        out[:, :2] = d.astype(np.float16).view(np.uint8)
        out[:, 2:] = q.view(np.uint8)
        return out.reshape(-1)
    if qtype == Q4_0:
        b = _blocks(x)
        imax = np.abs(b).argmax(axis=1)[:, None]            # first index on ties, like ggml
        m = np.take_along_axis(b, imax, axis=1)
        d = m / np.float32(-8)
        inv = inv_or_zero(d)
        q = np.trunc(b * inv + np.float32(8.5)).astype(np.int32)
        q = np.minimum(q, 15).astype(np.uint8)               # lower end is >= 0 by construction
        out = np.empty((b.shape[0], 18), dtype=np.uint8)
        out[:, :2] = d.astype(np.float16).view(np.uint8)
        out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
        return out.reshape(-1)
    if qtype == Q6_0:
        return _quantize_q6_0(_blocks(x))
    if qtype in (3, 6, 7):                                   # Q4_1, Q5_0, Q5_1
        from . import legacy
        return legacy.quantize(x, qtype)
    if qtype == 20:                                          # IQ4_NL: quantize_row_iq4_nl_ref is ntry -1
        raise NotImplementedError("quantize_row: IQ4_NL's row reference (ntry -1) is not implemented")
    if qtype in _KQUANTS:
        from . import kquants
        return kquants.quantize(np.asarray(x, np.float32).reshape(1, -1), qtype)
    raise NotImplementedError(f"reference quantize: type {type_info(qtype).name} not supported")


def dequantize(raw: np.ndarray, qtype: int, n: int, n_per_row: int | None = None) -> np.ndarray:
    """Decode the first `n` values of raw bytes `raw` (flat, C order) of type `qtype` to f32
    (one row of n values for the types with per-row metadata).  _R4/_R8 types: n covers whole
    groups of rows of n_per_row values (default n / interleave: one group, as ik's to_float)."""
    ti = type_info(qtype)
    if ti.interleave:
        from . import interleaved
        npr = n // ti.interleave if n_per_row is None else n_per_row
        if npr <= 0 or n % (npr * ti.interleave):
            raise ValueError(f"{ti.name}: {n} values are not whole groups of {ti.interleave} rows of {npr}")
        return interleaved.dequantize(raw, qtype, n // npr, npr).reshape(-1)
    from . import iqk, kquants, legacy
    for family in (legacy, kquants):
        if qtype in (family.LEGACY_TYPES if family is legacy else family.KQUANT_TYPES):
            return family.dequantize(raw, qtype, n)
    if qtype in iqk.IQK_TYPES:
        return iqk.dequantize(raw, qtype, n)
    raw = raw_bytes(raw, qtype, n)
    if qtype == F32:
        return raw.view(np.float32).copy()
    if qtype == F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == BF16:
        return bf16_bits_to_f32(raw.view(np.uint16))
    if qtype == Q8_0:
        b = raw.reshape(-1, 34)
        d = f16_field(b[:, :2])
        return (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)
    if qtype == Q4_0:
        b = raw.reshape(-1, 18)
        d = f16_field(b[:, :2])
        qs = b[:, 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32) - 8
        return (q * d).reshape(-1)
    if qtype == Q6_0:
        b = raw.reshape(-1, 26)
        d = f16_field(b[:, :2])
        qh, qs = b[:, 2:10].astype(np.int32), b[:, 10:].astype(np.int32)
        j = np.arange(16)
        h = qh[:, j % 8] >> (4 * (j // 8))
        lo = ((qs & 15) | ((h << 4) & 0x30)) - 32
        hi = ((qs >> 4) | ((h << 2) & 0x30)) - 32
        return (np.concatenate([lo, hi], axis=1).astype(np.float32) * d).reshape(-1)
    raise NotImplementedError(f"reference dequantize: type {ti.name} not supported")


def _quantize_q6_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, imax, axis=1)[:, 0] / np.float32(-32)).astype(np.float32)
    inv = inv_or_zero(d)
    xs = b * inv[:, None]                                     # scaled values, f32
    q = np.minimum(63, np.trunc(xs + np.float32(32.5)).astype(np.int32))
    qf = (q - 32).astype(np.float32)
    w = xs * xs
    sumqx = np.zeros(len(b), dtype=np.float32)
    sumq2 = np.zeros(len(b), dtype=np.float32)
    for j in range(16):                                       # C's summation order
        a, c = j, j + 16
        sumqx = (sumqx + w[:, a] * b[:, a] * qf[:, a] + w[:, c] * b[:, c] * qf[:, c]).astype(np.float32)
        sumq2 = (sumq2 + w[:, a] * qf[:, a] * qf[:, a] + w[:, c] * qf[:, c] * qf[:, c]).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        dd = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, 1), d).astype(np.float32)
    from .legacy import _pack_qx_0
    return _pack_qx_0(q, dd, 6).reshape(-1)
