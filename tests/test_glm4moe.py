"""glm4moe (GLM-4.5): the engine against a plain NumPy restatement (q/k/v biases, partial NEOX
RoPE, a dense lead layer, sigmoid routing with exp_probs_b for the choice only, weights normalised
and scaled, an ungated shared expert, the NextN layer skipped)."""
from __future__ import annotations

import numpy as np

from engine.model import load_model, quiet_log
from test_qwen import _attend, _rms, _rope_neox, _run, _weights


def reference_glm4moe(path, toks):
    meta, W = _weights(path)
    a = "glm4moe"
    g = lambda k: meta[f"{a}.{k}"]
    eps, base = g("attention.layer_norm_rms_epsilon"), g("rope.freq_base")
    H, Hkv, hd, n_rot = g("attention.head_count"), g("attention.head_count_kv"), g("attention.key_length"), \
        g("rope.dimension_count")
    T = len(toks)
    pos = np.arange(T, dtype=np.float64)
    silu = lambda z: z / (1 + np.exp(-z))
    x = W["token_embd.weight"][toks]
    for i in range(g("block_count") - g("nextn_predict_layers")):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = (h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(T, H, hd)
        k = (h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(T, Hkv, hd)
        v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(T, Hkv, hd)
        q = np.concatenate([_rope_neox(q[..., :n_rot], pos, base), q[..., n_rot:]], axis=-1)
        k = np.concatenate([_rope_neox(k[..., :n_rot], pos, base), k[..., n_rot:]], axis=-1)
        x = x + _attend(q, k, v).reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "post_attention_norm.weight"], eps)
        if i < g("leading_dense_block_count"):
            y = (silu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        else:
            sc = 1 / (1 + np.exp(-(h @ W[p + "ffn_gate_inp.weight"].T)))          # sigmoid scores
            y = np.zeros_like(h)
            for t in range(T):
                top = np.argsort(-(sc[t] + W[p + "exp_probs_b.bias"]))[:g("expert_used_count")]
                wts = sc[t, top] / sc[t, top].sum() * g("expert_weights_scale")
                for e, wt in zip(top, wts):
                    z = silu(W[p + "ffn_gate_exps.weight"][e] @ h[t]) * (W[p + "ffn_up_exps.weight"][e] @ h[t])
                    y[t] += wt * (W[p + "ffn_down_exps.weight"][e] @ z)
            sh = silu(h @ W[p + "ffn_gate_shexp.weight"].T) * (h @ W[p + "ffn_up_shexp.weight"].T)
            y += sh @ W[p + "ffn_down_shexp.weight"].T
        x = x + y
    return _rms(x, W["output_norm.weight"], eps) @ W["output.weight"].T


def test_matches_plain_numpy_restatement(make_model):
    p = make_model(arch="glm4moe", qtype="f32")
    toks = np.random.default_rng(5).integers(0, 265, 24).astype(np.int32)
    ref = reference_glm4moe(p, toks)
    got = _run(p, toks)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    m = load_model(p, quiet_log)
    assert m.hp.n_nextn == 1 and len(m.arch.layers) == m.hp.n_layer - 1 and m.hp.n_rot == m.hp.n_embd_head_k // 2
    assert "moe" not in m.arch.layers[0] and m.arch.layers[1]["moe"].probs_bias is not None
