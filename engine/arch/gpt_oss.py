"""The `gpt-oss` architecture (gpt-oss-20b / 120b): llama's block with q/k/v/o biases, attention
sinks (a learned logit per head in every softmax), even layers attending through a sliding
window (`attention.sliding_window`) and odd ones to the whole context, NEOX RoPE with YaRN;
every FFN a MoE whose router has a bias and takes the top-k raw logits then a softmax over
them, experts with biases and a clamped SwiGLU (alpha 1.702, limit 7)."""
from __future__ import annotations

from ..hparams import GATING_SOFTMAX_WEIGHT, HParams
from .llama import LlamaArch


class GptOssArch(LlamaArch):
    FFN_NORM = "post_attention_norm.weight"

    def __init__(self, hp: HParams, w, log) -> None:
        super().__init__(hp, w, log)
        self.moe_gating, self.moe_norm_w, self.moe_scale = GATING_SOFTMAX_WEIGHT, False, 1.0
        for i, L in enumerate(self.layers):
            p = f"blk.{i}."
            L["sinks"] = w.vector(p + "attn_sinks.weight", hp.n_head)
            m = L["moe"]
            m.act = "swiglu_oai"
            m.router_bias = w.vector(p + "ffn_gate_inp.bias", hp.n_expert)
            m.gate_bias = w.vector(p + "ffn_gate_exps.bias").reshape(hp.n_expert, -1)
            m.up_bias = w.vector(p + "ffn_up_exps.bias").reshape(hp.n_expert, -1)
            m.down_bias = w.vector(p + "ffn_down_exps.bias").reshape(hp.n_expert, -1)

    def layer_window(self, il: int) -> int:
        return self.hp.n_swa if il % 2 == 0 else 0
