"""The row-interleaved forms of the mainline i-quants, MXFP4, Q5_0 / Q6_0 and IQ5_KS
(quant.interleaved), and ik's IQ1_S_R4 / IQ1_M_R4 decoders, against ik_llama.cpp's bytes and values
(tests/data/golden_interleaved_iq.npz, from scripts/make_goldens_interleaved_iq.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from quant import interleaved as il
from quant import iquants, reference, registry
from quant.kernels import F16_TO_F32, decode_rows_at, readonly, tag
from quant.types import interleaved_form, type_info

DATA = os.path.join(os.path.dirname(__file__), "data", "golden_interleaved_iq.npz")
NAMES = [type_info(t).name for t in il.R_TYPES_IQ]
NEEDS_IMATRIX = {"IQ2_XXS_R4", "IQ2_XS_R4"}     # ik's bytes in */r were made with the imatrix


@pytest.fixture(scope="module")
def g():
    with np.load(DATA) as f:
        return {k: f[k] for k in f.files}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_table_entries():
    for name in NAMES:
        ti = type_info(name)
        base = type_info(ti.base)
        assert ti.interleave in (4, 8) and ti.id in il.R_TYPES_IQ
        assert interleaved_form(base.id) is ti
        assert (ti.block_size, ti.type_size, ti.row_meta) == (base.block_size, base.type_size, base.row_meta)
        r = registry.traits(name)
        assert r.dot == registry.DOT_UNPACK and r.decodes and il.plain_type(ti.id) == base.id


def test_sign_scramble_is_ik_sign_rule():
    """ik's decoders take the 8 signs of a group as t ^ (t << 1) of the stored 7 bits t: that
    must be ksigns_iq2xs (the 7 plain bits and their parity) of the plain sign index."""
    s = np.arange(128)
    t = (il._SCRAMBLE[2 * s] >> 1).astype(np.int64)
    np.testing.assert_array_equal((t ^ (t << 1)) & 255, iquants.sign_byte(s))
    assert np.array_equal(il._UNSCRAMBLE[il._SCRAMBLE], np.arange(256))
    np.testing.assert_array_equal(il._SCRAMBLE[1::2] & 1, 1)


@pytest.mark.parametrize("name", NAMES)
def test_repack_matches_ik(g, name):
    nrows, n = g["x"].shape
    np.testing.assert_array_equal(il.repack(g[f"{name}/plain"], type_info(name).base, nrows, n), g[f"{name}/r"])


@pytest.mark.parametrize("name", NAMES)
def test_unpack_gives_ik_plain_bytes(g, name):
    nrows, n = g["x"].shape
    np.testing.assert_array_equal(il.unpack(g[f"{name}/r"], name, nrows, n), g[f"{name}/plain"])


@pytest.mark.parametrize("name", NAMES)
def test_unpack_inverts_repack_on_any_bytes(name):
    """Random bytes use every bit of the layout (and every scrambled sign byte)."""
    ti = type_info(name)
    nrows, n = 2 * ti.interleave, 512
    raw = np.random.default_rng(ti.id).integers(0, 256, (nrows, ti.row_bytes(n)), dtype=np.uint8)
    plain = il.unpack(raw, name, nrows, n)
    np.testing.assert_array_equal(il.repack(plain, ti.base, nrows, n), raw)
    np.testing.assert_array_equal(il.unpack(il.repack(plain, ti.base, nrows, n), name, nrows, n), plain)


@pytest.mark.parametrize("key", ["r", "rand"])
@pytest.mark.parametrize("name", NAMES)
def test_dequantize_matches_ik(g, name, key):
    """ik's dequantize_row_<type>_r4/_r8 on the quantizer's rows and on random bytes (every
    field value, scales kept finite)."""
    raw = g[f"{name}/{key}"]
    want = g[f"{name}/deq"] if key == "r" else g[f"{name}/rand/deq"]
    nrows, n = want.shape
    y = reference.dequantize(raw, type_info(name).id, nrows * n, n_per_row=n)
    np.testing.assert_array_equal(_bits(y), _bits(want).reshape(-1))


@pytest.mark.parametrize("name", NAMES)
def test_unpack_group_matches_unpack(g, name):
    ti = type_info(name)
    for key, n in (("r", 512), ("rand", 256)):
        raw = g[f"{name}/{key}"]
        nrows = raw.shape[0]
        want = il.unpack(raw, name, nrows, n)
        pad = 5                                            # groups at odd byte offsets
        buf = np.concatenate([np.full(pad, 0xA5, np.uint8), raw.reshape(-1)])
        buf.flags.writeable = False
        out = np.full((ti.interleave, want.shape[1]), 0x5A, dtype=np.uint8)
        rb = ti.row_bytes(n)
        for gi in range(nrows // ti.interleave):
            il.unpack_group(buf, ti.id, pad + gi * ti.interleave * rb, n, out)
            np.testing.assert_array_equal(out, want[gi * ti.interleave:(gi + 1) * ti.interleave])
    np.testing.assert_array_equal(il.unpack_fast(g[f"{name}/r"], name, 8, 512), g[f"{name}/plain"])


@pytest.mark.parametrize("name", NAMES)
def test_decode_rows_at_matches_ik(g, name):
    """The engine's row decoder (unpack_group, then the plain type's decoder): ik's values, rows
    taken in any order (each group unpacked when first needed)."""
    ti = type_info(name)
    for key, deq in (("r", f"{name}/deq"), ("rand", f"{name}/rand/deq")):
        raw, want = g[f"{name}/{key}"], g[deq]
        nrows, n = want.shape
        rb = ti.row_bytes(n)
        y = np.full((nrows, n), np.nan, dtype=np.float32)
        decode_rows_at(readonly(raw.reshape(-1)), tag(ti.id), 0, rb, nrows, n, 32, F16_TO_F32, y)
        if name in ("Q5_0_R4", "Q6_0_R4"):       # the plain decoders' -0 (quant.interleaved._PLUS_ZERO)
            assert (y[y == 0].view(np.uint32) == 0x80000000).any()
            y += np.float32(0)
        np.testing.assert_array_equal(_bits(y), _bits(want))
        y1 = np.zeros((1, n), dtype=np.float32)
        decode_rows_at(readonly(raw.reshape(-1)), tag(ti.id), (nrows - 1) * rb, rb, 1, n, 32, F16_TO_F32, y1)
        np.testing.assert_array_equal(_bits(y1[0] + np.float32(0)), _bits(want[-1] + np.float32(0)))


@pytest.mark.parametrize("use_im", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_quantize_matches_ik(g, name, use_im):
    """ggml_quantize_chunk for the R type: the base quantizer (QHelper's weights where ik uses
    them), then repack.  Skipped while the base type has no quantizer in quant."""
    if name in NEEDS_IMATRIX:
        key, im = (f"{name}/r", g["im"]) if use_im else (None, None)
    else:
        key, im = (f"{name}/r/im", g["im"]) if use_im else (f"{name}/r", None)
    if key is None or key not in g:
        pytest.skip("no ik bytes for this case (imatrix required, or ignored by ik)")
    try:
        ours = reference.quantize(g["x"], type_info(name).id, im)
    except NotImplementedError as e:
        pytest.skip(f"base quantizer missing: {e}")
    np.testing.assert_array_equal(ours, g[key].reshape(-1))


def test_mxfp4_r8_ignores_the_imatrix(g):
    x = g["x"]
    a = reference.quantize(x, type_info("MXFP4_R8").id, None)
    b = reference.quantize(x, type_info("MXFP4_R8").id, g["im"])
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------ IQ1_S_R4 / IQ1_M_R4 (not repackings)
@pytest.mark.parametrize("key", ["r", "r/im", "rand"])
@pytest.mark.parametrize("name", ["IQ1_S_R4", "IQ1_M_R4"])
def test_iq1_r4_dequantize_matches_ik(g, name, key):
    if f"{name}/{key}" not in g:
        pytest.skip("no such golden")
    raw = g[f"{name}/{key}"]
    want = g[f"{name}/deq" if key == "r" else f"{name}/{key}/deq"]
    f = il.dequantize_iq1_s_r4 if name == "IQ1_S_R4" else il.dequantize_iq1_m_r4
    np.testing.assert_array_equal(_bits(f(raw, *want.shape)), _bits(want))


@pytest.mark.parametrize("key", ["r", "rand"])
def test_iq1_s_r4_converts_to_iq1_s_exactly(g, key):
    raw = g[f"IQ1_S_R4/{key}"]
    want = g["IQ1_S_R4/deq" if key == "r" else "IQ1_S_R4/rand/deq"]
    nrows, n = want.shape
    plain = il.iq1_s_r4_to_iq1_s(raw, nrows, n)
    assert plain.shape == (nrows, type_info("IQ1_S").row_bytes(n))
    y = reference.dequantize(plain.reshape(-1), type_info("IQ1_S").id, nrows * n)
    np.testing.assert_array_equal(_bits(y), _bits(want).reshape(-1))


@pytest.mark.parametrize("key", ["r", "rand"])
def test_iq1_m_r4_rows_decode_to_ik_values(g, key):
    """IQ1_M_R4 -> ikcli's IQ1_M_ROWS: the NumPy reference, the Numba decoder (plain id and
    kernel tag) and the file path (registry dequantize of the R bytes) give ik's values."""
    raw = g[f"IQ1_M_R4/{key}"]
    want = g["IQ1_M_R4/deq" if key == "r" else "IQ1_M_R4/rand/deq"]
    nrows, n = want.shape
    rows = il.iq1_m_r4_to_rows(raw, nrows, n)
    ti = type_info("IQ1_M_ROWS")
    assert ti.internal and rows.shape == (nrows, ti.row_bytes(n)) and il.plain_type("IQ1_M_R4") == ti.id
    np.testing.assert_array_equal(il.unpack_fast(raw, "IQ1_M_R4", nrows, n), rows)
    np.testing.assert_array_equal(_bits(iquants.dequantize(rows.reshape(-1), ti.id, nrows * n, n)),
                                  _bits(want).reshape(-1))
    for qt in (ti.id, tag(ti.id)):      # the all-types branch (as test_typetag's) and the kernel tag
        y = np.empty((nrows, n), np.float32)
        decode_rows_at(readonly(rows.reshape(-1)), qt, 0, rows.shape[1], nrows, n, 32, F16_TO_F32, y)
        np.testing.assert_array_equal(_bits(y), _bits(want))
    y = registry.traits("IQ1_M_R4").dequantize(raw.reshape(-1), nrows * n, n)
    np.testing.assert_array_equal(_bits(y), _bits(want).reshape(-1))


def test_iq1_r4_are_not_repackings():
    """No -rtr / --repack target for IQ1_S / IQ1_M (ik has none: the R4 forms are quantized)."""
    assert interleaved_form(type_info("IQ1_S").id) is None and interleaved_form(type_info("IQ1_M").id) is None
    assert type_info("IQ1_M_ROWS").id not in registry.QUANTIZE_TYPES
    assert {type_info("IQ1_S_R4").id, type_info("IQ1_M_R4").id} <= registry.QUANTIZE_TYPES


def test_iq1_r4_bad_shapes(g):
    with pytest.raises(ValueError, match="groups of 4"):
        il.dequantize_iq1_s_r4(g["IQ1_S_R4/r"][:3], 3, 512)
    with pytest.raises(ValueError, match="multiple of 32"):
        il.dequantize_iq1_m_r4(g["IQ1_M_R4/r"], 8, 500)
    with pytest.raises(ValueError, match="multiple of 256"):
        il.iq1_s_r4_to_iq1_s(g["IQ1_S_R4/r"], 8, 480)
