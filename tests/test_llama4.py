"""llama4 (Llama-4 Scout / Maverick): the engine against a plain NumPy restatement (normal RoPE with
rope_freqs on three layers of four, their q/k L2 norm and chunked attention, the fourth layer
without RoPE over the whole context with its temperature-scaled queries, dense and MoE layers
interleaved, a sigmoid top-1 router whose weight scales the expert's input, a shared expert);
incremental decoding; chunked attention in every attention path.

The chunk (8192) and the temperature's floor scale (8192) are ik's fixed values; the tests shrink
them on the loaded model so that 40 tokens cross several chunks and temperature steps."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.context import Context
from engine.model import load_model, quiet_log
from test_qwen import _attend, _rms, _weights

CHUNK, FLOOR = 8, 4


def _rope_norm(x, pos, base, ff):
    """llama.cpp's normal RoPE: consecutive pairs (2i, 2i+1) rotated by pos * base^(-2i/d) / ff[i]."""
    d = x.shape[-1]
    th = pos[:, None] * base ** (-2.0 * np.arange(d // 2) / d) / ff          # (T, d/2)
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def reference_llama4(path, toks, chunk=CHUNK, floor=FLOOR, kq_norm=True, no_rope=True, temperature=True,
                     weight_before=True):
    meta, W = _weights(path)
    g = lambda k: meta[f"llama4.{k}"]
    eps, base = g("attention.layer_norm_rms_epsilon"), g("rope.freq_base")
    H, Hkv, hd = g("attention.head_count"), g("attention.head_count_kv"), g("attention.key_length")
    T = len(toks)
    pos = np.arange(T, dtype=np.float64)
    silu = lambda z: z / (1 + np.exp(-z))
    ffn = lambda h, p, s="": (silu(h @ W[p + f"ffn_gate{s}.weight"].T) * (h @ W[p + f"ffn_up{s}.weight"].T)) \
        @ W[p + f"ffn_down{s}.weight"].T
    qi, kj = np.arange(T)[:, None], np.arange(T)[None, :]
    x = W["token_embd.weight"][toks]
    for i in range(g("block_count")):
        p = f"blk.{i}."
        roped = (i + 1) % 4 != 0 or not no_rope
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(T, H, hd)
        k = (h @ W[p + "attn_k.weight"].T).reshape(T, Hkv, hd)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, Hkv, hd)
        if roped:
            q, k = _rope_norm(q, pos, base, W["rope_freqs.weight"]), _rope_norm(k, pos, base, W["rope_freqs.weight"])
            if kq_norm:
                q, k = _rms(q, 1.0, eps), _rms(k, 1.0, eps)
            hidden = (kj > qi) | (kj < qi // chunk * chunk)              # causal, and only the own chunk
        else:
            if temperature:
                q = q * (np.log(np.floor((pos + 1) / floor) + 1) * 0.1 + 1)[:, None, None]
            hidden = kj > qi
        x = x + _attend(q, k, v, hidden).reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        if p + "ffn_gate_inp.weight" in W:
            lg = h @ W[p + "ffn_gate_inp.weight"].T
            y = ffn(h, p, "_shexp")
            for t in range(T):
                e = int(np.argmax(lg[t]))                                 # top-1 by the raw logit
                wt = 1 / (1 + np.exp(-lg[t, e]))
                xe = h[t] * wt if weight_before else h[t]
                z = silu(W[p + "ffn_gate_exps.weight"][e] @ xe) * (W[p + "ffn_up_exps.weight"][e] @ xe)
                y[t] += (W[p + "ffn_down_exps.weight"][e] @ z) * (1.0 if weight_before else wt)
        else:
            y = ffn(h, p)
        x = x + y
    return _rms(x, W["output_norm.weight"], eps) @ W["output.weight"].T


def _model(path, chunk=CHUNK, floor=FLOOR, kq_norm=True):
    m = load_model(path, quiet_log)
    m.arch.attn_chunk, m.arch.temp_floor_scale, m.arch.kq_norm = chunk, floor, kq_norm
    return m


def _run(path, toks, n_ubatch=512, **kw):
    ctx = Context(_model(path), EngineConfig(path, n_ctx=128, n_ubatch=n_ubatch, **kw), quiet_log)
    return ctx.decode(np.asarray(toks, dtype=np.int32))


@pytest.mark.parametrize("flash", [True, False])
def test_matches_plain_numpy_restatement(make_model, flash):
    p = make_model(arch="llama4", qtype="f32")
    toks = np.random.default_rng(5).integers(0, 265, 40).astype(np.int32)   # five chunks of 8
    ref = reference_llama4(p, toks)
    got = _run(p, toks, flash_attn=flash)
    tol = 2e-3 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=tol)
    # each llama4 trait is what makes them agree: without it the restatement is far off
    for off in ({"chunk": 1 << 20}, {"no_rope": False}, {"temperature": False}, {"kq_norm": False},
                {"weight_before": False}):
        assert np.abs(reference_llama4(p, toks, **off) - ref).max() > 10 * tol, off


def test_layout_and_settings(make_model):
    m = load_model(make_model(arch="llama4", qtype="f32"), quiet_log)
    a = m.arch
    assert m.hp.n_moe_layer_step == 2 and m.hp.n_ff_exp == 64 and m.hp.n_expert_used == 1 and not m.hp.rope_neox
    assert ["moe" in L for L in a.layers] == [False, True, False, True] and all("shexp" in L for L in a.layers[1::2])
    assert a.layers[1]["shexp"][0] is None                                 # the shared expert has no gate
    assert [a.layer_rope(i) for i in range(4)] == [True, True, True, False]
    assert [a.layer_chunk(i) for i in range(4)] == [8192, 8192, 8192, 0] and a.kq_norm
    assert a.freq_factors is not None and a.layers[1]["moe"].weight_before_ffn


def test_maverick_has_no_kq_norm(make_model):
    """128 experts (Maverick): ik turns the q/k L2 norm off."""
    p = make_model(arch="llama4", qtype="f32", n_expert=128)
    assert not load_model(p, quiet_log).arch.kq_norm
    toks = np.random.default_rng(3).integers(0, 265, 20).astype(np.int32)
    ctx = Context(_model(p, kq_norm=False), EngineConfig(p, n_ctx=64), quiet_log)
    ref = reference_llama4(p, toks, kq_norm=False)
    np.testing.assert_allclose(ctx.decode(toks), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("flash", [True, False])
def test_incremental_decoding_matches_one_batch(make_model, flash):
    p = make_model(arch="llama4", qtype="f32")
    t = np.random.default_rng(2).integers(0, 265, 40).astype(np.int32)
    full = _run(p, t, flash_attn=flash)
    ctx = Context(_model(p), EngineConfig(p, n_ctx=128, n_ubatch=5, flash_attn=flash), quiet_log)
    # ubatches of 5 straddle the chunks of 8; then single tokens; then the rest
    inc = np.concatenate([ctx.decode(t[:13]), ctx.decode(t[13:14]), ctx.decode(t[14:15]), ctx.decode(t[15:])])
    np.testing.assert_allclose(inc, full, rtol=1e-3, atol=1e-3 * np.abs(full).max())


@pytest.mark.parametrize("flash,blas", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("T,n_kv,chunk", [(1, 300, 64), (40, 300, 16), (130, 700, 100)])
def test_chunked_attention_in_every_path(monkeypatch, flash, blas, T, n_kv, chunk):
    """standard_attention with a chunk (flash kernel, flash BLAS tiles, materialized K*Q) against a
    plain masked softmax; the queries span chunk boundaries, the cells are in shuffled order."""
    import engine.flash_attn as fa
    from engine.attention import standard_attention
    from engine.kv_cache import CACHE_TYPES, LayerCache, RowStore
    if blas:
        monkeypatch.setattr(fa, "use_kernel_path", lambda *a: False)
    rng = np.random.default_rng(T + chunk)
    H, hkv, d = 8, 2, 32
    lc = LayerCache(RowStore(n_kv, hkv * d, CACHE_TYPES["f32"]), RowStore(n_kv, hkv * d, CACHE_TYPES["f32"]))
    K = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    V = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    lc.k.write(0, K.reshape(n_kv, -1))
    lc.v.write(0, V.reshape(n_kv, -1))
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    cp = rng.permutation(n_kv).astype(np.int32)
    qp = np.arange(n_kv - T, n_kv, dtype=np.int32)
    want = np.empty((T, H, d))
    for t in range(T):
        vis = (cp <= qp[t]) & (cp >= qp[t] // chunk * chunk)
        for h in range(H):
            s = K[vis, h // (H // hkv)] @ q[t, h] * 0.2
            pr = np.exp(s - s.max())
            want[t, h] = pr / pr.sum() @ V[vis, h // (H // hkv)]
    got = standard_attention(q, lc, n_kv, hkv, d, d, cp, qp, 0.2, flash, 0, chunk=chunk)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_quantize_mixture_as_ik(capsys, make_model, tmp_path):
    """Q4_K_M on a 256-wide llama4 file: every tensor the type ik's llama-quantize --dry-run gives
    (recorded from ik 8337e4cd3; all of ik's CORE and _R4 ftypes were compared the same way)."""
    from conftest import cli
    src = make_model(arch="llama4", qtype="f16", preset="llama4-256")
    code, out, err = cli(capsys, "quantize", "--dry-run", src, str(tmp_path / "x.gguf"), "Q4_K_M", "1")
    assert code == 0, err[-2000:]
    got = {ln.split()[0]: ln.split()[-2] for ln in (out + err).splitlines() if ln.startswith(("blk.", "output", "token"))}
    want = {"output.weight": "q6_K", "blk.2.ffn_down.weight": "q6_K", "blk.3.ffn_down_exps.weight": "q6_K",
            "blk.3.ffn_down_shexp.weight": "q6_K"}
    for n, t in got.items():
        exp = want.get(n, "f32" if "norm" in n or "gate_inp" in n else "q8_0" if "attn_k." in n or "attn_v." in n
                       else "q5_K" if "attn_output" in n else "q4_K")
        assert t == exp, (n, t, exp)
    assert len(got) == 47


def test_imatrix_entries_as_ik(capsys, make_model, tmp_path, corpus_text):
    """ikcli imatrix records ik's 34 entries with its call counts (ik 8337e4cd3 on the same file:
    the experts' fused up/gate under ffn_up_exps, the shared expert's and the dense layers' up and
    gate apart, the router)."""
    from conftest import cli
    from engine.imatrix import read_dat
    src = make_model(arch="llama4", qtype="f16", preset="llama4-256")
    text = tmp_path / "t.txt"
    text.write_text(corpus_text[:6000], encoding="utf-8")
    out = tmp_path / "l4.dat"
    code, _, err = cli(capsys, "imatrix", "-m", src, "-f", str(text), "-o", str(out), "-c", "128", "--chunks", "2",
                       "-t", "1")
    assert code == 0, err[-2000:]
    got = {name: ncall for name, ncall, _ in read_dat(str(out)).entries}
    attn = ["attn_k", "attn_output", "attn_q", "attn_v"]
    dense, moe = attn + ["ffn_down", "ffn_gate", "ffn_up"], attn + [
        "ffn_down_exps", "ffn_down_shexp", "ffn_gate_inp", "ffn_gate_shexp", "ffn_up_exps", "ffn_up_shexp"]
    want = {f"blk.{i}.{n}.weight" for i in range(4) for n in (moe if i % 2 else dense)}
    assert set(got) == want and len(want) == 34
    assert set(got.values()) == {4}                      # two calls per chunk, as ik's (16 for 8 chunks)


def test_context_shift_rotates_only_the_rope_layers(make_model):
    """After dropping positions [2, 5): layer 0's moved keys are the keys of those tokens decoded at
    their new positions (RoPE then the L2 norm commute), layer 3's (no RoPE) are moved unchanged."""
    from engine.arch.common import context_shift
    p = make_model(arch="llama4", qtype="f32")
    toks = np.random.default_rng(3).integers(0, 200, 12).astype(np.int32)
    cfg = EngineConfig(p, n_ctx=64, type_k="f32", type_v="f32")
    a = Context(_model(p), cfg, quiet_log)
    a.decode(toks)
    rows = lambda c, il, n: np.array(c.cache.layers[il].k.read(n), dtype=np.float32)
    before3 = rows(a, 3, 12).copy()
    assert context_shift(a.model.arch, a.cache, 2, 3) == 3
    b = Context(a.model, cfg, quiet_log)
    b.decode(toks[5:], pos0=2)
    want = rows(b, 0, 7)
    np.testing.assert_allclose(rows(a, 0, 9)[2:], want, rtol=0, atol=2e-5 * np.abs(want).max())
    np.testing.assert_array_equal(rows(a, 3, 9)[2:], before3[5:])
