"""Public entry points: matmul / get_rows / dequantize / quantize_tensor on QTensors.

matmul(w, x) computes x @ W.T for f32 activations x (n, cols) and weights W (rows, cols)
stored in any supported GGML type, reading the packed weight bytes in place:

* n < MANY_TOKENS (decode, small batches): x is quantized once to int8 + f32 scale per 32
  and Q8_0 / Q4_0 rows are dotted with it using integer block sums (F16 / BF16 rows are
  decoded row by row and dotted in f32), parallel over output rows (numba prange).
* n >= MANY_TOKENS (prompt processing): a tile of rows is decoded into a reusable f32
  scratch buffer and multiplied with BLAS (numpy matmul), tile after tile; at no point is
  more than one tile of the weight matrix held in f32.
* F32 weights go to BLAS directly (the strided view of the bytes is already a matrix).

Threads: the Numba kernels use numba's thread pool (numba.set_num_threads, set by the
engine); the BLAS calls use numpy's BLAS pool.
"""
from __future__ import annotations

import numba
import numpy as np

from . import kernels as K
from . import reference
from .tensor import QTensor
from .types import BF16, F16, F32, Q4_0, Q8_0, type_info

MANY_TOKENS = 16          # from this many activation rows on, use dequantized tiles + BLAS
TILE_BYTES = 4 << 20      # target size of the f32 scratch tile

_SUPPORTED = frozenset({F32, F16, BF16, Q8_0, Q4_0})
_ELEM = {F32: 4, F16: 2, BF16: 2, Q8_0: 1, Q4_0: 1}   # alignment the kernels' views need


def supported(qtype: int) -> bool:
    """True when matmul / get_rows / dequantize / quantize_tensor handle this type id."""
    return int(qtype) in _SUPPORTED


def _check(qtype: int) -> None:
    if not supported(qtype):
        raise NotImplementedError(f"no kernels for tensor type {type_info(qtype).name}")


def _rows_view(w: QTensor) -> tuple[np.ndarray, int, int, int]:
    """(buf, stride, rows, cols) in the kernels' calling convention, without copying the data
    unless its rows are not laid out as contiguous byte runs at a regular spacing."""
    _check(w.qtype)
    data = w.data
    if data.ndim != 2:
        raise ValueError(f"expected a 2-D weight (rows, row_bytes), got data of shape {data.shape}; "
                         "select an expert first (w[i])")
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    rows, rb = data.shape
    cols = w.cols
    if rb != type_info(w.qtype).row_bytes(cols):
        raise ValueError(f"row of {rb} bytes does not hold {cols} {type_info(w.qtype).name} values")
    stride = data.strides[0] if rows > 1 else rb
    if data.strides[1] != 1 or stride < rb or stride % _ELEM[w.qtype] or \
            data.__array_interface__["data"][0] % _ELEM[w.qtype]:
        data = np.ascontiguousarray(data)
        stride = rb
    span = (rows - 1) * stride + rb if rows else 0
    buf = np.lib.stride_tricks.as_strided(data, shape=(span,), strides=(1,), writeable=False)
    return buf, int(stride), int(rows), int(cols)


def _as_act(x: np.ndarray, cols: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"activations must be (n, {cols}), got {x.shape}")
    return x


def tile_rows(cols: int, rows: int) -> int:
    """Rows per f32 scratch tile in the many-token path (a multiple of 16, 16..512)."""
    t = TILE_BYTES // (4 * max(cols, 1))
    t = max(16, min(512, t)) // 16 * 16
    return min(t, rows) if rows else 16


def matmul(w: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x @ W.T for x of shape (n, cols): returns (n, rows) f32 (written into `out` if given)."""
    buf, stride, rows, cols = _rows_view(w)
    x = _as_act(x, cols)
    n = x.shape[0]
    if out is None:
        out = np.empty((n, rows), dtype=np.float32)
    elif out.shape != (n, rows) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {(n, rows)}, got {out.dtype} {out.shape}")
    if n == 0 or rows == 0:
        return out
    target = out if out.flags.c_contiguous else np.empty((n, rows), dtype=np.float32)

    qt = w.qtype
    if qt == F32:
        wf = np.lib.stride_tricks.as_strided(buf.view(np.float32), shape=(rows, cols),
                                             strides=(stride, 4), writeable=False)
        np.matmul(x, wf.T, out=target)
    elif n < MANY_TOKENS:
        _few_tokens(buf, qt, stride, rows, cols, x, target)
    else:
        _many_tokens(buf, qt, stride, rows, cols, x, target)
    if target is not out:
        out[...] = target
    return out


def _few_tokens(buf, qt, stride, rows, cols, x, out) -> None:
    if qt == Q8_0 or qt == Q4_0:
        q = np.empty(x.shape, dtype=np.int8)
        s = np.empty((x.shape[0], cols // K.QK), dtype=np.float32)
        K.quantize_act_q8(x, K.QK, q, s)
        kern = K.matvec_q8_0 if qt == Q8_0 else K.matvec_q4_0
        kern(buf, stride, rows, cols, K.QK, K.F16_TO_F32, q, s, out)
    else:
        K.matvec_float(buf, qt, stride, rows, cols, K.QK, K.F16_TO_F32, x, out, 8 * numba.get_num_threads())


def _many_tokens(buf, qt, stride, rows, cols, x, out) -> None:
    tr = tile_rows(cols, rows)
    tile = np.empty((tr, cols), dtype=np.float32)
    ids = np.arange(rows, dtype=np.int64)
    part = np.empty((x.shape[0], tr), dtype=np.float32)
    for r0 in range(0, rows, tr):
        r1 = min(rows, r0 + tr)
        k = r1 - r0
        K.dequant_rows(buf, qt, stride, ids[r0:r1], cols, K.QK, K.F16_TO_F32, tile[:k])
        if k == tr:
            np.matmul(x, tile.T, out=part)
            out[:, r0:r1] = part
        else:
            out[:, r0:r1] = x @ tile[:k].T


def get_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W as f32, shape ids.shape + (cols,) (embedding lookup)."""
    buf, stride, rows, cols = _rows_view(w)
    ids = np.asarray(ids)
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= rows):
        raise IndexError(f"row id out of range 0..{rows - 1}")
    out = np.empty((flat.size, cols), dtype=np.float32)
    if flat.size:
        K.dequant_rows(buf, w.qtype, stride, flat, cols, K.QK, K.F16_TO_F32, out)
    return out.reshape(*ids.shape, cols)


def dequantize(w: QTensor) -> np.ndarray:
    """The whole tensor as f32 of shape w.shape (meant for small tensors and tests)."""
    _check(w.qtype)
    cols = w.cols
    data = w.data.reshape(-1, w.data.shape[-1])
    flat = QTensor(data, w.qtype, (data.shape[0], cols))
    return get_rows(flat, np.arange(data.shape[0])).reshape(w.shape)


def quantize_tensor(x: np.ndarray, qtype: int) -> QTensor:
    """Quantize f32 values of shape (..., cols) with ggml's reference rules (see quant.reference)."""
    _check(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    raw = reference.quantize(x, qtype)
    return QTensor.from_raw(raw, qtype, x.shape)
