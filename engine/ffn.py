"""Feed-forward blocks: SiLU-gated MLP and mixture-of-experts routing.

The MoE block works on (token, expert) pairs, as ggml's mul_mat_id does: one call per
projection for all selected experts of all tokens (quant.matmul.matmul_id groups the pairs
by expert).  fused=True (ik_llama.cpp's -fmoe) computes silu(gate . x) * (up . x) in one
pass over activations quantized once (quant.matmul.moe_up_gate); fused=False multiplies
gate and up separately and applies SiLU*mul in NumPy.  Both give the same result.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .linear import matmul, matmul_id, moe_up_gate, up_gate
from quant.tensor import QTensor

from .hparams import GATING_SIGMOID, GATING_SOFTMAX_WEIGHT
from .device import on_device
from .ops import host, on_host, sigmoid, silu, softmax, take_rows, weighted_row_sums

SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = np.float32(1.702), np.float32(7.0)


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clip(u, -7, 7) + 1)."""
    g = np.minimum(g, SWIGLU_OAI_LIMIT)
    return g * sigmoid(SWIGLU_OAI_ALPHA * g) * (np.clip(u, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + np.float32(1.0))


def ffn_silu(x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor, fused: bool = True) -> np.ndarray:
    """down @ (silu(gate @ x) * (up @ x)); fused: the first half in one pass (x quantized once)."""
    if fused:
        h = up_gate(gate, up, x)
    else:
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
    # gpt-oss: biases of the router and of each expert's projections, and its clamped SwiGLU
    router_bias: np.ndarray | None = None   # (n_expert,)
    gate_bias: np.ndarray | None = None     # (n_expert, n_ff_exp)
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None     # (n_expert, n_embd)
    act: str = "silu"                       # or "swiglu_oai"
    # llama4: experts chosen by the raw router logits (not their sigmoid, which saturates into
    # ties), and each chosen expert's input scaled by its weight instead of its output
    select_by_logits: bool = False
    weight_before_ffn: bool = False


def route(logits: np.ndarray, n_used: int, gating: int, bias: np.ndarray | None, norm_w: bool,
          scale: float, ser_min: int = -1, ser_thresh: float = 0.0,
          by_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids (T, n_used) and their weights (T, n_used) from router logits (T, n_expert), as
    route_reference, in one compiled call (the ~15 NumPy calls of a generated token's routing
    took 45 us a layer in the model, where every call runs with cold caches; 7 us now)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    if not 0 < n_used <= logits.shape[1]:
        return route_reference(logits, n_used, gating, bias, norm_w, scale, ser_min, ser_thresh, by_logits)
    T = logits.shape[0]
    ids = np.empty((T, n_used), dtype=np.int64)
    w = np.empty((T, n_used), dtype=np.float32)
    b = _NO_BIAS if bias is None or by_logits else np.ascontiguousarray(bias, dtype=np.float32)
    _route_rows(logits, n_used, gating, b, norm_w, scale, ser_min, ser_thresh, by_logits, ids, w)
    return ids, w


_NO_BIAS = np.zeros(0, dtype=np.float32)


@njit(cache=True, nogil=True)
def _route_rows(logits, n_used, gating, bias, norm_w, scale, ser_min, ser_thresh, by_logits, ids, w):
    """route() for host f32 logits (T, n_expert), one compiled call: the same f32 operations as
    route_reference (selection: the largest score first, ties to the lower id, as a stable
    argsort of -score), except the sums' order (sequential, not NumPy's pairwise)."""
    T, ne = logits.shape
    probs = np.empty(ne, dtype=np.float32)
    sel = np.empty(ne, dtype=np.float32)
    taken = np.zeros(ne, dtype=np.bool_)
    score = np.empty(n_used, dtype=np.float32)
    one = np.float32(1.0)
    for t in range(T):
        x = logits[t]
        if gating == GATING_SIGMOID:
            for e in range(ne):
                probs[e] = one / (one + np.exp(-x[e]))
        elif gating == GATING_SOFTMAX_WEIGHT:
            probs[:] = x
        else:
            mx = x.max()
            tot = np.float32(0.0)
            for e in range(ne):
                probs[e] = np.exp(x[e] - mx)
                tot += probs[e]
            for e in range(ne):
                probs[e] /= tot
        for e in range(ne):
            sel[e] = x[e] if by_logits else probs[e] + bias[e] if bias.size else probs[e]
        taken[:] = False
        for k in range(n_used):
            best = -1
            for e in range(ne):         # NaN scores are never the best (argsort puts them last)
                if not taken[e] and (best < 0 or sel[e] > sel[best] or (sel[best] != sel[best] and sel[e] == sel[e])):
                    best = e
            taken[best] = True
            ids[t, k] = best
            score[k] = sel[best]
            w[t, k] = probs[best]
        if ser_min > 0 and ser_thresh > 0:
            lim = score[0] * np.float32(ser_thresh)
            for k in range(ser_min, n_used):
                if score[k] < lim:
                    ids[t, k] = -1
                    w[t, k] = 0.0
        if gating == GATING_SOFTMAX_WEIGHT:     # dropped experts (-ser) take no share
            mx = -np.inf
            for k in range(n_used):
                if ids[t, k] >= 0:
                    mx = max(mx, w[t, k])
            tot = np.float32(0.0)
            for k in range(n_used):
                w[t, k] = np.exp(w[t, k] - mx) if ids[t, k] >= 0 else np.float32(0.0)
                tot += w[t, k]
            for k in range(n_used):
                w[t, k] /= tot
        if norm_w:
            tot = np.float32(0.0)
            for k in range(n_used):
                tot += w[t, k]
            for k in range(n_used):
                w[t, k] /= tot
        if abs(scale - 1.0) > 1e-5:
            for k in range(n_used):
                w[t, k] *= np.float32(scale)


def route_reference(logits: np.ndarray, n_used: int, gating: int, bias: np.ndarray | None, norm_w: bool,
                    scale: float, ser_min: int = -1, ser_thresh: float = 0.0,
                    by_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids (T, n_used) and their weights (T, n_used) from router logits (T, n_expert).

    Smart Expert Reduction (ik_llama.cpp's -ser K,t; on when K > 0 and t > 0): of the experts
    sorted by selection score (probs + bias), those at sorted position >= K whose score is
    below t * (top score) are dropped: id -1, weight 0.  Normalization then divides by the
    sum of the kept weights.  Each token is routed on its own, whatever the batch.
    by_logits: the selection score is the raw logit (llama4), the weights still the probabilities.
    """
    probs = sigmoid(logits) if gating == GATING_SIGMOID else logits if gating == GATING_SOFTMAX_WEIGHT \
        else softmax(logits, axis=-1)
    sel = logits if by_logits else probs + bias if bias is not None else probs
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :n_used]
    w = np.take_along_axis(probs, ids, axis=-1)
    if ser_min > 0 and ser_thresh > 0:
        score = np.take_along_axis(sel, ids, axis=-1)
        drop = score < score[:, :1] * np.float32(ser_thresh)   # f32 compare, as ggml
        drop[:, :ser_min] = False
        ids = np.where(drop, -1, ids)
        w = np.where(drop, np.float32(0.0), w)
    if gating == GATING_SOFTMAX_WEIGHT:      # dropped experts (-ser) take no share
        w = softmax(np.where(ids >= 0, w, -np.inf), axis=-1)
    if norm_w:
        w = w / np.sum(w, axis=-1, keepdims=True)
    if abs(scale - 1.0) > 1e-5:
        w = w * np.float32(scale)
    return ids, w.astype(np.float32)


_SORT_PAIRS = 64       # pairs from which moe_ffn sorts them by expert (a generated token's few: not worth it)


def moe_ffn(x: np.ndarray, m: MoEWeights, n_used: int, gating: int, norm_w: bool, scale: float,
            fused: bool = True, ser: tuple[int, float] = (-1, 0.0)) -> np.ndarray:
    """Weighted sum of the selected experts' SiLU-gated MLPs; only selected experts are touched.

    ser = (K, t): Smart Expert Reduction (see route); dropped experts are not computed.
    """
    logits = host(matmul(m.router, x))      # routing runs on the host (a GPU router's logits come down)
    if m.router_bias is not None:
        logits += m.router_bias
    ids, w = route(logits, n_used, gating, m.probs_bias, norm_w, scale, *ser, by_logits=m.select_by_logits)
    # pairs in token order, then slot order (dropped slots, id -1, make none); slot_pair: each
    # slot's pair or -1
    pair_ids, pair_rows, slot_pair = _pairs(ids)
    n_pairs = pair_ids.size
    if m.weight_before_ffn:               # llama4: each pair's input row scaled, the experts' sum unweighted
        keep = ids >= 0
        x = take_rows(x, pair_rows)
        x *= w[keep][:, None]
        pair_rows = np.arange(n_pairs)
        w = keep.astype(np.float32)
    # a prompt's pairs sorted by expert (stable: each expert's pairs stay in token order): the
    # products' kernels take them grouped as given, so the gate/up results need no scatter to
    # token order, the down product's activations no gather and its results no scatter; the sum
    # below reads each slot's row wherever it lies.  The same pair values either way; per layer
    # of a 512-token batch (DeepSeek-V2-Lite shapes) two scatters of 18.9 and 25 MB and a gather saved
    order = np.argsort(pair_ids, kind="stable") if n_pairs >= _SORT_PAIRS else None
    if order is not None:
        pair_ids, pair_rows = pair_ids[order], pair_rows[order]
    if m.act == "swiglu_oai":                # biases and a clamped activation: gate and up apart
        g = matmul_id(m.gate, x, pair_ids, pair_rows)
        u = matmul_id(m.up, x, pair_ids, pair_rows)
        if m.gate_bias is not None:
            g += m.gate_bias[pair_ids]
            u += m.up_bias[pair_ids]
        par = swiglu_oai(g, u) if not on_device(g) else on_host(swiglu_oai, g, u)
    elif fused:
        par = moe_up_gate(m.gate, m.up, x, pair_ids, pair_rows)
    else:
        par = silu(matmul_id(m.gate, x, pair_ids, pair_rows))
        par *= matmul_id(m.up, x, pair_ids, pair_rows)
    y = matmul_id(m.down, par, pair_ids, np.arange(n_pairs))
    if m.down_bias is not None:
        y += m.down_bias[pair_ids]
    # sum over slots in slot order, the same for a token alone or in a batch
    if order is not None:                 # pair order[i]'s row is row i of y
        pos = np.empty(n_pairs, dtype=np.int64)
        pos[order] = np.arange(n_pairs)
        keep = slot_pair >= 0
        slot_pair[keep] = pos[slot_pair[keep]]
    if on_device(y):
        from .cuda_backend import moe_combine
        keep = ids >= 0
        y *= (w[keep] if order is None else w[keep][order])[:, None]      # each row's pair weight
        return moe_combine(y, slot_pair, x.shape[0])
    return weighted_row_sums(y, w, slot_pair)


@njit(cache=True, nogil=True)
def _pairs(ids):
    """(expert id, token row) of every kept slot of ids (T, n_used), in token then slot order, and
    each slot's pair index (-1: dropped), in one compiled pass (six NumPy calls a layer before)."""
    T, n = ids.shape
    P = 0
    for t in range(T):
        for j in range(n):
            P += ids[t, j] >= 0
    pair_ids = np.empty(P, np.int64)
    pair_rows = np.empty(P, np.int64)
    slot_pair = np.full((T, n), -1, np.int64)
    p = 0
    for t in range(T):
        for j in range(n):
            if ids[t, j] >= 0:
                pair_ids[p] = ids[t, j]
                pair_rows[p] = t
                slot_pair[t, j] = p
                p += 1
    return pair_ids, pair_rows, slot_pair
