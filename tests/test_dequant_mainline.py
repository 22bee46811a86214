"""Decoding of the mainline types Q4_1 Q5_0 Q5_1 IQ4_NL (quant.legacy) and Q2_K Q3_K Q4_K
Q5_K Q6_K IQ4_XS (quant.kquants), bit for bit against three references:

* the NumPy reference of each module (`dequantize`) vs the Numba row decoders, on random
  bytes (the f16 scale fields overwritten with finite values: zeros, subnormals, negatives)
  and on real quantized rows;
* gguf.quants.dequantize (mainline ggml's layouts, independently written);
* tests/data/golden_mainline.npz: rows quantized by ik_llama.cpp and decoded by its
  dequantize_row_* (scripts/make_goldens_mainline.py writes it).

Every comparison is of the f32 bit patterns (so -0.0 != +0.0): all products in these
decoders are exact in f32, leaving at most one rounding per value, so there is no room for
any difference.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GT

from quant import kquants, legacy
from quant.kernels import F16_TO_F32
from quant.types import type_info

GOLDEN = Path(__file__).parent / "data" / "golden_mainline.npz"

LEGACY = ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
ALL = LEGACY + KQUANTS

# byte offsets of the f16 fields (d, m / dmin) within a block
F16_FIELDS = {"Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def _module(name):
    return legacy if name in LEGACY else kquants


def _reference(name, raw, n):
    return _module(name).dequantize(raw, type_info(name).id, n)


def _decoder(name):
    return legacy.decode_row_legacy if name in LEGACY else kquants.decode_row_kquants


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _random_blocks(rng, name, nblocks):
    """Random bytes, the f16 fields set to finite values of either sign over the whole f16
    range (zeros and subnormals included)."""
    ti = type_info(name)
    raw = rng.integers(0, 256, (nblocks, ti.type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        v = rng.choice([-1.0, 1.0], nblocks) * 2.0 ** rng.uniform(-26, 15, nblocks)
        v[rng.random(nblocks) < 0.05] = 0.0
        raw[:, off:off + 2] = v.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw


def _decode_rows(name, buf, nrows, stride, cols):
    """Every row of a read-only flat buffer through the Numba decoder; y has a tail that must stay untouched."""
    buf = np.ascontiguousarray(buf).reshape(-1)
    buf.flags.writeable = False
    out = np.full((nrows, cols + 8), 7.0, dtype=np.float32)
    for r in range(nrows):
        _decoder(name)(buf, type_info(name).id, r * stride, cols, F16_TO_F32, out[r])
    assert np.all(out[:, cols:] == 7.0), "decoder wrote past cols"
    return out[:, :cols]


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", ALL)
def test_numba_matches_reference_random(name):
    """Rows of random blocks at a stride larger than a row (as in a memory-mapped tensor view)."""
    rng = np.random.default_rng(ALL.index(name))
    ti = type_info(name)
    nrows, cols = 3, 8 * 256
    rb = ti.row_bytes(cols)
    stride = rb + 2 * ti.type_size + 6
    buf = np.zeros((nrows, stride), dtype=np.uint8)
    buf[:, :rb] = _random_blocks(rng, name, nrows * (cols // ti.block_size)).reshape(nrows, rb)
    got = _decode_rows(name, buf, nrows, stride, cols)
    for r in range(nrows):
        np.testing.assert_array_equal(_bits(got[r]), _bits(_reference(name, buf[r, :rb], cols)))


@pytest.mark.parametrize("name", ALL)
def test_reference_matches_gguf(name, golden):
    rng = np.random.default_rng(100 + ALL.index(name))
    ti = type_info(name)
    raw = _random_blocks(rng, name, 64).reshape(-1)
    n = 64 * ti.block_size
    np.testing.assert_array_equal(_bits(_reference(name, raw, n)), _bits(gq.dequantize(raw, GT[name])))
    real = golden[f"{name}_raw"]
    np.testing.assert_array_equal(_bits(_reference(name, real, real.shape[0] * int(golden["n"]))),
                                  _bits(gq.dequantize(real, GT[name]).reshape(-1)))


@pytest.mark.parametrize("name", ALL)
def test_golden_ik_llama(name, golden):
    """ik_llama.cpp's quantized rows, decoded by the reference and by Numba, equal its own decoding."""
    raw, want, n = golden[f"{name}_raw"], golden[f"{name}_deq"], int(golden["n"])
    assert raw.shape == (want.shape[0], type_info(name).row_bytes(n)) and want.shape[1] == n
    for r in range(raw.shape[0]):
        np.testing.assert_array_equal(_bits(_reference(name, raw[r], n)), _bits(want[r]), err_msg=f"row {r}")
    got = _decode_rows(name, raw, raw.shape[0], raw.shape[1], n)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # the golden rows exercise what they should: a zero row, and nonzero rows
    assert not want[1].any() and all(want[r].any() for r in (0, 2, 3, 4, 5))


@pytest.mark.parametrize("name", ALL)
def test_reference_prefix_and_sizes(name):
    """dequantize(raw, t, n) decodes the first n values only, and refuses short input / ragged n."""
    ti = type_info(name)
    raw = _random_blocks(np.random.default_rng(5), name, 4).reshape(-1)
    full = _reference(name, raw, 4 * ti.block_size)
    assert full.dtype == np.float32 and full.shape == (4 * ti.block_size,)
    np.testing.assert_array_equal(_bits(_reference(name, raw, 2 * ti.block_size)), _bits(full[:2 * ti.block_size]))
    with pytest.raises(ValueError):
        _reference(name, raw, 5 * ti.block_size)
    with pytest.raises(ValueError):
        _reference(name, raw, ti.block_size + 1)


def test_iq4_tables_agree():
    np.testing.assert_array_equal(legacy.KVALUES_IQ4NL, kquants.KVALUES_IQ4NL)
    np.testing.assert_array_equal(legacy.KVALUES_IQ4NL, gq.IQ4_NL.kvalues)


def test_wrong_family_refused():
    buf = np.zeros(1024, dtype=np.uint8)
    buf.flags.writeable = False
    y = np.zeros(256, dtype=np.float32)
    with pytest.raises(ValueError):
        legacy.decode_row_legacy(buf, type_info("Q4_K").id, 0, 256, F16_TO_F32, y)
    with pytest.raises(ValueError):
        kquants.decode_row_kquants(buf, type_info("Q4_0").id, 0, 256, F16_TO_F32, y)
    with pytest.raises(ValueError):
        legacy.dequantize(buf, type_info("Q6_K").id, 256)
    with pytest.raises(ValueError):
        kquants.dequantize(buf, type_info("Q5_1").id, 256)
