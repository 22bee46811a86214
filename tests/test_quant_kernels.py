"""Numba kernels and quant.matmul against the NumPy reference (and gguf.quants as oracle).

Tolerances, and why:
* decoding (dequantize / get_rows / tiles) does the same single f32 multiply as the
  reference, so it must match exactly;
* f32 dot products of length c differ from a float64 sum by at most ~c*eps*sum|w*x|
  (eps = 2^-24); with c <= 256 that is < 2e-5 of |W|@|x|, the scale used below;
* the integer paths quantize x per block of 32 to q*s with |x - q*s| <= s/2 = amax/254,
  so |y - x@W.T| <= |W| @ e with e_j = amax(block of j)/254 — checked as a hard bound,
  plus an exact emulation of the same integer arithmetic in NumPy.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GT

from quant import kernels as K
from quant import matmul as M
from quant import reference as R
from quant.tensor import QTensor
from quant.types import BF16, F16, F32, Q4_0, Q8_0, type_info

ALL = [F32, F16, BF16, Q8_0, Q4_0]
INT_TYPES = [Q8_0, Q4_0]
GGUF_TYPE = {F32: GT.F32, F16: GT.F16, BF16: GT.BF16, Q8_0: GT.Q8_0, Q4_0: GT.Q4_0}
F32_TOL = 2e-5


def _weights(rng, rows, cols):
    """Random rows with varied scales plus the awkward blocks: zeros, ties, one spike."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w *= rng.uniform(0.01, 4.0, (rows, 1)).astype(np.float32)
    w[0, :32] = 0.0
    if rows > 1:
        w[1, :32] = 0.5                      # every element ties for the max
    if rows > 2:
        w[2, 5] = -7.0 * np.abs(w[2]).max()  # negative spike sets the Q4_0 scale sign
    if rows > 3:
        w[3, 40:72] = rng.standard_normal(32) * 1e-6   # f16 subnormal scales
    return w


def _ref_matrix(w: QTensor) -> np.ndarray:
    return R.dequantize(np.ascontiguousarray(w.data), w.qtype, int(np.prod(w.shape))).reshape(w.shape)


def _bf16(v):
    """float32 -> nearest-even bfloat16, back as float32 (bit manipulation)."""
    u = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _ref_act_q8(x):
    """ik_llama.cpp's Q8_2 activation rule: bf16 scale, round half to even, int8 saturation."""
    b = x.reshape(x.shape[0], -1, 32)
    d = _bf16(np.abs(b).max(axis=2) / np.float32(127))
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(b * inv[:, :, None]), -128, 127).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float32)


# ------------------------------------------------------------------ reference quantizers
@pytest.mark.parametrize("qt", ALL)
def test_reference_matches_gguf(qt):
    rng = np.random.default_rng(1)
    x = _weights(rng, 24, 256)
    ours = R.quantize(x, qt)
    theirs = np.asarray(gq.quantize(x, GGUF_TYPE[qt])).view(np.uint8).reshape(-1)
    assert np.array_equal(ours, theirs)
    back = R.dequantize(ours, qt, x.size)
    want = gq.dequantize(theirs.reshape(24, -1), GGUF_TYPE[qt]).reshape(-1)
    assert np.array_equal(back, want)
    assert ours.size == type_info(qt).row_bytes(x.size)


def test_reference_q8_0_rounding_is_roundf():
    # 0.49999997 * 1 must round to 0 (floor(x + 0.5) would give 1)
    x = np.zeros(32, np.float32)
    x[0] = 127.0
    x[1] = np.nextafter(np.float32(0.5), np.float32(0))
    x[2] = 2.5
    x[3] = -2.5
    q = R.quantize(x, Q8_0)[2:].view(np.int8)
    assert list(q[:4]) == [127, 0, 3, -3]


