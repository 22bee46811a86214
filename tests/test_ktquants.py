"""ik_llama.cpp's trellis types IQ1_KT .. IQ4_KT (quant.ktquants) against ik's own bytes and values.

Golden data: tests/data/golden_kt.npz, written by scripts/make_goldens_kt.py with ik_llama.cpp's
ggml_quantize_chunk and dequantize_row_iq*_kt:
* decoding: random-byte rows decoded by ik; the NumPy reference and the Numba row decoder must
  give the same bits;
* quantizing: weight-like rows (with zero super-blocks, sub-blocks and groups) without and with
  an importance matrix, and rows whose importances are zero on 7 of every 8 columns (exact
  ties in the codebook search, decided by ik's lane order), and two rows on which IQ3_KT's
  row-scale search depends on which sums GCC fused: the bytes must be ik's, every row;
* round trip: the decoded values must be near x (per-row relative RMSE bounds).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import ktquants as kt
from quant.types import type_info

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_kt.npz"
TYPES = ["IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"]
# per-row RMSE / std of the decoded weight-like rows: loose bounds (ik: 0.55-0.85, 0.41-0.68,
# 0.2-0.33, 0.1-0.13)
MAX_REL_RMSE = {"IQ1_KT": 0.95, "IQ2_KT": 0.78, "IQ3_KT": 0.38, "IQ4_KT": 0.16}


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_ik(golden, name):
    ti = type_info(name)
    raw, ref = golden[f"{name}/raw"], golden[f"{name}/deq"]
    ours = kt.dequantize(raw, ti.id, ref.size, ref.shape[1]).reshape(ref.shape)
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("name", TYPES)
def test_decode_row_matches_ik(golden, name):
    ti = type_info(name)
    raw, ref = golden[f"{name}/raw"], golden[f"{name}/deq"]
    n = ref.shape[1]
    buf = np.ascontiguousarray(raw).reshape(-1)
    lut = np.zeros(1, dtype=np.float32)
    y = np.full(n + 8, np.nan, dtype=np.float32)
    ymm = np.empty(n, dtype=np.float32)
    mm = kt.dequantize(raw, ti.id, ref.size, n, matmul_scale=True).reshape(ref.shape)
    for r in range(raw.shape[0]):
        kt.decode_row_kt(buf, ti.id, r * ti.row_bytes(n), n, lut, y)
        np.testing.assert_array_equal(_bits(y[:n]), _bits(ref[r]))
        assert np.isnan(y[n:]).all()                     # writes y[:cols] only
        kt.decode_row_kt_mm(buf, ti.id, r * ti.row_bytes(n), n, lut, ymm)
        np.testing.assert_array_equal(_bits(ymm), _bits(mm[r]))
    if kt.MATMUL_SCALE[ti.id] != 1.0:
        assert not np.array_equal(mm, ref)


@pytest.mark.parametrize("case", ["q", "q/im", "qs/im", "qv"])
@pytest.mark.parametrize("name", TYPES)
def test_quantize_bytes_match_ik(golden, name, case):
    ti = type_info(name)
    src = case.split("/")[0][1:]                         # "", "s" or "v"
    x = golden["x" + src]
    im = golden["im" + src] if case.endswith("/im") else None
    ref = golden[f"{name}/{case}"]
    ours = kt.quantize(x, ti.id, im).reshape(ref.shape)
    same = (ours == ref).all(axis=1)
    assert same.all(), f"{name} {case}: rows {np.flatnonzero(~same).tolist()} differ from ik"


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_rmse(golden, name):
    ti = type_info(name)
    x = golden["x"]
    raw = kt.quantize(x, ti.id)
    y = kt.dequantize(raw, ti.id, x.size, x.shape[1]).reshape(x.shape)
    live = x.std(axis=1) > 0
    rel = np.sqrt(((x - y) ** 2).mean(axis=1))[live] / x.std(axis=1)[live]
    assert rel.max() < MAX_REL_RMSE[name], rel


def test_zero_rows_and_codebooks():
    """All-zero rows give all-zero bytes; every codebook cluster holds a multiple of 8 points,
    and every codebook point is in at least one cluster."""
    for tid in sorted(kt.TYPES):
        ti = type_info(tid)
        assert not kt.quantize(np.zeros((2, 256), np.float32), tid).any()
        for off in ((4096, 4096 + 32768) if tid == kt.IQ4_KT else (4096,)):
            cb = kt.codebook(tid, off)
            sizes = np.diff(cb.coff)
            assert (sizes % 8 == 0).all() and sizes[:-1].min() > 0
            assert np.unique(cb.cmem[:cb.coff[-2]]).size == cb.vals.shape[0]
            assert cb.cval.size == cb.g * cb.cmem.size
        assert ti.row_bytes(256) == 4 + ti.type_size


def test_trellis_levels_range():
    lv = kt.trellis_levels(np.arange(1 << 16), 8)
    assert lv.min() >= -126 and lv.max() <= 126
    assert lv.dtype == np.int32 and lv.shape == (1 << 16, 8)


def test_bad_inputs():
    with pytest.raises(ValueError):
        kt.quantize(np.zeros((1, 200), np.float32), kt.IQ2_KT)
    with pytest.raises(ValueError):
        kt.quantize(np.zeros((1, 256), np.float32), kt.IQ2_KT, np.ones(512, np.float32))
    with pytest.raises(NotImplementedError):
        kt.quantize(np.zeros((1, 256), np.float32), type_info("IQ4_K").id)
    with pytest.raises(ValueError):
        kt.dequantize(np.zeros(10, np.uint8), type_info("IQ4_K").id, 256)


@pytest.mark.parametrize("name", ["IQ2_KT", "IQ3_KT", "IQ4_KT"])
def test_get_rows_is_dequantize_row_and_matmuls_carry_the_factor(name):
    """A lookup (token embedding) gives ik's dequantize_row values; the engine's decoder (its
    matmuls' tile path) the row scale times ik's matmul factor (IQ2_KT 1.05, IQ3_KT 1.01)."""
    from quant import matmul as M
    from quant.tensor import QTensor
    t = type_info(name).id
    x = np.random.default_rng(t).standard_normal((6, 256)).astype(np.float32)
    w = QTensor.from_raw(kt.quantize(x, t, None), t, (6, 256))
    ids = np.array([4, 0, 4, 5])
    plain = kt.dequantize(w.data.reshape(-1), t, 6 * 256, 256).reshape(6, 256)
    scaled = kt.dequantize(w.data.reshape(-1), t, 6 * 256, 256, matmul_scale=True).reshape(6, 256)
    assert np.array_equal(M.get_rows(w, ids).view(np.uint32), plain[ids].view(np.uint32))
    from quant import kernels as K
    dec = np.empty((6, 256), np.float32)
    K.dequant_rows(K.readonly(w.data.reshape(-1)), K.tag(t), w.data.shape[1], np.arange(6), 256, K.QK, K.F16_TO_F32, dec)
    assert np.array_equal(dec.view(np.uint32), scaled.view(np.uint32))
    assert (kt.MATMUL_SCALE[t] == 1.0) == np.array_equal(plain, scaled)
