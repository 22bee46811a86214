#!/usr/bin/env python3
"""Train a tiny DeepSeek-V2-style (GGUF arch "deepseek2") model on Shakespeare
and export it as a GGUF file that ik_llama.cpp / mainline llama.cpp can load.

    python scripts/train_demo_model.py --out engine/data/demo-deepseek2.gguf

Pipeline
 1. byte-level BPE tokenizer (scripts/bpe_train.py) trained on the train text;
 2. torch model whose forward pass is the math of ik_llama.cpp's deepseek2
    graph (src/graphs/build_deepseek2.cpp, non-TP path, no YaRN):
      RMSNorm -> MLA attention (q_a -> q_a_norm -> q_b  | or wq when
      q_lora_rank == 0; kv_a_mqa -> [c | k_pe]; c -> kv_a_norm -> kv_b ->
      per head [k_nope | v]; RoPE type NORM (adjacent pairs) on q_pe and the
      single shared k_pe; softmax(kq_scale * q.k + causal mask) v; wo) ->
      residual -> RMSNorm -> dense SiLU-gated FFN (first
      leading_dense_block_count layers) or MoE (softmax router, top-k,
      optional weight normalisation, expert_weights_scale, routed SiLU-gated
      experts + shared expert) -> residual; final RMSNorm; untied output.
 3. export GGUF (old mainline layout: attn_kv_b, no attn_k_b/attn_v_b);
 4. perplexity exactly like llama-perplexity (chunks of n_ctx tokens of the
    tokenized test text (tokenized with BOS prepended), first token of each
    chunk replaced by BOS, score the second half of each chunk:
    positions n_ctx/2 .. n_ctx-2 predict the next token; PPL = exp(mean NLL)).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bpe_train import EOT, BpeTokenizer, train_bpe  # noqa: E402

MODEL_NAME = "ikcli-demo-deepseek2-shakespeare"


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------
class Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    @property
    def head_k(self):  # attention.key_length
        return self.qk_nope + self.qk_rope

    @property
    def kq_scale(self):
        # build_deepseek2(): mscale = attn_factor*(1 + rope_yarn_log_mul*log(1/freq_scale)) = 1 without YaRN
        # kq_scale = mscale*mscale/sqrt(n_embd_head_k)
        return 1.0 / math.sqrt(self.head_k)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        # ggml_rms_norm: x / sqrt(mean(x^2) + eps), then * weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_norm(x, cos, sin):
    """LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (x[2i], x[2i+1]) by pos*base^(-2i/n_rot).
    x: [B, T, H, n_rot]; cos/sin: [T, n_rot/2]"""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    return torch.stack((y0, y1), dim=-1).flatten(-2)


def rope_tables(n_ctx, n_rot, base):
    inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)  # theta_scale^i
    ang = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


class MLA(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        H = c.n_head
        if c.q_lora_rank > 0:
            self.wq_a = nn.Linear(c.n_embd, c.q_lora_rank, bias=False)       # blk.N.attn_q_a
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.eps)                     # blk.N.attn_q_a_norm
            self.wq_b = nn.Linear(c.q_lora_rank, H * c.head_k, bias=False)    # blk.N.attn_q_b
        else:
            self.wq = nn.Linear(c.n_embd, H * c.head_k, bias=False)           # blk.N.attn_q
        self.wkv_a = nn.Linear(c.n_embd, c.kv_lora_rank + c.qk_rope, bias=False)  # blk.N.attn_kv_a_mqa
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.eps)                            # blk.N.attn_kv_a_norm
        self.wkv_b = nn.Linear(c.kv_lora_rank, H * (c.qk_nope + c.v_dim), bias=False)  # blk.N.attn_kv_b
        self.wo = nn.Linear(H * c.v_dim, c.n_embd, bias=False)                     # blk.N.attn_output

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        H = c.n_head
        if c.q_lora_rank > 0:
            q = self.wq_b(self.q_a_norm(self.wq_a(x)))
        else:
            q = self.wq(x)
        q = q.view(B, T, H, c.head_k)
        q_nope, q_pe = q[..., :c.qk_nope], q[..., c.qk_nope:]
        kv_a = self.wkv_a(x)
        ckv, k_pe = kv_a[..., :c.kv_lora_rank], kv_a[..., c.kv_lora_rank:]
        kv = self.wkv_b(self.kv_a_norm(ckv)).view(B, T, H, c.qk_nope + c.v_dim)
        k_nope, v = kv[..., :c.qk_nope], kv[..., c.qk_nope:]
        q_pe = rope_norm(q_pe, cos[:T], sin[:T])
        k_pe = rope_norm(k_pe.view(B, T, 1, c.qk_rope), cos[:T], sin[:T]).expand(B, T, H, c.qk_rope)
        qh = torch.cat((q_nope, q_pe), -1).transpose(1, 2)   # [B,H,T,dk]
        kh = torch.cat((k_nope, k_pe), -1).transpose(1, 2)
        vh = v.transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=c.kq_scale)
        return self.wo(o.transpose(1, 2).reshape(B, T, H * c.v_dim))


class DenseFFN(nn.Module):
    def __init__(self, n_embd, n_ff):
        super().__init__()
        self.gate = nn.Linear(n_embd, n_ff, bias=False)
        self.up = nn.Linear(n_embd, n_ff, bias=False)
        self.down = nn.Linear(n_ff, n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        E, D, Fe = c.n_expert, c.n_embd, c.n_ff_exp
        self.gate_inp = nn.Linear(D, E, bias=False)                 # blk.N.ffn_gate_inp
        self.gate_exps = nn.Parameter(torch.empty(E, Fe, D))         # blk.N.ffn_gate_exps
        self.up_exps = nn.Parameter(torch.empty(E, Fe, D))           # blk.N.ffn_up_exps
        self.down_exps = nn.Parameter(torch.empty(E, D, Fe))         # blk.N.ffn_down_exps
        self.shexp = DenseFFN(D, Fe * c.n_shared)                    # blk.N.ffn_{gate,up,down}_shexp
        self.aux = None

    def forward(self, x):
        c = self.c
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        logits = self.gate_inp(xf)
        probs = torch.softmax(logits.float(), -1)                 # expert_gating_func = softmax
        w, idx = torch.topk(probs, c.n_expert_used, dim=-1)     # ggml_top_k on the probs
        if c.weights_norm:
            w = w / w.sum(-1, keepdim=True)
        if abs(c.weights_scale - 1.0) > 1e-5:
            w = w * c.weights_scale
        out = torch.zeros_like(xf)
        for e in range(c.n_expert):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = xf[tok]
            h = F.silu(xe @ self.gate_exps[e].t()) * (xe @ self.up_exps[e].t())
            ye = (h @ self.down_exps[e].t()) * w[tok, slot, None]
            out.index_add_(0, tok, ye)
        if self.training:
            # Switch-style load-balancing loss (training only)
            frac = torch.bincount(idx.flatten(), minlength=c.n_expert).float() / idx.numel()
            self.aux = c.n_expert * (frac * probs.mean(0)).sum()
        out = out + self.shexp(xf)
        return out.view(shp)


class Block(nn.Module):
    def __init__(self, c: Cfg, il: int):
        super().__init__()
        self.attn_norm = RMSNorm(c.n_embd, c.eps)
        self.attn = MLA(c)
        self.ffn_norm = RMSNorm(c.n_embd, c.eps)
        self.ffn = DenseFFN(c.n_embd, c.n_ff) if il < c.n_dense_lead else MoE(c)
        self.drop = nn.Dropout(c.dropout)  # training only (identity in eval / inference)

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class Model(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        self.tok_embd = nn.Embedding(c.n_vocab, c.n_embd)
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c.n_layer)])
        self.output_norm = RMSNorm(c.n_embd, c.eps)
        self.output = nn.Linear(c.n_embd, c.n_vocab, bias=False)
        cos, sin = rope_tables(c.n_ctx, c.qk_rope, c.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init()

    def _init(self):
        std = 0.02
        proj_std = std / math.sqrt(2 * self.c.n_layer)
        for n, p in self.named_parameters():
            if p.dim() == 1:
                continue  # norms stay at 1
            if n.endswith("wo.weight") or n.endswith("down.weight") or n.endswith("down_exps"):
                nn.init.normal_(p, 0.0, proj_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        x = self.tok_embd(ids)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        return self.output(self.output_norm(x))

    def aux_loss(self):
        a = [b.ffn.aux for b in self.blocks if isinstance(b.ffn, MoE) and b.ffn.aux is not None]
        return sum(a) / len(a) if a else torch.zeros(())


# --------------------------------------------------------------------------------------
# perplexity (llama-perplexity method)
# --------------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model, tokens_with_bos, n_ctx, bos_id, max_chunks=None, batch=8):
    """tokens_with_bos = tokenize(text, add_bos=True). Mirrors examples/perplexity/perplexity.cpp
    perplexity(): n_chunk = len // n_ctx; in each chunk token 0 -> BOS; logits at positions
    first..n_ctx-2 (first = n_ctx/2) are scored against the following token."""
    was = model.training
    model.eval()
    toks = torch.tensor(tokens_with_bos, dtype=torch.long)
    n_chunk = len(toks) // n_ctx
    if max_chunks:
        n_chunk = min(n_chunk, max_chunks)
    first = n_ctx // 2
    nll, count = 0.0, 0
    per_chunk = []
    for i0 in range(0, n_chunk, batch):
        i1 = min(n_chunk, i0 + batch)
        x = torch.stack([toks[i * n_ctx:(i + 1) * n_ctx] for i in range(i0, i1)]).clone()
        x[:, 0] = bos_id
        logits = model(x).double()
        lp = torch.log_softmax(logits[:, first:n_ctx - 1], -1)
        tgt = torch.stack([toks[i * n_ctx + first + 1:(i + 1) * n_ctx] for i in range(i0, i1)])
        nl = -lp.gather(-1, tgt[..., None])[..., 0]
        for r in nl:
            nll += r.sum().item()
            count += r.numel()
            per_chunk.append(math.exp(nll / count))
    model.train(was)
    return math.exp(nll / count), n_chunk, count, per_chunk


# --------------------------------------------------------------------------------------
# GGUF export
# --------------------------------------------------------------------------------------
def export_gguf(model: Model, tok: BpeTokenizer, path: str, c: Cfg):
    import gguf

    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_name(MODEL_NAME)
    w.add_description("Tiny DeepSeek-V2-style MoE/MLA demo model trained on tiny-shakespeare "
                      "by ikcli scripts/train_demo_model.py")
    w.add_vocab_size(c.n_vocab)
    w.add_context_length(c.n_ctx)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(c.n_ff)
    w.add_block_count(c.n_layer)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head)     # old mainline layout: n_head_kv == n_head
    w.add_rope_freq_base(c.rope_base)
    w.add_rope_dimension_count(c.qk_rope)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    w.add_layer_norm_rms_eps(c.eps)
    w.add_key_length(c.head_k)
    w.add_value_length(c.v_dim)
    if c.q_lora_rank > 0:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_leading_dense_block_count(c.n_dense_lead)
    w.add_expert_count(c.n_expert)
    w.add_expert_used_count(c.n_expert_used)
    w.add_expert_shared_count(c.n_shared)
    w.add_expert_feed_forward_length(c.n_ff_exp)
    w.add_expert_weights_scale(c.weights_scale)
    w.add_expert_weights_norm(bool(c.weights_norm))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok.tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == EOT else gguf.TokenType.NORMAL for t in tok.tokens])
    w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.bos_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def f16(t):
        return t.detach().float().numpy().astype(np.float16)

    def f32(t):
        return t.detach().float().numpy().astype(np.float32)

    # numpy shape [rows, cols] -> GGUF ne = [cols, rows] (gguf-py reverses the shape)
    w.add_tensor("token_embd.weight", f16(model.tok_embd.weight))
    for il, b in enumerate(model.blocks):
        p = f"blk.{il}."
        a = b.attn
        w.add_tensor(p + "attn_norm.weight", f32(b.attn_norm.weight))
        if c.q_lora_rank > 0:
            w.add_tensor(p + "attn_q_a.weight", f16(a.wq_a.weight))
            w.add_tensor(p + "attn_q_a_norm.weight", f32(a.q_a_norm.weight))
            w.add_tensor(p + "attn_q_b.weight", f16(a.wq_b.weight))
        else:
            w.add_tensor(p + "attn_q.weight", f16(a.wq.weight))
        w.add_tensor(p + "attn_kv_a_mqa.weight", f16(a.wkv_a.weight))
        w.add_tensor(p + "attn_kv_a_norm.weight", f32(a.kv_a_norm.weight))
        w.add_tensor(p + "attn_kv_b.weight", f16(a.wkv_b.weight))
        w.add_tensor(p + "attn_output.weight", f16(a.wo.weight))
        w.add_tensor(p + "ffn_norm.weight", f32(b.ffn_norm.weight))
        if isinstance(b.ffn, DenseFFN):
            w.add_tensor(p + "ffn_gate.weight", f16(b.ffn.gate.weight))
            w.add_tensor(p + "ffn_up.weight", f16(b.ffn.up.weight))
            w.add_tensor(p + "ffn_down.weight", f16(b.ffn.down.weight))
        else:
            m = b.ffn
            w.add_tensor(p + "ffn_gate_inp.weight", f32(m.gate_inp.weight))
            w.add_tensor(p + "ffn_gate_exps.weight", f16(m.gate_exps))
            w.add_tensor(p + "ffn_up_exps.weight", f16(m.up_exps))
            w.add_tensor(p + "ffn_down_exps.weight", f16(m.down_exps))
            w.add_tensor(p + "ffn_gate_shexp.weight", f16(m.shexp.gate.weight))
            w.add_tensor(p + "ffn_up_shexp.weight", f16(m.shexp.up.weight))
            w.add_tensor(p + "ffn_down_shexp.weight", f16(m.shexp.down.weight))
    w.add_tensor("output_norm.weight", f32(model.output_norm.weight))
    w.add_tensor("output.weight", f16(model.output.weight))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def round_to_export_precision(model: Model):
    """Round every weight to the precision it is stored with in the GGUF
    (f16 for matrices, f32 for norms and the router)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "gate_inp" not in n:
                p.copy_(p.half().float())


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="engine/data/demo-deepseek2.gguf")
    ap.add_argument("--train", default="/work/shared/corpus/shakespeare.train.txt")
    ap.add_argument("--test", default="/work/shared/corpus/shakespeare.test.txt")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--dropout", type=float, default=0.1, help="residual-branch dropout (training only)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop training early after this many minutes (0 = no limit; breaks determinism)")
    ap.add_argument("--eval-every", type=int, default=200)
    # tokenizer / architecture
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--q-lora-rank", type=int, default=128,
                    help="0 = no q_lora (attn_q); NOTE ik_llama.cpp only accepts that for n_layer 26/27")
    ap.add_argument("--kv-lora-rank", type=int, default=64)
    ap.add_argument("--qk-nope", type=int, default=32)
    ap.add_argument("--qk-rope", type=int, default=16)
    ap.add_argument("--v-dim", type=int, default=32)
    ap.add_argument("--n-ff", type=int, default=768)
    ap.add_argument("--n-dense-lead", type=int, default=1)
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--n-expert-used", type=int, default=2)
    ap.add_argument("--n-ff-exp", type=int, default=128)
    ap.add_argument("--n-shared", type=int, default=1)
    ap.add_argument("--weights-norm", type=int, default=1)
    ap.add_argument("--weights-scale", type=float, default=1.5)
    ap.add_argument("--rope-base", type=float, default=10000.0)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--tokenizer-json", default="", help="optional path to also dump {tokens, merges}")
    ap.add_argument("--metrics-json", default="", help="optional path to dump final metrics")
    a = ap.parse_args()

    if a.q_lora_rank == 0 and a.n_layer not in (26, 27):
        print("WARNING: ik_llama.cpp/llama.cpp decide 'lite' (no q_lora) by n_layer in {26,27}; "
              "this file will not load there", file=sys.stderr)

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    rng = np.random.default_rng(a.seed)
    t_start = time.time()

    train_text = open(a.train, encoding="utf-8").read()
    test_text = open(a.test, encoding="utf-8").read()
    tokens, merges = train_bpe(train_text, a.vocab_size)
    tok = BpeTokenizer(tokens, merges)
    if a.tokenizer_json:
        with open(a.tokenizer_json, "w") as f:
            json.dump({"tokens": tokens, "merges": [f"{x} {y}" for x, y in merges]}, f)
    train_ids = np.array(tok.encode(train_text), dtype=np.int64)
    test_ids = tok.encode(test_text, add_bos=True)
    print(f"tokenizer: vocab {len(tokens)} merges {len(merges)}; train {len(train_ids)} tokens "
          f"({len(train_text)/len(train_ids):.2f} chars/tok); test {len(test_ids)} tokens (incl. BOS) "
          f"[{time.time()-t_start:.1f}s]", flush=True)

    c = Cfg(n_vocab=len(tokens), n_ctx=a.n_ctx, n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head,
            q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope=a.qk_nope, qk_rope=a.qk_rope,
            v_dim=a.v_dim, n_ff=a.n_ff, n_dense_lead=a.n_dense_lead, n_expert=a.n_expert,
            n_expert_used=a.n_expert_used, n_ff_exp=a.n_ff_exp, n_shared=a.n_shared,
            weights_norm=a.weights_norm, weights_scale=a.weights_scale, rope_base=a.rope_base, eps=a.eps, dropout=a.dropout)
    model = Model(c)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} params; kq_scale {c.kq_scale:.6f}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        pr = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * pr)))

    T = a.n_ctx
    bos = tok.bos_id
    t_train = time.time()
    steps_done = 0
    for step in range(a.steps):
        # random windows; position 0 holds BOS exactly like the perplexity chunks
        starts = rng.integers(0, len(train_ids) - T - 1, size=a.batch)
        x = np.stack([train_ids[s:s + T] for s in starts])
        y = np.stack([train_ids[s + 1:s + T + 1] for s in starts])
        x[:, 0] = bos
        x = torch.from_numpy(x)
        y = torch.from_numpy(y)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, c.n_vocab), y.reshape(-1))
        aux = model.aux_loss()
        opt.zero_grad(set_to_none=True)
        (loss + a.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        el = time.time() - t_train
        if step % 25 == 0 or step == a.steps - 1:
            print(f"step {step:5d} loss {loss.item():.4f} aux {aux.item():.3f} lr {lr_at(step):.2e} "
                  f"[{el:.0f}s, {el/(step+1):.2f}s/step]", flush=True)
        if a.eval_every and step > 0 and step % a.eval_every == 0:
            ppl, *_ = perplexity(model, test_ids, T, bos, max_chunks=24)
            print(f"  test ppl (first 24 chunks) {ppl:.3f}", flush=True)
        if a.max_minutes and el > a.max_minutes * 60:
            print(f"stopping early after {steps_done} steps (time limit)", flush=True)
            break
    train_time = time.time() - t_train

    ppl_f32, n_chunk, count, _ = perplexity(model, test_ids, T, bos)
    round_to_export_precision(model)
    ppl, n_chunk, count, per_chunk = perplexity(model, test_ids, T, bos)
    print(f"test perplexity (n_ctx={T}, {n_chunk} chunks, {count} scored tokens): "
          f"{ppl:.4f} with f16-rounded weights ({ppl_f32:.4f} before rounding)", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    export_gguf(model, tok, a.out, c)
    size = os.path.getsize(a.out)
    print(f"wrote {a.out} ({size} bytes); train time {train_time:.1f}s; total {time.time()-t_start:.1f}s")

    # a short greedy sample, for the notes
    with torch.no_grad():
        model.eval()
        ids = tok.encode("ROMEO:\n", add_bos=True)
        for _ in range(60):
            lg = model(torch.tensor([ids[-T:]]))[0, -1]
            ids.append(int(lg.argmax()))
        sample = tok.decode(ids)
    print("greedy sample:\n" + sample)

    if a.metrics_json:
        with open(a.metrics_json, "w") as f:
            json.dump({"ppl": ppl, "ppl_f32_weights": ppl_f32, "n_chunk": n_chunk, "scored": count,
                       "per_chunk_running_ppl": per_chunk, "n_params": n_params, "file_size": size,
                       "train_time_s": train_time, "steps": steps_done, "test_tokens_incl_bos": len(test_ids),
                       "first_test_tokens": test_ids[:40], "sample": sample,
                       "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
