#!/usr/bin/env python3
"""Write small random-weight GGUF models (llama, deepseek2 in its three layouts) with the gguf writer.

Used by the tests (imported as a module) and by benchmarks:

    python scripts/make_test_model.py out.gguf --arch deepseek2 --layout ik --type q8_0 --preset tiny
    python scripts/make_test_model.py ds-1b.gguf --arch deepseek2 --type q8_0 --preset 1b
    python scripts/make_test_model.py sp.gguf --preset tiny --split 3   # sp-00001-of-00003.gguf …

Layouts of DeepSeek files (DESIGN.md): `ik` (attn_kv_b + attn_k_b + attn_v_b), `mainline-old`
(attn_kv_b only), `mainline-mla` (attn_k_b/attn_v_b only, head_count_kv = 1, key_length 576-style).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gguf  # noqa: E402

from engine.tokenizer import gpt2_byte_chars  # noqa: E402
from quant.matmul import quantize_tensor  # noqa: E402
from quant.types import type_info  # noqa: E402


@dataclass
class Shape:
    n_embd: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_head_kv: int = 2          # llama only
    head_dim: int = 16          # llama only
    n_ff: int = 128
    n_ctx: int = 256
    # deepseek2
    q_lora_rank: int = 48       # 0: no q_lora (V2-Lite style)
    kv_lora_rank: int = 32
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 64
    n_dense_lead: int = 1
    gating: int = 1             # 1 softmax (V2), 2 sigmoid + exp_probs_b (V3)
    weights_norm: bool = False
    weights_scale: float = 1.0
    yarn_factor: float = 0.0    # >0: YaRN rope scaling with this factor
    yarn_log_mul: float = 0.0
    yarn_orig_ctx: int = 0
    rope_base: float = 10000.0
    llama_moe: bool = False     # llama only: Mixtral-style routed experts instead of a dense MLP
    qwen_head_dim: int = 24     # qwen3: the head size (attention.key_length), not n_embd / n_head
    n_vocab: int = 0            # >0: the byte vocabulary padded with control tokens to this size


PRESETS = {
    "tiny": Shape(),
    # V3-like: sigmoid gating with selection bias, weight norm and scale, YaRN
    "tiny-v3": Shape(gating=2, weights_norm=True, weights_scale=2.5, yarn_factor=4.0, yarn_log_mul=0.1,
                     yarn_orig_ctx=64),
    # V2-Lite-like: no q_lora. ik_llama.cpp infers "no q_lora" from n_layer in {26, 27}.
    "tiny-lite": Shape(q_lora_rank=0, n_layer=26, n_embd=32, n_expert=4, n_ff_exp=32, n_ff=64, kv_lora_rank=32,
                       qk_nope=16, qk_rope=16, v_head=16),
    "tiny-moe": Shape(llama_moe=True, n_expert=4),
    # qwen3moe at 256-multiple widths (so the 256-block types quantize every matrix): 8 experts, top 2
    "qwen256": Shape(n_embd=256, n_head=4, n_head_kv=2, qwen_head_dim=64, n_ff=512, n_expert=8, n_expert_used=2,
                     n_ff_exp=256, n_layer=2),
    # llama4 at 256-multiple widths (heads of 64): the K-quant and IQK types apply to every matrix
    "llama4-256": Shape(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_expert=8, n_ff_exp=256),
    # DeepSeek's real latent sizes (576/512, rope 64): ik_llama.cpp accepts the new-mainline MLA
    # layout only with these
    "tiny-mla576": Shape(kv_lora_rank=512, qk_rope=64, qk_nope=32, v_head=32),
    # V2-Lite-like at the real latent sizes (ik_llama.cpp runs every mode on it; quantized caches fit)
    "tiny-lite576": Shape(q_lora_rank=0, n_layer=26, n_embd=32, n_expert=4, n_ff_exp=32, n_ff=64, kv_lora_rank=512,
                          qk_nope=32, qk_rope=64, v_head=32),
    # every matrix 256 columns wide or a multiple (except W_k_b's 64): quantizable to the 256-block
    # k-quant and IQK types by llama-quantize
    "small256": Shape(n_embd=256, n_head=4, n_ff=512, q_lora_rank=256, kv_lora_rank=512, qk_nope=64, qk_rope=64,
                      v_head=64, n_expert=8, n_ff_exp=256),
    # DeepSeek's attention (16 heads, 576/512 latent cache) over small weights: a token's time at
    # depth is mostly flash attention (scripts/bench_sweep.py on it compares the attention kernels)
    "attn16": Shape(n_embd=256, n_layer=8, n_head=16, n_ff=512, n_ctx=8192, q_lora_rank=256, kv_lora_rank=512,
                    qk_nope=128, qk_rope=64, v_head=128, n_expert=8, n_expert_used=2, n_ff_exp=256),
    # ~1B parameters, DeepSeek-shaped (for benchmarks)
    "1b": Shape(n_embd=1024, n_layer=10, n_head=16, n_ff=4096, n_ctx=4096, q_lora_rank=384, kv_lora_rank=512,
                qk_nope=128, qk_rope=64, v_head=128, n_expert=64, n_expert_used=6, n_expert_shared=2,
                n_ff_exp=512, n_dense_lead=1, gating=2, weights_norm=True, weights_scale=2.5),
    # ~2.2B parameters, DeepSeek-V3-shaped with every width a multiple of 256 (so ik's mixtures and
    # the 256-block types apply to every matrix) and DeepSeek's 102400-token output matrix: the
    # model of the kernel benchmarks (README, scripts/bench_types.py)
    "2b": Shape(n_embd=2048, n_layer=4, n_head=16, n_ff=4096, n_ctx=4096, q_lora_rank=512, kv_lora_rank=512,
                qk_nope=128, qk_rope=64, v_head=128, n_expert=64, n_expert_used=6, n_expert_shared=2,
                n_ff_exp=1536, n_dense_lead=1, gating=2, weights_norm=True, weights_scale=2.5, n_vocab=102400),
}


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level GPT-2 style vocabulary: 256 byte symbols + <|endoftext|>, a few merges."""
    tokens = gpt2_byte_chars()
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("o", "u"), ("Ġ", "s")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(3)
    return tokens, types, merges


