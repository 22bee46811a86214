"""quant.kquants_fast's Numba quantizers against the NumPy references (quant.reference /
quant.kquants, which tests/test_quantize_mainline.py holds to ik_llama.cpp's bytes) and against
ik's own bytes (the golden files): byte for byte, without and with an importance matrix."""
import os
import threading

import numpy as np
import pytest

from quant import kquants_fast as kf
from quant import reference
from quant.types import type_info

HERE = os.path.join(os.path.dirname(__file__), "data")
GOLDEN = os.path.join(HERE, "golden_quantize_mainline.npz")
GOLDEN_IM = os.path.join(HERE, "golden_quantize_mainline_imatrix.npz")

NAMES = ("q8_0", "q4_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")
IM_NAMES = ("q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")
# (mode, type) where the NumPy reference itself is not byte-exact with ik (see test_quantize_mainline):
# the least share of identical blocks
NOT_EXACT_VS_IK = {("none", "q4_K"): 0.9, ("imat", "q2_K"): 0.65}


def _blocks(raw, name):
    return np.asarray(raw).reshape(-1, type_info(name).type_size)


def _numpy_ref(x, name, im=None):
    return reference.quantize(x, type_info(name).id, imatrix=im, fast=False)


def _fast(x, name, im=None):
    return reference.quantize(x, type_info(name).id, imatrix=im, fast=True)


def weight_like(seed: int, nrows: int = 12, ncols: int = 1024):
    """Weight-like rows with the awkward cases: an all-zero super-block and sub-block, exact ties,
    heavy tails, outlier columns, a constant row, tiny and large magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((nrows, ncols)) * rng.uniform(0.005, 0.05, (nrows, 1))
    out = rng.choice(ncols, ncols // 64, replace=False)
    x[:, out] *= rng.uniform(4, 12, out.size)
    x[0, :256] = 0
    x[0, 300:316] = 0
    x[1] = np.round(x[1] * 64) / 64                      # many exact ties
    x[2] = rng.standard_t(3, ncols) * 0.02
    x[3] = 0.01                                           # constant (positive) row
    x[4] *= 1e-4                                          # f16 subnormal scales
    x[5] *= 1e3
    x[6] = np.abs(x[6])                                   # min 0
    x[7] = -np.abs(x[7])
    im = np.exp(rng.normal(0.0, 1.5, ncols)) * 1e-2
    im[out[:4]] *= 100
    im[:8] = 0                                            # unused columns
    return x.astype(np.float32), im.astype(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_same_bytes_as_numpy_reference_golden(name):
    for path in (GOLDEN, GOLDEN_IM):
        x = np.load(path)["x"]
        ref, fast = _numpy_ref(x, name), _fast(x, name)
        assert fast.dtype == np.uint8 and fast.shape == ref.shape
        assert np.array_equal(_blocks(fast, name), _blocks(ref, name))


@pytest.mark.parametrize("name", IM_NAMES)
def test_same_bytes_as_numpy_reference_golden_imatrix(name):
    g = np.load(GOLDEN_IM)
    x, im = g["x"], g["imatrix"]
    assert np.array_equal(_fast(x, name, im), _numpy_ref(x, name, im))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_same_bytes_as_numpy_reference_weight_like(name, seed):
    x, im = weight_like(seed)
    fast = _fast(x, name)
    ref = _numpy_ref(x, name)
    same = (_blocks(fast, name) == _blocks(ref, name)).all(axis=1)
    assert same.all(), np.nonzero(~same)[0][:10]
    if name in IM_NAMES:
        fast = _fast(x, name, im)
        ref = _numpy_ref(x, name, im)
        same = (_blocks(fast, name) == _blocks(ref, name)).all(axis=1)
        assert same.all(), np.nonzero(~same)[0][:10]


@pytest.mark.parametrize("name", ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"))
def test_super_block_counts_not_a_multiple_of_the_batch(name):
    """The fits run 2 or 4 super-blocks side by side; 27 and 1 super-blocks exercise the tail."""
    x, im = weight_like(4, 9, 768)                      # 27 super-blocks
    for rows in (x, x[2, :256]):
        qim = im[:rows.shape[-1]]
        assert np.array_equal(_fast(rows, name), _numpy_ref(rows, name))
        assert np.array_equal(_fast(rows, name, qim), _numpy_ref(rows, name, qim))


@pytest.mark.parametrize("mode", ["none", "imat"])
@pytest.mark.parametrize("name", IM_NAMES)
def test_ik_bytes(name, mode):
    """ik_llama.cpp's own bytes (ggml_quantize_chunk) on the weight-like golden rows."""
    g = np.load(GOLDEN_IM)
    x, im = g["x"], g["imatrix"]
    ours = _blocks(_fast(x, name, im if mode == "imat" else None), name)
    ik = _blocks(g[f"{mode}/{name}"], name)
    same = (ours == ik).all(axis=1).mean()
    assert same >= NOT_EXACT_VS_IK.get((mode, name), 1.0), same


