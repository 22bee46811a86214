"""The KV cache of one context: per layer, K and V rows indexed by position (one sequence)."""
from __future__ import annotations

import numpy as np

CACHE_DTYPES = {"f32": np.float32, "f16": np.float16}


class KVCache:
    """Standard (decompressed-head) cache: K (n_ctx, n_head_kv, dk) and V (n_ctx, n_head_kv, dv) per layer."""

    def __init__(self, n_ctx: int, shapes: list[tuple[int, int, int]], type_k: str = "f16", type_v: str = "f16") -> None:
        self.n_ctx = n_ctx
        self.type_k, self.type_v = type_k, type_v
        dk_t, dv_t = CACHE_DTYPES[type_k], CACHE_DTYPES[type_v]
        self.k = [np.zeros((n_ctx, h, dk), dtype=dk_t) for h, dk, _ in shapes]
        self.v = [np.zeros((n_ctx, h, dv), dtype=dv_t) for h, _, dv in shapes]
        self.n = 0  # positions [0, n) hold valid entries

    def clear(self) -> None:
        self.n = 0

    def store(self, il: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        t = k.shape[0]
        if pos0 + t > self.n_ctx:
            raise ValueError(f"KV cache overflow: positions {pos0}..{pos0 + t} exceed n_ctx = {self.n_ctx}")
        self.k[il][pos0:pos0 + t] = k
        self.v[il][pos0:pos0 + t] = v

    def view(self, il: int, n_kv: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k[il][:n_kv], self.v[il][:n_kv]

    def size_bytes(self) -> tuple[int, int]:
        return sum(a.nbytes for a in self.k), sum(a.nbytes for a in self.v)
