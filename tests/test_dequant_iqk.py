"""IQK types (ik_llama.cpp's IQ2_K .. IQ6_K, IQ4_KS, IQ4_KSS, IQ2_KS): decoding bit for bit.

* golden data (tests/data/golden_iqk.npz, scripts/make_goldens_iqk.py): rows quantized by
  ik_llama.cpp and the values its dequantize_row_<type> gives for them; the NumPy reference
  quant.iqk.dequantize and the Numba decode_row_iqk must reproduce them exactly;
* the Numba decoder against the reference on random bytes (every bit pattern of scales,
  extra bits and quants is a valid block) with finite row / block scales, at odd byte offsets.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import iqk
from quant.kernels import F16_TO_F32
from quant.types import type_info

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_iqk.npz"
TYPES = ["IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ4_KS", "IQ4_KSS", "IQ2_KS"]
F16_D = {"IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K"}   # f16 d at byte 0 of every block


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _numba_rows(raw2d, qtype, n_per_row, offset=0, stride=None, decoder=iqk.decode_row_iqk):
    """Decode rows of raw2d with the Numba decoder, rows placed `stride` bytes apart starting
    at byte `offset` of a read-only buffer (junk bytes in between)."""
    nrows, rb = raw2d.shape
    stride = stride or rb
    buf = np.full(offset + nrows * stride, 0xA5, dtype=np.uint8)
    for r in range(nrows):
        buf[offset + r * stride:offset + r * stride + rb] = raw2d[r]
    buf.flags.writeable = False
    y = np.full((nrows, n_per_row + 8), np.nan, dtype=np.float32)
    for r in range(nrows):
        decoder(buf, np.int64(qtype), np.int64(offset + r * stride), np.int64(n_per_row), F16_TO_F32, y[r])
    assert np.isnan(y[:, n_per_row:]).all(), "decoder wrote past cols"
    return y[:, :n_per_row]


@pytest.mark.parametrize("name", TYPES)
def test_golden_reference(golden, name):
    ti = type_info(name)
    raw, want = golden[f"{name}/raw"], golden[f"{name}/y"]
    assert raw.shape[1] == ti.row_bytes(want.shape[1])
    got = iqk.dequantize(raw, ti.id, want.size, want.shape[1]).reshape(want.shape)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("name", TYPES)
def test_golden_numba(golden, name):
    ti = type_info(name)
    raw, want = golden[f"{name}/raw"], golden[f"{name}/y"]
    for offset, stride in ((0, None), (3, raw.shape[1] + 5)):   # unaligned rows, gaps between rows
        got = _numba_rows(raw, ti.id, want.shape[1], offset, stride)
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_golden_quality(golden):
    """Sanity of the golden file itself: ik's quantization error is what the type promises."""
    x = golden["x"]
    bound = {"IQ2_K": 0.45, "IQ2_KS": 0.45, "IQ3_K": 0.2, "IQ4_K": 0.2, "IQ4_KS": 0.2,
             "IQ4_KSS": 0.25, "IQ5_K": 0.15, "IQ6_K": 0.1}
    for name in TYPES:
        y = golden[f"{name}/y"]
        for r in range(x.shape[0]):
            if not x[r].any():
                assert not y[r].any()
                continue
            rel = np.sqrt(((x[r] - y[r]) ** 2).mean() / (x[r] ** 2).mean())
            if name == "IQ6_K" and r == 3:
                continue        # 6-bit grid, but d ~ 6e-8 is an f16 subnormal with 1 bit left
            assert rel < bound[name], (name, r, rel)


