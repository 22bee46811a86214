"""Mixture-of-experts kernels and routing: quant.matmul.matmul_id / moe_up_gate / up_gate and
engine.ffn.route / moe_ffn / ffn_silu.

References are plain NumPy in float64 on the dequantized weights; for Q8_0 / Q4_0 the
activations are first rounded through the Q8 activation blocks (quant.matmul._q8_rounded),
as both kernel paths do, so only f32 summation error remains (bounded by TOL * |W| @ |x|).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.ffn import MoEWeights, ffn_silu, moe_ffn, route, route_reference
from engine.hparams import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT
from quant import matmul as M
from quant.tensor import QTensor
from quant.types import BF16, F16, F32, Q4_0, Q8_0

ALL = [F32, F16, BF16, Q8_0, Q4_0]
TOL = 2e-5


def _qt(rng, shape, qt, scale=1.0):
    return M.quantize_tensor((rng.standard_normal(shape) * scale).astype(np.float32), qt)


def _act64(x, qt):
    return (M._q8_rounded(x) if qt in (Q8_0, Q4_0) else x).astype(np.float64)


def _ref_id(w, x, ids, rows):
    """(P, N) float64 products and the |W| @ |x| scale of their rounding error."""
    W = M.dequantize(w).astype(np.float64)
    if W.ndim == 2:
        W = W[None]
    xa = _act64(x, w.qtype)[rows]
    return np.einsum("pnk,pk->pn", W[ids], xa), np.einsum("pnk,pk->pn", np.abs(W[ids]), np.abs(xa))


def _silu64(g):
    return g / (1.0 + np.exp(-g))


# pair sets: counts per expert decide the path (few: < 8 pairs, int/float kernel; many: tiles + BLAS)
PAIRS = {
    "empty": ([], []),
    "one": ([3], [0]),
    "few-distinct": ([5, 0, 2, 4], [0, 0, 0, 0]),
    "few-repeated": ([1, 4, 1, 1, 0, 4], [0, 1, 2, 0, 2, 1]),
    "many": (list(np.arange(60) % 3), list(np.arange(60) % 7)),
    "mixed": ([0] * 12 + [2, 5, 5, 3] + [0] * 3, list(range(19))),
}


@pytest.mark.parametrize("qt", ALL)
@pytest.mark.parametrize("case", list(PAIRS))
def test_matmul_id_and_moe_up_gate_match_numpy(qt, case):
    rng = np.random.default_rng(1)
    E, N, K = 6, 40, 96
    gate, up = _qt(rng, (E, N, K), qt), _qt(rng, (E, N, K), qt)
    x = rng.standard_normal((19, K)).astype(np.float32)
    ids, rows = (np.asarray(a, dtype=np.int64) for a in PAIRS[case])
    y = M.matmul_id(gate, x, ids, rows)
    assert y.shape == (ids.size, N) and y.dtype == np.float32
    g, gs = _ref_id(gate, x, ids, rows)
    assert np.all(np.abs(y - g) <= TOL * gs + 1e-30)

    u, us = _ref_id(up, x, ids, rows)
    f = M.moe_up_gate(gate, up, x, ids, rows)
    assert f.shape == (ids.size, N)
    # error of silu(g)*u from errors eg, eu of g, u: |silu'| <= 1.1, |silu| <= |g|
    bound = TOL * (1.1 * gs * np.abs(u) + np.abs(g) * us) + 1e-6 * np.abs(_silu64(g) * u)
    assert np.all(np.abs(f - _silu64(g) * u) <= bound + 1e-30)

    # the fused op against the separate products + NumPy's SiLU: bitwise up to exp's last ulp
    sep = M.matmul_id(gate, x, ids, rows)
    sep = sep / (1.0 + np.exp(-sep)) * M.matmul_id(up, x, ids, rows)
    np.testing.assert_allclose(f, sep, rtol=1e-6, atol=1e-6 * (np.abs(sep).max(initial=0) + 1e-30))


@pytest.mark.parametrize("qt", [F16, Q8_0, Q4_0])
def test_matmul_id_interleaved_experts_read_in_place(qt):
    """Expert tensors whose rows are stored (rows, expert, bytes): no copy, same results (rows
    longer than quant.matmul.SHORT_ROWS: shorter Q8_0 / Q4_0 rows are repacked by design)."""
    rng = np.random.default_rng(2)
    E, N, K = 4, 24, M.SHORT_ROWS + 64
    w = _qt(rng, (E, N, K), qt)
    big = np.ascontiguousarray(w.data.transpose(1, 0, 2))
    big.flags.writeable = False
    wi = QTensor(big.transpose(1, 0, 2), qt, w.shape)
    v = M._view(wi)
    assert np.shares_memory(v.buf, big) and v.estride == big.shape[2] and v.stride == E * big.shape[2]
    x = rng.standard_normal((3, K)).astype(np.float32)
    for ids in ([3, 1, 1], [2] * 9 + [0]):
        ids = np.asarray(ids)
        rows = np.arange(ids.size) % 3
        assert np.array_equal(M.matmul_id(wi, x, ids, rows), M.matmul_id(w, x, ids, rows))


def test_matmul_id_rejects_bad_pairs():
    rng = np.random.default_rng(3)
    w = _qt(rng, (3, 8, 32), Q8_0)
    x = np.ones((2, 32), np.float32)
    with pytest.raises(IndexError):
        M.matmul_id(w, x, np.array([3]), np.array([0]))
    with pytest.raises(IndexError):
        M.matmul_id(w, x, np.array([0]), np.array([2]))
    with pytest.raises(ValueError):
        M.matmul_id(w, x, np.array([0, 1]), np.array([0]))
    with pytest.raises(ValueError):
        M.moe_up_gate(w, _qt(rng, (3, 16, 32), Q8_0), x, np.array([0]), np.array([0]))


@pytest.mark.parametrize("qt", ALL)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_ffn_silu_fused_equals_unfused(qt, T):
    rng = np.random.default_rng(4)
    n_embd, n_ff = 64, 96
    g, u, d = _qt(rng, (n_ff, n_embd), qt), _qt(rng, (n_ff, n_embd), qt), _qt(rng, (n_embd, n_ff), qt)
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    a = ffn_silu(x, g, u, d, fused=True)
    b = ffn_silu(x, g, u, d, fused=False)
    assert np.array_equal(ffn_silu(x, g, u, d), a)           # fused is the default
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    if qt == F32 or T >= M.many_tokens(qt):                   # no kernel SiLU involved: bitwise
        assert np.array_equal(a, b)


def _moe(rng, qt, n_expert=16, n_embd=64, n_ff=64, bias=False):
    return MoEWeights(router=_qt(rng, (n_expert, n_embd), F32, 0.5),
                      probs_bias=(rng.standard_normal(n_expert) * 0.05).astype(np.float32) if bias else None,
                      gate=_qt(rng, (n_expert, n_ff, n_embd), qt), up=_qt(rng, (n_expert, n_ff, n_embd), qt),
                      down=_qt(rng, (n_expert, n_embd, n_ff), qt, 0.5))


def _moe_ref(x, m, ids, w):
    """Plain per-token restatement on dequantized weights (float64), ids/w from route."""
    G, U, D = (M.dequantize(t).astype(np.float64) for t in (m.gate, m.up, m.down))
    out = np.zeros((x.shape[0], D.shape[1]))
    for t in range(x.shape[0]):
        xt = _act64(x[t:t + 1], m.gate.qtype)[0]
        for e, we in zip(ids[t], w[t]):
            if e >= 0:
                h = _silu64(G[e] @ xt) * (U[e] @ xt)
                h = _act64(h[None].astype(np.float32), m.down.qtype)[0]
                out[t] += we * (D[e] @ h)
    return out


@pytest.mark.parametrize("qt", [F32, Q8_0])
@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("gating,bias", [(GATING_SOFTMAX, False), (GATING_SIGMOID, True)])
def test_moe_ffn_fused_equals_unfused_and_reference(qt, T, gating, bias):
    rng = np.random.default_rng(5)
    m = _moe(rng, qt, bias=bias)
    x = rng.standard_normal((T, 64)).astype(np.float32)
    a = moe_ffn(x, m, 4, gating, True, 2.5, fused=True)
    b = moe_ffn(x, m, 4, gating, True, 2.5, fused=False)
    scale = np.abs(b).max()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)
    ids, w = route(M.matmul(m.router, x), 4, gating, m.probs_bias, True, 2.5)
    ref = _moe_ref(x[:20], m, ids[:20], w[:20])
    np.testing.assert_allclose(a[:20], ref, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("qt", [F32, Q8_0, "Q4_K"])
@pytest.mark.parametrize("fused", [True, False])
def test_moe_ffn_pairs_sorted_by_expert_change_nothing(qt, fused, monkeypatch):
    """A prompt's pairs go to the products sorted by expert (no scatter / gather between them):
    bit for bit the result of the pairs in token order, on the kernel (GEMM) and tile paths."""
    import engine.ffn as F
    from quant.types import type_info
    qt = type_info(qt).id if isinstance(qt, str) else qt
    rng = np.random.default_rng(11)
    m = _moe(rng, qt, n_embd=256, n_ff=256)
    x = rng.standard_normal((200, 256)).astype(np.float32)
    assert 200 * 4 >= F._SORT_PAIRS
    sorted_ = moe_ffn(x, m, 4, GATING_SIGMOID, True, 2.5, fused=fused, ser=(2, 0.6))
    monkeypatch.setattr(F, "_SORT_PAIRS", 1 << 62)
    assert np.array_equal(moe_ffn(x, m, 4, GATING_SIGMOID, True, 2.5, fused=fused, ser=(2, 0.6)), sorted_)


def _logit(p):
    p = np.asarray(p, dtype=np.float64)
    return np.log(p / (1 - p)).astype(np.float32)


P8 = [0.05, 0.40, 0.10, 0.02, 0.30, 0.16, 0.12, 0.01]   # sorted: e1 .40, e4 .30, e5 .16, e6 .12, e2 .10


def test_ser_drops_below_threshold_after_min():
    lg = _logit(P8)[None]
    ids, w = route(lg, 4, GATING_SIGMOID, None, False, 1.0)
    assert ids.tolist() == [[1, 4, 5, 6]]
    # thresh 0.5: scores < 0.2 drop from sorted position 1 on -> e5 (.16) and e6 (.12)
    ids, w = route(lg, 4, GATING_SIGMOID, None, False, 1.0, ser_min=1, ser_thresh=0.5)
    assert ids.tolist() == [[1, 4, -1, -1]]
    np.testing.assert_allclose(w, [[0.40, 0.30, 0.0, 0.0]], rtol=1e-6)
    assert w[0, 2] == 0 and w[0, 3] == 0
    # min 3: position 2 is kept whatever its score
    ids, _ = route(lg, 4, GATING_SIGMOID, None, False, 1.0, ser_min=3, ser_thresh=0.5)
    assert ids.tolist() == [[1, 4, 5, -1]]
    # normalization over the kept weights only, then the scale
    ids, w = route(lg, 4, GATING_SIGMOID, None, True, 2.0, ser_min=1, ser_thresh=0.5)
    np.testing.assert_allclose(w, [[2 * 0.4 / 0.7, 2 * 0.3 / 0.7, 0.0, 0.0]], rtol=1e-6)
    # the threshold scales with the top score: e4 (.30) stays at t = .74 (>= .296), goes at t = .76 (< .304)
    ids, _ = route(lg, 4, GATING_SIGMOID, None, False, 1.0, ser_min=1, ser_thresh=0.74)
    assert ids.tolist() == [[1, 4, -1, -1]]
    ids, _ = route(lg, 4, GATING_SIGMOID, None, False, 1.0, ser_min=1, ser_thresh=0.76)
    assert ids.tolist() == [[1, -1, -1, -1]]


def test_ser_with_selection_bias():
    """The rule works on biased scores; the weights are the unbiased probabilities."""
    lg = _logit(P8)[None]
    bias = np.array([0.5, 0, 0, 0, 0, 0, 0, 0], np.float32)   # e0: .05 + .5 = .55 becomes top
    ids, w = route(lg, 4, GATING_SIGMOID, bias, False, 1.0)
    assert ids.tolist() == [[0, 1, 4, 5]]
    # thresh 0.6 of .55 = .33: e1 (.40) kept, e4 (.30) and e5 (.16) dropped
    ids, w = route(lg, 4, GATING_SIGMOID, bias, True, 1.0, ser_min=1, ser_thresh=0.6)
    assert ids.tolist() == [[0, 1, -1, -1]]
    np.testing.assert_allclose(w, [[0.05 / 0.45, 0.40 / 0.45, 0.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("ser", [(-1, 0.0), (0, 0.5), (2, 0.0), (-1, 0.9)])
def test_ser_off_is_plain_top_k(ser):
    rng = np.random.default_rng(6)
    lg = rng.standard_normal((50, 16)).astype(np.float32)
    for gating, bias in ((GATING_SOFTMAX, None), (GATING_SIGMOID, rng.standard_normal(16).astype(np.float32))):
        a = route(lg, 6, gating, bias, True, 1.5)
        b = route(lg, 6, gating, bias, True, 1.5, *ser)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        assert (a[0] >= 0).all()


def test_ser_dropped_experts_are_not_computed():
    """Experts dropped by SER have NaN weights here: touching them would poison the output."""
    rng = np.random.default_rng(7)
    m = _moe(rng, F32)
    x = rng.standard_normal((30, 64)).astype(np.float32)
    ids, w = route(M.matmul(m.router, x), 6, GATING_SOFTMAX, None, True, 1.0, 1, 0.9)
    used = np.unique(ids[ids >= 0])
    assert (ids < 0).any() and used.size < 16
    for t in (m.gate, m.up, m.down):
        d = M.dequantize(t)
        d[np.setdiff1d(np.arange(16), used)] = np.nan
        t.data = M.quantize_tensor(d, F32).data
    for fused in (True, False):
        y = moe_ffn(x, m, 6, GATING_SOFTMAX, True, 1.0, fused=fused, ser=(1, 0.9))
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y, _moe_ref(x, m, ids, w), rtol=1e-4, atol=1e-5 * np.abs(y).max())


@pytest.mark.parametrize("qt", [F32, Q8_0])
def test_ser_batch_equals_tokens_one_at_a_time(qt):
    rng = np.random.default_rng(8)
    m = _moe(rng, qt, bias=True)
    T = 300
    x = rng.standard_normal((T, 64)).astype(np.float32)
    ser = (2, 0.85)
    lg = M.matmul(m.router, x)
    ids, w = route(lg, 6, GATING_SIGMOID, m.probs_bias, True, 2.5, *ser)
    assert (ids < 0).sum() > T            # the rule is active on many tokens
    for t in range(0, T, 37):             # routing is per token
        i1, w1 = route(lg[t:t + 1], 6, GATING_SIGMOID, m.probs_bias, True, 2.5, *ser)
        assert np.array_equal(i1, ids[t:t + 1]) and np.array_equal(w1, w[t:t + 1])
    batch = moe_ffn(x, m, 6, GATING_SIGMOID, True, 2.5, ser=ser)
    single = np.concatenate([moe_ffn(x[t:t + 1], m, 6, GATING_SIGMOID, True, 2.5, ser=ser) for t in range(T)])
    np.testing.assert_allclose(batch, single, rtol=1e-5, atol=1e-5 * np.abs(single).max())


@pytest.mark.parametrize("gating", [GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ser,norm,scale,by_logits", [((-1, 0.0), True, 2.5, False), ((2, 0.7), True, 1.0, False),
                                                      ((1, 0.9), False, 1.5, False), ((-1, 0.0), False, 1.0, True)])
def test_route_compiled_equals_reference(gating, bias, ser, norm, scale, by_logits):
    rng = np.random.default_rng([gating, bias, ser[0] + 1])
    lg = rng.standard_normal((40, 64)).astype(np.float32)
    lg[3, 5:9] = lg[3, 20]                  # ties: the lower id first
    lg[4, :] = 0.25                         # all tied
    lg[5, 7] = np.nan                       # a NaN score is never chosen (argsort puts it last)
    lg = lg[:, ::-1].copy()[:, ::-1]        # (and a strided input is taken as it is)
    b = rng.standard_normal(64).astype(np.float32) * 0.3 if bias else None
    ids, w = route(lg, 6, gating, b, norm, scale, *ser, by_logits=by_logits)
    rid, rw = route_reference(lg, 6, gating, b, norm, scale, *ser, by_logits=by_logits)
    assert ids.dtype == rid.dtype and w.dtype == rw.dtype == np.float32
    ok = np.isfinite(rw).all(axis=1)        # a softmax over a NaN logit is NaN in both
    np.testing.assert_array_equal(ids[ok], rid[ok])
    np.testing.assert_allclose(w[ok], rw[ok], rtol=2e-6, atol=1e-7)
    if b is None and ser[0] < 0:
        assert ids[4].tolist() == list(range(6))


def test_route_more_used_than_experts_as_reference():
    lg = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    a, b = route(lg, 6, GATING_SOFTMAX, None, True, 1.0), route_reference(lg, 6, GATING_SOFTMAX, None, True, 1.0)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[0].shape == (3, 4)


@pytest.mark.parametrize("qt", [Q8_0, Q4_0, F16, F32])
def test_matmul_heads_one_token_plan_matches_matmul_id(qt):
    """quant.matmul.matmul_heads (DeepSeek's per-head products): one token goes straight to the pair
    kernels, more tokens through matmul_id; both give matmul_id's values bit for bit (the same
    kernel calls), for short rows (the _R8 form) and long ones; engine.linear's wrapper shows an
    observer the mul_mat_id pairs."""
    from engine import linear
    rng = np.random.default_rng(7)
    for H, N, K in ((16, 32, 128), (3, 8, M.SHORT_ROWS + 64)):
        w = _qt(rng, (H, N, K), qt)
        for T in (1, 2, 5):
            x = rng.standard_normal((T, H, K)).astype(np.float32)
            ids = np.tile(np.arange(H), T)
            want = M.matmul_id(w, x.reshape(T * H, K), ids, np.arange(T * H)).reshape(T, H, N)
            assert np.array_equal(M.matmul_heads(w, x), want), (H, T)
            assert np.array_equal(linear.matmul_heads(w, x), want)
    seen = []
    with linear.observing(lambda op, ws, xx, i, r: seen.append((op, i.tolist(), r.tolist()))):
        linear.matmul_heads(w, rng.standard_normal((2, H, K)).astype(np.float32))
    assert seen == [("mul_mat_id", [0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5])]
    with pytest.raises(ValueError):
        M.matmul_heads(w, np.zeros((1, H + 1, K), np.float32))


@pytest.mark.parametrize("qt", [Q8_0, Q4_0, F16])
def test_up_gate_few_rows_plan_matches_moe_up_gate(qt):
    """quant.matmul.up_gate (a dense SiLU MLP's first half): a few rows go to the pair kernels
    directly, with moe_up_gate's values bit for bit (the same kernel call); many rows and other
    types take moe_up_gate itself."""
    rng = np.random.default_rng(9)
    for N, K in ((48, 256), (24, M.SHORT_ROWS)):
        gate, up = _qt(rng, (N, K), qt), _qt(rng, (N, K), qt)
        for n in (1, 3, 11, 40):
            x = rng.standard_normal((n, K)).astype(np.float32)
            want = M.moe_up_gate(gate, up, x, np.zeros(n, np.int64), np.arange(n))
            assert np.array_equal(M.up_gate(gate, up, x), want), (N, K, n)
