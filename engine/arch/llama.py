"""The llama block and the files built on it: `llama` (LLaMA, Mistral, Mixtral-style MoE) and
`qwen2` / `qwen2moe` (q/k/v biases, NEOX RoPE; experts without renormalised weights plus a
shared expert behind a sigmoid gate).  GQA attention with RoPE, a SiLU MLP or routed experts."""
from __future__ import annotations

import numpy as np

from quant.tensor import f32_qtensor

from ..ffn import MoEWeights, ffn_silu, moe_ffn
from ..gguf_file import ModelFileError
from ..hparams import GATING_SOFTMAX, HParams, yarn_kq_scale, rope_attn_factor
from ..kv_cache import KVCache
from ..linear import matmul
from ..ops import rms_norm, sigmoid
from ..rope import apply_rope
from .common import (Head, RunOptions, UBatch, cached_attention, check_moe_shapes, rope_tables, rotate_key_rows,
                     shift_rope_tables)


class LlamaArch:
    FFN_NORM = "ffn_norm.weight"      # glm4moe names it post_attention_norm

    def __init__(self, hp: HParams, w, log) -> None:
        self.hp = hp
        E, H, Hkv, dk = hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_embd_head_k
        emb = w.matrix("token_embd.weight", (hp.n_vocab, E))
        out = w.matrix("output.weight", (hp.n_vocab, E)) if w.has("output.weight") else emb
        self.head = Head(emb, w.vector("output_norm.weight", E), out, hp.rms_eps)
        self.freq_factors = w.optional_vector("rope_freqs.weight")
        self.layers = []
        for i in range(hp.n_layer - hp.n_nextn):      # NextN / MTP layers are loaded by nobody, as ik skips them
            p = f"blk.{i}."
            L = {
                "attn_norm": w.vector(p + "attn_norm.weight", E),
                "wq": w.matrix(p + "attn_q.weight", (H * dk, E)),
                "wk": w.matrix(p + "attn_k.weight", (Hkv * dk, E)),
                "wv": w.matrix(p + "attn_v.weight", (Hkv * hp.n_embd_head_v, E)),
                "wo": w.matrix(p + "attn_output.weight", (E, H * hp.n_embd_head_v)),
                "ffn_norm": w.vector(p + self.FFN_NORM, E),
                # qwen2's projections carry biases (llama's may)
                "bq": w.optional_vector(p + "attn_q.bias"),
                "bk": w.optional_vector(p + "attn_k.bias"),
                "bv": w.optional_vector(p + "attn_v.bias"),
                "bo": w.optional_vector(p + "attn_output.bias"),
                # per-head RMSNorm of q and k before RoPE (qwen3 always; glm4moe where the file has them)
                "q_norm": w.optional_vector(p + "attn_q_norm.weight"),
                "k_norm": w.optional_vector(p + "attn_k_norm.weight"),
                "sinks": w.optional_vector(p + "attn_sinks.weight"),      # gpt-oss
            }
            if w.has(p + "ffn_gate_inp.weight"):
                if hp.n_expert_used <= 0:
                    raise ModelFileError(f"{w.mf.path}: MoE tensors present but no {hp.arch}.expert_used_count")
                L["moe"] = MoEWeights(w.matrix(p + "ffn_gate_inp.weight"), None, w.matrix(p + "ffn_gate_exps.weight"),
                                      w.matrix(p + "ffn_up_exps.weight"), w.matrix(p + "ffn_down_exps.weight"))
                check_moe_shapes(w.mf.path, p, L["moe"], hp.n_expert, E)
                if w.has(p + "ffn_gate_shexp.weight"):     # a shared expert: gated per token in qwen2moe
                    g = w.optional_vector(p + "ffn_gate_inp_shexp.weight")
                    if g is not None:                     # a 1-row matrix: its product is observed (imatrix)
                        g = f32_qtensor(g.reshape(1, E))
                        g.name = p + "ffn_gate_inp_shexp.weight"
                    L["shexp"] = (g, w.matrix(p + "ffn_gate_shexp.weight"),
                                  w.matrix(p + "ffn_up_shexp.weight"), w.matrix(p + "ffn_down_shexp.weight"))
            else:
                L["gate"] = w.matrix(p + "ffn_gate.weight")
                L["up"] = w.matrix(p + "ffn_up.weight")
                L["down"] = w.matrix(p + "ffn_down.weight")
            self.layers.append(L)
        # router: Mixtral / Qwen3-MoE renormalise the softmax top-k weights, Qwen2-MoE uses them as
        # they are; GLM-4.5 reads sigmoid gating, weight norm and scale from the file
        self.moe_gating, self.moe_norm_w, self.moe_scale = GATING_SOFTMAX, hp.arch != "qwen2moe", 1.0
        self.kq_scale = yarn_kq_scale(hp)
        self.attn_factor = rope_attn_factor(hp)

    def qk_norm(self, L: dict, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-head RMSNorm of q and k before RoPE, where the file has the norms."""
        if L["q_norm"] is None:
            return q, k
        eps = self.hp.rms_eps
        return rms_norm(q, L["q_norm"], eps), rms_norm(k, L["k_norm"], eps)

    def layer_window(self, il: int) -> int:
        """The sliding window of layer il (0: attends to the whole context)."""
        return 0

    def layer_chunk(self, il: int) -> int:
        """The attention chunk of layer il (llama4; 0: none)."""
        return 0

    def layer_rope(self, il: int) -> bool:
        """Whether layer il rotates q and k (llama4 leaves every 4th layer without RoPE)."""
        return True

    def position_qk(self, il: int, L: dict, q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                    pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q (T, H, dk) and k (T, Hkv, dk) of layer il as attention takes them: per-head norms where
        the file has them, then RoPE on the first n_rot values of each head (partial: glm4moe)."""
        hp = self.hp
        q, k = self.qk_norm(L, q, k)
        apply_rope(q[..., :hp.n_rot], cos, sin, hp.rope_neox)     # in place
        apply_rope(k[..., :hp.n_rot], cos, sin, hp.rope_neox)
        return q, k

    def shift_keys(self, cache: KVCache, c0: int, c1: int, delta: int) -> None:
        """Re-rotate the cached keys of cells [c0, c1) by delta positions (context shift)."""
        hp = self.hp
        cos, sin = shift_rope_tables(hp, c1 - c0, delta, self.freq_factors)
        for il, lc in enumerate(cache.layers):
            if not self.layer_rope(il):        # keys cached without a rotation stay as they are
                continue
            rotate_key_rows(lc.k, c0, c1, hp.n_head_kv, hp.n_embd_head_k, 0, hp.n_rot, cos, sin, hp.rope_neox)

    def make_cache(self, n_ctx: int, opts: RunOptions, type_k: int, type_v: int) -> KVCache:
        hp = self.hp
        return KVCache.standard(n_ctx, [(hp.n_head_kv, hp.n_embd_head_k, hp.n_embd_head_v)] * len(self.layers),
                                type_k, type_v)

    def forward(self, ub: UBatch, cache: KVCache, opts: RunOptions) -> np.ndarray:
        hp = self.hp
        T = len(ub.tokens)
        cos, sin = rope_tables(hp, ub.pos, self.attn_factor, self.freq_factors)
        x = self.head.embed(ub.tokens)
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], hp.rms_eps)
            q = _biased(matmul(L["wq"], h), L["bq"]).reshape(T, hp.n_head, hp.n_embd_head_k)
            k = _biased(matmul(L["wk"], h), L["bk"]).reshape(T, hp.n_head_kv, hp.n_embd_head_k)
            v = _biased(matmul(L["wv"], h), L["bv"]).reshape(T, hp.n_head_kv, hp.n_embd_head_v)
            q, k = self.position_qk(il, L, q, k, cos, sin, ub.pos)
            a = cached_attention(ub, cache, il, q, k, v, self.kq_scale, opts, self.layer_window(il), L["sinks"],
                                 self.layer_chunk(il))
            x = x + _biased(matmul(L["wo"], a.reshape(T, -1)), L["bo"])
            h = rms_norm(x, L["ffn_norm"], hp.rms_eps)
            if "moe" in L:
                # softmax, top-k, weights renormalised (or not: qwen2moe), no scale
                x = x + moe_ffn(h, L["moe"], hp.n_expert_used, self.moe_gating, self.moe_norm_w, self.moe_scale,
                                fused=opts.fused_moe, ser=opts.ser)
                if "shexp" in L:
                    g, gate, up, down = L["shexp"]
                    y = ffn_silu(h, gate, up, down)
                    x = x + (y if g is None else y * sigmoid(matmul(g, h)))
            else:
                x = x + ffn_silu(h, L["gate"], L["up"], L["down"])
        return self.head.logits(x, ub.out_rows, opts)


def _biased(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    if b is not None:
        y += b
    return y
