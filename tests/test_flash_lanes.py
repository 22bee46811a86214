"""engine.flash_lanes (token-generation flash attention with query rows in vector lanes) against
engine.flash_attn's portable kernel, an f64 reference on bf16-rounded inputs, and an exact f64
reference.

f32 kind: the same f32 arithmetic as the portable kernel in another order, so outputs agree to
TOL_LANES_F32 (a layout bug - wrong row, cell, lane or d - gives errors of order 1).  It is
generic vector IR and runs on every CPU; the bf16 tests need AVX512-BF16.

bf16 tolerances (relative to the largest output): q, k, v and the probabilities carry bf16's 8
significant bits.  With the f32 refinement of the heavy scores turned off, on these random
inputs (peaked softmax: score std ~3) outputs differ from the f32 kernel by 5e-3 (median) ..
1.03e-2 (max of the latent cases), and from an f64 reference that rounds the scaled q, k and v
to bf16 as the kernel does by 6.8e-4 (median) .. 1.1e-3 (max): what is left is the rounding of
p and the sum order.  With the refinement (the default) the score error is gone where it
matters and only the rounding of p and v remains.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine import flash_attn as fa
from engine import flash_lanes as fl
from engine.kv_cache import CACHE_TYPES, RowStore
from quant.kernels import F16_TO_F32
from quant.numeric import bf16_bits_to_f32, f32_to_bf16_bits

needs_bf16 = pytest.mark.skipif(not fl.bf16_available(), reason="CPU (numba target) without AVX512-BF16")
KINDS = ["f32", pytest.param("bf16", marks=needs_bf16)]

TOL_LANES_F32 = 2e-5  # f32 kind vs the portable kernel, relative to the largest output
TOL_F32 = 2.5e-2    # vs the f32 kernel, relative to the largest output
TOL_ROUNDED = 3e-3  # vs f64 attention on bf16-rounded q, k, v


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest even), back as f32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def bf16_q(q: np.ndarray, scale: float) -> np.ndarray:
    """q as the kernel rounds it: scaled into the log2 domain first."""
    c = np.float32(scale * fa.LOG2E)
    return bf16(q * c) / c


def reference(q, K, V, cell_pos, q_pos, scale):
    """f64 softmax(scale q.k) v, rows that see nothing -> 0.  q (T, H, dk), K (n, Hkv, dk)."""
    T, H, _ = q.shape
    G = H // K.shape[1]
    out = np.zeros((T, H, V.shape[2]))
    vis = cell_pos[None, :] <= q_pos[:, None]
    for h in range(H):
        s = scale * (q[:, h].astype(np.float64) @ K[:, h // G].astype(np.float64).T)
        s[~vis] = -np.inf
        mx = s.max(axis=1, keepdims=True)
        mx[~np.isfinite(mx)] = 0.0
        p = np.exp(s - mx)
        den = p.sum(axis=1, keepdims=True)
        den[den == 0] = 1.0
        out[:, h] = (p / den) @ V[:, h // G].astype(np.float64)
    return out


@pytest.fixture
def no_refine(monkeypatch):
    """Every score from the bf16 dots: the kernel then matches the rounded reference closely."""
    monkeypatch.setattr(fl, "REFINE_LOG2", -1.0)


@pytest.fixture
def lanes_calls(monkeypatch):
    """The kinds of engine.flash_lanes calls (so a test knows which path flash_attn took)."""
    calls = []
    real = fl.flash_kernel_lanes

    def spy(*a, **kw):
        calls.append(a[-1] if len(a) > 14 else kw.get("kind", "f32"))
        return real(*a, **kw)
    monkeypatch.setattr(fl, "flash_kernel_lanes", spy)
    return calls


def use(monkeypatch, kind: str) -> None:
    """flash_attn's generation kernel: "portable" (engine.flash_attn's), "f32" or "bf16" lanes."""
    monkeypatch.setattr(fa, "USE_BF16", kind == "bf16")
    monkeypatch.setattr(fa, "USE_LANES", kind != "portable")
    if fa._HOST is None:
        fa._lanes_kind(16, 16, 16)
    monkeypatch.setattr(fa, "_HOST", (fa._HOST[0], fa._HOST[1], True))   # f32 lanes also without AVX-512


def run_both(monkeypatch, kind, q, k, v, n_kv, hkv, dk, dv, cell_pos, q_pos, scale):
    use(monkeypatch, "portable")
    ref32 = fa.flash_attn(q, k, v, n_kv, hkv, dk, dv, cell_pos, q_pos, scale, path="kernel")
    use(monkeypatch, kind)
    out = fa.flash_attn(q, k, v, n_kv, hkv, dk, dv, cell_pos, q_pos, scale, path="kernel")
    return out, ref32


def close(a, b, tol):
    assert a.shape == b.shape and np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def latent_case(rng, n_kv, T, qtype, dk=96, dv=64, H=16, cell_pos=None, q_pos=None):
    k = RowStore(n_kv + 3, dk, qtype)                 # rows past n_kv must be ignored
    k.write(0, rng.standard_normal((n_kv + 3, dk), dtype=np.float32))
    if cell_pos is None:
        cell_pos = np.arange(n_kv)
    if q_pos is None:
        q_pos = np.arange(n_kv - T, n_kv)
    q = rng.standard_normal((T, H, dk), dtype=np.float32)
    return q, k, cell_pos, q_pos


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_kv", [1, 15, 16, 17, 37, 300, 613])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_latent_matches_portable_kernel_and_rounded_reference(monkeypatch, no_refine, lanes_calls, n_kv, T, kind):
    rng = np.random.default_rng(n_kv * 10 + T)
    q, k, cp, qp = latent_case(rng, n_kv, T, CACHE_TYPES["f16"])
    out, ref32 = run_both(monkeypatch, kind, q, k, None, n_kv, 1, 96, 64, cp, qp, 0.3)
    assert lanes_calls == [kind]
    if kind == "f32":
        close(out, ref32, TOL_LANES_F32)
        return
    close(out, ref32, TOL_F32)
    K = bf16(k.read(n_kv)).reshape(n_kv, 1, 96)
    close(out, reference(bf16_q(q, 0.3), K, K[:, :, :64], cp, qp, 0.3), TOL_ROUNDED)


@pytest.fixture(autouse=True)
def f32_scores(monkeypatch):
    """The f32 kind's q8_0 caches with f32 scores (exactly the portable kernel's arithmetic) unless
    a test asks for the integer ones (test_q8_0_cache_integer_scores)."""
    monkeypatch.setattr(fl, "Q8_SCORES", False)


def q8_rounded(q, scale):
    """q as the integer-score path rounds it: scaled into the log2 domain, int8 per 32 values with
    d = max |x| / 127 rounded to bf16 (the matmuls' activation rule), back in q's units (f64)."""
    c = np.float32(scale * fa.LOG2E)
    x = (q * c).astype(np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = bf16((np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32))
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = np.rint(blocks * inv)
    assert np.abs(v).max() <= 127
    return (v * d.astype(np.float64)).reshape(x.shape) / np.float64(c)


@pytest.mark.parametrize("n_kv,T,dk,dv", [(1, 1, 96, 64), (17, 2, 96, 64), (200, 4, 96, 64), (613, 1, 576, 512)])
def test_q8_0_cache_integer_scores(monkeypatch, lanes_calls, n_kv, T, dk, dv):
    """q8_0 cache, f32 kind, integer scores (vpdpbusd with VNNI, widened products elsewhere): the
    query rows rounded to int8 per 32 values, then exact integer sums, so the output equals an f64
    reference on those rounded rows to f32 rounding; the rounding itself moves the outputs from the
    f32-score kernel's by ~5e-3 relative on these random rows."""
    monkeypatch.setattr(fl, "Q8_SCORES", True)
    rng = np.random.default_rng(n_kv + T)
    q, k, cp, qp = latent_case(rng, n_kv, T, CACHE_TYPES["q8_0"], dk=dk, dv=dv)
    sc = 0.3 if dk < 500 else 0.12             # score std ~3, as DeepSeek's latent heads
    out, ref32 = run_both(monkeypatch, "f32", q, k, None, n_kv, 1, dk, dv, cp, qp, sc)
    assert lanes_calls == ["f32"]
    K = k.read(n_kv).reshape(n_kv, 1, dk)
    close(out, reference(q8_rounded(q, sc), K, K[:, :, :dv], cp, qp, sc), 2e-5)
    close(out, ref32, 3e-2)
    if n_kv > 16:
        assert np.abs(out - ref32).max() > 1e-4 * np.abs(ref32).max()    # the integer path ran


def test_q8_0_cache_integer_scores_gqa(monkeypatch, lanes_calls):
    """Integer scores with two kv heads (each K head's blocks at its own offset in the row) and a
    separate q8_0 V store."""
    monkeypatch.setattr(fl, "Q8_SCORES", True)
    rng = np.random.default_rng(12)
    n, hkv, H, dk, dv = 150, 2, 32, 64, 32
    k = RowStore(n, hkv * dk, CACHE_TYPES["q8_0"], dk)
    v = RowStore(n, hkv * dv, CACHE_TYPES["q8_0"], dv)
    k.write(0, rng.standard_normal((n, hkv * dk), dtype=np.float32))
    v.write(0, rng.standard_normal((n, hkv * dv), dtype=np.float32))
    q = rng.standard_normal((2, H, dk), dtype=np.float32)
    cp, qp = np.arange(n), np.array([n - 2, n - 1])
    use(monkeypatch, "f32")
    out = fa.flash_attn(q, k, v, n, hkv, dk, dv, cp, qp, 0.2, path="kernel")
    assert lanes_calls == ["f32"]
    K, V = k.read(n).reshape(n, hkv, dk), v.read(n).reshape(n, hkv, dv)
    close(out, reference(q8_rounded(q, 0.2), K, V, cp, qp, 0.2), 2e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ctype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q6_0", "q4_1", "q5_0", "q5_1", "q8_kv"])
def test_cache_types(monkeypatch, lanes_calls, ctype, kind):
    """Float caches are converted in place (bf16) or decoded (f32), quantized ones through the
    shared decoder."""
    rng = np.random.default_rng(7)
    q, k, cp, qp = latent_case(rng, 200, 2, CACHE_TYPES[ctype])
    out, ref32 = run_both(monkeypatch, kind, q, k, None, 200, 1, 96, 64, cp, qp, 0.3)
    assert lanes_calls == [kind]
    close(out, ref32, TOL_LANES_F32 if kind == "f32" else TOL_F32)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_cells_and_rows_that_see_nothing(monkeypatch, lanes_calls, kind):
    """Cells out of position order with gaps; one query sees no cell (-> zeros), one only a few."""
    rng = np.random.default_rng(3)
    n = 300
    cp = (2 * rng.permutation(n) + 10).astype(np.int64)
    qp = np.array([5, 13, 400, 611])
    q, k, cp, qp = latent_case(rng, n, 4, CACHE_TYPES["f16"], cell_pos=cp, q_pos=qp)
    out, ref32 = run_both(monkeypatch, kind, q, k, None, n, 1, 96, 64, cp, qp, 0.3)
    assert lanes_calls == [kind]
    assert not out[0].any()
    close(out, ref32, TOL_LANES_F32 if kind == "f32" else TOL_F32)


def test_f32_kind_on_deepseek_latent_heads(monkeypatch, lanes_calls):
    """576/512 latent heads (DeepSeek's MLA), 16 rows, a depth that splits into several ranges
    with a partial last block: the f32 kind equals the portable kernel and an f64 reference."""
    rng = np.random.default_rng(8)
    n = 1000
    q, k, cp, qp = latent_case(rng, n, 1, CACHE_TYPES["f16"], dk=576, dv=512)
    out, ref32 = run_both(monkeypatch, "f32", q, k, None, n, 1, 576, 512, cp, qp, 0.12)
    assert lanes_calls == ["f32"]
    close(out, ref32, TOL_LANES_F32)
    K = k.read(n).reshape(n, 1, 576)
    close(out, reference(q, K, K[:, :, :512], cp, qp, 0.12), 1e-4)


def rel_l2(a, b):
    """Largest relative L2 error over the (token, head) output rows."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return float(np.max(np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)))


@needs_bf16
@pytest.mark.parametrize("ctype", ["f16", "q8_0"])
def test_refinement_removes_the_score_error(monkeypatch, lanes_calls, ctype):
    """The 576/512 latent heads of DeepSeek, scores with std ~2.9 (as the 1B test model's):
    bf16 scores alone put ~1e-2 relative errors on the outputs, the f32 refinement of the
    scores near the running max brings them down to the rounding of p and v (~2e-3)."""
    rng = np.random.default_rng(5)
    n = 700
    q, k, cp, qp = latent_case(rng, n, 1, CACHE_TYPES[ctype], dk=576, dv=512)
    K = k.read(n).reshape(n, 1, 576)
    ref = reference(q, K, K[:, :, :512], cp, qp, 0.12)
    use(monkeypatch, "bf16")
    monkeypatch.setattr(fl, "REFINE_LOG2", -1.0)
    rough = fa.flash_attn(q, k, None, n, 1, 576, 512, cp, qp, 0.12, path="kernel")
    monkeypatch.setattr(fl, "REFINE_LOG2", 6.0)
    out = fa.flash_attn(q, k, None, n, 1, 576, 512, cp, qp, 0.12, path="kernel")
    assert lanes_calls == ["bf16", "bf16"]
    assert rel_l2(rough, ref) > 6e-3
    assert rel_l2(out, ref) < 3e-3


@pytest.mark.parametrize("kind", KINDS)
def test_standard_heads_gqa_separate_v(monkeypatch, no_refine, lanes_calls, kind):
    """Two kv heads with separate K and V stores and 12 query rows per kv head (padded to 16)."""
    rng = np.random.default_rng(11)
    n, hkv, H, dk, dv = 150, 2, 24, 64, 32
    k = RowStore(n, hkv * dk, CACHE_TYPES["f16"])
    v = RowStore(n, hkv * dv, CACHE_TYPES["q8_0"])
    k.write(0, rng.standard_normal((n, hkv * dk), dtype=np.float32))
    v.write(0, rng.standard_normal((n, hkv * dv), dtype=np.float32))
    q = rng.standard_normal((1, H, dk), dtype=np.float32)
    cp, qp = np.arange(n), np.array([n - 1])
    out, ref32 = run_both(monkeypatch, kind, q, k, v, n, hkv, dk, dv, cp, qp, 0.2)
    assert lanes_calls == [kind]
    if kind == "f32":
        close(out, ref32, TOL_LANES_F32)
        return
    close(out, ref32, TOL_F32)
    K = bf16(k.read(n)).reshape(n, hkv, dk)
    V = bf16(v.read(n)).reshape(n, hkv, dv)
    close(out, reference(bf16_q(q, 0.2), K, V, cp, qp, 0.2), TOL_ROUNDED)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ctype", ["f32", "f16", "bf16", "q8_0", "q8_0 int"])
def test_rows_past_the_last_cell_are_ignored(monkeypatch, lanes_calls, ctype, kind):
    """A partial last block: the cache rows past n_kv hold NaN (and the cache ends before the
    block does); they must not reach the output (0 * NaN is NaN)."""
    ctype, _, scores = ctype.partition(" ")
    monkeypatch.setattr(fl, "Q8_SCORES", scores == "int")
    rng = np.random.default_rng(11)
    n_kv = 37                                    # blocks of 16: the last holds 5 cells
    q, k, cp, qp = latent_case(rng, n_kv, 1, CACHE_TYPES[ctype])
    out, _ = run_both(monkeypatch, kind, q, k, None, n_kv, 1, 96, 64, cp, qp, 0.3)
    bad = RowStore(n_kv + 3, 96, CACHE_TYPES[ctype])
    bad.data[:] = k.data
    bad.data[n_kv:] = 0xFF                       # NaN in every float type and in q8_0's scales
    use(monkeypatch, kind)
    got = fa.flash_attn(q, bad, None, n_kv, 1, 96, 64, cp, qp, 0.3, path="kernel")
    assert lanes_calls == [kind, kind] and np.isfinite(got).all()
    np.testing.assert_array_equal(got, out)


def test_aligned_scratch_starts_on_a_cache_line():
    for n in (1, 16, 1000):
        for like in (np.empty(0, np.float32), np.empty(0, np.uint16)):
            a = fl._aligned_empty(n, like)
            assert a.shape == (n,) and a.dtype == like.dtype and a.ctypes.data % 64 == 0


@pytest.mark.parametrize("kind", KINDS)
def test_more_splits_than_blocks(no_refine, kind):
    """Split ranges past the last cell (empty work items) must not enter the merge."""
    rng = np.random.default_rng(2)
    q, k, cp, qp = latent_case(rng, 40, 1, CACHE_TYPES["f16"])
    got = fl.flash_kernel_lanes(q, 0.3 * fa.LOG2E, qp, 1, k, None, 40, 96, 64, cp, 8, F16_TO_F32, 192, 192, kind)
    K = k.read(40).reshape(40, 1, 96)
    if kind == "f32":
        close(got.reshape(1, 16, 64), reference(q, K, K[:, :, :64], cp, qp, 0.3), 1e-5)
        return
    K = bf16(K)
    ref = reference(bf16_q(q, 0.3), K, K[:, :, :64], cp, qp, 0.3)
    close(got.reshape(1, 16, 64), ref, TOL_ROUNDED)


@pytest.mark.parametrize("H,dk,dv", [(4, 96, 64), (16, 72, 64), (16, 96, 40)])
def test_portable_kernel_where_lanes_do_not_fit(monkeypatch, lanes_calls, H, dk, dv):
    """Few query rows per kv head (most lanes would be padding) or head sizes that are not
    multiples of 16: the portable kernel, exact as before."""
    use(monkeypatch, "bf16" if fl.bf16_available() else "f32")
    rng = np.random.default_rng(1)
    q, k, cp, qp = latent_case(rng, 50, 1, CACHE_TYPES["f16"], dk=dk, dv=dv, H=H)
    out = fa.flash_attn(q, k, None, 50, 1, dk, dv, cp, qp, 0.3, path="kernel")
    assert not lanes_calls
    K = k.read(50).reshape(50, 1, dk)
    close(out, reference(q, K, K[:, :, :dv], cp, qp, 0.3), 1e-4)


def _settings_in_new_process(**env_over) -> str:
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("IKCLI_FA_BF16", "IKCLI_FA_LANES")}
    env.update(env_over)
    res = subprocess.run([sys.executable, "-c", "import engine.flash_attn as fa; print(fa.USE_BF16, fa.USE_LANES)"],
                         env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return res.stdout.strip()


def test_environment_switches():
    assert _settings_in_new_process() == "None True"             # bf16 where it measured faster
    assert _settings_in_new_process(IKCLI_FA_BF16="0") == "False True"
    assert _settings_in_new_process(IKCLI_FA_BF16="1", IKCLI_FA_LANES="0") == "True False"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch,kw", [("deepseek2", dict(n_head=16)),
                                     ("llama", dict(n_head=16, n_head_kv=1, n_embd=256))])
def test_model_generation_with_lanes_kernel(make_model, monkeypatch, lanes_calls, arch, kw, kind):
    """Tiny models with 16 query heads per kv head (latent MLA / GQA): a prompt, then tokens one
    at a time, with a lanes kernel against the portable kernel (same batching, so only the kernel
    differs).  Measured on these random models: bf16 logits within 1.7e-3 of the largest."""
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    p = make_model(arch=arch, qtype="f32", **kw)
    t = np.random.default_rng(1).integers(0, 265, 40).astype(np.int32)
    m = load_model(p, quiet_log)

    def run():
        ctx = Context(m, EngineConfig(p, n_ctx=128), quiet_log)
        return np.concatenate([ctx.decode(t[:30])] + [ctx.decode(t[i:i + 1]) for i in range(30, 40)])
    use(monkeypatch, "portable")
    ref = run()
    use(monkeypatch, kind)
    got = run()
    assert lanes_calls.count(kind) >= 10 * 3 and set(lanes_calls) == {kind}, "generation did not take the kernel"
    close(got, ref, 1e-4 if kind == "f32" else 1e-2)


def test_model_generation_q8_0_cache_integer_scores(make_model, monkeypatch, lanes_calls):
    """A tiny DeepSeek model with a q8_0 latent cache: a prompt, then tokens one at a time, with
    the integer scores against the f32 ones (same kernel otherwise).  Measured on this random
    model, relative to the largest logit: int8 against f32 scores 1.4e-2; from an f16 cache's
    logits the q8_0 cache is 1.12e-2 away with f32 scores and 1.31e-2 with int8 ones (rounding the
    query rows costs about what rounding the cache does, and not on top of it)."""
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    p = make_model(arch="deepseek2", qtype="f32", n_head=16, kv_lora_rank=48)    # latent rows of 48 + 16
    t = np.random.default_rng(1).integers(0, 265, 40).astype(np.int32)
    m = load_model(p, quiet_log)

    def run(cache="q8_0"):
        ctx = Context(m, EngineConfig(p, n_ctx=128, type_k=cache), quiet_log)
        return np.concatenate([ctx.decode(t[:30])] + [ctx.decode(t[i:i + 1]) for i in range(30, 40)])
    use(monkeypatch, "f32")
    ref, f16 = run(), run("f16")
    monkeypatch.setattr(fl, "Q8_SCORES", True)
    got = run()
    assert set(lanes_calls) == {"f32"} and len(lanes_calls) >= 3 * 10 * 3
    close(got, ref, 3e-2)
    assert not np.array_equal(got[-10:], ref[-10:])
    assert np.abs(got - f16).max() < 1.5 * np.abs(ref - f16).max()


def test_choice_by_host(monkeypatch, lanes_calls):
    """With the settings unset, bf16 only where preferred, the f32 lanes where the CPU has AVX-512,
    else the portable kernel; USE_BF16 False / USE_LANES False turn each off."""
    rng = np.random.default_rng(4)
    q, k, cp, qp = latent_case(rng, 100, 1, CACHE_TYPES["f16"])
    K = k.read(100).reshape(100, 1, 96)
    ref = reference(q, K, K[:, :, :64], cp, qp, 0.3)
    fa._lanes_kind(16, 16, 16)
    for host, bf, lanes, want in [((True, True, True), None, True, "bf16"), ((True, False, True), None, True, "f32"),
                                  ((False, False, True), True, True, "f32"), ((True, False, False), None, True, None),
                                  ((True, True, True), False, True, "f32"), ((True, False, True), None, False, None)]:
        if want == "bf16" and not fl.bf16_available():
            continue
        lanes_calls.clear()
        monkeypatch.setattr(fa, "_HOST", host)
        monkeypatch.setattr(fa, "USE_BF16", bf)
        monkeypatch.setattr(fa, "USE_LANES", lanes)
        out = fa.flash_attn(q, k, None, 100, 1, 96, 64, cp, qp, 0.3, path="kernel")
        assert lanes_calls == ([want] if want else []), (host, bf, lanes)
        close(out, ref, 1e-4 if want != "bf16" else TOL_F32)
