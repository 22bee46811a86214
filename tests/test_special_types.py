"""ik_llama.cpp's special types Q8_KV, Q8_KV_R8, Q8_K_R16 and BF16_R16 (quant.legacy's Q8_KV,
quant.interleaved's row-interleaved forms) against ik's bytes and values
(tests/data/golden_special.npz, from scripts/make_goldens_special.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from quant import interleaved as il
from quant import legacy, registry
from quant.kernels import F16_TO_F32, decode_rows_at, readonly, tag
from quant.types import interleaved_form, type_info

DATA = os.path.join(os.path.dirname(__file__), "data", "golden_special.npz")
NAMES = ("Q8_KV", "Q8_KV_R8", "Q8_K_R16", "BF16_R16")
R_NAMES = ("Q8_KV_R8", "Q8_K_R16", "BF16_R16")


@pytest.fixture(scope="module")
def g():
    with np.load(DATA) as f:
        return {k: f[k] for k in f.files}


def _truncated_bf16(x: np.ndarray) -> np.ndarray:
    """What BF16_R16 holds: the top 16 bits of each f32 (ik's repack_f32_bf16_r16)."""
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _values(g, name: str) -> np.ndarray:
    return _truncated_bf16(g["x"]) if name == "BF16_R16" else g[f"{name}/deq"]


def test_table_entries():
    # ggml.c type_traits: row sizes for 256 values, groups of rows, bases
    want = {"Q8_KV": (151, 8 + 256, 0, ""), "Q8_KV_R8": (398, 4 + 256, 8, "Q8_KV"),
            "Q8_K_R16": (397, 258, 16, "Q8_K"), "BF16_R16": (230, 512, 16, "BF16")}
    for name, (tid, rb, il_, base) in want.items():
        ti = type_info(name)
        assert (ti.id, ti.row_bytes(256), ti.interleave, ti.base) == (tid, rb, il_, base)
    assert interleaved_form(type_info("Q8_KV").id).name == "Q8_KV_R8"
    assert interleaved_form(type_info("Q8_K").id).name == "Q8_K_R8"      # R16 is not the default
    assert il.plain_type("Q8_K_R16") == type_info("Q8_0").id
    assert il.plain_type("Q8_KV_R8") == type_info("Q8_KV").id
    for name in NAMES:
        r = registry.traits(name)
        assert r.decodes and r.quantize is not None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("with_imatrix", [False, True])
def test_quantize_matches_ik(g, name, with_imatrix):
    """ggml_quantize_chunk's bytes; ik ignores the imatrix for all four types."""
    x = g["x"]
    im = np.linspace(0.1, 3, x.shape[1], dtype=np.float32) if with_imatrix else None
    ours = registry.traits(name).quantize(x, im).reshape(g[f"{name}/r"].shape)
    np.testing.assert_array_equal(ours, g[f"{name}/r"])


def test_q8_kv_quantize_row(g):
    """quantize_row (from_float) works per row of the last axis: the same bytes as quantize."""
    x = g["x"]
    np.testing.assert_array_equal(legacy.quantize_row(x.reshape(4, 8, -1), legacy.Q8_KV_ID),
                                  g["Q8_KV/r"].reshape(-1))


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_matches_ik(g, name):
    """The reference decoders give ik's dequantize_row_<t> bit for bit (BF16_R16, which has none
    in ik: the truncated values)."""
    x = g["x"]
    nrows, n = x.shape
    y = registry.traits(name).dequantize(g[f"{name}/r"].reshape(-1), x.size, n).reshape(nrows, n)
    np.testing.assert_array_equal(y.view(np.uint32), _values(g, name).view(np.uint32))


@pytest.mark.parametrize("name", R_NAMES)
def test_unpack_repack(g, name):
    """unpack (NumPy and Numba) and repack are inverses on ik's bytes; Q8_KV_R8 unpacks to exactly
    ik's Q8_KV rows (the quant sums the R form drops, recomputed)."""
    raw = g[f"{name}/r"]
    nrows, n = g["x"].shape
    plain = il.unpack(raw, name, nrows, n)
    np.testing.assert_array_equal(il.unpack_fast(raw, name, nrows, n), plain)
    if name == "Q8_KV_R8":
        np.testing.assert_array_equal(plain, g["Q8_KV/r"])
    if name == "Q8_K_R16":           # Q8_0 rows: nothing to repack them from; check the values
        y = legacy.dequantize(plain.reshape(-1), legacy.Q8_0_ID, nrows * n).reshape(nrows, n)
        np.testing.assert_array_equal(y, g["Q8_K_R16/deq"])
    else:
        back = il.repack(plain, type_info(name).base, nrows, n, name)
        np.testing.assert_array_equal(back, raw)


@pytest.mark.parametrize("name", NAMES)
def test_decode_rows_at_matches_ik(g, name):
    """The engine's row decoder (quant.kernels) on every row, and on a lone row of the last group."""
    raw = g[f"{name}/r"]
    nrows, n = g["x"].shape
    rb = type_info(name).row_bytes(n)
    y = np.empty((nrows, n), np.float32)
    decode_rows_at(readonly(raw.reshape(-1)), tag(type_info(name).id), 0, rb, nrows, n, 32, F16_TO_F32, y)
    want = _values(g, name)
    np.testing.assert_array_equal(y, want)
    y1 = np.empty((1, n), np.float32)
    decode_rows_at(readonly(raw.reshape(-1)), tag(type_info(name).id), (nrows - 2) * rb, rb, 1, n, 32, F16_TO_F32, y1)
    np.testing.assert_array_equal(y1[0], want[nrows - 2])


def test_row_errors():
    with pytest.raises(ValueError):
        il.repack(np.zeros((8, 2 * 30), np.uint8), "BF16", 8, 30)                 # 8 rows of BF16_R16
    with pytest.raises(ValueError):
        registry.traits("Q8_K_R16").quantize(np.zeros((8, 256), np.float32), None)  # needs 16 rows
    with pytest.raises(ValueError):
        legacy.quantize_q8_kv(np.zeros((2, 48), np.float32))


def test_matmul_unpacked_at_load(g):
    """The engine computes with the R forms through their plain rows (unpacked at load): the
    same product as the plain rows' f32 values."""
    from quant.matmul import matmul, plain_if_no_kernel
    from quant.tensor import QTensor
    x = g["x"]
    nrows, n = x.shape
    a = np.random.default_rng(3).standard_normal((3, n)).astype(np.float32)
    for name in NAMES:
        w = QTensor(g[f"{name}/r"], type_info(name).id, (nrows, n))
        p = plain_if_no_kernel(w)
        if name in R_NAMES:
            assert p.qtype == il.plain_type(name)
        v = _values(g, name).astype(np.float64)
        want = a.astype(np.float64) @ v.T
        tol = 1e-2 * (np.abs(a) @ np.abs(v).T)        # q8 activations on the Q8_0 path
        for got in (matmul(p, a), matmul(w, a)):     # unpacked here, or by matmul's view
            assert got.shape == want.shape and np.all(np.abs(got - want) <= tol)
