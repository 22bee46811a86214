"""gemma3: the engine against a plain NumPy restatement (scaled embeddings, sandwich norms, q/k
norms, NEOX RoPE with base 10000 on the sliding layers and the file's base on the global one,
a 16-position sliding window, GELU FFN); and the sliding window in both attention paths."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.model import load_model, quiet_log
from test_qwen import _attend, _rms, _rope_neox, _run, _weights


def reference_gemma3(path, toks, window=True):
    meta, W = _weights(path)
    g = lambda k: meta[f"gemma3.{k}"]
    eps, E = g("attention.layer_norm_rms_epsilon"), g("embedding_length")
    H, Hkv, hd, n_swa = g("attention.head_count"), g("attention.head_count_kv"), g("attention.key_length"), \
        g("attention.sliding_window")
    T = len(toks)
    pos = np.arange(T, dtype=np.float64)
    gelu = lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    x = W["token_embd.weight"][toks] * math.sqrt(E)
    for i in range(g("block_count")):
        p = f"blk.{i}."
        sliding = (i + 1) % 6 != 0
        base = 10000.0 if sliding else g("rope.freq_base")
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = _rope_neox(_rms((h @ W[p + "attn_q.weight"].T).reshape(T, H, hd), W[p + "attn_q_norm.weight"], eps), pos, base)
        k = _rope_neox(_rms((h @ W[p + "attn_k.weight"].T).reshape(T, Hkv, hd), W[p + "attn_k_norm.weight"], eps), pos, base)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, Hkv, hd)
        qi, kj = np.arange(T)[:, None], np.arange(T)[None, :]
        hidden = (kj > qi) | ((qi - kj >= n_swa) & sliding & window)
        att = _attend(q, k, v, hidden)
        x = x + _rms(att.reshape(T, -1) @ W[p + "attn_output.weight"].T, W[p + "post_attention_norm.weight"], eps)
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        y = (gelu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = x + _rms(y, W[p + "post_ffw_norm.weight"], eps)
    return _rms(x, W["output_norm.weight"], eps) @ W["token_embd.weight"].T


@pytest.mark.parametrize("flash", [True, False])
def test_matches_plain_numpy_restatement(make_model, flash):
    p = make_model(arch="gemma3", qtype="f32")
    toks = np.random.default_rng(5).integers(0, 265, 40).astype(np.int32)    # past the 16-position window
    ref = reference_gemma3(p, toks)
    got = _run(p, toks, flash_attn=flash)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    # the window is what makes them agree: without it the restatement is far off
    assert np.abs(reference_gemma3(p, toks, window=False) - ref).max() > 100 * 2e-3 * np.abs(ref).max()
    m = load_model(p, quiet_log)
    assert m.hp.n_swa == 16 and m.hp.rope_neox


def test_incremental_decoding_matches_one_batch(make_model):
    from engine.config import EngineConfig
    from engine.context import Context
    p = make_model(arch="gemma3", qtype="f32")
    t = np.random.default_rng(2).integers(0, 265, 40).astype(np.int32)
    full = _run(p, t)
    m = load_model(p, quiet_log)
    ctx = Context(m, EngineConfig(p, n_ctx=128, n_ubatch=7), quiet_log)
    inc = np.concatenate([ctx.decode(t[:20]), ctx.decode(t[20:21]), ctx.decode(t[21:])])
    np.testing.assert_allclose(inc, full, rtol=1e-3, atol=1e-3 * np.abs(full).max())


@pytest.mark.parametrize("T,n_kv", [(1, 700), (40, 700), (300, 1200)])
@pytest.mark.parametrize("window", [1, 37, 300])
def test_sliding_window_in_both_flash_paths(T, n_kv, window):
    """flash_attn's kernel and BLAS paths with a window against a plain masked softmax."""
    from engine.flash_attn import flash_attn
    from engine.kv_cache import CACHE_TYPES, RowStore
    rng = np.random.default_rng(T + window)
    H, hkv, d = 8, 2, 32
    k, v = RowStore(n_kv, hkv * d, CACHE_TYPES["f32"]), RowStore(n_kv, hkv * d, CACHE_TYPES["f32"])
    K = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    V = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    k.write(0, K.reshape(n_kv, -1))
    v.write(0, V.reshape(n_kv, -1))
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    cp = np.arange(n_kv, dtype=np.int64)
    qp = np.arange(n_kv - T, n_kv, dtype=np.int64)
    want = np.empty((T, H, d))
    for t in range(T):
        vis = (cp <= qp[t]) & (qp[t] - cp < window)
        for h in range(H):
            s = K[vis, h // (H // hkv)] @ q[t, h] * 0.2
            pr = np.exp(s - s.max())
            want[t, h] = pr / pr.sum() @ V[vis, h // (H // hkv)]
    for path in ("kernel", "blas"):
        got = flash_attn(q, k, v, n_kv, hkv, d, d, cp, qp, 0.2, path=path, window=window)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=path)
