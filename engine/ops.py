"""Element-wise and normalisation operations of the forward pass (float32 NumPy; an
engine.device.DeviceArray input runs the op on the GPU, engine.cuda_backend; RMSNorm in
Numba: a 1B-model token runs 41 norms, ~9 us each as NumPy expressions, ~2 us compiled, for
one row of 384..1024 values)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .device import DeviceArray, empty, on_device, to_host


def _gpu():
    from . import cuda_backend       # imports numba.cuda: only when an activation is on the GPU
    return cuda_backend


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _rms_norm_rows(x, w, eps, out):
    n = x.shape[1]
    for t in range(x.shape[0]):
        xr = x[t]
        ss = np.float32(0.0)
        for j in range(n):
            ss += xr[j] * xr[j]
        scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
        o = out[t]
        for j in range(n):
            o[j] = xr[j] * scale * w[j]


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; w is the learned scale (None: no scale)."""
    if on_device(x) or getattr(w, "on_gpu", False):
        return _gpu().rms_norm(to_device_of(x), w, eps)
    n = x.shape[-1]
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n)
    w = np.ones(n, np.float32) if w is None else np.ascontiguousarray(w, dtype=np.float32)
    out = np.empty_like(x2)
    _rms_norm_rows(x2, w, np.float32(eps), out)
    return out.reshape(x.shape)


def silu(x: np.ndarray) -> np.ndarray:
    if on_device(x):
        return _gpu().silu(x)
    with np.errstate(over="ignore"):          # exp(-x) = inf for very negative x gives the right 0
        return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    if on_device(x):
        if axis not in (-1, x.ndim - 1):
            raise ValueError("softmax on the GPU runs over the last axis")
        return _gpu().softmax(x)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu's)."""
    if on_device(x):
        return on_host(gelu, x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * x * (np.float32(1.0) + np.float32(0.044715) * x * x)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    if on_device(x):
        return _gpu().sigmoid(x)
    with np.errstate(over="ignore"):          # exp(-x) = inf for very negative x gives the right 0
        return 1.0 / (1.0 + np.exp(-x))


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


# ---- the same spelling for host and GPU arrays (the architectures use these, not np.*, where an
# ---- activation may live on the GPU: NumPy's array constructors cannot dispatch on a GPU array)

def to_device_of(x):
    from .device import to_device
    return to_device(x)


def to_side_of(x, like):
    """x on the side of `like` (a layer's constant: on the GPU when it is a GPU layer's)."""
    return to_device_of(x) if getattr(like, "on_gpu", False) else host(x)


def on_host(fn, *args):
    """fn (a host op with no GPU kernel yet) on GPU inputs: they come down, the result goes up."""
    return _gpu().on_host(fn, *args)


def contiguous(x):
    """x as a C-contiguous array, on the side it is (np.ascontiguousarray for host arrays)."""
    return x.contiguous() if isinstance(x, DeviceArray) else np.ascontiguousarray(x)


def empty_like_side(shape: tuple, like) -> "np.ndarray | DeviceArray":
    """An uninitialised f32 array on the side of `like`."""
    return empty(shape, like)


def host(x) -> np.ndarray:
    """x on the host (a GPU array comes down; counted in engine.device.TRANSFERS)."""
    return to_host(x)


def take_rows(x, rows: np.ndarray):
    """x[rows] (fancy row selection), contiguous."""
    if on_device(x):
        return _gpu().take_rows(x, rows)
    return np.ascontiguousarray(x[rows])


def heads_with_shared(x, n_first: int, shared):
    """(n, H, n_first + m): each head's first n_first values of x (n, H, >= n_first), then the
    row's shared values (n, m) (DeepSeek's decompressed keys: per-head nope part, the rope part
    shared by all heads).  On the host one parallel pass (two NumPy assignments, a 50 MB
    strided copy per layer at 4096 cells, ran on one thread)."""
    n, H = x.shape[0], x.shape[1]
    shape = (n, H, n_first + shared.shape[1])
    if on_device(x) or on_device(shared):
        out = empty_like_side(shape, x)
        out[:, :, :n_first] = x[:, :, :n_first]
        out[:, :, n_first:] = shared.reshape(n, 1, -1)
        return out
    out = np.empty(shape, dtype=np.float32)
    _heads_with_shared(np.ascontiguousarray(x, dtype=np.float32), n_first,
                       np.ascontiguousarray(shared, dtype=np.float32), out)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _heads_with_shared(x, n_first, shared, out):
    m = shared.shape[1]
    for c in prange(out.shape[0]):
        for h in range(out.shape[1]):
            for d in range(n_first):
                out[c, h, d] = x[c, h, d]
            for d in range(m):
                out[c, h, n_first + d] = shared[c, d]


def all_finite(x) -> bool:
    if on_device(x):
        return _gpu().all_finite(x)
    return bool(np.isfinite(x).all())


@njit(parallel=True, cache=True, nogil=True)
def _weighted_row_sums(y, w, idx, out):
    for t in prange(idx.shape[0]):
        for c in range(out.shape[1]):
            out[t, c] = np.float32(0.0)
        for j in range(idx.shape[1]):
            k = idx[t, j]
            if k >= 0:
                wj = w[t, j]
                for c in range(out.shape[1]):
                    out[t, c] += y[k, c] * wj


def weighted_row_sums(y: np.ndarray, w: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """out[t] = sum over j of w[t, j] * y[idx[t, j]] (idx -1: skipped), j in order, in f32: the
    same products and sums, in the same order, as multiplying y's rows by their weights and
    adding them slot by slot in NumPy (the MoE expert sum; one parallel pass instead of
    n_used fancy-index passes: ~5 ms per layer of a 512-token batch)."""
    out = np.empty((idx.shape[0], y.shape[1]), dtype=np.float32)
    _weighted_row_sums(np.ascontiguousarray(y, dtype=np.float32), np.ascontiguousarray(w, dtype=np.float32),
                       np.ascontiguousarray(idx, dtype=np.int64), out)
    return out
