"""NumPy reference quantizers of the mainline GGML types against ik_llama.cpp's bytes
(ggml_quantize_chunk without and with an importance matrix, stored by
scripts/make_goldens_quantize_mainline.py)."""
import os

import numpy as np
import pytest

from quant import reference
from quant.types import type_info

HERE = os.path.join(os.path.dirname(__file__), "data")
DATA = os.path.join(HERE, "golden_quantize_mainline.npz")
DATA_IM = os.path.join(HERE, "golden_quantize_mainline_imatrix.npz")
TYPES = ("q4_1", "q5_0", "q5_1", "q6_K", "q4_K", "q5_K")
IM_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_0", "iq4_nl",
            "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs")
# Where not every block is bit-exact: the least fraction of identical (super-)blocks.  Both are
# f32/f64 rounding-order differences of ik's -O3 -march=native build (which a*b + c GCC fuses
# into an FMA, loop by loop) deciding near-ties between equally good fits:
#   q4_K without imatrix: make_qkx2_quants' candidate choice (30/32 here, 99.6% elsewhere);
#   q2_K with imatrix: make_qkx3_quants' f64 closed-form error, exact ties between the
#   fits L, s and 3L/2, 2s/3 of sub-blocks with min 0.
MIN_IDENTICAL = {("none", "q4_K"): 0.9, ("imat", "q2_K"): 0.65}


@pytest.fixture(scope="module")
def golden():
    return np.load(DATA)


@pytest.fixture(scope="module")
def golden_im():
    return np.load(DATA_IM)


