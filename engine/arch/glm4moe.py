"""The `glm4moe` architecture (GLM-4.5 / 4.5-Air / 4.6): llama's block with q/k/v biases, partial
NEOX RoPE (rope.dimension_count of each head's values) and optional per-head q/k norms; after
`leading_dense_block_count` dense layers, DeepSeek-V3's router (sigmoid scores, `exp_probs_b`
for the choice only, weights normalised and scaled) over routed experts plus an ungated shared
expert.  The file's NextN (MTP) layers at the end are skipped, as ik skips them."""
from __future__ import annotations

from ..hparams import HParams
from .llama import LlamaArch


class Glm4MoeArch(LlamaArch):
    FFN_NORM = "post_attention_norm.weight"

    def __init__(self, hp: HParams, w, log) -> None:
        super().__init__(hp, w, log)
        self.moe_gating, self.moe_norm_w, self.moe_scale = (hp.expert_gating_func, hp.expert_weights_norm,
                                                            hp.expert_weights_scale)
        for i, L in enumerate(self.layers):
            if "moe" in L:
                L["moe"].probs_bias = w.optional_vector(f"blk.{i}.exp_probs_b.bias")
