"""The `llama4` architecture (Llama-4 Scout 17B-16E, Maverick 17B-128E): llama's block (GQA,
normal RoPE with the file's `rope_freqs`) where three layers of four rotate q and k, L2-normalise
them (unless the model has 128 experts, as ik decides) and attend only within their chunk of
8192 positions, and every fourth layer has no RoPE and attends to the whole context with its
queries scaled up far into it (attention temperature tuning).  Every `interleave_moe_layer_step`-th
layer is a MoE layer: a sigmoid router's top expert, whose weight scales the expert's input
rather than its output, plus an ungated shared expert; the other layers have a dense SiLU MLP.

ik_llama.cpp fixes the chunk, the no-RoPE step and the temperature constants for llama4 (no
GGUF keys); they are attributes here so tests can shrink them."""
from __future__ import annotations

import numpy as np

from ..gguf_file import ModelFileError
from ..hparams import GATING_SIGMOID, HParams
from ..ops import rms_norm
from ..rope import apply_rope
from .llama import LlamaArch

ATTN_CHUNK = 8192            # positions per attention chunk of the RoPE layers
NO_ROPE_STEP = 4             # layer il has no RoPE iff (il + 1) % 4 == 0; the others are chunked
TEMP_FLOOR_SCALE = 8192      # attention temperature: q *= 1 + 0.1 * log(floor((pos + 1) / 8192) + 1)
TEMP_SCALE = 0.1


class Llama4Arch(LlamaArch):
    def __init__(self, hp: HParams, w, log) -> None:
        super().__init__(hp, w, log)
        if hp.n_rot != hp.n_embd_head_k:            # ik asserts the same
            raise ModelFileError(f"{w.mf.path}: llama4 rotates whole heads: rope.dimension_count {hp.n_rot} != "
                                 f"head size {hp.n_embd_head_k}")
        self.attn_chunk, self.no_rope_step = ATTN_CHUNK, NO_ROPE_STEP
        self.temp_floor_scale, self.temp_scale = TEMP_FLOOR_SCALE, TEMP_SCALE
        self.kq_norm = hp.n_expert != 128          # ik: Maverick (128 experts) has no q/k L2 norm
        # sigmoid of the chosen logit as the weight; no renormalisation, no scale
        self.moe_gating, self.moe_norm_w, self.moe_scale = GATING_SIGMOID, False, 1.0
        for i, L in enumerate(self.layers):
            p = f"blk.{i}."
            if ("moe" in L) != ((i + 1) % hp.n_moe_layer_step == 0):
                raise ModelFileError(f"{w.mf.path}: layer {i} {'has' if 'moe' in L else 'lacks'} "
                                     f"'{p}ffn_gate_inp.weight' (interleave_moe_layer_step {hp.n_moe_layer_step})")
            if "moe" not in L:
                continue
            if "shexp" not in L:
                raise ModelFileError(f"{w.mf.path}: llama4 MoE layer {i} without '{p}ffn_gate_shexp.weight'")
            L["moe"].select_by_logits = L["moe"].weight_before_ffn = True

    def layer_rope(self, il: int) -> bool:
        return (il + 1) % self.no_rope_step != 0

    def layer_chunk(self, il: int) -> int:
        return self.attn_chunk if self.layer_rope(il) else 0

    def position_qk(self, il: int, L: dict, q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                    pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.layer_rope(il):
            # no RoPE: the queries' temperature grows with the position (1 below temp_floor_scale - 1)
            p = np.asarray(pos, dtype=np.float32)
            t = np.log(np.floor((p + np.float32(1.0)) / np.float32(self.temp_floor_scale)) + np.float32(1.0)) \
                * np.float32(self.temp_scale) + np.float32(1.0)
            return q * t.astype(np.float32)[:, None, None], k
        apply_rope(q, cos, sin, False)
        apply_rope(k, cos, sin, False)
        if self.kq_norm:                            # an RMSNorm with no weight, after RoPE
            q, k = rms_norm(q, None, self.hp.rms_eps), rms_norm(k, None, self.hp.rms_eps)
        return q, k
