"""ik_llama.cpp's newer IQK types IQ3_KS, IQ5_KS, IQ2_KL: decoders and quantizers against ik.

Golden data: tests/data/golden_iqk_new.npz (scripts/make_goldens_iqk_new.py, from ik's libggml):
* random-byte rows (finite row scales) and what ik's dequantize_row_<type> makes of them: the
  NumPy reference (quant.iqk.dequantize, also through the registry) and the Numba decoder
  (quant.kernels.decode_rows_at, rows at odd offsets with junk between) must give the same bits;
* weight-like rows (with an all-zero super-block, sub-block and row) quantized by
  ggml_quantize_chunk without and with an importance matrix: quant.iqk_quantize must write the
  same bytes (MIN_IDENTICAL: the share of rows required; all of them today), and its
  (importance-weighted) RMSE must be no worse than ik's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import iqk, iqk_quantize, registry
from quant.kernels import F16_TO_F32, decode_rows_at, tag
from quant.types import type_info

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_iqk_new.npz"
TYPES = ["IQ3_KS", "IQ5_KS", "IQ2_KL"]
MIN_IDENTICAL: dict[str, float] = {}           # default 1.0: every row identical to ik's
MAX_REL_RMSE = {"IQ3_KS": 0.32, "IQ5_KS": 0.08, "IQ2_KL": 0.35}   # loose (ik: <= 0.29, 0.063, 0.30)


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _numba(raw2d, qtype, n, offset=0, gap=0):
    """decode_rows_at over rows placed row_bytes + gap apart from byte `offset` (junk between)."""
    nrows, rb = raw2d.shape
    stride = rb + gap
    buf = np.full(offset + nrows * stride, 0xA5, dtype=np.uint8)
    for r in range(nrows):
        buf[offset + r * stride:offset + r * stride + rb] = raw2d[r]
    buf.flags.writeable = False
    y = np.full((nrows, n + 8), np.nan, dtype=np.float32)
    decode_rows_at(buf, tag(qtype), offset, stride, nrows, n, 256, F16_TO_F32, y)
    assert np.isnan(y[:, n:]).all(), "decoder wrote past cols"
    return y[:, :n]


def _wrmse(x, y, w):
    w = np.ones(x.shape[-1]) if w is None else w.astype(np.float64)
    return float(np.sqrt(((x.astype(np.float64) - y) ** 2 * w).mean() / w.mean()))


def test_family_membership():
    for name in TYPES:
        t = type_info(name).id
        assert t in iqk.TYPES and t in iqk_quantize.QUANTIZE_TYPES and iqk.is_iqk(t)
        r = registry.traits(name)
        assert r.family == "iqk" and r.decodes and r.quantize is not None


@pytest.mark.parametrize("name", TYPES)
def test_decode_matches_ik(golden, name):
    ti = type_info(name)
    raw, want = golden[f"{name}/raw"], golden[f"{name}/y"]
    n = want.shape[1]
    assert raw.shape[1] == ti.row_bytes(n)
    got = iqk.dequantize(raw, ti.id, want.size, n).reshape(want.shape)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    via_registry = registry.traits(name).dequantize(raw.reshape(-1), want.size, n).reshape(want.shape)
    np.testing.assert_array_equal(_bits(via_registry), _bits(want))
    for offset, gap in ((0, 0), (3, 5)):
        np.testing.assert_array_equal(_bits(_numba(raw, ti.id, n, offset, gap)), _bits(want))


@pytest.mark.parametrize("use_im", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_quantize_matches_ik(golden, name, use_im):
    ti = type_info(name)
    x = golden["x"]
    im = golden["im"] if use_im else None
    ref = golden[f"{name}/q" + ("/im" if use_im else "")]
    ours = iqk_quantize.quantize(x, ti.id, im).reshape(ref.shape)
    same = (ours == ref).all(axis=1).mean()
    assert same >= MIN_IDENTICAL.get(name, 1.0), f"{name}: {same:.4f} of rows identical"
    n = x.shape[1]
    y_ours = iqk.dequantize(ours.reshape(-1), ti.id, x.size, n).reshape(x.shape)
    y_ik = iqk.dequantize(ref.reshape(-1), ti.id, x.size, n).reshape(x.shape)
    assert _wrmse(x, y_ours, im) <= _wrmse(x, y_ik, im) * (1 + 1e-6)
    # the all-zero row: IQ3_KS stores the row scale -0 (-max_scale / 16 of max_scale 0)
    assert not y_ours[5].any() and (ours[5, ti.row_meta:] == 0).all()
    if name == "IQ3_KS":
        assert ours[5, :2].tolist() == [0x00, 0x80]


@pytest.mark.parametrize("name", TYPES)
def test_round_trip(golden, name):
    """Our bytes decode (NumPy and Numba the same) to values near x, row by row."""
    ti = type_info(name)
    x = golden["x"][:8]
    n = x.shape[1]
    raw = iqk_quantize.quantize(x, ti.id).reshape(x.shape[0], -1)
    y = iqk.dequantize(raw.reshape(-1), ti.id, x.size, n).reshape(x.shape)
    np.testing.assert_array_equal(_bits(_numba(raw, ti.id, n)), _bits(y))
    for r in range(x.shape[0]):
        if x[r].any():
            rel = np.sqrt(((x[r] - y[r]) ** 2).mean() / (x[r] ** 2).mean())
            assert rel < MAX_REL_RMSE[name], (r, rel)


def test_iq2kl_grid():
    """IQ2_KL's 32 level pairs are pairs of IQ3_K's first-table levels, each once, and the
    quantizer's pair index (k_index) points at the pair it names."""
    pairs = {tuple(p) for p in iqk.IQ2KL_PAIRS.tolist()}
    assert len(pairs) == 32 and all(a in iqk.IQ3NL[:8] and b in iqk.IQ3NL[:8] for a, b in pairs)
    k = iqk_quantize.KL_INDEX
    assert sorted(k[k >= 0].tolist()) == list(range(32)) and sorted((-k[k < 0] - 1).tolist()) == list(range(32))
    for a in range(8):
        for b in range(8):
            i = k[8 * a + b]
            if i >= 0:
                assert tuple(iqk.IQ2KL_PAIRS[i]) == (iqk.IQ3NL[a], iqk.IQ3NL[b])