def test_q2_k_ternary_chunk():
    """quantize_row_q2_K_ref's whole-chunk test: nearly ternary weights take the -m / 0 / m form."""
    rng = np.random.default_rng(1)
    x = (rng.integers(-1, 2, (8, 512)) * 0.05 + rng.standard_normal((8, 512)) * 0.001).astype(np.float32)
    fast = _fast(x, "q2_K")
    assert np.array_equal(fast, _numpy_ref(x, "q2_K"))
    assert np.all(_blocks(fast, "q2_K")[:, :16] == 17)


def test_iq4_level_matches_the_table_lookup():
    """The vectorizable nearest-level count against best_index_iq4nl's table + f32 test, on
    every f32 within 4096 ulps of each midpoint and each integer, outside the range, NaN."""
    from numba import njit

    from quant.kquants import KVALUES_IQ4NL, best_index_iq4nl

    @njit
    def levels(a):
        out = np.empty(a.size, np.int32)
        vals = np.empty(a.size, np.float32)
        for i in range(a.size):
            out[i], vals[i] = kf._iq4_level(a[i])
        return out, vals

    kv = KVALUES_IQ4NL.astype(np.float64)
    centres = np.concatenate([(kv[1:] + kv[:-1]) / 2, np.arange(-130, 131)]).astype(np.float32)
    steps = np.arange(-4096, 4097, dtype=np.int64)
    bits = centres.view(np.int32).astype(np.int64)
    # walk in ulps on each side of each centre (by bit patterns: negatives count the other way)
    v = (bits[:, None] + steps[None, :]).astype(np.int32).view(np.float32).reshape(-1)
    v = np.concatenate([v, np.float32([0.0, -0.0, 1e30, -1e30, np.inf, -np.inf, np.nan, 1e-40, -1e-40])])
    idx, vals = levels(v)
    with np.errstate(invalid="ignore"):                   # NaN's cast in the table lookup
        assert np.array_equal(idx, best_index_iq4nl(v))
    assert np.array_equal(vals, KVALUES_IQ4NL.astype(np.float32)[idx])


def test_f16_conversion_matches_numpy():
    """The in-kernel f32 -> f16 rounding (round to nearest even, subnormals, overflow)."""
    rng = np.random.default_rng(5)
    v = np.concatenate([
        rng.standard_normal(20000) * np.exp(rng.uniform(-25, 12, 20000)),
        [0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, -1e9, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-12,
         1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, np.inf, -np.inf],
    ]).astype(np.float32)
    ours = np.array([kf._f16_bits(np.float32(a)) for a in v], np.uint16)
    with np.errstate(over="ignore"):
        assert np.array_equal(ours, v.astype(np.float16).view(np.uint16))
    back = np.array([kf._f16_value(h) for h in ours], np.float32)
    assert np.array_equal(back, ours.view(np.float16).astype(np.float32))


def test_threads_and_flat_rows_agree():
    """Several threads at once (the kernels release the GIL) give the same bytes; a flat row is one row."""
    x, im = weight_like(9, 8, 512)
    want = {n: _fast(x, n, im if n in IM_NAMES else None) for n in ("q4_K", "q6_K")}
    got = {}

    def run(n):
        got[n] = _fast(x, n, im if n in IM_NAMES else None)
    ts = [threading.Thread(target=run, args=(n,)) for n in want]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for n in want:
        assert np.array_equal(got[n], want[n])
    row = _fast(x[3], "q5_K", im)
    assert np.array_equal(row, _fast(x, "q5_K", im).reshape(8, -1)[3])


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="multiple"):
        kf.quantize(np.zeros((2, 100), np.float32), type_info("q4_K").id)
    with pytest.raises(ValueError, match="imatrix"):
        kf.quantize(np.zeros((2, 256), np.float32), type_info("q6_K").id, np.ones(128, np.float32))


def test_large_inputs_take_the_fast_path(monkeypatch):
    """reference.quantize sends inputs of FAST_MIN_VALUES or more to the Numba kernels."""
    calls = []
    real = kf.quantize
    monkeypatch.setattr(kf, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = np.random.default_rng(0).standard_normal(reference.FAST_MIN_VALUES).astype(np.float32)
    reference.quantize(x.reshape(-1, 256), type_info("q8_0").id)
    reference.quantize(x[:256], type_info("q8_0").id)
    assert len(calls) == 1