class _Writer:
    def __init__(self, qtype: str, rng: np.random.Generator, expert_qtype: str | None = None):
        self.qtype = type_info(qtype)
        self.expert_qtype = type_info(expert_qtype) if expert_qtype else None   # the *_exps.weight tensors
        self.rng = rng
        self.tensors: list[tuple[str, np.ndarray, int]] = []   # name, data, ggml type

    def mat(self, name: str, *shape: int, scale: float = 1.0, keep_f32: bool = False) -> np.ndarray:
        """Random matrix of NumPy shape (…, rows, cols); cols is the input dimension."""
        w = (self.rng.standard_normal(shape) * (scale / np.sqrt(shape[-1]))).astype(np.float32)
        self.put(name, w, keep_f32)
        return w

    def put(self, name: str, w: np.ndarray, keep_f32: bool = False) -> None:
        t = self.expert_qtype if self.expert_qtype and name.endswith("_exps.weight") else self.qtype
        if t.interleave and w.ndim >= 2 and w.shape[-2] % t.interleave:   # as llama-quantize: the plain type
            t = type_info(t.base)
        if keep_f32 or w.ndim == 1 or w.shape[-1] % t.block_size:
            self.tensors.append((name, w.astype(np.float32), 0))
        else:
            self.tensors.append((name, w, t.id))

    def vec(self, name: str, n: int, base: float = 1.0, noise: float = 0.1) -> None:
        self.tensors.append((name, (base + noise * self.rng.standard_normal(n)).astype(np.float32), 0))

    def emit(self, writers: list[gguf.GGUFWriter]) -> None:
        per = -(-len(self.tensors) // len(writers))
        for i, (name, w, tid) in enumerate(self.tensors):
            gw = writers[min(i // per, len(writers) - 1)]
            if tid == 0:
                gw.add_tensor(name, w)
            elif tid == 1:
                gw.add_tensor(name, w.astype(np.float16))
            else:
                q = quantize_tensor(w, tid)
                # bytes given as int8 with the logical shape: gguf takes the type id as it is, so
                # ik_llama.cpp's types (unknown to gguf's enum) are written as well
                raw = np.ascontiguousarray(q.data).view(np.int8)
                gw.add_tensor(name, raw, raw_shape=w.shape, raw_dtype=tid)


def _tokenizer_kv(gw: gguf.GGUFWriter, n_vocab: int = 0, pre: str = "gpt-2") -> int:
    tokens, types, merges = byte_vocab()
    for i in range(len(tokens), n_vocab):      # a real-sized output matrix (DeepSeek: 102400 rows)
        tokens.append(f"<|pad{i}|>")
        types.append(3)
    gw.add_tokenizer_model("gpt2")
    gw.add_tokenizer_pre(pre)
    gw.add_token_list(tokens)
    gw.add_token_types(types)
    gw.add_token_merges(merges)
    gw.add_bos_token_id(len(tokens) - 1)
    gw.add_eos_token_id(len(tokens) - 1)
    gw.add_add_bos_token(True)
    gw.add_add_eos_token(False)
    return len(tokens)


def _common_kv(gw: gguf.GGUFWriter, a: str, s: Shape, n_vocab: int, eps: float) -> None:
    """The `{arch}.*` keys every architecture has."""
    gw.add_uint32(f"{a}.context_length", s.n_ctx)
    gw.add_uint32(f"{a}.embedding_length", s.n_embd)
    gw.add_uint32(f"{a}.block_count", s.n_layer)
    gw.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    gw.add_uint32(f"{a}.attention.head_count", s.n_head)
    gw.add_float32(f"{a}.rope.freq_base", s.rope_base)
    gw.add_float32(f"{a}.attention.layer_norm_rms_epsilon", eps)
    gw.add_uint32(f"{a}.vocab_size", n_vocab)


def _embedding_and_head(w: _Writer, s: Shape, n_vocab: int) -> None:
    w.mat("token_embd.weight", n_vocab, s.n_embd, scale=np.sqrt(s.n_embd))
    w.vec("output_norm.weight", s.n_embd)
    w.mat("output.weight", n_vocab, s.n_embd, scale=2.0)


def _attention(w: _Writer, p: str, s: Shape, hd: int, E: int, biases: bool = False, qk_norm: bool = False) -> None:
    """q / k / v / output projections of heads of hd values (then q/k/v biases, per-head q/k
    norms where the family has them), drawn in this order by every builder that uses it."""
    w.mat(p + "attn_q.weight", s.n_head * hd, E, scale=2.0)
    w.mat(p + "attn_k.weight", s.n_head_kv * hd, E, scale=2.0)
    w.mat(p + "attn_v.weight", s.n_head_kv * hd, E)
    if biases:
        for n, rows in (("q", s.n_head * hd), ("k", s.n_head_kv * hd), ("v", s.n_head_kv * hd)):
            w.vec(p + f"attn_{n}.bias", rows, base=0.0, noise=0.5)
    if qk_norm:
        w.vec(p + "attn_q_norm.weight", hd, noise=0.3)
        w.vec(p + "attn_k_norm.weight", hd, noise=0.3)
    w.mat(p + "attn_output.weight", E, s.n_head * hd, scale=0.5)


def _ffn(w: _Writer, p: str, E: int, F: int, suffix: str = "") -> None:
    """A SiLU-gated FFN of width F (suffix "_shexp": a shared expert)."""
    w.mat(p + f"ffn_gate{suffix}.weight", F, E)
    w.mat(p + f"ffn_up{suffix}.weight", F, E)
    w.mat(p + f"ffn_down{suffix}.weight", E, F, scale=0.5)


def _experts(w: _Writer, p: str, X: int, E: int, F: int, probs_b: float = 0.0) -> None:
    """The router and X routed experts of width F (probs_b > 0: the selection bias exp_probs_b,
    of that spread)."""
    w.mat(p + "ffn_gate_inp.weight", X, E, scale=3.0, keep_f32=True)
    if probs_b:
        w.vec(p + "exp_probs_b.bias", X, base=0.0, noise=probs_b)
    w.mat(p + "ffn_gate_exps.weight", X, F, E)
    w.mat(p + "ffn_up_exps.weight", X, F, E)
    w.mat(p + "ffn_down_exps.weight", X, E, F, scale=0.5)


def build_llama(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int) -> None:
    a = "llama"
    _common_kv(gw, a, s, n_vocab, 1e-5)
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    gw.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    if s.llama_moe:
        gw.add_uint32(f"{a}.expert_count", s.n_expert)
        gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    E = s.n_embd
    _embedding_and_head(w, s, n_vocab)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        _attention(w, p, s, s.head_dim, E)
        w.vec(p + "ffn_norm.weight", E)
        if s.llama_moe:      # llama's experts are feed_forward_length wide (no separate expert length key)
            _experts(w, p, s.n_expert, E, s.n_ff)
        else:
            _ffn(w, p, E, s.n_ff)


def build_qwen3(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int, moe: bool) -> None:
    """qwen3 / qwen3moe as convert_hf_to_gguf writes them: key_length for the head size, per-head
    q/k norms, and for the MoE experts of expert_feed_forward_length (no shared expert)."""
    a = "qwen3moe" if moe else "qwen3"
    _common_kv(gw, a, s, n_vocab, 1e-6)
    hd, E = s.qwen_head_dim, s.n_embd
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    gw.add_uint32(f"{a}.attention.key_length", hd)
    gw.add_uint32(f"{a}.attention.value_length", hd)
    if moe:
        gw.add_uint32(f"{a}.expert_count", s.n_expert)
        gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        gw.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    _embedding_and_head(w, s, n_vocab)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        _attention(w, p, s, hd, E, qk_norm=True)
        w.vec(p + "ffn_norm.weight", E)
        if moe:
            _experts(w, p, s.n_expert, E, s.n_ff_exp)
        else:
            _ffn(w, p, E, s.n_ff)


def build_qwen2(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int, moe: bool) -> None:
    """qwen2 / qwen2moe as convert_hf_to_gguf writes them: q/k/v biases; for the MoE, experts of
    expert_feed_forward_length and one shared expert (expert_shared_feed_forward_length) behind
    a per-token sigmoid gate (ffn_gate_inp_shexp)."""
    a = "qwen2moe" if moe else "qwen2"
    _common_kv(gw, a, s, n_vocab, 1e-6)
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    if moe:
        gw.add_uint32(f"{a}.expert_count", s.n_expert)
        gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        gw.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
        gw.add_uint32(f"{a}.expert_shared_feed_forward_length", 2 * s.n_ff_exp)
    E, hd = s.n_embd, s.n_embd // s.n_head
    _embedding_and_head(w, s, n_vocab)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        _attention(w, p, s, hd, E, biases=True)
        w.vec(p + "ffn_norm.weight", E)
        if moe:
            _experts(w, p, s.n_expert, E, s.n_ff_exp)
            w.vec(p + "ffn_gate_inp_shexp.weight", E, base=0.0, noise=0.3)
            _ffn(w, p, E, 2 * s.n_ff_exp, "_shexp")
        else:
            _ffn(w, p, E, s.n_ff)


def build_gemma3(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int) -> None:
    """gemma3 as convert_hf_to_gguf writes it: 7 layers (layer 5 global, the others sliding with a
    16-position window, so the window matters at -c 64), the file's own head size, q/k norms,
    the sandwich norms (post_attention_norm, post_ffw_norm), a GELU FFN, tied embeddings."""
    a = "gemma3"
    s = replace(s, n_layer=7)
    _common_kv(gw, a, replace(s, rope_base=1e6), n_vocab, 1e-6)
    hd, E = s.qwen_head_dim, s.n_embd
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    gw.add_uint32(f"{a}.attention.key_length", hd)
    gw.add_uint32(f"{a}.attention.value_length", hd)
    gw.add_uint32(f"{a}.attention.sliding_window", 16)
    w.mat("token_embd.weight", n_vocab, E, scale=1.0)
    w.vec("output_norm.weight", E)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        _attention(w, p, s, hd, E, qk_norm=True)
        w.vec(p + "post_attention_norm.weight", E, base=0.5)
        w.vec(p + "ffn_norm.weight", E)
        _ffn(w, p, E, s.n_ff)
        w.vec(p + "post_ffw_norm.weight", E, base=0.5)


def build_gpt_oss(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int) -> None:
    """gpt-oss as convert_hf_to_gguf writes it: biases on q/k/v/o, the router and every expert
    projection; attention sinks; a 16-position window on the even layers; YaRN x4 (original
    context 64); experts of expert_feed_forward_length (MXFP4 as the real files, with
    expert_qtype="mxfp4")."""
    a = "gpt-oss"
    s = replace(s, n_layer=4)
    _common_kv(gw, a, replace(s, rope_base=150000.0), n_vocab, 1e-5)
    hd, E, X, F = s.qwen_head_dim, s.n_embd, s.n_expert, s.n_ff_exp
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    gw.add_uint32(f"{a}.attention.key_length", hd)
    gw.add_uint32(f"{a}.attention.value_length", hd)
    gw.add_uint32(f"{a}.rope.dimension_count", hd)
    gw.add_uint32(f"{a}.attention.sliding_window", 16)
    gw.add_uint32(f"{a}.expert_count", X)
    gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    gw.add_uint32(f"{a}.expert_feed_forward_length", F)
    gw.add_string(f"{a}.rope.scaling.type", "yarn")
    gw.add_float32(f"{a}.rope.scaling.factor", 4.0)
    gw.add_uint32(f"{a}.rope.scaling.original_context_length", 64)
    _embedding_and_head(w, s, n_vocab)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        for n, rows in (("q", s.n_head * hd), ("k", s.n_head_kv * hd), ("v", s.n_head_kv * hd)):
            w.mat(p + f"attn_{n}.weight", rows, E, scale=2.0 if n != "v" else 1.0)
            w.vec(p + f"attn_{n}.bias", rows, base=0.0, noise=0.5)
        w.mat(p + "attn_output.weight", E, s.n_head * hd, scale=0.5)
        w.vec(p + "attn_output.bias", E, base=0.0, noise=0.2)
        w.vec(p + "attn_sinks.weight", s.n_head, base=1.0, noise=1.0)
        w.vec(p + "post_attention_norm.weight", E)
        w.mat(p + "ffn_gate_inp.weight", X, E, scale=3.0, keep_f32=True)
        w.vec(p + "ffn_gate_inp.bias", X, base=0.0, noise=0.5)
        w.mat(p + "ffn_gate_exps.weight", X, F, E, scale=4.0)    # past the SwiGLU's clamp at 7 now and then
        w.mat(p + "ffn_gate_exps.bias", X, F, scale=np.sqrt(F) * 0.5, keep_f32=True)
        w.mat(p + "ffn_up_exps.weight", X, F, E, scale=4.0)
        w.mat(p + "ffn_up_exps.bias", X, F, scale=np.sqrt(F) * 0.5, keep_f32=True)
        w.mat(p + "ffn_down_exps.weight", X, E, F, scale=0.5)
        w.mat(p + "ffn_down_exps.bias", X, E, scale=np.sqrt(E) * 0.2, keep_f32=True)


def build_glm4moe(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int) -> None:
    """glm4moe as convert_hf_to_gguf writes GLM-4.5: q/k/v biases, half the head rotated (NEOX),
    n_dense_lead dense layers, then sigmoid-routed experts with exp_probs_b, weights normalised
    and scaled, one shared expert; plus one NextN layer at the end (its tensors, never run)."""
    a = "glm4moe"
    n_layer = s.n_layer + 1                                     # + the NextN layer
    _common_kv(gw, a, replace(s, n_layer=n_layer), n_vocab, 1e-5)
    hd, E = s.qwen_head_dim, s.n_embd
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    gw.add_uint32(f"{a}.attention.key_length", hd)
    gw.add_uint32(f"{a}.attention.value_length", hd)
    gw.add_uint32(f"{a}.rope.dimension_count", hd // 2)
    gw.add_uint32(f"{a}.expert_count", s.n_expert)
    gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    gw.add_uint32(f"{a}.expert_shared_count", 1)
    gw.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    gw.add_uint32(f"{a}.leading_dense_block_count", s.n_dense_lead)
    gw.add_float32(f"{a}.expert_weights_scale", 2.5)
    gw.add_bool(f"{a}.expert_weights_norm", True)
    gw.add_uint32(f"{a}.expert_gating_func", 2)
    gw.add_uint32(f"{a}.nextn_predict_layers", 1)
    _embedding_and_head(w, s, n_vocab)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        _attention(w, p, s, hd, E, biases=True)
        w.vec(p + "post_attention_norm.weight", E)
        if i < s.n_dense_lead:
            _ffn(w, p, E, s.n_ff)
            continue
        _experts(w, p, s.n_expert, E, s.n_ff_exp, probs_b=0.3)
        _ffn(w, p, E, s.n_ff_exp, "_shexp")
        if i == n_layer - 1:                                     # the NextN layer's own tensors
            w.vec(p + "nextn.enorm.weight", E)
            w.vec(p + "nextn.hnorm.weight", E)
            w.mat(p + "nextn.eh_proj.weight", E, 2 * E)
            w.vec(p + "nextn.shared_head_norm.weight", E)


def build_llama4(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int) -> None:
    """llama4 as convert_hf_to_gguf writes Llama-4: at least 4 layers (layer 3 has no RoPE), every
    second one a MoE layer (interleave_moe_layer_step 2, as Maverick) of top-1 experts
    expert_feed_forward_length wide plus a shared expert as wide, dense layers
    feed_forward_length wide, the head size as key/value_length, llama3-style rope_freqs."""
    a = "llama4"
    s = replace(s, n_layer=max(s.n_layer, 4), n_expert_used=1)
    _common_kv(gw, a, s, n_vocab, 1e-5)
    hd, E = s.head_dim, s.n_embd
    gw.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    gw.add_uint32(f"{a}.attention.key_length", hd)
    gw.add_uint32(f"{a}.attention.value_length", hd)
    gw.add_uint32(f"{a}.rope.dimension_count", hd)
    gw.add_uint32(f"{a}.expert_count", s.n_expert)
    gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    gw.add_uint32(f"{a}.interleave_moe_layer_step", 2)
    gw.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    # llama3 frequency factors (factor 8, low/high 1/4, original context 64): 1 for the fast pairs,
    # 8 for the slow ones, smooth between
    wavelen = 2 * np.pi * s.rope_base ** (np.arange(0, hd, 2) / hd)
    smooth = np.clip((64 / wavelen - 1) / (4 - 1), 0, 1)
    w.put("rope_freqs.weight", (1 / ((1 - smooth) / 8 + smooth)).astype(np.float32))
    _embedding_and_head(w, s, n_vocab)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        _attention(w, p, s, hd, E)
        w.vec(p + "ffn_norm.weight", E)
        if (i + 1) % 2 == 0:
            _experts(w, p, s.n_expert, E, s.n_ff_exp)
            _ffn(w, p, E, s.n_ff_exp, "_shexp")
        else:
            _ffn(w, p, E, s.n_ff)


def build_deepseek2(w: _Writer, gw: gguf.GGUFWriter, s: Shape, n_vocab: int, layout: str) -> None:
    a = "deepseek2"
    E, H = s.n_embd, s.n_head
    nope, rope, dv, lora = s.qk_nope, s.qk_rope, s.v_head, s.kv_lora_rank
    _common_kv(gw, a, s, n_vocab, 1e-6)
    gw.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    gw.add_uint32(f"{a}.leading_dense_block_count", s.n_dense_lead)
    if s.q_lora_rank:
        gw.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    gw.add_uint32(f"{a}.attention.kv_lora_rank", lora)
    if layout == "mainline-mla":
        gw.add_uint32(f"{a}.attention.head_count_kv", 1)
        gw.add_uint32(f"{a}.attention.key_length", lora + rope)
        gw.add_uint32(f"{a}.attention.value_length", lora)
        gw.add_uint32(f"{a}.attention.key_length_mla", nope + rope)
        gw.add_uint32(f"{a}.attention.value_length_mla", dv)
    else:
        gw.add_uint32(f"{a}.attention.head_count_kv", H)
        gw.add_uint32(f"{a}.attention.key_length", nope + rope)
        gw.add_uint32(f"{a}.attention.value_length", dv)
    gw.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    gw.add_uint32(f"{a}.expert_count", s.n_expert)
    gw.add_uint32(f"{a}.expert_shared_count", s.n_expert_shared)
    gw.add_float32(f"{a}.expert_weights_scale", s.weights_scale)
    gw.add_bool(f"{a}.expert_weights_norm", s.weights_norm)
    gw.add_uint32(f"{a}.expert_gating_func", s.gating)
    gw.add_uint32(f"{a}.rope.dimension_count", rope)
    if s.yarn_factor > 0:
        gw.add_string(f"{a}.rope.scaling.type", "yarn")
        gw.add_float32(f"{a}.rope.scaling.factor", s.yarn_factor)
        gw.add_uint32(f"{a}.rope.scaling.original_context_length", s.yarn_orig_ctx or s.n_ctx)
        gw.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", s.yarn_log_mul)
    else:
        gw.add_string(f"{a}.rope.scaling.type", "none")

    _embedding_and_head(w, s, n_vocab)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vec(p + "attn_norm.weight", E)
        if s.q_lora_rank:
            w.mat(p + "attn_q_a.weight", s.q_lora_rank, E)
            w.vec(p + "attn_q_a_norm.weight", s.q_lora_rank)
            w.mat(p + "attn_q_b.weight", H * (nope + rope), s.q_lora_rank, scale=2.0)
        else:
            w.mat(p + "attn_q.weight", H * (nope + rope), E, scale=2.0)
        w.mat(p + "attn_kv_a_mqa.weight", lora + rope, E, scale=2.0)
        w.vec(p + "attn_kv_a_norm.weight", lora)
        kv_b = (w.rng.standard_normal((H, nope + dv, lora)) / np.sqrt(lora)).astype(np.float32)
        k_b = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))   # (H, lora, nope)
        v_b = np.ascontiguousarray(kv_b[:, nope:, :])                      # (H, dv, lora)
        if layout in ("ik", "mainline-old"):
            w.put(p + "attn_kv_b.weight", kv_b.reshape(H * (nope + dv), lora))
        if layout == "ik":
            w.put(p + "attn_k_b.weight", k_b.reshape(H * lora, nope))
            w.put(p + "attn_v_b.weight", v_b.reshape(H * dv, lora))
        elif layout == "mainline-mla":
            w.put(p + "attn_k_b.weight", k_b)
            w.put(p + "attn_v_b.weight", v_b)
        w.mat(p + "attn_output.weight", E, H * dv, scale=0.5)
        w.vec(p + "ffn_norm.weight", E)
        if i < s.n_dense_lead:
            _ffn(w, p, E, s.n_ff)
        else:
            _experts(w, p, s.n_expert, E, s.n_ff_exp, probs_b=0.05 if s.gating == 2 else 0.0)
            if s.n_expert_shared:
                _ffn(w, p, E, s.n_ff_exp * s.n_expert_shared, "_shexp")


def write_model(path: str, arch: str = "deepseek2", layout: str = "ik", qtype: str = "f16",
                shape: Shape | str = "tiny", seed: int = 0, split: int = 1, expert_qtype: str | None = None,
                **overrides) -> list[str]:
    """Write a random model; returns the written paths (several with split > 1).  expert_qtype: the
    routed experts' type (e.g. MXFP4, as gpt-oss files ship them), else qtype."""
    s = PRESETS[shape] if isinstance(shape, str) else shape
    if overrides:
        s = replace(s, **overrides)
    rng = np.random.default_rng(seed)
    if split > 1:
        base = path[:-5] if path.endswith(".gguf") else path
        paths = [f"{base}-{i:05d}-of-{split:05d}.gguf" for i in range(1, split + 1)]
    else:
        paths = [path]
    writers = [gguf.GGUFWriter(p, arch) for p in paths]
    gw = writers[0]
    gw.add_name(f"ikcli-test-{arch}-{layout}-{qtype}")
    if split > 1:
        for i, x in enumerate(writers):
            x.add_uint16("split.no", i)
            x.add_uint16("split.count", split)
    n_vocab = _tokenizer_kv(gw, s.n_vocab, "llama4" if arch == "llama4" else "gpt-2")
    w = _Writer(qtype, rng, expert_qtype)
    if arch == "llama":
        build_llama(w, gw, s, n_vocab)
    elif arch == "glm4moe":
        build_glm4moe(w, gw, s, n_vocab)
    elif arch == "gemma3":
        build_gemma3(w, gw, s, n_vocab)
    elif arch == "llama4":
        build_llama4(w, gw, s, n_vocab)
    elif arch == "gpt-oss":
        build_gpt_oss(w, gw, s, n_vocab)
    elif arch in ("qwen2", "qwen2moe"):
        build_qwen2(w, gw, s, n_vocab, arch == "qwen2moe")
    elif arch in ("qwen3", "qwen3moe"):
        build_qwen3(w, gw, s, n_vocab, arch == "qwen3moe")
    elif arch == "deepseek2":
        build_deepseek2(w, gw, s, n_vocab, layout)
    else:
        raise ValueError(f"unknown arch {arch}")
    if split > 1:
        for x in writers:
            x.add_int32("split.tensors.count", len(w.tensors))
    w.emit(writers)
    for x in writers:
        x.write_header_to_file()
        x.write_kv_data_to_file()
        x.write_tensors_to_file()
        x.close()
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", default="deepseek2", choices=["llama", "deepseek2", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "glm4moe", "gemma3", "gpt-oss",
                                                    "llama4"])
    ap.add_argument("--layout", default="ik", choices=["ik", "mainline-old", "mainline-mla"])
    ap.add_argument("--type", default="f16", help="weight type: f32 f16 bf16 q8_0 q4_0")
    ap.add_argument("--expert-type", default=None, help="type of the routed experts (*_exps.weight), e.g. mxfp4")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", type=int, default=1)
    a = ap.parse_args()
    for p in write_model(a.out, a.arch, a.layout, a.type, a.preset, a.seed, a.split, a.expert_type):
        print(p)


if __name__ == "__main__":
    main()
