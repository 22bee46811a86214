"""IQ1_S_R4 / IQ1_M_R4 quantizers (quant.iq1_r4_quantize) against ik_llama.cpp's bytes.

Golden data: tests/data/golden_iq1_r4.npz (scripts/make_goldens_iq1_r4.py), ik's
ggml_quantize_chunk on 8 weight-like rows of 1024 (zero / tiny blocks and halves, importances
zero on some blocks and halves), 4 Gaussian rows of 256 (an all-zero row, a row at 1e3, ties)
and 16 rows of 512 with random zero halves, each without and with an importance matrix.
Every 32-value block of 4 rows and every group header must be ik's; the bytes must decode
(quant.interleaved's reference dequantizers) close to x.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import interleaved
from quant.iq1_r4_quantize import QUANTIZE_TYPES, quantize, row_bytes

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_iq1_r4.npz"
TYPES = {"IQ1_S_R4": 219, "IQ1_M_R4": 229}
BLOCK = {219: 24, 229: 28}                  # bytes per 32 values of a group of 4 rows
DEQUANT = {219: interleaved.dequantize_iq1_s_r4, 229: interleaved.dequantize_iq1_m_r4}
CASES = [(t, c, im) for t in TYPES for c in ("w", "g", "h") for im in (False, True)]
# relative (importance-weighted) RMSE of the decoded golden rows; ik's own values are
# 0.17-0.62 (the largest: IQ1_S_R4 on weight-like rows with 5-12x outlier columns, no imatrix)
MAX_REL = {219: 0.65, 229: 0.5}


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _rel(x, y, w):
    w = np.ones(x.shape[-1]) if w is None else w.astype(np.float64)
    return float(np.sqrt((w * (x.astype(np.float64) - y) ** 2).sum() / (w * x.astype(np.float64) ** 2).sum()))


@pytest.mark.parametrize("name,case,use_im", CASES, ids=[f"{t}-{c}-{'im' if u else 'plain'}" for t, c, u in CASES])
def test_bytes_match_ik(golden, name, case, use_im):
    qt = TYPES[name]
    x = golden[f"x_{case}"]
    im = golden[f"im_{case}"] if use_im else None
    ref = golden[f"{name}/{case}" + ("/im" if use_im else "")]
    ours = quantize(x, qt, im)
    assert ours.shape == ref.shape == (x.shape[0], row_bytes(qt, x.shape[1]))
    g_ours, g_ref = ours.reshape(x.shape[0] // 4, -1), ref.reshape(x.shape[0] // 4, -1)
    assert np.array_equal(g_ours[:, :8], g_ref[:, :8]), "row scales differ"
    same = (g_ours[:, 8:].reshape(-1, BLOCK[qt]) == g_ref[:, 8:].reshape(-1, BLOCK[qt])).all(axis=1)
    assert same.all(), f"{name}/{case}: {same.sum()}/{same.size} blocks identical"
    y = DEQUANT[qt](ours, x.shape[0], x.shape[1])
    assert _rel(x, y, im) < MAX_REL[qt]


@pytest.mark.parametrize("qt", QUANTIZE_TYPES)
def test_round_trip_and_imatrix(qt):
    """Fresh Gaussian rows decode close to x, an all-zero row to zeros (row scale 0), and the
    imatrix lowers the importance-weighted error."""
    rng = np.random.default_rng(qt)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[5] = 0
    im = np.exp(rng.uniform(-3, 3, 512)).astype(np.float32)
    raw = quantize(x, qt)
    y = DEQUANT[qt](raw, 8, 512)
    assert np.all(y[5] == 0) and raw[4:8].reshape(-1)[2:4].tobytes() == b"\0\0"   # row 5's f16 d
    keep = np.arange(8) != 5
    assert _rel(x[keep], y[keep], None) < 0.5
    y_im = DEQUANT[qt](quantize(x, qt, im), 8, 512)
    assert _rel(x[keep], y_im[keep], im) < _rel(x[keep], y[keep], im)


def test_errors():
    x = np.zeros((4, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(np.zeros((6, 64), np.float32), 219)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((4, 48), np.float32), 229)
    with pytest.raises(ValueError, match="imatrix"):
        quantize(x, 219, np.ones(32, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quantize(x.reshape(-1), 229)
    with pytest.raises(ValueError, match="IQ1_S_R4"):
        quantize(x, 29)
