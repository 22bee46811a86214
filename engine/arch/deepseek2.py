"""The `deepseek2` architecture (DeepSeek-V2/V2-Lite/V2.5/V3/R1): multi-head latent attention + MoE.

Attention runs in the decompressed form (`-mla 0`): the latent c = norm(W_kv_a · x) is expanded
through W_kv_b into per-head K (nope part) and V, and the shared rope key is broadcast to all heads.

GGUF layouts (DESIGN.md): `attn_kv_b` (+ optional `attn_k_b`/`attn_v_b`) in ik and old-mainline
files; new-mainline files carry only `attn_k_b` (nope × lora per head, stored transposed) and
`attn_v_b`, from which W_kv_b is rebuilt at load.
"""
from __future__ import annotations

import numpy as np

from quant.matmul import dequantize, matmul

from ..attention import causal_attention
from ..ffn import MoEWeights, ffn_silu, moe_ffn
from ..gguf_file import ModelFileError
from ..hparams import HParams, rope_attn_factor, yarn_kq_scale
from ..kv_cache import KVCache
from ..model import f32_qtensor
from ..ops import rms_norm
from ..rope import apply_rope
from .common import Head, UBatch, rope_tables


def rebuild_kv_b(k_b: np.ndarray, v_b: np.ndarray, n_head: int, nope: int, n_v: int, lora: int) -> np.ndarray:
    """W_kv_b (n_head·(nope+v), lora) from k_b (n_head, lora, nope) and v_b (n_head, v, lora)."""
    k_b = k_b.reshape(n_head, lora, nope)
    v_b = v_b.reshape(n_head, n_v, lora)
    out = np.empty((n_head, nope + n_v, lora), dtype=np.float32)
    out[:, :nope, :] = k_b.transpose(0, 2, 1)
    out[:, nope:, :] = v_b
    return out.reshape(n_head * (nope + n_v), lora)


