"""A context: one model, one KV cache, batches split into micro-batches."""
from __future__ import annotations

import dataclasses

import numpy as np

from .arch.common import RunOptions, UBatch
from .config import EngineConfig
from .heap import retain_freed_memory
from .kv_cache import CACHE_TYPES, cache_type_name
from .model import Log, Model


_threads_set: list[int] = []


def set_threads(n: int) -> None:
    """Both pools: Numba's kernels and the BLAS behind the many-token matmuls (skipped when this
    thread last set the same count: a token's decode call paid ~10 us for it)."""
    import numba
    from quant.matmul import set_num_threads
    if _threads_set == [n] and numba.get_num_threads() == min(max(1, n), numba.config.NUMBA_NUM_THREADS):
        return
    set_num_threads(n)
    _threads_set[:] = [n]


def padded_ctx(n_ctx: int, flash_attn: bool) -> int:
    """llama.cpp pads the context to 256 cells with flash attention, 32 without."""
    pad = 256 if flash_attn else 32
    return (n_ctx + pad - 1) // pad * pad


class Context:
    def __init__(self, model: Model, cfg: EngineConfig, log: Log | None = None, n_seq: int = 1) -> None:
        """n_seq > 1: that many KV caches of n_ctx / n_seq cells each (the server's slots, as
        llama.cpp splits -c); `cache` is the first."""
        retain_freed_memory()          # the ubatches' scratch arrays reuse pages (engine.heap)
        self.model = model
        self.cfg = cfg
        hp = model.hp
        log = log or model.log
        mla = cfg.mla if hp.arch == "deepseek2" else 0     # as in ik_llama.cpp: MLA models only
        self.n_ctx = padded_ctx(cfg.n_ctx if cfg.n_ctx > 0 else hp.n_ctx_train, cfg.flash_attn)
        self.n_batch = min(cfg.n_batch, self.n_ctx)
        self.n_ubatch = min(cfg.n_ubatch, self.n_batch)
        self.opts = RunOptions(flash_attn=cfg.flash_attn, mla=mla, amb_bytes=cfg.attn_max_batch_mib * 1024 * 1024,
                               fused_moe=cfg.fused_moe, ser=(cfg.ser_min, cfg.ser_thresh))
        type_k, type_v = CACHE_TYPES[cfg.type_k], CACHE_TYPES[cfg.type_v]
        self.caches = [model.arch.make_cache(self.n_ctx // n_seq, self.opts, type_k, type_v) for _ in range(n_seq)]
        for c in self.caches:
            model.place_cache(c)          # the GPU layers' stores into GPU memory (-ngl / -ot, not -nkvo)
        self.cache = self.caches[0]
        p = "llama_init_from_model"
        log(f"{p}: n_ctx         = {self.n_ctx}")
        log(f"{p}: n_batch       = {self.n_batch}")
        log(f"{p}: n_ubatch      = {self.n_ubatch}")
        log(f"{p}: flash_attn    = {int(cfg.flash_attn)}")
        if hp.arch == "deepseek2":
            log(f"{p}: mla_attn      = {mla}")
        log(f"{p}: attn_max_b    = {cfg.attn_max_batch_mib}")
        log(f"{p}: fused_moe     = {int(cfg.fused_moe)}")
        log(f"{p}: ser           = {cfg.ser_min}, {cfg.ser_thresh:g}")
        log(f"{p}: freq_base     = {hp.rope_freq_base:.1f}")
        log(f"{p}: freq_scale    = {hp.rope_freq_scale:g}")
        self._log_kv_size(log)

    def _log_kv_size(self, log: Log) -> None:
        kb = sum(c.size_bytes()[0] for c in self.caches)
        vb = sum(c.size_bytes()[1] for c in self.caches)
        mib = 1024 ** 2
        on_gpu = sum(s.nbytes for c in self.caches for L in c.layers for s in L.stores() if s.device != "CPU")
        if kb + vb - on_gpu or not on_gpu:
            log(f"llama_kv_cache_init: {'CPU':>10s} KV buffer size = {(kb + vb - on_gpu) / mib:8.2f} MiB")
        if on_gpu:
            log(f"llama_kv_cache_init: {'CUDA0':>10s} KV buffer size = {on_gpu / mib:8.2f} MiB")
        L0 = self.cache.layers[0] if self.cache.layers else None
        head = f"llama_init_from_model: KV self size  = {(kb + vb) / mib:7.2f} MiB, "
        if L0 is None:
            return
        if self.cache.latent:
            c = f"c^KV ({cache_type_name(L0.k.qtype)}): {kb / mib:7.2f} MiB"
            if self.opts.flash_attn:
                log(head + c + ", kv^T: not used")
            else:
                vt_type = L0.vt.qtype if L0.vt is not None else CACHE_TYPES[self.cfg.type_v]
                log(head + c + f", kv^T ({cache_type_name(vt_type)}): {vb / mib:7.2f} MiB")
        else:
            log(head + f"K ({cache_type_name(L0.k.qtype)}): {kb / mib:7.2f} MiB, "
                f"V ({cache_type_name(L0.v.qtype)}): {vb / mib:7.2f} MiB")

    @property
    def n_past(self) -> int:
        """Cells in use."""
        return self.cache.n

    def clear(self) -> None:
        self.cache.clear()

    def seq_rm(self, p0: int = 0, p1: int = -1) -> int:
        """Remove the cached tokens with positions in [p0, p1) (p1 < 0: to the end)."""
        return self.cache.seq_rm(p0, p1)

    def decode(self, tokens: np.ndarray, logits_from: int = 0, pos0: int | None = None,
               embeddings: bool = False) -> np.ndarray:
        """Append `tokens` at positions pos0, pos0+1, ... (default: after the last cached one).

        Returns the logits (float32, (n - logits_from, n_vocab)) of tokens[logits_from:]; with
        `embeddings`, their normed final hidden states instead (n - logits_from, n_embd), what
        llama.cpp's embeddings are pooled from.
        """
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = len(tokens)
        if self.cache.n + n > self.n_ctx:
            raise ValueError(f"context overflow: {self.cache.n} cached + {n} new tokens > n_ctx = {self.n_ctx}")
        bad = (tokens < 0) | (tokens >= self.model.n_vocab)
        if bad.any():
            raise ValueError(f"token id {int(tokens[bad][0])} out of range [0, {self.model.n_vocab})")
        if pos0 is None:
            pos0 = self.cache.next_pos()
        set_threads(self.cfg.threads(batch=n > 1))
        opts = dataclasses.replace(self.opts, embeddings=True) if embeddings else self.opts
        width = self.model.hp.n_embd if embeddings else self.model.n_vocab
        if 0 < n <= self.n_ubatch:             # one ubatch: its logits are the result (no copy)
            return self._ubatch(tokens, np.arange(min(logits_from, n), n), pos0, opts, width)
        out = np.empty((max(n - logits_from, 0), width), dtype=np.float32)
        for s in range(0, n, self.n_ubatch):
            e = min(n, s + self.n_ubatch)
            rows = np.arange(max(s, logits_from), e) - s
            lg = self._ubatch(tokens[s:e], rows, pos0 + s, opts, width)
            if len(rows):
                out[rows[0] + s - logits_from: e - logits_from] = lg
        return out

    def _ubatch(self, tokens: np.ndarray, rows: np.ndarray, pos0: int, opts: RunOptions | None = None,
                width: int = 0) -> np.ndarray:
        """One micro-batch at positions pos0.. into the cache; the logits of its `rows` (or what
        `opts` asks for: rows `width` wide)."""
        pos = np.arange(pos0, pos0 + len(tokens), dtype=np.int32)
        cell0 = self.cache.reserve(pos)
        try:
            lg = self.model.arch.forward(UBatch(tokens, pos, rows, cell0), self.cache, opts or self.opts)
        except BaseException:
            self.cache.n = cell0          # the batch's cells hold nothing valid
            raise
        return np.asarray(lg, dtype=np.float32).reshape(len(rows), width or self.model.n_vocab)
