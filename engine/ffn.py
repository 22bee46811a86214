"""Feed-forward blocks: SiLU-gated MLP and mixture-of-experts routing."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quant.matmul import matmul
from quant.tensor import QTensor

from .hparams import GATING_SIGMOID
from .ops import sigmoid, silu, softmax


def ffn_silu(x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor) -> np.ndarray:
    h = silu(matmul(gate, x))
    h *= matmul(up, x)
    return matmul(down, h)


@dataclass
class MoEWeights:
    router: QTensor              # (n_expert, n_embd)
    probs_bias: np.ndarray | None  # exp_probs_b: added to the probabilities for selection only
    gate: QTensor                # (n_expert, n_ff_exp, n_embd)
    up: QTensor
    down: QTensor                # (n_expert, n_embd, n_ff_exp)


def route(logits: np.ndarray, n_used: int, gating: int, bias: np.ndarray | None, norm_w: bool,
          scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids (T, n_used) and their weights (T, n_used) from router logits (T, n_expert)."""
    probs = sigmoid(logits) if gating == GATING_SIGMOID else softmax(logits, axis=-1)
    sel = probs + bias if bias is not None else probs
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :n_used]
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm_w:
        w = w / np.sum(w, axis=-1, keepdims=True)
    if abs(scale - 1.0) > 1e-5:
        w = w * np.float32(scale)
    return ids, w.astype(np.float32)


def moe_ffn(x: np.ndarray, m: MoEWeights, n_used: int, gating: int, norm_w: bool, scale: float) -> np.ndarray:
    """Weighted sum of the selected experts' SiLU-gated MLPs; only selected experts are touched."""
    ids, w = route(matmul(m.router, x), n_used, gating, m.probs_bias, norm_w, scale)
    out = np.zeros((x.shape[0], m.down.shape[-2]), dtype=np.float32)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        xe = np.ascontiguousarray(x[rows])
        y = ffn_silu(xe, m.gate[int(e)], m.up[int(e)], m.down[int(e)])
        out[rows] += w[rows, slots][:, None] * y
    return out
