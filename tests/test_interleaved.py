"""ik_llama.cpp's row-interleaved _R4/_R8 layouts (quant.interleaved) against ik's own bytes and
values (tests/data/golden_interleaved.npz, from scripts/make_goldens_interleaved.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from quant import interleaved as il
from quant import reference
from quant.types import BY_ID, interleaved_form, type_info

DATA = os.path.join(os.path.dirname(__file__), "data", "golden_interleaved.npz")
NAMES = [type_info(t).name for t in il.R_TYPES]
PERMUTED = [n for n in NAMES if n != "Q8_K_R8"]          # pure bit permutations of a plain type

# where quant's base-type quantizer is known not to give ik's bytes on this data (then the
# repacked bytes cannot either; the repack itself is checked by test_repack_matches_ik)
KNOWN_BASE_MISMATCH = {
    ("Q4_K_R4", False): "quant.kquants' Q4_K quantizer misses ik on a rounding-order near-tie (row 5)",
    ("Q2_K_R4", True): "quant.kquants' Q2_K imatrix quantizer is not bit-exact with ik's",
}


@pytest.fixture(scope="module")
def g():
    with np.load(DATA) as f:
        return {k: f[k] for k in f.files}


def _shape(g):
    return g["x"].shape


def test_table_entries():
    for name in NAMES:
        ti = type_info(name)
        assert ti.interleave in (4, 8)
        if name != "Q8_K_R8":
            base = type_info(ti.base)
            assert interleaved_form(base.id) is ti
            assert (ti.block_size, ti.type_size, ti.row_meta) == (base.block_size, base.type_size, base.row_meta)


@pytest.mark.parametrize("name", PERMUTED)
def test_repack_matches_ik(g, name):
    nrows, n = _shape(g)
    ours = il.repack(g[f"{name}/plain"], type_info(name).base, nrows, n)
    np.testing.assert_array_equal(ours, g[f"{name}/r"])


@pytest.mark.parametrize("name", PERMUTED)
def test_unpack_gives_ik_plain_bytes(g, name):
    nrows, n = _shape(g)
    np.testing.assert_array_equal(il.unpack(g[f"{name}/r"], name, nrows, n), g[f"{name}/plain"])


@pytest.mark.parametrize("name", PERMUTED)
def test_unpack_inverts_repack_on_any_bytes(name):
    """Random bytes use every bit of the layout, also patterns a quantizer never writes."""
    ti = type_info(name)
    nrows, n = 2 * ti.interleave, 2 * max(ti.block_size, 256)
    raw = np.random.default_rng(ti.id).integers(0, 256, (nrows, ti.row_bytes(n)), dtype=np.uint8)
    plain = il.unpack(raw, name, nrows, n)
    np.testing.assert_array_equal(il.repack(plain, ti.base, nrows, n), raw)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_matches_ik(g, name):
    nrows, n = _shape(g)
    ik = g[f"{name}/deq"]
    # whole tensor with n_per_row, and one group the way ik's to_float is called
    flat = reference.dequantize(g[f"{name}/r"], type_info(name).id, nrows * n, n_per_row=n)
    np.testing.assert_array_equal(flat.view(np.uint32), ik.reshape(-1).view(np.uint32))
    nr = type_info(name).interleave
    one = reference.dequantize(g[f"{name}/r"][:nr], type_info(name).id, nr * n)
    np.testing.assert_array_equal(one.view(np.uint32), ik[:nr].reshape(-1).view(np.uint32))


@pytest.mark.parametrize("name", NAMES)
def test_unpack_group_matches_unpack(g, name):
    ti = type_info(name)
    nrows, n = _shape(g)
    raw = g[f"{name}/r"]
    want = il.unpack(raw, name, nrows, n)
    pad = 7                                             # groups start at arbitrary byte offsets
    buf = np.concatenate([np.full(pad, 0xA5, np.uint8), raw.reshape(-1)])
    buf.flags.writeable = False                         # the engine passes read-only maps
    out = np.full((ti.interleave, want.shape[1]), 0x5A, dtype=np.uint8)
    rb = ti.row_bytes(n)
    for gi in range(nrows // ti.interleave):
        il.unpack_group(buf, ti.id, pad + gi * ti.interleave * rb, n, out)
        np.testing.assert_array_equal(out, want[gi * ti.interleave:(gi + 1) * ti.interleave])


@pytest.mark.parametrize("name", NAMES)
def test_unpack_group_on_any_bytes(name):
    """Every bit of the layout (random bytes), several groups and block columns."""
    ti = type_info(name)
    nrows, n = 2 * ti.interleave, 3 * max(ti.block_size, 256)
    raw = np.random.default_rng(ti.id + 1).integers(0, 256, (nrows, ti.row_bytes(n)), dtype=np.uint8)
    want = il.unpack(raw, name, nrows, n)
    out = np.zeros((ti.interleave, want.shape[1]), dtype=np.uint8)
    for gi in range(2):
        il.unpack_group(raw.reshape(-1), ti.id, gi * ti.interleave * ti.row_bytes(n), n, out)
        np.testing.assert_array_equal(out, want[gi * ti.interleave:(gi + 1) * ti.interleave])


def test_unpack_group_decodes_like_ik(g):
    """Q8_K_R8 unpacks to Q8_0 rows; through the plain reference decoder they give ik's values."""
    nrows, n = _shape(g)
    raw = g["Q8_K_R8/r"].reshape(-1)
    out = np.zeros((8, type_info("Q8_0").row_bytes(n)), dtype=np.uint8)
    il.unpack_group(raw, il.Q8_K_R8, 0, n, out)
    y = np.stack([reference.dequantize(out[r], il.Q8_0, n) for r in range(8)])
    np.testing.assert_array_equal(y.view(np.uint32), g["Q8_K_R8/deq"].view(np.uint32))


