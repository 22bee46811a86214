"""Quantizers of ik_llama.cpp's IQK types (quant.iqk_quantize) against ik's own bytes.

Golden data: tests/data/golden_quantize_iqk.npz, written by scripts/make_goldens_quantize_iqk.py
with ik_llama.cpp's ggml_quantize_chunk (weight-like rows of 512, 1024 and 2048, without and
with an importance matrix).  For every type and case:
* the bytes must be ik's, super-block by super-block (MIN_IDENTICAL: the fraction required);
* the (importance-weighted) RMSE of the decoded values must be within 0.5% of ik's;
* the bytes must decode (quant.iqk, NumPy and Numba decoders agreeing) to values near x.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from quant import iqk, iqk_quantize, reference
from quant.kernels import F16_TO_F32
from quant.types import type_info

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_quantize_iqk.npz"
TYPES = [t for t in ["IQ4_K", "IQ2_K", "IQ3_K", "IQ5_K", "IQ6_K", "IQ4_KS", "IQ4_KSS", "IQ2_KS"]
         if type_info(t).id in iqk_quantize.QUANTIZE_TYPES]
SHAPES = (512, 1024, 2048)
MIN_IDENTICAL: dict[str, float] = {}          # default 1.0: every super-block identical
# relative RMSE of a decoded Gaussian-like row, loose upper bounds (ik: 0.02 .. 0.3)
MAX_REL_RMSE = {"IQ2_K": 0.45, "IQ2_KS": 0.5, "IQ3_K": 0.25, "IQ4_K": 0.12, "IQ4_KS": 0.15,
                "IQ4_KSS": 0.2, "IQ5_K": 0.06, "IQ6_K": 0.03}


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _case(golden, name, n, use_im):
    x, im = golden[f"x{n}"], golden[f"im{n}"]
    ref = golden[f"{name}/{n}" + ("/im" if use_im else "")]
    return x, (im if use_im else None), ref


def _decode(raw2d, qtype, n):
    return iqk.dequantize(raw2d.reshape(-1), qtype, raw2d.shape[0] * n, n).reshape(-1, n)


def _wrmse(x, y, w):
    w = np.ones(x.shape[-1]) if w is None else w.astype(np.float64)
    e = (x.astype(np.float64) - y) ** 2
    return float(np.sqrt((e * w).mean() / w.mean()))


@pytest.mark.parametrize("use_im", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("n", SHAPES)
@pytest.mark.parametrize("name", TYPES)
def test_bytes_and_rmse_match_ik(golden, name, n, use_im):
    ti = type_info(name)
    x, im, ref = _case(golden, name, n, use_im)
    ours = iqk_quantize.quantize(x, ti.id, im).reshape(ref.shape)
    if ti.row_meta:                            # the row scale (IQ4_KS, IQ4_KSS, IQ2_KS)
        assert (ours[:, :ti.row_meta] == ref[:, :ti.row_meta]).all(axis=1).mean() >= MIN_IDENTICAL.get(name, 1.0)
    a = ours[:, ti.row_meta:].reshape(-1, ti.type_size)
    b = ref[:, ti.row_meta:].reshape(-1, ti.type_size)
    same = (a == b).all(axis=1).mean()
    assert same >= MIN_IDENTICAL.get(name, 1.0), f"{name}: {same:.4f} of super-blocks identical"
    # RMSE (importance-weighted with an imatrix) no worse than ik's by more than 0.5 %
    r_ours = _wrmse(x, _decode(ours, ti.id, n), im)
    r_ik = _wrmse(x, _decode(ref, ti.id, n), im)
    assert r_ours <= r_ik * 1.005, (r_ours, r_ik)


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_decoders(golden, name):
    """Our bytes decode through both existing decoders to the same values, close to x."""
    ti = type_info(name)
    n = 1024
    x = golden[f"x{n}"]
    raw = iqk_quantize.quantize(x, ti.id).reshape(x.shape[0], -1)
    y = _decode(raw, ti.id, n)
    assert np.isfinite(y).all()
    rel = np.sqrt(((x - y) ** 2).mean(axis=1) / (x ** 2).mean(axis=1))
    assert (rel < MAX_REL_RMSE[name]).all(), rel
    buf = raw.reshape(-1)
    yn = np.empty(n, dtype=np.float32)
    for r in range(x.shape[0]):
        iqk.decode_row_iqk(buf, ti.id, r * raw.shape[1], n, F16_TO_F32, yn)
        assert np.array_equal(yn.view(np.uint32), y[r].view(np.uint32))


def test_flat_input_and_reference_dispatch(golden):
    """A flat array is one row (rows of len(imatrix) with one); quant.reference.quantize
    hands the IQK types to this module."""
    ti = type_info("IQ4_K")
    x, im, ref = _case(golden, "IQ4_K", 512, True)
    assert np.array_equal(iqk_quantize.quantize(x.reshape(-1), ti.id, im), ref.reshape(-1))
    assert np.array_equal(iqk_quantize.quantize(x[0], ti.id), _case(golden, "IQ4_K", 512, False)[2][0])
    if "imatrix" in inspect.signature(reference.quantize).parameters:
        assert np.array_equal(reference.quantize(x, ti.id, imatrix=im), ref.reshape(-1))
    assert np.array_equal(reference.quantize(x[:1], ti.id), _case(golden, "IQ4_K", 512, False)[2][0])


def test_best_index_is_nearest_level():
    """The lookup-table nearest-level search equals a plain nearest search (ties to the upper
    level, distances compared in f32) on both IQ4_K level sets, around every midpoint."""
    for off in (0, 16):
        v = iqk_quantize.LV4[off:off + 16]
        mids = (v[1:] + v[:-1]) / np.float32(2)
        xs = [np.linspace(-140, 140, 4001, dtype=np.float32), mids,
              np.nextafter(mids, np.float32(-1e9)), np.nextafter(mids, np.float32(1e9)),
              np.arange(-130, 130, dtype=np.float32) + np.float32(0.999)]
        for x in np.concatenate(xs).astype(np.float32):
            k = int(np.searchsorted(v, x, side="right")) - 1
            if k < 0:
                want = 0
            elif k >= 15:
                want = 15
            else:
                want = k if np.float32(x - v[k]) < np.float32(v[k + 1] - x) else k + 1
            assert iqk_quantize._bi(4, off, np.float32(x)) == want, (off, x)


@pytest.mark.parametrize("lset", [3, 4, 5, 6])
def test_lane_pick_equals_best_index(lset):
    """The searches' vectorized level pick (thresholds; _pick_lanes) gives ik's best index
    (_bi) at and around every threshold, on random values and at the range edges, for both
    halves of every level set.  (Checked offline on every f32; this samples.)"""
    tp, _, xbig = iqk_quantize._lthr(lset)
    n = tp.size // 2
    idx = np.tile(np.arange(1, n + 1, dtype=np.float32), 2)
    rng = np.random.default_rng(lset)
    for h in range(2):
        t = tp[h * n:h * n + n - 1]
        pts = [t, np.nextafter(t, np.float32(-np.inf)), np.nextafter(t, np.float32(np.inf)), t - 1, t + 1,
               rng.uniform(-300, 300, 2000).astype(np.float32), rng.standard_normal(500).astype(np.float32),
               np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 2.0 ** 31, -2.0 ** 31, 3e9, -3e9, 1e-30], np.float32),
               np.array([xbig[h], np.nextafter(xbig[h], np.float32(0))], np.float32)]
        xs = np.concatenate(pts).astype(np.float32)
        al = np.empty(xs.size, np.float32)
        got = np.empty(xs.size, np.float32)
        iqk_quantize._pick_lanes(xs, h, n, tp, idx, np.float32(0), xbig[h], np.ones(1, np.float32), al, got)
        want = np.array([iqk_quantize._bi(lset, h * n, x) for x in xs])
        bad = np.flatnonzero(got.astype(np.int64) != want)
        assert bad.size == 0, (h, xs[bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("bad", ["len", "imatrix", "type"])
def test_bad_input_one_line_errors(bad):
    x = np.zeros((2, 512), dtype=np.float32)
    if bad == "len":
        with pytest.raises(ValueError, match="multiple of 256"):
            iqk_quantize.quantize(np.zeros((2, 300), np.float32), type_info("IQ4_K").id)
    elif bad == "imatrix":
        with pytest.raises(ValueError, match="imatrix"):
            iqk_quantize.quantize(x, type_info("IQ4_K").id, np.ones(256, np.float32))
    else:
        with pytest.raises(NotImplementedError, match="Q8_0"):
            iqk_quantize.quantize(x, type_info("Q8_0").id)
