"""The reference codecs of every type, by type id: the slow, obviously-correct NumPy versions that
define what the Numba kernels must produce and what a GGUF file written by ikcli contains.

`quantize` reproduces ik_llama.cpp's ggml_quantize_chunk bit for bit (with or without an
importance matrix), `quantize_row` ggml's quantize_row_<type>_ref (the KV cache's from_float),
`dequantize` its dequantize_row_<type>.  Each dispatches through quant.registry to the type's
family module (quant.floats, legacy, kquants, iqk / iqk_quantize, interleaved), where the
layouts and rules are described.  The byte helpers they share live in quant.numeric (re-exported
here).
"""
from __future__ import annotations

import numpy as np

from .numeric import (QK, bf16_bits_to_f32, blocks, f16_field, f32_to_bf16_bits, fma32,  # noqa: F401
                      inv_or_zero, raw_bytes, round_half_away, rows)
from .registry import traits

# inputs of at least this many values go to the Numba kernels of quant.kquants_fast (same bytes)
FAST_MIN_VALUES = 1 << 16


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
    tr = traits(qtype)
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        n = np.shape(x)[-1] if np.ndim(x) >= 2 else np.size(x)
        if imatrix.size != n:
            raise ValueError(f"imatrix has {imatrix.size} values but the rows have {n} columns")
    if tr.quantize is None:
        raise NotImplementedError(f"reference quantize: type {tr.name} not supported")
    if fast is None:
        fast = np.size(x) >= FAST_MIN_VALUES
    if fast and tr.quantize_fast is not None and (imatrix is None or tr.fast_imatrix):
        return tr.quantize_fast(rows(x), imatrix)
    return tr.quantize(rows(x), imatrix)


def quantize_row(x: np.ndarray, qtype: int) -> np.ndarray:
    """Quantize f32 values (any shape, flattened in C order) with ggml's quantize_row_<type>_ref
    (what the KV cache's from_float does; for every type but Q6_0 and IQ4_NL the same bytes as
    `quantize` without imatrix).  Returns a flat uint8 array of n // block_size * type_size bytes.
    """
    tr = traits(qtype)
    if tr.quantize_row is None:
        raise NotImplementedError(f"reference quantize: type {tr.name} not supported")
    return tr.quantize_row(x)


def dequantize(raw: np.ndarray, qtype: int, n: int, n_per_row: int | None = None) -> np.ndarray:
    """Decode the first `n` values of raw bytes `raw` (flat, C order) of type `qtype` to f32
    (one row of n values for the types with per-row metadata).  _R4/_R8 types: n covers whole
    groups of rows of n_per_row values (default n / interleave: one group, as ik's to_float)."""
    tr = traits(qtype)
    if tr.dequantize is None:
        raise NotImplementedError(f"reference dequantize: type {tr.name} not supported")
    return tr.dequantize(raw, n, n_per_row)
