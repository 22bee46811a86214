"""The `qwen3` and `qwen3moe` architectures (Qwen3 dense, Qwen3-30B-A3B / 235B-A22B): llama's
block with an RMSNorm over each head of q and k before RoPE (NEOX pairs), a head size of its
own (`attention.key_length`), and for qwen3moe a softmax router whose top-k weights are
renormalised, no shared expert, experts `expert_feed_forward_length` wide."""
from __future__ import annotations

from ..hparams import HParams
from .llama import LlamaArch


class Qwen3Arch(LlamaArch):
    def __init__(self, hp: HParams, w, log) -> None:
        super().__init__(hp, w, log)
        for i, L in enumerate(self.layers):       # required here (llama's block applies them)
            p = f"blk.{i}."
            L["q_norm"] = w.vector(p + "attn_q_norm.weight", hp.n_embd_head_k)
            L["k_norm"] = w.vector(p + "attn_k_norm.weight", hp.n_embd_head_k)