def test_f16_bits_all_patterns():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    y = np.empty(65536, np.float32)
    # an F16 row of every bit pattern through decode_row (the vcvtph2ps conversion)
    K.decode_row(K.readonly(h.view(np.uint8)), K.tag(K.F16_ID), 0, 65536, K.QK, K.F16_TO_F32, y)
    want = h.view(np.float16).astype(np.float32)
    # exact bits for every number, inf and subnormal; NaNs stay NaNs of the same sign (the
    # hardware conversion quiets signalling NaNs, so their payload bits may differ)
    nan = np.isnan(want)
    assert np.array_equal(y.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(y[nan]).all() and np.array_equal(np.signbit(y[nan]), np.signbit(want[nan]))


# ------------------------------------------------------------------ dequantize / get_rows
@pytest.mark.parametrize("qt", ALL)
def test_dequantize_matches_reference_and_gguf(qt):
    rng = np.random.default_rng(2)
    x = _weights(rng, 13, 128)
    w = M.quantize_tensor(x, qt)
    got = M.dequantize(w)
    assert got.shape == x.shape and got.dtype == np.float32
    assert np.array_equal(got, _ref_matrix(w))
    assert np.array_equal(got, gq.dequantize(w.data, GGUF_TYPE[qt]))
    # and it is actually close to what was quantized (catches a wrong-but-consistent pair)
    tol = {F32: 0, F16: 1e-3, BF16: 8e-3, Q8_0: 1e-2, Q4_0: 0.15}[qt]
    assert np.abs(got - x).max() <= tol * np.abs(x).max()


@pytest.mark.parametrize("qt", ALL)
def test_get_rows(qt):
    rng = np.random.default_rng(3)
    x = _weights(rng, 37, 96)
    w = M.quantize_tensor(x, qt)
    ids = np.array([[5, 0, 36], [5, 17, 2]])
    got = M.get_rows(w, ids)
    assert got.shape == (2, 3, 96)
    assert np.array_equal(got, _ref_matrix(w)[ids])
    with pytest.raises(IndexError):
        M.get_rows(w, np.array([37]))


# ------------------------------------------------------------------ activation quantizer
def test_quantize_act_q8_exact():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((5, 256)) * rng.uniform(1e-3, 1e3, (5, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = np.linspace(-3.5, 3.5, 32)
    x[2, :32] = 0
    x[2, 0] = 127.0                                      # d = 1 exactly
    x[2, 1] = -np.nextafter(np.float32(0.5), np.float32(0))  # roundf -> 0, floor(|v|+.5) -> 1
    q = np.empty(x.shape, np.int8)
    s = np.empty((5, 8), np.float32)
    bs = np.empty((5, 8), np.int32)
    K.quantize_act_q8(x, K.QK, q, s, bs)
    rq, rs = _ref_act_q8(x)
    assert np.array_equal(q, rq) and np.array_equal(s, rs)
    assert np.array_equal(bs, rq.reshape(5, 8, 32).astype(np.int32).sum(axis=2))


def _ref_act_q8_k(x):
    """ik_llama.cpp's Q8_K activation rule: per 256 values d = amax/127 (f32), q = x * (127/amax)
    rounded half to even; d repeated for each 32 of its 256 values."""
    b = x.reshape(x.shape[0], -1, 256)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(b * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), np.repeat(d, 8, axis=1)


def test_quantize_act_q8_k_exact():
    """qk 256 (the GEMM activations of ik's Q8_K types): the reference's bytes and scales, in the
    parallel, one-pass and serial entry points alike, with the per-16 sums from its scale."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 512)) * rng.uniform(1e-3, 1e3, (4, 1))).astype(np.float32)
    x[0, :256] = 0                                        # a zero block: d = 0, q = 0
    x[1, 256:] = np.linspace(-3.5, 3.5, 256)
    x[2, :3] = (-127.0, 0.5, 1.5)                         # 127 / amax = 1: ties to even
    x[2, 3:256] = 0
    rq, rs = _ref_act_q8_k(x)
    q, s, bs = np.empty(x.shape, np.int8), np.empty((4, 16), np.float32), np.empty((4, 16), np.int32)
    K.quantize_act_q8(x, 256, q, s, bs)
    assert np.array_equal(q, rq) and np.array_equal(s, rs)
    assert np.array_equal(bs, rq.reshape(4, 16, 32).astype(np.int32).sum(axis=2))
    i16 = rq.reshape(4, 32, 16).astype(np.int32).sum(axis=2)
    for fn in (K.quantize_act_q8_sums, K.quantize_act_q8_serial):
        q2, s2 = np.empty(x.shape, np.int8), np.empty((4, 16), np.float32)
        bs2, b16, c16 = np.empty((4, 32), np.int32), np.empty((4, 32), np.float32), np.empty((4, 32), np.int32)
        fn(x, 256, q2, s2, bs2, b16, c16)
        assert np.array_equal(q2, rq) and np.array_equal(s2, rs)
        assert np.array_equal(bs2, i16) and np.array_equal(c16, -128 * i16)
        assert np.array_equal(b16, i16.astype(np.float32) * np.repeat(rs, 2, axis=1))


# ------------------------------------------------------------------ matmul
def _check_matmul(w: QTensor, x: np.ndarray, y: np.ndarray):
    W = _ref_matrix(w).astype(np.float64)
    xd = x.astype(np.float64)
    scale = np.abs(xd) @ np.abs(W).T + 1e-30
    if w.qtype in INT_TYPES:  # both paths use Q8-rounded activations with integer weight types
        q, s = _ref_act_q8(x)
        # exact emulation of the integer path: per-block int sums times both scales
        xq = (q.reshape(len(x), -1, 32).astype(np.float64) * s[:, :, None]).reshape(x.shape)
        assert np.all(np.abs(y - xq @ W.T) <= F32_TOL * (np.abs(xq) @ np.abs(W).T) + 1e-30)
        # and the bound that activation rounding guarantees against the f32 product
        # bf16 scale d <= amax/127·(1 + 2^-8): half a step, plus a saturated 127.5 -> 127
        e = np.repeat(np.abs(x).reshape(len(x), -1, 32).max(axis=2) / 127.0 * (1 + 2 ** -8), 32, axis=1)
        bound = e @ np.abs(W).T * (1 + 1e-4) + F32_TOL * scale
        assert np.all(np.abs(y - xd @ W.T) <= bound)
    else:
        assert np.all(np.abs(y - xd @ W.T) <= F32_TOL * scale)


@pytest.mark.parametrize("qt", ALL)
@pytest.mark.parametrize("n", [1, 3, 40])
def test_matmul_paths(qt, n, monkeypatch):
    monkeypatch.setattr(M, "TILE_BYTES", 16 * 4 * 256)   # 16-row tiles: 77 = 4*16 + 13
    rng = np.random.default_rng(10 + n)
    w = M.quantize_tensor(_weights(rng, 77, 256), qt)
    x = rng.standard_normal((n, 256)).astype(np.float32)
    y = M.matmul(w, x)
    assert y.shape == (n, 77) and y.dtype == np.float32
    _check_matmul(w, x, y)
    out = np.full((n, 77), np.nan, np.float32)
    assert M.matmul(w, x, out=out) is out
    assert np.array_equal(out, y)


@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_XS", "IQ2_K", "Q4_K_R4", "Q8_0_R8"])
def test_matvec_act_equals_separate_calls(tname):
    """The one-call path of a few activation rows (K.matvec_act: quantize, gather the pairs' rows,
    row dots) gives the same bits as quantizing with quant.matmul._act and calling matvec_int:
    plain, fused up/gate, and pairs whose rows are gathered (a token's experts)."""
    qt = type_info(tname).id
    rng = np.random.default_rng(3)
    n_exp, rows, cols = 3, 48, 512
    w = M.quantize_tensor(_weights(rng, n_exp * rows, cols), qt).data.reshape(n_exp, rows, -1)
    gate, up = QTensor(w, qt, (n_exp, rows, cols)), QTensor(w[::-1].copy(), qt, (n_exp, rows, cols))
    x = rng.standard_normal((2, cols)).astype(np.float32)
    ids, x_rows = np.array([2, 0, 2, 1, 0], np.int64), np.array([0, 0, 1, 1, 1], np.int64)
    order, counts, few, ge, gb, _, _ = K.group_pairs(ids, x_rows, n_exp, 2, 1 << 62)
    assert few == 5 and counts.max() < K.GEMM_MIN
    act = tuple(a[x_rows[order]] for a in M._act(qt, x, 5))
    for vb in (None, M._view(up, few=True)):       # the views products of a few rows read
        va = M._view(gate, few=True)
        b = va if vb is None else vb
        ref = np.empty((5, rows), np.float32)
        K.matvec_int(va.tag, va.buf, va.estride, va.stride, b.buf, b.estride, b.stride, vb is not None, rows, cols,
                     K.QK, K.F16_TO_F32, *act, ge, gb, ref, np.empty_like(ref))
        got = np.empty((5, rows), np.float32)
        K.matvec_act(va.tag, va.buf, va.estride, va.stride, b.buf, b.estride, b.stride, vb is not None, rows, cols,
                     K.QK, K.F16_TO_F32, x, qt not in M._Q8_SIMD, x_rows[order], ge, gb, got, np.empty_like(got))
        assert np.array_equal(got, ref)
        if vb is None:
            ref_gate = ref
    # and through the public entry point, which now takes that path (results back in pair order)
    assert np.array_equal(M.matmul_id(gate, x, ids, x_rows)[order], ref_gate)


def test_matmul_path_choice_without_gemm(monkeypatch):
    """On a CPU without VNNI (no tile GEMM) quant.matmul's choice by row count stands: Q8_0 from
    8 rows goes to the dequantized tiles, not to the one-call row dots (K.matvec_act)."""
    monkeypatch.setattr(K, "HAS_GEMM", False)
    monkeypatch.setattr(K, "GEMM_MIN", 1 << 62)
    calls = []
    real_act, real_tiles = K.matvec_act, M._tiles
    monkeypatch.setattr(K, "matvec_act", lambda *a: (calls.append("act"), real_act(*a))[1])
    monkeypatch.setattr(M, "_tiles", lambda *a: (calls.append("tiles"), real_tiles(*a))[1])
    rng = np.random.default_rng(5)
    w = M.quantize_tensor(_weights(rng, 32, 256), Q8_0)
    for n, path in ((3, "act"), (M.many_tokens(Q8_0), "tiles"), (10, "tiles")):
        calls.clear()
        x = rng.standard_normal((n, 256)).astype(np.float32)
        _check_matmul(w, x, M.matmul(w, x))
        assert calls == [path], (n, calls)


def test_tile_rows_remainder_is_used():
    assert M.tile_rows(256, 77) <= 77
    assert M.tile_rows(4096, 10_000) % 16 == 0


@pytest.mark.parametrize("qt", ALL)
@pytest.mark.parametrize("layout", ["padded", "interleaved"])
def test_matmul_noncontiguous_expert(qt, layout):
    rng = np.random.default_rng(20)
    E, rows, cols = 3, 45, 128
    experts = [M.quantize_tensor(_weights(rng, rows, cols), qt) for _ in range(E)]
    rb = experts[0].data.shape[1]
    if layout == "padded":   # rows of each expert are rb + 8 bytes apart
        big = np.zeros((E, rows, rb + 8), np.uint8)
        for e in range(E):
            big[e, :, :rb] = experts[e].data
        data = big[:, :, :rb]
    else:                    # stored (rows, E, rb): an expert's rows are E*rb bytes apart
        big = np.zeros((rows, E, rb), np.uint8)
        for e in range(E):
            big[:, e] = experts[e].data
        data = big.transpose(1, 0, 2)
    big.flags.writeable = False              # like a read-only memory map
    w3 = QTensor(data, qt, (E, rows, cols))
    for e in (0, 2):
        we = w3[e]
        assert not we.data.flags.c_contiguous
        buf, stride, _, _, _ = M._rows_view(we)
        assert np.shares_memory(buf, big) and stride == we.data.strides[0]   # no copy
        for n in (1, 3, 40):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            y = M.matmul(we, x)
            assert np.array_equal(M.dequantize(we), M.dequantize(experts[e]))
            _check_matmul(experts[e], x, y)
        assert np.array_equal(M.get_rows(we, np.array([44, 1])), M.get_rows(experts[e], np.array([44, 1])))


def test_matmul_rejects_bad_shapes():
    w = M.quantize_tensor(np.ones((4, 64), np.float32), Q8_0)
    with pytest.raises(ValueError):
        M.matmul(w, np.ones((2, 32), np.float32))
    with pytest.raises(ValueError):
        M.matmul(w, np.ones((2, 64), np.float32), out=np.empty((2, 5), np.float32))


def test_supported():
    for qt in ALL:
        assert M.supported(qt)
    assert M.supported(type_info("Q4_K").id) and M.supported(type_info("IQ4_KS").id)   # decoded rows
    assert not M.supported(type_info("Q8_K").id)
    with pytest.raises(NotImplementedError):        # an activation-only type has no weight quantizer
        M.quantize_tensor(np.ones((1, 256), np.float32), type_info("Q8_K").id)


def test_set_num_threads_roundtrip():
    nb0, bl0 = M.get_num_threads()
    try:
        M.set_num_threads(1)
        assert M.get_num_threads()[0] == 1
        if bl0 is not None:
            assert M.get_num_threads()[1] == 1
    finally:
        M.set_num_threads(nb0, bl0 if bl0 is not None else nb0)


# ------------------------------------------------------------------ row-interleaved kernels
@pytest.mark.parametrize("qt", [Q8_0, Q4_0])
@pytest.mark.parametrize("n", [1, 3, 20])
def test_interleaved_r8_equals_plain(qt, n, monkeypatch):
    """Q8_0_R8 / Q4_0_R8 (quant.simd's 8-row group kernels, and their row decoder on the tile
    path) give the plain type's results: the same integer block sums, f32 sums in another order."""
    from quant import interleaved
    from quant.types import interleaved_form
    monkeypatch.setattr(M, "TILE_BYTES", 16 * 4 * 256)
    rng = np.random.default_rng(7 + n)
    E, rows, cols = 3, 48, 256
    w = M.quantize_tensor(np.stack([_weights(rng, rows, cols) for _ in range(E)]), qt)
    rt = interleaved_form(qt)
    raw = interleaved.repack(w.data.reshape(E * rows, -1), qt, E * rows, cols)
    wr = QTensor(raw.reshape(w.data.shape), rt.id, w.shape)
    for e in range(E):
        assert np.array_equal(M.dequantize(wr[e]), M.dequantize(w[e]))
    x = rng.standard_normal((n, cols)).astype(np.float32)
    scale = np.abs(x) @ np.abs(M.dequantize(w[1])).T
    assert np.all(np.abs(M.matmul(wr[1], x) - M.matmul(w[1], x)) <= F32_TOL * scale)
    ids = rng.integers(0, E, 2 * n)
    rows_ = np.repeat(np.arange(n), 2)
    yr, yp = M.matmul_id(wr, x, ids, rows_), M.matmul_id(w, x, ids, rows_)
    assert np.allclose(yr, yp, rtol=0, atol=F32_TOL * float(scale.max()))


# ------------------------------------------------------------------ quant.simd row dots
def _row_dots(fn):
    """njit wrapper: out[k, r] = fn's dot of weight row r with activation row k."""
    from numba import njit

    @njit
    def run(buf, rows, stride, q, s, bs, nb, out):
        for k in range(q.shape[0]):
            for r in range(rows):
                out[k, r] = fn(buf, r * stride, q[k], s[k], bs[k], nb)
    return run


def _group_dots(fn):
    from numba import njit

    @njit
    def run(buf, rows, gstride, q, s, bs, nb, out):
        for k in range(q.shape[0]):
            for g in range(rows // 8):
                fn(buf, g * gstride, q[k], s[k], bs[k], nb, out[k], g * 8)
    return run


@pytest.mark.parametrize("qt", [Q8_0, Q4_0])
@pytest.mark.parametrize("form", ["row", "r8"])
def test_simd_vnni_and_generic_agree(qt, form):
    """The generic-IR and AVX512-VNNI forms of every row / group dot (the kernels use one of them,
    by CPU) give the exact integer block sums: checked against an f64 emulation, with weights at
    the int8 / nibble extremes (incl. -128, which Q8_0 files may hold) and saturated activations."""
    from quant import interleaved, simd
    rng = np.random.default_rng(31)
    rows, cols, n = 16, 512, 3
    w = M.quantize_tensor(_weights(rng, rows, cols), qt)
    data = np.array(w.data)
    if qt == Q8_0:                        # raw extremes: -128 / 127 weights in two blocks
        data[4, 2:34] = np.uint8(128)
        data[5, 36:68] = np.uint8(127)
    else:
        data[4, 2:18] = np.uint8(0xFF)    # nibbles 15 / 0
        data[5, 20:36] = np.uint8(0x00)
    w = QTensor(data, qt, w.shape)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[0, :64] = np.where(np.arange(64) % 2, -1.0, 1.0) * 1e3   # |q| = 127 blocks, alternating sign
    x[1, 64:96] = -5.0                                          # every value -127
    q = np.empty(x.shape, np.int8)
    sc = np.empty((n, cols // 32), np.float32)
    bs = np.empty((n, cols // 32), np.int32)
    K.quantize_act_q8(x, K.QK, q, sc, bs)
    q[2, :32] = -127                    # the low end (the quantizer saturates at -127: AVX2's signed pairs)
    bs[2, 0] = -127 * 32
    W = _ref_matrix(w).astype(np.float64)
    # per-block integer sums times both scales, summed in f64
    ref = (q.reshape(n, -1, 32).astype(np.float64) * sc[:, :, None]).reshape(n, cols) @ W.T
    mag = (np.abs(q.reshape(n, -1, 32)).astype(np.float64) * sc[:, :, None]).reshape(n, cols) @ np.abs(W).T
    nb = cols // 32
    if form == "row":
        kinds = {"generic": getattr(simd, f"row_dot_{'q8_0' if qt == Q8_0 else 'q4_0'}_generic"),
                 "vnni": getattr(simd, f"row_dot_{'q8_0' if qt == Q8_0 else 'q4_0'}_vnni")}
        buf, stride, wrap = data.reshape(-1), data.shape[1], _row_dots
    else:
        raw = interleaved.repack(data, qt, rows, cols)
        name = "q8_0_r8" if qt == Q8_0 else "q4_0_r8"
        kinds = {"generic": getattr(simd, f"group_dot_{name}_generic"), "vnni": getattr(simd, f"group_dot_{name}_vnni")}
        buf, stride, wrap = raw.reshape(-1), raw.shape[1] * 8, _group_dots
    checked = 0
    for kind, fn in kinds.items():
        if kind == "vnni" and not simd.HAS_VNNI:
            continue                      # the VNNI form may only be compiled where the CPU has it
        out = np.zeros((n, rows), np.float32)
        wrap(fn)(buf, rows, stride, q, sc, bs, nb, out)
        assert np.all(np.abs(out - ref) <= 4e-7 * mag + 1e-30), kind
        checked += 1
    assert checked == (2 if simd.HAS_VNNI else 1)