@pytest.mark.parametrize("use_im", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_quantize_matches_ik(g, name, use_im):
    key = f"{name}/r/im" if use_im else f"{name}/r"
    if key not in g:
        pytest.skip(f"{name} ignores the imatrix (ik's bytes are those without one)")
    x, im = g["x"], g["im"]
    try:
        ours = reference.quantize(x, type_info(name).id, im if use_im else None)
    except NotImplementedError as e:
        pytest.skip(f"base quantizer of {name} missing: {e}")
    want = g[key].reshape(-1)
    if not np.array_equal(ours, want) and (name, use_im) in KNOWN_BASE_MISMATCH:
        pytest.xfail(KNOWN_BASE_MISMATCH[(name, use_im)])
    np.testing.assert_array_equal(ours, want)


def test_quantize_q8_k_r8_zero_and_tiny_rows():
    x = np.zeros((8, 256), np.float32)
    x[1, 5] = 1e-30
    x[2] = np.linspace(-3, 3, 256, dtype=np.float32)
    raw = reference.quantize(x, il.Q8_K_R8)
    y = reference.dequantize(raw, il.Q8_K_R8, 8 * 256, 256).reshape(8, 256)
    assert not y[0].any()
    assert np.abs(y[2] - x[2]).max() <= 3 / 127


def test_bad_shapes_are_one_line_errors(g):
    x = g["x"]
    with pytest.raises(ValueError, match="6 x 512"):
        reference.quantize(x[:6], type_info("Q8_0_R8").id)
    with pytest.raises(ValueError, match="4 x 512"):
        il.repack(g["IQ4_XS_R8/plain"][:4], "IQ4_XS", 4, 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        il.unpack(g["Q4_K_R4/r"], "Q4_K_R4", 8, 320)
    with pytest.raises(ValueError, match="no row-interleaved form"):
        il.repack(g["Q4_K_R4/plain"], "Q4_1", 8, 512)
    with pytest.raises(ValueError, match="not a row-interleaved"):
        il.plain_type("Q4_K")


def test_unpack_group_rejects_bad_arguments(g):
    raw = g["Q4_K_R4/r"].reshape(-1)
    out = np.zeros((4, 288), dtype=np.uint8)
    with pytest.raises(ValueError, match="not a row-interleaved"):
        il.unpack_group(raw, 12, 0, 512, out)
    with pytest.raises(ValueError, match="too small"):
        il.unpack_group(raw, il.Q4_K_R4, 0, 512, out[:, :100])
    with pytest.raises(ValueError, match="past the end"):
        il.unpack_group(raw, il.Q4_K_R4, raw.size - 10, 512, out)


# ------------------------------------------------------------------ the engine's kernels
@pytest.mark.parametrize("name", [t.name for t in sorted(BY_ID.values(), key=lambda t: t.id)
                                  if t.interleave])
def test_matmul_runs_every_r_type_like_its_plain_type(name):
    """quant.matmul on an _R4/_R8 tensor (3-D, experts) equals the same on the unpacked plain
    rows: decoded values bit for bit; products within f32 rounding (the types with kernels of
    their own, quant.simd and quant.simd_r4, sum in another order; the others are unpacked to
    their plain type, Q8_K_R8 to Q8_0), on the few-token and the tile paths (100 rows: tiles for
    every type whose rows go there; the quant.simd_r4 types stay on their kernels)."""
    from quant import matmul as M
    from quant.tensor import QTensor
    ti = type_info(name)
    rng = np.random.default_rng(ti.id)
    E, rows, cols = 2, 16, 768      # past quant.matmul.SHORT_ROWS: the plain Q8_0 / Q4_0 rows stay plain
    x = rng.standard_normal((E * rows, cols)).astype(np.float32)
    raw = reference.quantize(x, ti.id).reshape(E, rows, -1)
    pt = il.plain_type(ti.id)
    plain = il.unpack(raw.reshape(E * rows, -1), ti.id, E * rows, cols).reshape(E, rows, -1)
    wr, wp = QTensor(raw, ti.id, (E, rows, cols)), QTensor(plain, pt, (E, rows, cols))
    for e in range(E):
        assert np.array_equal(M.dequantize(wr[e]), M.dequantize(wp[e]))
    for n in (1, 3, 24, 100):
        a = rng.standard_normal((n, cols)).astype(np.float32)
        scale = float((np.abs(a) @ np.abs(M.dequantize(wp[1])).T).max())
        want = M.matmul(wp[1], a)
        assert np.allclose(M.matmul(wr[1], a), want, rtol=0, atol=2e-5 * scale)
        ids = rng.integers(0, E, n)
        want = M.matmul_id(wp, a, ids, np.arange(n))
        assert np.allclose(M.matmul_id(wr, a, ids, np.arange(n)), want, rtol=0, atol=2e-5 * scale)


def _few_row_products_agree(w, plain, deq, shape, rng, ns, ref_atol: float) -> None:
    """Products of n in ns activation rows (matmul for 2-D, matmul_id for 3-D weights, and for
    3-D matmul_heads of one token) through w's few-row form equal the plain kernels' within f32
    rounding and the dequantized reference deq within ref_atol (relative to the largest)."""
    from quant import matmul as M
    for n in ns:
        a = rng.standard_normal((n, shape[-1])).astype(np.float32)
        if len(shape) == 2:
            got, want, ref = M.matmul(w, a), M.matmul(plain, a), a @ deq[0].T
        else:
            ids = rng.integers(0, shape[0], n)
            got, want = M.matmul_id(w, a, ids, np.arange(n)), M.matmul_id(plain, a, ids, np.arange(n))
            ref = np.einsum("nc,nrc->nr", a, deq[ids])
        scale = float(np.abs(ref).max())
        assert np.allclose(got, want, rtol=0, atol=2e-5 * scale), (shape, n)
        assert np.allclose(got, ref, rtol=0, atol=ref_atol * scale), (shape, n)
    if len(shape) == 3:
        a = rng.standard_normal((1, shape[0], shape[-1])).astype(np.float32)
        want = np.einsum("thc,hrc->thr", a, deq)
        scale = float(np.abs(want).max())
        assert np.allclose(M.matmul_heads(w, a), M.matmul_heads(plain, a), rtol=0, atol=2e-5 * scale), shape
        assert np.allclose(M.matmul_heads(w, a), want, rtol=0, atol=ref_atol * scale), shape


@pytest.mark.parametrize("qt", ["Q8_0", "Q4_0", "Q5_0", "Q6_0", "IQ4_NL"])
def test_short_rows_are_multiplied_in_r8_form(qt, monkeypatch):
    """Q8_0 / Q4_0 matrices of rows <= quant.matmul.SHORT_ROWS values (DeepSeek's per-head attn_k_b /
    attn_v_b) go to products of a few rows in their _R8 form (with VNNI), and Q5_0 / Q6_0 / IQ4_NL
    ones (attn_k_b's fallback types) in Q8_0_R8 holding the same values: the few-row view holds
    the repacked bytes, 2-D and 3-D (per head) alike, and products of many rows keep the plain
    layout; products equal the plain kernels' within f32 rounding and the dequantized reference
    within the activations' quantization; get_rows still reads the plain rows; row counts that
    are not a multiple of 8 and longer rows stay plain."""
    from quant import kernels as K
    from quant import matmul as M
    from quant.tensor import QTensor
    tid = type_info(qt).id
    r8 = interleaved_form(type_info("Q8_0").id if tid in M._EXACT_IN_Q8_0 else tid).id
    rng = np.random.default_rng(tid)
    cases = [((16, 128), True), ((4, 16, 64), True), ((3, 8, 512), True), ((12, 128), False),
             ((16, M.SHORT_ROWS + 32), False)]
    for shape, short in cases:
        x = rng.standard_normal(shape).astype(np.float32)
        raw = reference.quantize(x.reshape(-1, shape[-1]), tid)
        w = QTensor(raw.reshape(*shape[:-1], -1), tid, shape)
        assert M._view(w, few=True).qtype == (r8 if short and K.HAS_SHORT_R8 else tid), shape
        assert M._view(w).qtype == tid          # many rows: the plain layout (the GEMM's)
        monkeypatch.setattr(M, "_SHORT_R8", {})
        plain = QTensor(raw.reshape(*shape[:-1], -1), tid, shape)     # a fresh view: the plain kernels
        assert M._view(plain, few=True).qtype == tid
        monkeypatch.undo()
        deq = M.dequantize(plain).reshape(-1, shape[-2], shape[-1])
        _few_row_products_agree(w, plain, deq, shape, rng, (1, 5, 40), 2e-2)
        if len(shape) == 3:         # one expert with enough pairs for the integer GEMM, the others few
            n = 40
            ids = np.where(np.arange(n) < 30, 0, rng.integers(1, shape[0], n))
            a = rng.standard_normal((n, shape[-1])).astype(np.float32)
            got, want = M.matmul_id(w, a, ids, np.arange(n)), M.matmul_id(plain, a, ids, np.arange(n))
            ref = np.einsum("nc,nrc->nr", a, deq[ids])
            scale = float(np.abs(ref).max())
            assert np.allclose(got, want, rtol=0, atol=2e-5 * scale), (shape, "skewed")
            assert np.allclose(got, ref, rtol=0, atol=2e-2 * scale), (shape, "skewed")
        if len(shape) == 2:
            ids = np.array([3, 0, 15 if shape[0] > 15 else 1])
            assert np.array_equal(M.get_rows(w, ids), deq[0][ids])


@pytest.mark.parametrize("qt", ["Q4_K", "IQ4_K"])
def test_short_rows_of_block_types_are_multiplied_in_r4_form(qt, monkeypatch):
    """K-quant / IQK matrices of rows <= quant.matmul.SHORT_ROWS values (DeepSeek's attn_v_b in an
    IQK mixture) go to products of a few rows in their _R4 form (with VNNI), row counts a multiple
    of 4; products equal the plain kernels' within f32 rounding (2-D, per expert, per head) and
    the dequantized reference within the activations' quantization."""
    from quant import kernels as K
    from quant import matmul as M
    from quant.tensor import QTensor
    tid = type_info(qt).id
    r4 = interleaved_form(tid).id
    rng = np.random.default_rng(tid)
    for shape, short in (((16, 256), True), ((3, 8, 512), True), ((6, 256), False), ((8, M.SHORT_ROWS + 256), False)):
        x = rng.standard_normal(shape).astype(np.float32)
        raw = reference.quantize(x.reshape(-1, shape[-1]), tid)
        w = QTensor(raw.reshape(*shape[:-1], -1), tid, shape)
        assert M._view(w, few=True).qtype == (r4 if short and K.HAS_SHORT_R8 else tid), shape
        monkeypatch.setattr(M, "_SHORT_R8", {})
        plain = QTensor(raw.reshape(*shape[:-1], -1), tid, shape)
        assert M._view(plain, few=True).qtype == tid
        monkeypatch.undo()
        deq = M.dequantize(plain).reshape(-1, shape[-2], shape[-1])
        _few_row_products_agree(w, plain, deq, shape, rng, (1, 3, 20), 3e-2)


@pytest.mark.parametrize("qt", ["Q5_0", "Q6_0", "IQ4_NL"])
def test_exact_q8_0_form_holds_the_same_values(qt):
    """quant.matmul._exact_q8_0: the Q8_0 rows decode to exactly the values of the source rows
    (extreme levels included); a block whose scale is not finite leaves the rows in their type."""
    from quant import matmul as M
    from quant.tensor import QTensor
    tid, q8 = type_info(qt).id, type_info("Q8_0").id
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)          # both ends of the level range
    x[1, 32:64] = 0.0                           # a zero scale
    raw = reference.quantize(x, tid).reshape(8, -1)
    out = M._exact_q8_0(raw, tid, 128)
    assert out is not None and out.shape == (8, 4 * 34)
    assert np.array_equal(M.dequantize(QTensor(out, q8, (8, 128))), M.dequantize(QTensor(raw, tid, (8, 128))))
    bad = raw.copy()
    bad[2, :2] = np.array([np.inf], np.float16).view(np.uint8)
    assert M._exact_q8_0(bad, tid, 128) is None
