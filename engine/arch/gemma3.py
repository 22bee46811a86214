"""The `gemma3` architecture: embeddings scaled by sqrt(n_embd); per layer RMSNorm before and
after attention and before and after the FFN (the "sandwich"), per-head q/k norms, NEOX RoPE;
five sliding-window layers (window `attention.sliding_window`, RoPE base 10000, no scaling)
to one global layer (the file's RoPE base and scaling); a GELU-gated FFN."""
from __future__ import annotations

import math

import numpy as np

from ..hparams import HParams, rope_attn_factor
from ..kv_cache import KVCache
from ..linear import matmul
from ..ops import gelu, rms_norm
from ..rope import apply_rope, rope_cos_sin
from .common import Head, RunOptions, UBatch, cached_attention, rope_tables

SWA_PATTERN = 6            # layer il slides unless (il + 1) % 6 == 0
LOCAL_ROPE_BASE = 10000.0


class Gemma3Arch:
    def __init__(self, hp: HParams, w, log) -> None:
        self.hp = hp
        E, H, Hkv, dk, dv = hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_embd_head_k, hp.n_embd_head_v
        emb = w.matrix("token_embd.weight", (hp.n_vocab, E))
        out = w.matrix("output.weight", (hp.n_vocab, E)) if w.has("output.weight") else emb
        self.head = Head(emb, w.vector("output_norm.weight", E), out, hp.rms_eps)
        self.layers = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": w.vector(p + "attn_norm.weight", E),
                "wq": w.matrix(p + "attn_q.weight", (H * dk, E)),
                "wk": w.matrix(p + "attn_k.weight", (Hkv * dk, E)),
                "wv": w.matrix(p + "attn_v.weight", (Hkv * dv, E)),
                "q_norm": w.vector(p + "attn_q_norm.weight", dk),
                "k_norm": w.vector(p + "attn_k_norm.weight", dk),
                "wo": w.matrix(p + "attn_output.weight", (E, H * dv)),
                "attn_post_norm": w.vector(p + "post_attention_norm.weight", E),
                "ffn_norm": w.vector(p + "ffn_norm.weight", E),
                "gate": w.matrix(p + "ffn_gate.weight"),
                "up": w.matrix(p + "ffn_up.weight"),
                "down": w.matrix(p + "ffn_down.weight"),
                "ffn_post_norm": w.vector(p + "post_ffw_norm.weight", E),
            })
        # ik's attention scale: 1/sqrt(head size), but the 27B (62 layers) uses n_embd / n_head
        self.kq_scale = 1.0 / math.sqrt(E / H if hp.n_layer == 62 else dk)
        self.attn_factor = rope_attn_factor(hp)

    def make_cache(self, n_ctx: int, opts: RunOptions, type_k: int, type_v: int) -> KVCache:
        hp = self.hp
        return KVCache.standard(n_ctx, [(hp.n_head_kv, hp.n_embd_head_k, hp.n_embd_head_v)] * hp.n_layer,
                                type_k, type_v)

    def forward(self, ub: UBatch, cache: KVCache, opts: RunOptions) -> np.ndarray:
        hp = self.hp
        T, eps = len(ub.tokens), hp.rms_eps
        glob = rope_tables(hp, ub.pos, self.attn_factor)
        local = rope_cos_sin(ub.pos, hp.n_rot, LOCAL_ROPE_BASE, 1.0, hp.yarn_ext_factor, self.attn_factor,
                             hp.n_ctx_orig_yarn, hp.yarn_beta_fast, hp.yarn_beta_slow)
        x = self.head.embed(ub.tokens) * np.float32(math.sqrt(hp.n_embd))
        for il, L in enumerate(self.layers):
            sliding = (il + 1) % SWA_PATTERN != 0
            cos, sin = local if sliding else glob
            h = rms_norm(x, L["attn_norm"], eps)
            q = rms_norm(matmul(L["wq"], h).reshape(T, hp.n_head, hp.n_embd_head_k), L["q_norm"], eps)
            k = rms_norm(matmul(L["wk"], h).reshape(T, hp.n_head_kv, hp.n_embd_head_k), L["k_norm"], eps)
            v = matmul(L["wv"], h).reshape(T, hp.n_head_kv, hp.n_embd_head_v)
            apply_rope(q, cos, sin, hp.rope_neox)
            apply_rope(k, cos, sin, hp.rope_neox)
            a = cached_attention(ub, cache, il, q, k, v, self.kq_scale, opts, hp.n_swa if sliding else 0)
            x = x + rms_norm(matmul(L["wo"], a.reshape(T, -1)), L["attn_post_norm"], eps)
            h = rms_norm(x, L["ffn_norm"], eps)
            y = gelu(matmul(L["gate"], h))
            y *= matmul(L["up"], h)
            x = x + rms_norm(matmul(L["down"], y), L["ffn_post_norm"], eps)
        return self.head.logits(x, ub.out_rows, opts)