class DeepSeek2Arch:
    def __init__(self, hp: HParams, w, log, mla: int = 0) -> None:
        if mla != 0:
            raise ModelFileError(f"-mla {mla} is not available yet: this version runs DeepSeek attention with -mla 0")
        self.hp = hp
        E, H = hp.n_embd, hp.n_head
        dk, dv, rope, lora = hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.kv_lora_rank
        nope = dk - rope
        emb = w.matrix("token_embd.weight", (hp.n_vocab, E))
        out = w.matrix("output.weight", (hp.n_vocab, E)) if w.has("output.weight") else emb
        self.head = Head(emb, w.vector("output_norm.weight", E), out, hp.rms_eps)
        self.has_q_lora = w.has("blk.0.attn_q_a.weight")
        computed = 0
        self.layers = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            L: dict = {"attn_norm": w.vector(p + "attn_norm.weight", E)}
            if self.has_q_lora:
                ql = w.entry(p + "attn_q_a.weight").ne[1]
                L["wq_a"] = w.matrix(p + "attn_q_a.weight", (ql, E))
                L["q_a_norm"] = w.vector(p + "attn_q_a_norm.weight", ql)
                L["wq_b"] = w.matrix(p + "attn_q_b.weight", (H * dk, ql))
            else:
                L["wq"] = w.matrix(p + "attn_q.weight", (H * dk, E))
            L["wkv_a"] = w.matrix(p + "attn_kv_a_mqa.weight", (lora + rope, E))
            L["kv_a_norm"] = w.vector(p + "attn_kv_a_norm.weight", lora)
            if w.has(p + "attn_kv_b.weight"):
                L["wkv_b"] = w.matrix(p + "attn_kv_b.weight", (H * (nope + dv), lora))
            elif w.has(p + "attn_k_b.weight") and w.has(p + "attn_v_b.weight"):
                kb = dequantize(w.entry(p + "attn_k_b.weight").qtensor())
                vb = dequantize(w.entry(p + "attn_v_b.weight").qtensor())
                if kb.size != H * lora * nope or vb.size != H * dv * lora:
                    raise ModelFileError(f"{w.mf.path}: {p}attn_k_b/attn_v_b have unexpected sizes")
                L["wkv_b"] = f32_qtensor(rebuild_kv_b(kb, vb, H, nope, dv, lora))
                w.extra[p + "attn_kv_b.weight"] = L["wkv_b"]
                computed += 1
            else:
                raise ModelFileError(f"{w.mf.path}: missing tensor '{p}attn_kv_b.weight' (and no attn_k_b/attn_v_b to rebuild it)")
            L["wo"] = w.matrix(p + "attn_output.weight", (E, H * dv))
            L["ffn_norm"] = w.vector(p + "ffn_norm.weight", E)
            if i < hp.n_layer_dense_lead:
                L["gate"] = w.matrix(p + "ffn_gate.weight")
                L["up"] = w.matrix(p + "ffn_up.weight")
                L["down"] = w.matrix(p + "ffn_down.weight")
            else:
                L["moe"] = MoEWeights(
                    w.matrix(p + "ffn_gate_inp.weight", (hp.n_expert, E)),
                    w.optional_vector(p + "exp_probs_b.bias"),
                    w.matrix(p + "ffn_gate_exps.weight"), w.matrix(p + "ffn_up_exps.weight"),
                    w.matrix(p + "ffn_down_exps.weight"))
                if hp.n_expert_shared > 0:
                    L["sh_gate"] = w.matrix(p + "ffn_gate_shexp.weight")
                    L["sh_up"] = w.matrix(p + "ffn_up_shexp.weight")
                    L["sh_down"] = w.matrix(p + "ffn_down_shexp.weight")
            self.layers.append(L)
        if computed:
            log(f"llm_load_tensors: computed attn_kv_b for {computed} layers from attn_k_b and attn_v_b "
                f"(f32, {lora} x {H * (nope + dv)})")
        self.kq_scale = yarn_kq_scale(hp)
        self.attn_factor = rope_attn_factor(hp)

    def cache_shapes(self) -> list[tuple[int, int, int]]:
        hp = self.hp
        return [(hp.n_head, hp.n_embd_head_k, hp.n_embd_head_v)] * hp.n_layer

    def attention(self, L: dict, h: np.ndarray, ub: UBatch, cos, sin, cache: KVCache, il: int,
                  scratch_bytes: int) -> np.ndarray:
        hp = self.hp
        T, H = h.shape[0], hp.n_head
        dk, dv, rope, lora = hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.kv_lora_rank
        nope = dk - rope
        if self.has_q_lora:
            q = matmul(L["wq_b"], rms_norm(matmul(L["wq_a"], h), L["q_a_norm"], hp.rms_eps))
        else:
            q = matmul(L["wq"], h)
        q = q.reshape(T, H, dk)
        kvr = matmul(L["wkv_a"], h)
        c = rms_norm(np.ascontiguousarray(kvr[:, :lora]), L["kv_a_norm"], hp.rms_eps)
        k_pe = np.ascontiguousarray(kvr[:, lora:]).reshape(T, 1, rope)
        q_pe = np.ascontiguousarray(q[:, :, nope:])
        apply_rope(q_pe, cos, sin, False)
        apply_rope(k_pe, cos, sin, False)
        q[:, :, nope:] = q_pe
        kv = matmul(L["wkv_b"], c).reshape(T, H, nope + dv)
        k = np.empty((T, H, dk), dtype=np.float32)
        k[:, :, :nope] = kv[:, :, :nope]
        k[:, :, nope:] = k_pe
        v = kv[:, :, nope:]
        pos0 = int(ub.pos[0])
        cache.store(il, pos0, k, v)
        kc, vc = cache.view(il, pos0 + T)
        a = causal_attention(q, kc, vc, ub.pos, self.kq_scale, scratch_bytes)
        return matmul(L["wo"], a.reshape(T, H * dv))

    def forward(self, ub: UBatch, cache: KVCache, scratch_bytes: int) -> np.ndarray:
        hp = self.hp
        cos, sin = rope_tables(hp, ub.pos, self.attn_factor)
        x = self.head.embed(ub.tokens)
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], hp.rms_eps)
            x = x + self.attention(L, h, ub, cos, sin, cache, il, scratch_bytes)
            h = rms_norm(x, L["ffn_norm"], hp.rms_eps)
            if "moe" in L:
                y = moe_ffn(h, L["moe"], hp.n_expert_used, hp.expert_gating_func, hp.expert_weights_norm,
                            hp.expert_weights_scale)
                if "sh_gate" in L:
                    y += ffn_silu(h, L["sh_gate"], L["sh_up"], L["sh_down"])
            else:
                y = ffn_silu(h, L["gate"], L["up"], L["down"])
            x = x + y
        return self.head.logits(x, ub.out_rows)
