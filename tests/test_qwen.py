"""qwen2 / qwen2moe / qwen3 / qwen3moe: the engine against a plain NumPy restatement of the
forward pass (NEOX RoPE, GQA; qwen2: q/k/v biases, experts not renormalised plus a shared expert
behind a sigmoid gate; qwen3: per-head q/k RMSNorm before RoPE, the file's own head size,
experts renormalised), batching, the quantizer and the file's metadata."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import FINAL_PPL, cli
from engine.config import EngineConfig
from engine.context import Context
from engine.model import load_model, quiet_log


def _run(path, toks, n_ubatch=512, **kw):
    m = load_model(path, quiet_log)
    ctx = Context(m, EngineConfig(path, n_ctx=128, n_ubatch=n_ubatch, **kw), quiet_log)
    return ctx.decode(np.asarray(toks, dtype=np.int32))


def _weights(path):
    r = GGUFReader(path)
    meta = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    W = {t.name: np.asarray(t.data, dtype=np.float64).reshape([int(x) for x in reversed(t.shape)])
         for t in r.tensors}
    return meta, W


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x, pos, base):
    """(i, i + d/2) pairs rotated by pos * base^(-2i/d): llama.cpp's NEOX RoPE."""
    d = x.shape[-1]
    th = pos[:, None] * base ** (-2.0 * np.arange(d // 2) / d)          # (T, d/2)
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _attend(q, k, v, hidden=None, sinks=None):
    """Plain softmax attention of q (T, H, d) over k, v (T, Hkv, d), GQA; hidden (T, T) True =
    masked (default: the causal mask); sinks (H,): one more logit per head, with no value."""
    T, H, hd = q.shape
    Hkv = k.shape[1]
    if hidden is None:
        hidden = np.triu(np.ones((T, T), dtype=bool), 1)
    att = np.empty((T, H, v.shape[2]))
    for hh in range(H):
        g = hh // (H // Hkv)
        s = q[:, hh] @ k[:, g].T / np.sqrt(hd)
        s[hidden] = -np.inf
        sk = -np.inf if sinks is None else sinks[hh]
        mx = np.maximum(s.max(axis=1, keepdims=True), sk)
        pr = np.exp(s - mx)
        att[:, hh] = (pr / (pr.sum(axis=1, keepdims=True) + np.exp(sk - mx))) @ v[:, g]
    return att


def reference_qwen(path, toks):
    meta, W = _weights(path)
    a = meta["general.architecture"]
    eps, base = meta[f"{a}.attention.layer_norm_rms_epsilon"], meta[f"{a}.rope.freq_base"]
    H, Hkv = meta[f"{a}.attention.head_count"], meta[f"{a}.attention.head_count_kv"]
    hd = meta.get(f"{a}.attention.key_length", meta[f"{a}.embedding_length"] // H)
    ident = lambda z, _w, _e: z
    qn = _rms if a.startswith("qwen3") else ident
    bias = lambda name: W.get(name, 0.0)
    T = len(toks)
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][toks]
    silu = lambda z: z / (1 + np.exp(-z))
    for i in range(meta[f"{a}.block_count"]):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = qn((h @ W[p + "attn_q.weight"].T + bias(p + "attn_q.bias")).reshape(T, H, hd),
               W.get(p + "attn_q_norm.weight"), eps)
        k = qn((h @ W[p + "attn_k.weight"].T + bias(p + "attn_k.bias")).reshape(T, Hkv, hd),
               W.get(p + "attn_k_norm.weight"), eps)
        v = (h @ W[p + "attn_v.weight"].T + bias(p + "attn_v.bias")).reshape(T, Hkv, hd)
        att = _attend(_rope_neox(q, pos, base), _rope_neox(k, pos, base), v)
        x = x + att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        if a.endswith("moe"):
            norm_w = a == "qwen3moe"
            n_used = meta[f"{a}.expert_used_count"]
            lg = h @ W[p + "ffn_gate_inp.weight"].T
            pr = np.exp(lg - lg.max(axis=1, keepdims=True))
            pr /= pr.sum(axis=1, keepdims=True)
            y = np.zeros_like(h)
            for t in range(T):
                top = np.argsort(-pr[t])[:n_used]
                for e in top:
                    z = silu(W[p + "ffn_gate_exps.weight"][e] @ h[t]) * (W[p + "ffn_up_exps.weight"][e] @ h[t])
                    wt = pr[t, e] / pr[t, top].sum() if norm_w else pr[t, e]
                    y[t] += wt * (W[p + "ffn_down_exps.weight"][e] @ z)
            if p + "ffn_gate_inp_shexp.weight" in W:
                g = 1 / (1 + np.exp(-(h @ W[p + "ffn_gate_inp_shexp.weight"])))
                sh = silu(h @ W[p + "ffn_gate_shexp.weight"].T) * (h @ W[p + "ffn_up_shexp.weight"].T)
                y += (sh @ W[p + "ffn_down_shexp.weight"].T) * g[:, None]
        else:
            y = (silu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = x + y
    return _rms(x, W["output_norm.weight"], eps) @ W["output.weight"].T


ARCHS = ["qwen2", "qwen2moe", "qwen3", "qwen3moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_plain_numpy_restatement(make_model, arch):
    p = make_model(arch=arch, qtype="f32")
    toks = np.random.default_rng(5).integers(0, 265, 24).astype(np.int32)
    ref = reference_qwen(p, toks)
    got = _run(p, toks)
    # the KV cache is f16: keys / values are rounded once
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    m = load_model(p, quiet_log)
    assert m.hp.rope_neox and m.hp.n_embd_head_k == (24 if arch.startswith("qwen3") else 16)
    assert (m.hp.n_ff_exp, m.hp.n_expert_used) == ((64, 2) if arch.endswith("moe") else (0, 0))
    if arch == "qwen2moe":
        assert "shexp" in m.arch.layers[0] and not m.arch.moe_norm_w


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_matches_one_batch(make_model, arch):
    p = make_model(arch=arch, qtype="f32")
    t = np.random.default_rng(2).integers(0, 265, 33).astype(np.int32)
    full = _run(p, t)
    m = load_model(p, quiet_log)
    ctx = Context(m, EngineConfig(p, n_ctx=128, n_ubatch=5), quiet_log)
    inc = np.concatenate([ctx.decode(t[:10]), ctx.decode(t[10:11]), ctx.decode(t[11:])])
    np.testing.assert_allclose(inc, full, rtol=1e-3, atol=1e-3 * np.abs(full).max())


def test_quantize_and_run(capsys, make_model, tmp_path):
    """ikcli quantize Q4_K_M on a qwen3moe file with 256-wide matrices, then perplexity on it."""
    src = make_model(arch="qwen3moe", qtype="f16", preset="qwen256")
    out = tmp_path / "q4km.gguf"
    code, _, err = cli(capsys, "quantize", str(src), str(out), "Q4_K_M", "2")
    assert code == 0, err[-2000:]
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.0.attn_q_norm.weight"] == "F32"
    code, stdout, err = cli(capsys, "perplexity", "-m", str(out), "-c", "128", "--chunks", "2", "-t", "2")
    assert code == 0 and FINAL_PPL.search(stdout), err[-2000:]