def _rmse(a, b, w=None):
    d = (np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2
    if w is not None:
        d = d * w
    return float(np.sqrt(np.mean(d)))


def reference_dequant(raw, qtype, n):
    return reference.dequantize(np.asarray(raw).reshape(-1), qtype, n)


@pytest.mark.parametrize("name", TYPES)
def test_matches_ik_bytes(golden, name):
    ti = type_info(name)
    x = golden["x"]
    ref = golden[name].reshape(-1, ti.type_size)
    ours = reference.quantize(x, ti.id).reshape(-1, ti.type_size)
    assert ours.shape == ref.shape
    same = (ours == ref).all(axis=1).mean()
    assert same >= MIN_IDENTICAL.get(("none", name), 1.0), same
    if same < 1.0:
        y_ref = reference_dequant(ref, ti.id, x.size)
        y_ours = reference_dequant(ours, ti.id, x.size)
        assert _rmse(y_ours, x.ravel()) <= _rmse(y_ref, x.ravel()) * (1 + 1e-4)


@pytest.mark.parametrize("mode", ["none", "imat"])
@pytest.mark.parametrize("name", IM_TYPES)
def test_matches_ik_bytes_weight_like(golden_im, name, mode):
    """Weight-like rows, without and with the imatrix: ik's bytes, block for block."""
    ti = type_info(name)
    x, im = golden_im["x"], golden_im["imatrix"]
    ref = golden_im[f"{mode}/{name}"].reshape(-1, ti.type_size)
    ours = reference.quantize(x, ti.id, imatrix=im if mode == "imat" else None)
    assert ours.dtype == np.uint8
    ours = ours.reshape(-1, ti.type_size)
    assert ours.shape == ref.shape
    same = (ours == ref).all(axis=1).mean()
    assert same >= MIN_IDENTICAL.get((mode, name), 1.0), same
    if same < 1.0:
        # then the error is no worse than ik's: plain and imatrix-weighted
        y_ref = reference_dequant(ref, ti.id, x.size).reshape(x.shape)
        y_ours = reference_dequant(ours, ti.id, x.size).reshape(x.shape)
        assert _rmse(y_ours, x) <= _rmse(y_ref, x) * (1 + 1e-4)
        if mode == "imat":
            assert _rmse(y_ours, x, im) <= _rmse(y_ref, x, im) * (1 + 1e-4)


@pytest.mark.parametrize("name", IM_TYPES)
def test_imatrix_lowers_weighted_error(golden_im, name):
    """The imatrix fit is no worse than ik's under the imatrix-weighted error, and (for the types
    that read it) better than quantizing without it."""
    ti = type_info(name)
    x, im = golden_im["x"], golden_im["imatrix"]
    ours = reference_dequant(reference.quantize(x, ti.id, imatrix=im), ti.id, x.size).reshape(x.shape)
    theirs = reference_dequant(golden_im[f"imat/{name}"], ti.id, x.size).reshape(x.shape)
    plain = reference_dequant(golden_im[f"none/{name}"], ti.id, x.size).reshape(x.shape)
    assert _rmse(ours, x, im) <= _rmse(theirs, x, im) * (1 + 1e-4)
    if name != "q8_0":
        assert _rmse(ours, x, im) < _rmse(plain, x, im)


def test_types_that_ignore_the_imatrix(golden_im):
    x, im = golden_im["x"], golden_im["imatrix"]
    for name in ("q8_0", "f16", "bf16", "f32"):
        qt = type_info(name).id
        assert np.array_equal(reference.quantize(x, qt, imatrix=im), reference.quantize(x, qt))


def test_imatrix_length_is_checked(golden_im):
    x = golden_im["x"]
    with pytest.raises(ValueError, match="imatrix"):
        reference.quantize(x, type_info("q4_K").id, imatrix=np.ones(x.shape[1] // 2, np.float32))
    with pytest.raises(ValueError, match="imatrix"):
        reference.quantize(x.reshape(-1), type_info("q4_0").id, imatrix=np.ones(x.shape[1], np.float32))


def test_rows_with_imatrix_are_independent(golden_im):
    """The imatrix applies to every row; a row quantizes the same alone (flat) or in a matrix."""
    x, im = golden_im["x"], golden_im["imatrix"]
    for name in ("q4_0", "q4_K", "iq4_xs"):
        ti = type_info(name)
        whole = reference.quantize(x, ti.id, imatrix=im).reshape(x.shape[0], -1)
        assert np.array_equal(reference.quantize(x[3], ti.id, imatrix=im), whole[3])


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_rmse_gaussian(golden, name):
    ti = type_info(name)
    x = np.random.default_rng(7).standard_normal((4, 2048)).astype(np.float32)
    raw = reference.quantize(x, ti.id)
    assert raw.dtype == np.uint8 and raw.size == 4 * ti.row_bytes(2048)
    err = _rmse(reference_dequant(raw, ti.id, x.size), x.ravel())
    # ik's RMSE on N(0,1) rows (quantize_row_*_ref): q4_1 .113, q5_0 .058, q5_1 .054, q4_K .068, q5_K .035, q6_K .017
    bound = {"q4_1": 0.12, "q5_0": 0.062, "q5_1": 0.058, "q4_K": 0.072, "q5_K": 0.037, "q6_K": 0.018}[name]
    assert err <= bound, err
    # and no worse than ik on the golden rows
    g = golden["x"]
    ours = _rmse(reference_dequant(reference.quantize(g, ti.id), ti.id, g.size), g.ravel())
    theirs = _rmse(reference_dequant(golden[name], ti.id, g.size), g.ravel())
    assert ours <= theirs + 1e-7


def test_flat_and_2d_inputs_agree(golden):
    x = golden["x"][:2]
    for name in ("q5_0", "q6_K", "q2_K", "iq4_nl"):
        qt = type_info(name).id
        assert np.array_equal(reference.quantize(x, qt), reference.quantize(x.reshape(-1), qt))


def test_zero_input():
    for name in TYPES + ("q2_K", "q3_K", "iq4_xs", "iq4_nl", "q6_0", "q4_0"):
        ti = type_info(name)
        for im in (None, np.ones(256, np.float32)):
            raw = reference.quantize(np.zeros(256, np.float32), ti.id, imatrix=im)
            assert raw.size == ti.row_bytes(256)
            assert np.all(reference_dequant(raw, ti.id, 256) == 0)


def test_kv_cache_row_quantizer_keeps_q6_0_ref():
    """quantize_row (from_float, the KV cache) keeps quantize_row_q6_0_ref: the block's first
    largest-magnitude element maps to level -32 exactly, unlike the chunk quantizer's fit."""
    x = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    qt = type_info("q6_0").id
    row = reference.quantize_row(x, qt)
    y = reference.dequantize(row, qt, 64)
    assert row.size == 2 * 26 and _rmse(y, x) < 0.05
    assert not np.array_equal(row, reference.quantize(x, qt))
