"""Public entry points: matmul / get_rows / dequantize / quantize_tensor on QTensors.

matmul(w, x) computes x @ W.T for f32 activations x (n, cols) and weights W (rows, cols)
stored in any supported GGML type, reading the packed weight bytes in place:

* few tokens (n < many_tokens(qtype): 8 for Q8_0/Q4_0, 16 for F16/BF16): x is quantized
  once to int8 + f32 scale per 32 and Q8_0 / Q4_0 rows are dotted with it using integer
  block sums (F16 / BF16 rows are decoded row by row and dotted in f32), parallel over
  output rows (numba prange).  Cost grows linearly with n.
* many tokens: a tile of rows (about TILE_BYTES of f32) is decoded into a reusable scratch
  buffer and multiplied with BLAS (numpy matmul), tile after tile; at no point is more
  than one tile of the weight matrix held in f32.  Cost grows slowly with n.
* F32 weights go to BLAS directly (the strided view of the bytes is already a matrix).

The crossovers were measured on a Zen 4 core (4096 x 4096): Q8_0 few-token costs ~2 ms
per token, the tile path ~13 ms + ~0.35 ms per token.

Weights may be non-contiguous views (one expert of a 3-D memory-mapped tensor, rows
spaced further apart than their length): only the byte span from the first to the last
row is viewed, never copied, as long as each row is one contiguous run of bytes.

Threads: the Numba kernels use numba's pool, the BLAS calls numpy's OpenBLAS pool; set
both with set_num_threads(n) (quant.blas_threads explains why BLAS's must be set too).
Idle pools that busy-wait fight for the cores: quant.kernels therefore defaults
OMP_WAIT_POLICY to PASSIVE for numba's OpenMP pool (for 512 x 4096 x 4096 Q8_0 on 2 cores
that took the many-token path from 228 to 104 ms), which only works if quant is imported
before numba runs its first parallel function.  TILE_DEQUANT_THREADS can also cap the
numba threads used for tile decoding.
"""
from __future__ import annotations

import numba
import numpy as np

from . import kernels as K
from .blas_threads import get_blas_threads, set_blas_threads
from . import reference
from .tensor import QTensor
from .types import BF16, F16, F32, Q4_0, Q8_0, type_info

MANY_TOKENS = 16          # from this many activation rows on, use dequantized tiles + BLAS
_MANY_TOKENS_INT = 8      # ... and this many for Q8_0 / Q4_0 (integer dots cost more per token)
TILE_BYTES = 4 << 20      # target size of the f32 scratch tile
# Numba threads that decode a tile (None: all of numba's).  Decoding is ~1-2 % of the work
# of a many-token matmul; see the module docstring on thread pools fighting.
TILE_DEQUANT_THREADS: int | None = None

_SUPPORTED = frozenset({F32, F16, BF16, Q8_0, Q4_0})
_ELEM = {F32: 4, F16: 2, BF16: 2, Q8_0: 1, Q4_0: 1}   # alignment the kernels' views need


def set_num_threads(n: int, blas: int | None = None) -> None:
    """Threads for matmul: numba's pool gets n, numpy's OpenBLAS gets `blas` (default n).

    numba.set_num_threads is per calling thread; the BLAS setting is process-wide.
    """
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
    set_blas_threads(int(n if blas is None else blas))


def get_num_threads() -> tuple[int, int | None]:
    """(numba threads, BLAS threads or None when numpy's BLAS is not OpenBLAS)."""
    return numba.get_num_threads(), get_blas_threads()


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


def many_tokens(qtype: int) -> int:
    """Number of activation rows from which matmul switches to the tile + BLAS path."""
    return min(MANY_TOKENS, _MANY_TOKENS_INT) if qtype in (Q8_0, Q4_0) else MANY_TOKENS


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
    elif n < many_tokens(qt):
        _few_tokens(buf, qt, stride, rows, cols, x, target)
    else:
        _many_tokens(buf, qt, stride, rows, cols, x, target)
    if target is not out:
        out[...] = target
    return out


def _quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (n, cols) -> int8 values and one scale per 32, ik_llama.cpp's Q8_2 rule (see kernels)."""
    q = np.empty(x.shape, dtype=np.int8)
    s = np.empty((x.shape[0], x.shape[1] // K.QK), dtype=np.float32)
    K.quantize_act_q8(x, K.QK, q, s)
    return q, s


def _few_tokens(buf, qt, stride, rows, cols, x, out) -> None:
    if qt == Q8_0 or qt == Q4_0:
        q, s = _quantize_act(x)
        kern = K.matvec_q8_0 if qt == Q8_0 else K.matvec_q4_0
        kern(buf, stride, rows, cols, K.QK, K.F16_TO_F32, q, s, out)
    else:
        K.matvec_float(buf, qt, stride, rows, cols, K.QK, K.F16_TO_F32, x, out, 8 * numba.get_num_threads())


def _q8_rounded(x: np.ndarray) -> np.ndarray:
    """x after a round trip through the Q8 activation blocks of the few-token path.

    GGML multiplies Q8_0 / Q4_0 weights with activations quantized this way; doing the same
    before BLAS makes a token's result independent of the batch it came in. Measured with it:
    perplexities within 0.2% of ik_llama.cpp's (-mla 0) on the random Q8_0/Q4_0 models of
    scripts/compare_perplexity.py, except the chaotic 26-layer Lite one (1.8%, README).
    """
    q, s = _quantize_act(x)
    return (q.reshape(x.shape[0], -1, K.QK).astype(np.float32) * s[:, :, None]).reshape(x.shape)


def _many_tokens(buf, qt, stride, rows, cols, x, out) -> None:
    if qt == Q8_0 or qt == Q4_0:
        x = _q8_rounded(x)
    tr = tile_rows(cols, rows)
    tile = np.empty((tr, cols), dtype=np.float32)
    ids = np.arange(rows, dtype=np.int64)
    nt = numba.get_num_threads()
    dq_threads = nt if TILE_DEQUANT_THREADS is None else max(1, min(nt, TILE_DEQUANT_THREADS))
    try:
        numba.set_num_threads(dq_threads)
        for r0 in range(0, rows, tr):
            r1 = min(rows, r0 + tr)
            t = tile[:r1 - r0]
            K.dequant_rows(buf, qt, stride, ids[r0:r1], cols, K.QK, K.F16_TO_F32, t)
            np.matmul(x, t.T, out=out[:, r0:r1])
    finally:
        numba.set_num_threads(nt)


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
    """Quantize f32 values of shape (..., cols) with ggml's reference rules (see quant.reference).

    The QTensor keeps x's shape; its data is a fresh (..., row_bytes) uint8 array.
    """
    _check(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("cannot quantize a scalar")
    raw = reference.quantize(x, qtype)
    return QTensor.from_raw(raw, qtype, x.shape)
