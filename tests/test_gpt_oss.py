"""gpt-oss: the engine against a plain NumPy restatement (biases everywhere, attention sinks, a
sliding window on the even layers, YaRN NEOX RoPE, raw-logit top-k router with a softmax over
the chosen, biased experts with the clamped SwiGLU); and sinks in every attention path."""
from __future__ import annotations


import numpy as np
import pytest

from engine.rope import rope_cos_sin
from test_qwen import _attend, _rms, _run, _weights


def _yarn_neox(x, pos, meta):
    a = "gpt-oss"
    d = x.shape[-1]
    factor = meta[f"{a}.rope.scaling.factor"]
    cos, sin = rope_cos_sin(pos, d, meta[f"{a}.rope.freq_base"], 1.0 / factor, 1.0, 1.0,
                            meta[f"{a}.rope.scaling.original_context_length"], 32.0, 1.0)
    c, s = cos.astype(np.float64)[:, None, :], sin.astype(np.float64)[:, None, :]
    lo, hi = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([lo * c - hi * s, lo * s + hi * c], axis=-1)


def reference_gpt_oss(path, toks, window=True, sinks=True):
    meta, W = _weights(path)
    g = lambda k: meta[f"gpt-oss.{k}"]
    eps = g("attention.layer_norm_rms_epsilon")
    H, Hkv, hd, n_swa = g("attention.head_count"), g("attention.head_count_kv"), g("attention.key_length"), \
        g("attention.sliding_window")
    T = len(toks)
    pos = np.arange(T)
    x = W["token_embd.weight"][toks]
    for i in range(g("block_count")):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = _yarn_neox((h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(T, H, hd), pos, meta)
        k = _yarn_neox((h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(T, Hkv, hd), pos, meta)
        v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(T, Hkv, hd)
        qi, kj = pos[:, None], pos[None, :]
        hidden = (kj > qi) | ((qi - kj >= n_swa) & (i % 2 == 0) & window)
        att = _attend(q, k, v, hidden, W[p + "attn_sinks.weight"] if sinks else None)
        x = x + att.reshape(T, -1) @ W[p + "attn_output.weight"].T + W[p + "attn_output.bias"]
        h = _rms(x, W[p + "post_attention_norm.weight"], eps)
        lg = h @ W[p + "ffn_gate_inp.weight"].T + W[p + "ffn_gate_inp.bias"]
        y = np.zeros_like(h)
        for t in range(T):
            top = np.argsort(-lg[t], kind="stable")[:g("expert_used_count")]
            wt = np.exp(lg[t, top] - lg[t, top].max())
            wt /= wt.sum()
            for e, we in zip(top, wt):
                gg = np.minimum(W[p + "ffn_gate_exps.weight"][e] @ h[t] + W[p + "ffn_gate_exps.bias"][e], 7.0)
                uu = np.clip(W[p + "ffn_up_exps.weight"][e] @ h[t] + W[p + "ffn_up_exps.bias"][e], -7.0, 7.0)
                z = gg / (1 + np.exp(-1.702 * gg)) * (uu + 1)
                y[t] += we * (W[p + "ffn_down_exps.weight"][e] @ z + W[p + "ffn_down_exps.bias"][e])
        x = x + y
    return _rms(x, W["output_norm.weight"], eps) @ W["output.weight"].T


@pytest.mark.parametrize("flash", [True, False])
def test_matches_plain_numpy_restatement(make_model, flash):
    p = make_model(arch="gpt-oss", qtype="f32")
    toks = np.random.default_rng(5).integers(0, 265, 40).astype(np.int32)    # past the 16-position window
    ref = reference_gpt_oss(p, toks)
    got = _run(p, toks, flash_attn=flash)
    tol = 2e-3 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=tol)
    # the window and the sinks are what make them agree
    assert np.abs(reference_gpt_oss(p, toks, window=False) - ref).max() > 20 * tol
    assert np.abs(reference_gpt_oss(p, toks, sinks=False) - ref).max() > 20 * tol


@pytest.mark.parametrize("T,n_kv,window", [(1, 700, 0), (40, 700, 37), (300, 1200, 0)])
def test_sinks_in_every_attention_path(T, n_kv, window):
    from engine.attention import causal_attention
    from engine.flash_attn import flash_attn
    from engine.kv_cache import CACHE_TYPES, RowStore
    rng = np.random.default_rng(T)
    H, hkv, d = 8, 2, 32
    k, v = RowStore(n_kv, hkv * d, CACHE_TYPES["f32"]), RowStore(n_kv, hkv * d, CACHE_TYPES["f32"])
    K = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    V = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    k.write(0, K.reshape(n_kv, -1))
    v.write(0, V.reshape(n_kv, -1))
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    sinks = (3.0 * rng.standard_normal(H)).astype(np.float32)
    cp = np.arange(n_kv, dtype=np.int64)
    qp = np.arange(n_kv - T, n_kv, dtype=np.int64)
    want = np.empty((T, H, d))
    for t in range(T):
        vis = (cp <= qp[t]) & ((qp[t] - cp < window) if window else True)
        for h in range(H):
            s = K[vis, h // (H // hkv)] @ q[t, h] * 0.2
            mx = max(s.max(), sinks[h])
            pr = np.exp(s - mx)
            want[t, h] = pr / (pr.sum() + np.exp(sinks[h] - mx)) @ V[vis, h // (H // hkv)]
    for path in ("kernel", "blas"):
        got = flash_attn(q, k, v, n_kv, hkv, d, d, cp, qp, 0.2, path=path, window=window, sinks=sinks)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=path)
    got = causal_attention(q, K, V, cp, qp, 0.2, 0, window, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg="non-flash")
