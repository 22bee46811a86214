"""Element-wise and normalisation operations of the forward pass (float32 NumPy)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; w is the learned scale (None: no scale)."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    y = x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    if w is not None:
        y *= w
    return y


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):          # exp(-x) = inf for very negative x gives the right 0
        return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):          # exp(-x) = inf for very negative x gives the right 0
        return 1.0 / (1.0 + np.exp(-x))


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
