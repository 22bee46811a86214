"""Rotary position embeddings with YaRN, as GGML computes them (NORM = adjacent pairs, NEOX = halves)."""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit, prange

from .device import on_device


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return max(0.0, start), min(n_dims - 1.0, end)


def rope_cos_sin(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
                 attn_factor: float, n_ctx_orig: int, beta_fast: float, beta_slow: float,
                 freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables of shape (len(pos), n_dims // 2), magnitude-scaled as in YaRN."""
    ff = None if freq_factors is None else np.asarray(freq_factors, dtype=np.float64)[: n_dims // 2].tobytes()
    inv, ramp, keep, mscale = _rope_consts(n_dims, freq_base, freq_scale, ext_factor, attn_factor, n_ctx_orig,
                                           beta_fast, beta_slow, ff)
    theta_extrap = pos.astype(np.float64)[:, None] * inv[None, :]
    theta = freq_scale * theta_extrap
    if ramp is not None:
        theta = theta * keep + theta_extrap * ramp
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _rope_consts(n_dims: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
                 n_ctx_orig: int, beta_fast: float, beta_slow: float, ff: bytes | None):
    """What rope_cos_sin's tables take from the model alone, made once (every decode asks for its
    positions' tables: ~10 NumPy calls a token less): the inverse frequencies, YaRN's ramp and
    1 - ramp (None without YaRN), the magnitude."""
    i0 = np.arange(0, n_dims, 2, dtype=np.float64)
    theta_scale = freq_base ** (-2.0 / n_dims)
    inv = theta_scale ** (i0 / 2)
    if ff is not None:
        inv = inv / np.frombuffer(ff, dtype=np.float64)
    mscale = attn_factor
    ramp = keep = None
    if ext_factor != 0.0:
        lo, hi = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        y = (np.floor(i0 / 2) - lo) / max(0.001, hi - lo)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        keep = 1 - ramp
        mscale = mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    for a in (inv, ramp, keep):     # shared by every call: read-only
        if a is not None:
            a.flags.writeable = False
    return inv, ramp, keep, mscale


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate x of shape (n_tok, n_head, n_dims) in place; cos/sin are (n_tok, n_dims // 2).
    x may be a view (the rope part of each head: q[:, :, nope:]).  The same f32 products and
    differences as apply_rope_reference, in one compiled pass (the NumPy form's strided copies
    took ~10 us a call in token generation, ~0.3 ms for a 512-token batch of 16 heads)."""
    if on_device(x):
        from . import cuda_backend
        if x.ndim == 3:
            cuda_backend.apply_rope(x, cos, sin, neox)    # a view in place: the kernel takes strides
            return x
        part = x.contiguous()                             # else rotated apart and written back
        cuda_backend.apply_rope(part, cos, sin, neox)
        if part is not x:
            x[...] = part
        return x
    if x.dtype != np.float32 or x.ndim != 3 or cos.shape != (x.shape[0], x.shape[2] // 2) or x.shape[2] % 2:
        return apply_rope_reference(x, cos, sin, neox)
    c = np.ascontiguousarray(cos, dtype=np.float32)
    s = np.ascontiguousarray(sin, dtype=np.float32)
    if x.shape[0] * x.shape[1] >= _ROPE_PARALLEL_ROWS:
        _rotate_parallel(x, c, s, neox)
    else:
        _rotate(x, c, s, neox)
    return x


_ROPE_PARALLEL_ROWS = 1024     # (token, head) rows from which the pass runs in the thread pool


def _rotate_rows(x, c, s, neox, t):
    h2 = x.shape[2] // 2
    for h in range(x.shape[1]):
        for i in range(h2):
            j0, j1 = (i, i + h2) if neox else (2 * i, 2 * i + 1)
            a = x[t, h, j0]
            b = x[t, h, j1]
            x[t, h, j0] = a * c[t, i] - b * s[t, i]
            x[t, h, j1] = a * s[t, i] + b * c[t, i]


_rotate_rows_jit = njit(cache=True, inline="always")(_rotate_rows)


@njit(cache=True)
def _rotate(x, c, s, neox):
    for t in range(x.shape[0]):
        _rotate_rows_jit(x, c, s, neox, t)


@njit(cache=True, parallel=True)
def _rotate_parallel(x, c, s, neox):
    for t in prange(x.shape[0]):
        _rotate_rows_jit(x, c, s, neox, t)


def apply_rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """apply_rope in NumPy (the reference the compiled pass is tested against)."""
    c = cos[:, None, :]
    s = sin[:, None, :]
    if neox:
        h = x.shape[-1] // 2
        a = x[..., :h].copy()
        b = x[..., h:]
        x[..., :h] = a * c - b * s
        x[..., h:] = a * s + b * c
    else:
        a = x[..., 0::2].copy()
        b = x[..., 1::2].copy()
        x[..., 0::2] = a * c - b * s
        x[..., 1::2] = a * s + b * c
    return x
