"""Attention over the KV cache: materialized K*Q (`-fa off`, bounded by `-amb`) or flash attention.

Masking everywhere uses the cells' positions: a query at position p sees cells with pos <= p.
"""
from __future__ import annotations

import numpy as np

from quant.gemm import gemm

from .kv_cache import LayerCache
from .ops import empty_like_side, softmax

# K*Q scratch cap used when -amb is 0 (no user limit): results do not depend on it
DEFAULT_SCRATCH_BYTES = 1024 * 1024 * 1024
MIB = 1024 * 1024


def head_steps(n_head: int, kq_bytes: int, amb_bytes: int) -> int:
    """Heads per step when the K*Q matrix (kq_bytes for all heads) must stay under amb_bytes.

    ik_llama.cpp's rule: n_step = ceil(size / amb) (at most n_head), heads per step =
    ceil(n_head / n_step); sizes are compared in whole MiB as there.
    """
    limit = amb_bytes if amb_bytes > 0 else DEFAULT_SCRATCH_BYTES
    kq_mib, amb_mib = kq_bytes // MIB, max(limit // MIB, 1)
    if kq_mib <= amb_mib:
        return n_head
    n_step = min(n_head, (kq_mib + amb_mib - 1) // amb_mib)
    return (n_head + n_step - 1) // n_step


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cell_pos: np.ndarray, q_pos: np.ndarray,
                     kq_scale: float, amb_bytes: int = 0, window: int = 0,
                     sinks: np.ndarray | None = None) -> np.ndarray:
    """softmax(kq_scale * q.k) v with K*Q materialized per group of heads.

    q (T, H, dk) f32; k (n_kv, Hkv, dk), v (n_kv, Hkv, dv) f32 for cells with positions cell_pos.
    Returns (T, H, dv). Heads are processed in groups sized by head_steps (the -amb rule).
    window > 0: a sliding window, query t sees only cells with q_pos[t] - cell_pos < window.
    sinks (H,): one more logit per head in each softmax, with no value (gpt-oss).
    """
    from .device import on_device
    if on_device(q) or on_device(k) or on_device(v):
        from . import cuda_backend
        return cuda_backend.causal_attention(q, k, v, cell_pos, q_pos, kq_scale, window, sinks)
    T, H, dk = q.shape
    n_kv, hkv, dv = v.shape
    g = H // hkv
    out = np.empty((T, H, dv), dtype=np.float32)
    hidden = cell_pos[None, :n_kv] > q_pos[:, None]               # (T, n_kv) True = masked
    if window > 0:
        hidden |= q_pos[:, None] - cell_pos[None, :n_kv] >= window
    hc = head_steps(H, T * n_kv * H * 4, amb_bytes)
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))                # (H, T, dk)
    for h0 in range(0, H, hc):
        h1 = min(H, h0 + hc)
        kv_idx = np.arange(h0, h1) // g
        kh = k[:, kv_idx, :].transpose(1, 0, 2)                    # (hc, n_kv, dk)
        vh = v[:, kv_idx, :].transpose(1, 0, 2)                    # (hc, n_kv, dv)
        s = gemm(qh[h0:h1], kh, np.empty((h1 - h0, T, n_kv), dtype=np.float32))
        s *= np.float32(kq_scale)
        s[:, hidden] = -np.inf
        if sinks is None:
            p = softmax(s, axis=-1)
        else:
            sk = np.asarray(sinks, dtype=np.float32)[h0:h1, None, None]
            mx = np.maximum(s.max(axis=-1, keepdims=True), sk)
            p = np.exp(s - mx)
            p /= p.sum(axis=-1, keepdims=True) + np.exp(sk - mx)
        p[~np.isfinite(p)] = 0.0                                   # a query that sees nothing
        out[:, h0:h1, :] = gemm(p, vh, np.empty((h1 - h0, T, dv), dtype=np.float32), trans_b=False).transpose(1, 0, 2)
    return out


# a cell position no query reaches: the cells of a chunk before the query's (chunked attention)
HIDDEN_POS = np.iinfo(np.int32).max


def standard_attention(q: np.ndarray, lc: LayerCache, n_kv: int, n_head_kv: int, dk: int, dv: int,
                       cell_pos: np.ndarray, q_pos: np.ndarray, kq_scale: float, flash: bool,
                       amb_bytes: int, window: int = 0, sinks: np.ndarray | None = None,
                       chunk: int = 0) -> np.ndarray:
    """Attention of q (T, H, dk) over the first n_kv cells of a standard (K rows, V rows) layer cache
    (window > 0: a sliding window of that many positions; chunk > 0: llama4's chunked attention,
    a query at p sees only cells with p // chunk * chunk <= position <= p)."""
    if chunk > 0:
        # per run of queries in one chunk, the cells of earlier chunks get a position no query
        # reaches: the causal test then hides them, in every path (flash, K*Q, GPU) unchanged
        start = np.asarray(q_pos, dtype=np.int64) // chunk * chunk
        cuts = [0, *(np.flatnonzero(np.diff(start)) + 1).tolist(), len(start)]
        cp = np.asarray(cell_pos[:n_kv])
        parts = [standard_attention(q[a:b], lc, n_kv, n_head_kv, dk, dv,
                                    np.where(cp >= start[a], cp, HIDDEN_POS).astype(cp.dtype), q_pos[a:b],
                                    kq_scale, flash, amb_bytes, window, sinks)
                 for a, b in zip(cuts[:-1], cuts[1:])]
        if len(parts) == 1:
            return parts[0]
        out = empty_like_side((len(start), q.shape[1], dv), parts[0])
        for (a, b), part in zip(zip(cuts[:-1], cuts[1:]), parts):
            out[a:b] = part
        return out
    if flash:
        from .flash_attn import flash_attn
        return flash_attn(q, lc.k, lc.v, n_kv, n_head_kv, dk, dv, cell_pos[:n_kv], q_pos, kq_scale, window=window,
                          sinks=sinks)
    k = lc.k.read(n_kv).reshape(n_kv, n_head_kv, dk)
    v = lc.v.read(n_kv).reshape(n_kv, n_head_kv, dv)
    return causal_attention(q, k, v, cell_pos[:n_kv], q_pos, kq_scale, amb_bytes, window, sinks)


def split_heads_for_decompression(n_head: int, kv_bytes: int, amb_bytes: int) -> int:
    """Heads per step when decompressing the latent cache (ik's rule for -mla 2/3 prompt processing):
    the smallest divisor `niter` of n_head with size / niter <= amb gives n_head / niter heads; else 1."""
    if amb_bytes <= 0 or kv_bytes // MIB <= amb_bytes // MIB:
        return n_head
    size, amb = kv_bytes // MIB, amb_bytes // MIB
    for niter in range(2, n_head):
        if n_head % niter == 0 and size // niter <= amb:
            return n_head // niter
    return 1