def _random_rows(rng, name, nrows, n_per_row):
    """Random bytes with finite scales (random bytes would give inf/NaN f16 / f32 scales)."""
    ti = type_info(name)
    raw = rng.integers(0, 256, (nrows, ti.row_bytes(n_per_row)), dtype=np.uint8)
    scales = rng.standard_normal(nrows) * np.logspace(-9, 1, nrows)   # f16 subnormals .. large
    if name in F16_D:
        blocks = raw.reshape(nrows, -1, ti.type_size)
        d = (rng.standard_normal(blocks.shape[:2]) * scales[:, None]).astype(np.float16)
        d[0, 0] = 0.0
        blocks[:, :, 0:2] = d.view(np.uint8).reshape(nrows, -1, 2)
    elif name == "IQ2_KS":
        raw[:, 0:2] = scales.astype(np.float16).view(np.uint8).reshape(nrows, 2)
    else:   # IQ4_KS, IQ4_KSS: f32 row scale
        raw[:, 0:4] = scales.astype(np.float32).view(np.uint8).reshape(nrows, 4)
    return raw


@pytest.mark.parametrize("name", TYPES)
def test_random_bytes_numba_vs_reference(name):
    rng = np.random.default_rng(type_info(name).id)
    n_per_row = 1024
    raw = _random_rows(rng, name, 6, n_per_row)
    ti = type_info(name)
    want = iqk.dequantize(raw, ti.id, raw.shape[0] * n_per_row, n_per_row).reshape(raw.shape[0], -1)
    assert np.isfinite(want).all()
    got = _numba_rows(raw, ti.id, n_per_row, offset=1, stride=raw.shape[1] + 2)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_iq6k_levels():
    """dequantize_row_iq6_k's cubic, as an FMA build computes it, is the int table to within 1/2;
    ik's matmul levels (decode_row_iqk_int6) are the int table exactly."""
    assert iqk.IQ6K_LEVELS.dtype == np.float32 and iqk.IQ6K_LEVELS.shape == (128,)
    assert np.abs(iqk.IQ6K_LEVELS - iqk.IQ6K_INT_LEVELS).max() <= 0.5
    np.testing.assert_array_equal(np.rint(iqk.IQ6K_LEVELS), iqk.IQ6K_INT_LEVELS)
    assert (iqk.IQ6K_LEVELS != iqk.IQ6K_LEVELS_NOFMA).sum() > 0   # the golden data tells them apart
    ti = type_info("IQ6_K")
    raw = _random_rows(np.random.default_rng(7), "IQ6_K", 3, 512)
    want = iqk.dequantize(raw, ti.id, 3 * 512, 512, iq6k_levels=iqk.IQ6K_INT_LEVELS).reshape(3, -1)
    got = _numba_rows(raw, ti.id, 512, decoder=iqk.decode_row_iqk_int6)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # other types decode the same through both entry points
    raw = _random_rows(np.random.default_rng(8), "IQ4_K", 2, 256)
    a = _numba_rows(raw, type_info("IQ4_K").id, 256)
    b = _numba_rows(raw, type_info("IQ4_K").id, 256, decoder=iqk.decode_row_iqk_int6)
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_is_iqk():
    for t in range(200):
        assert iqk.is_iqk(t) == (t in iqk.IQK_TYPES)
    assert iqk.IQK_TYPES == {type_info(n).id for n in TYPES + ["IQ3_KS", "IQ5_KS", "IQ2_KL"]}   # (those three: test_iqk_new)


def test_reference_partial_and_errors():
    ti = type_info("IQ4_KS")
    raw = _random_rows(np.random.default_rng(1), "IQ4_KS", 2, 512)
    full = iqk.dequantize(raw, ti.id, 1024, 512)
    np.testing.assert_array_equal(_bits(iqk.dequantize(raw, ti.id, 700, 512)), _bits(full[:700]))
    np.testing.assert_array_equal(_bits(iqk.dequantize(raw[0], ti.id, 512)), _bits(full[:512]))
    with pytest.raises(ValueError):
        iqk.dequantize(raw, type_info("Q4_0").id, 512)
    with pytest.raises(ValueError):
        iqk.dequantize(raw, ti.id, 1024, 500)
