"""A context: one model, one KV cache, batches split into micro-batches."""
from __future__ import annotations

import numpy as np

from .arch.common import UBatch
from .attention import DEFAULT_SCRATCH_BYTES
from .config import EngineConfig
from .kv_cache import KVCache
from .model import Log, Model


def set_threads(n: int) -> None:
    """Both pools: Numba's kernels and the BLAS behind the many-token matmuls."""
    from quant.matmul import set_num_threads
    set_num_threads(n)


class Context:
    def __init__(self, model: Model, cfg: EngineConfig, log: Log | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.n_ctx = cfg.n_ctx if cfg.n_ctx > 0 else model.hp.n_ctx_train
        self.n_batch = min(cfg.n_batch, self.n_ctx)
        self.n_ubatch = min(cfg.n_ubatch, self.n_batch)
        self.cache = KVCache(self.n_ctx, model.arch.cache_shapes())
        self.scratch = cfg.attn_max_batch_mib * 1024 * 1024 if cfg.attn_max_batch_mib > 0 else DEFAULT_SCRATCH_BYTES
        log = log or model.log
        kb, vb = self.cache.size_bytes()
        log(f"llama_init_from_model: n_ctx         = {self.n_ctx}")
        log(f"llama_init_from_model: n_batch       = {self.n_batch}")
        log(f"llama_init_from_model: n_ubatch      = {self.n_ubatch}")
        log("llama_init_from_model: flash_attn    = 0")
        if model.hp.arch == "deepseek2":
            log(f"llama_init_from_model: mla_attn      = {cfg.mla}")
        log(f"llama_init_from_model: attn_max_b    = {cfg.attn_max_batch_mib}")
        log(f"llama_init_from_model: freq_base     = {model.hp.rope_freq_base:.1f}")
        log(f"llama_init_from_model: freq_scale    = {model.hp.rope_freq_scale:g}")
        log(f"llama_kv_cache_init: {'CPU':>10s} KV buffer size = {(kb + vb) / 1024 ** 2:8.2f} MiB")
        log(f"llama_init_from_model: KV self size  = {(kb + vb) / 1024 ** 2:7.2f} MiB, "
            f"K ({self.cache.type_k}): {kb / 1024 ** 2:7.2f} MiB, V ({self.cache.type_v}): {vb / 1024 ** 2:7.2f} MiB")

    @property
    def n_past(self) -> int:
        return self.cache.n

    def clear(self) -> None:
        self.cache.clear()

    def decode(self, tokens: np.ndarray, logits_from: int = 0) -> np.ndarray:
        """Append `tokens` to the sequence; return logits (float32) of tokens[logits_from:]."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        pos0 = self.cache.n
        if pos0 + n > self.n_ctx:
            raise ValueError(f"context overflow: {pos0} + {n} tokens > n_ctx = {self.n_ctx}")
        bad = (tokens < 0) | (tokens >= self.model.n_vocab)
        if bad.any():
            raise ValueError(f"token id {int(tokens[bad][0])} out of range [0, {self.model.n_vocab})")
        set_threads(self.cfg.threads(batch=n > 1))
        out = np.empty((max(n - logits_from, 0), self.model.n_vocab), dtype=np.float32)
        for s in range(0, n, self.n_ubatch):
            e = min(n, s + self.n_ubatch)
            rows = np.arange(max(s, logits_from), e) - s
            ub = UBatch(tokens[s:e], np.arange(pos0 + s, pos0 + e, dtype=np.int32), rows)
            lg = self.model.arch.forward(ub, self.cache, self.scratch)
            self.cache.n = pos0 + e
            if len(rows):
                out[rows[0] + s - logits_from: e - logits_from] = lg
        return out
