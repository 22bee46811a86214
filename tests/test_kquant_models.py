"""Whole models in the K-quant / IQK types and their _R4 forms: the integer kernels of
quant.simd_blocks and quant.simd_r4 inside the engine, compared by whole logits across -rtr,
_R4 files against their plain twins, and the attention modes."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.context import Context
from engine.model import load_model, quiet_log
from quant.kernels import HAS_GEMM

LOG: list[str] = []


def run(path, t_prompt, t_gen, repack=False, log=quiet_log, **kw):
    """Logits of a prompt in one batch (integer GEMM from quant.kernels.GEMM_MIN tokens with VNNI,
    else integer row dots, or f32 tiles from 96 tokens for the plain block types), then of tokens
    generated one at a time (integer row dots)."""
    cfg = EngineConfig(path, **{"n_ctx": 256, **kw})
    ctx = Context(load_model(path, log, mla=cfg.mla, repack=repack), cfg, quiet_log)
    out = [ctx.decode(t_prompt)]
    for t in t_gen:
        out.append(ctx.decode(np.array([t])))
    return np.concatenate(out)


def tokens(n, seed=1):
    return np.random.default_rng(seed).integers(0, 265, n).astype(np.int32)


def close(a, b, rel, same_tiles=False):
    """The first token's logits within rel of the largest; the rest closely correlated.

    The paths compared sum the same integer products in other f32 orders (each product within
    1e-6 of the other path's, tests/test_block_dots.py).  Such a difference can flip the
    rounding of an activation to int8 or a near-tie in the expert routing, and these random
    models amplify that (measured: 6e-7 in one ffn_down product -> 1% in later logits).  The
    first token attends only to itself, but even there one flipped int8 rounding in the
    low-rank MLA products moves them by ~1e-3 (measured: 7.7e-7 out of the first layer's IQ2_K / IQ2_K_R4
    kernels -> 1.2e-3 out of the next product -> 1% in the logits), so rel allows that much;
    a wrong kernel is off by O(1).  same_tiles: plain and _R4 weights of the same values; with
    the integer GEMM (AVX512-VNNI) both take the same tiles for the whole 40-token prompt
    (every expert gets all of it), so the first token must then be bit-identical."""
    np.testing.assert_allclose(a[0], b[0], rtol=0, atol=rel * np.abs(b[0]).max())
    if same_tiles and HAS_GEMM:
        np.testing.assert_array_equal(a[0], b[0])
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.999
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()


ALL_EXPERTS = dict(n_expert_used=8)   # no routing ties (fewer discontinuities to amplify)


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "iq4_k", "iq2_k"])
def test_rtr_gives_the_plain_model_logits(make_model, qtype):
    """-rtr repacks into the _R4 forms (their own kernels): same integer sums, f32 sums in another
    order, and the prompt goes through the integer kernels instead of f32 tiles."""
    p = make_model(preset="small256", qtype=qtype, **ALL_EXPERTS)
    tp, tg = tokens(40), tokens(4, seed=2)
    lines: list[str] = []
    got = run(p, tp, tg, repack=True, log=lines.append)
    assert any(line.startswith("============ Repacked") for line in lines)
    close(got, run(p, tp, tg), 2e-2, same_tiles=True)


@pytest.mark.parametrize("r_type,plain", [("iq2_k_r4", "iq2_k"), ("q4_k_r4", "q4_k"), ("q2_k_r4", "q2_k"),
                                          ("iq4_xs_r8", "iq4_xs")])
def test_r4_file_equals_its_plain_twin(make_model, r_type, plain):
    """A file written in an _R4/_R8 type holds the plain type's values (same seed): its own
    kernels (IQ2_K_R4, Q4_K_R4) agree within f32 rounding; the types without one are unpacked
    at load, logged, and then compute exactly like the plain file."""
    pr = make_model(preset="small256", qtype=r_type, **ALL_EXPERTS)
    pp = make_model(preset="small256", qtype=plain, **ALL_EXPERTS)
    tp, tg = tokens(40), tokens(3, seed=2)
    lines: list[str] = []
    got = run(pr, tp, tg, log=lines.append)
    want = run(pp, tp, tg)
    unpacked = any("unpacked" in line and r_type in line for line in lines)
    if r_type in ("q2_k_r4", "iq4_xs_r8"):
        assert unpacked
        np.testing.assert_array_equal(got, want)
    else:
        assert not unpacked
        close(got, want, 2e-2, same_tiles=True)


@pytest.mark.parametrize("mla,fa", [(0, False), (1, False), (2, True), (3, True), (3, False)])
def test_modes_agree_on_a_kquant_model(make_model, mla, fa):
    p = make_model(preset="small256", qtype="q4_k", **ALL_EXPERTS)
    tp, tg = tokens(150), tokens(3, seed=2)
    ref = run(p, tp, tg, mla=0, flash_attn=False)
    got = run(p, tp, tg, mla=mla, flash_attn=fa)
    # the file's W_k_b (64 columns: not a multiple of 256) stays f32 while W_kv_b is Q4_K, so
    # -mla 0 (and the decompressed -mla 2/3 prompt) use Q4_K values where -mla 1/3 generation use
    # the f32 ones: close, not equal (measured: correlation 0.99928 for -mla 1 / 3 without -fa)
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.999
