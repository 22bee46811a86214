"""Causal softmax attention over decompressed heads (grouped-query aware), bounded scratch."""
from __future__ import annotations

import numpy as np

from .ops import softmax

DEFAULT_SCRATCH_BYTES = 256 * 1024 * 1024


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos_q: np.ndarray, kq_scale: float,
                     scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> np.ndarray:
    """q (T, H, dk) f32; k (n_kv, Hkv, dk), v (n_kv, Hkv, dv) with entry j at position j.

    Returns (T, H, dv). Query t sees keys j <= pos_q[t]. Heads are processed in groups so the
    K·Q buffer (heads × T × n_kv floats) stays under `scratch_bytes`.
    """
    T, H, dk = q.shape
    n_kv, hkv, dv = v.shape
    g = H // hkv
    out = np.empty((T, H, dv), dtype=np.float32)
    mask = np.arange(n_kv)[None, :] > pos_q[:, None]          # (T, n_kv) True = hidden
    per_head = T * n_kv * 4
    hc = max(1, min(H, scratch_bytes // max(per_head, 1)))
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))             # (H, T, dk)
    for h0 in range(0, H, hc):
        h1 = min(H, h0 + hc)
        kv_idx = np.arange(h0, h1) // g
        kh = k[:, kv_idx, :].astype(np.float32).transpose(1, 2, 0)   # (hc, dk, n_kv)
        vh = v[:, kv_idx, :].astype(np.float32).transpose(1, 0, 2)   # (hc, n_kv, dv)
        s = np.matmul(qh[h0:h1], kh)
        s *= np.float32(kq_scale)
        s[:, mask] = -np.inf
        p = softmax(s, axis=-1)
        out[:, h0:h1, :] = np.matmul(p, vh).transpose(1, 0, 2)
    return out
