"""Weight products of the forward pass, with an optional observer (imatrix collection).

A product runs where its weight lives: quant.matmul on the CPU, engine.cuda_backend for a weight
placed on the GPU (-ngl / -ot ...=CUDA0); a GPU activation reaching a CPU weight comes down first.

Thin wrappers of quant.matmul's matmul, matmul_id, matmul_heads, moe_up_gate and up_gate: the architectures
import them from here, so a tool can watch every product of a weight tensor with its
activations (llama-imatrix's eval callback) without the architectures knowing.  With no
observer set a call costs one extra Python call and one `if`.

The observer is called *before* the product as

    observer(op, weights, x, ids, rows)

op: ggml's name for the operation: "mul_mat", "mul_mat_id", "fused_up_gate" (dense SiLU MLP
first half) or "moe_fused_up_gate"; weights: the QTensors involved ((w,) or (gate, up)),
each with its label in `.name` ("" for tensors made on the fly); x: the f32 activations
(n, cols), on the host (a GPU activation comes down for the observer); ids / rows: for the expert ops, the expert id and activation row of each pair
(None otherwise).  The observer must not modify x.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import numpy as np

from quant import matmul as _mm
from quant.tensor import QTensor

from .device import to_host
from .ops import silu

Observer = Callable[[str, tuple, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]], None]

_observer: Optional[Observer] = None


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Call `observer` for every weight product made while the block runs (not re-entrant
    across threads: one observer for the process)."""
    global _observer
    prev = _observer
    _observer = observer
    try:
        yield
    finally:
        _observer = prev


def _gpu():
    from . import cuda_backend       # imports numba.cuda: only when a weight is on the GPU
    return cuda_backend


def _watch(op: str, ws: tuple, x, ids, rows) -> None:
    _observer(op, ws, to_host(x), ids, rows)


def matmul(w: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    if _observer is not None:
        _watch("mul_mat", (w,), x, None, None)
    if w.device != "CPU":
        return _gpu().matmul(w, x)
    return _mm.matmul(w, to_host(x), out)


def matmul_id(w: QTensor, x: np.ndarray, ids: np.ndarray, x_rows: np.ndarray) -> np.ndarray:
    if _observer is not None:
        _watch("mul_mat_id", (w,), x, ids, x_rows)
    if w.device != "CPU":
        return _gpu().matmul_id(w, x, ids, x_rows)
    return _mm.matmul_id(w, to_host(x), ids, x_rows)


def matmul_heads(w: QTensor, x: np.ndarray) -> np.ndarray:
    """y[t, h] = W[h] x[t, h] for W (H, N, K) and x (T, H, K).  Observers and the GPU see it as the
    mul_mat_id it is in pairs: head h of token t is pair (h, row t * H + h)."""
    T, H, K = x.shape
    if _observer is not None or w.device != "CPU":
        ids = np.tile(np.arange(H, dtype=np.int64), T)
        return matmul_id(w, x.reshape(T * H, K), ids, np.arange(T * H, dtype=np.int64)).reshape(T, H, -1)
    return _mm.matmul_heads(w, to_host(x))


def moe_up_gate(gate: QTensor, up: QTensor, x: np.ndarray, ids: np.ndarray, x_rows: np.ndarray) -> np.ndarray:
    if _observer is not None:
        _watch("moe_fused_up_gate", (gate, up), x, ids, x_rows)
    if gate.device != "CPU" and up.device != "CPU":
        return _gpu().moe_up_gate(gate, up, x, ids, x_rows)
    if gate.device != "CPU" or up.device != "CPU":      # split by -ot: each where it lives
        return silu(matmul_id(gate, x, ids, x_rows)) * matmul_id(up, x, ids, x_rows)
    return _mm.moe_up_gate(gate, up, to_host(x), ids, x_rows)


def up_gate(gate: QTensor, up: QTensor, x: np.ndarray) -> np.ndarray:
    if _observer is not None:
        _watch("fused_up_gate", (gate, up), x, None, None)
    if gate.device != "CPU" and up.device != "CPU":
        return _gpu().up_gate(gate, up, x)
    if gate.device != "CPU" or up.device != "CPU":
        return silu(matmul(gate, x)) * matmul(up, x)
    return _mm.up_gate(gate, up, to_host(x))
