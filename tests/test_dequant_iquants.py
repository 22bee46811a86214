"""Decoding of the mainline i-quants (quant.iquants: IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS
IQ3_S) and MXFP4 (quant.legacy), bit for bit against:

* tests/data/golden_iquants.npz: rows quantized by ik_llama.cpp and rows of random bytes, decoded by
  its dequantize_row_* (scripts/make_goldens_iquants.py);
* gguf.quants.dequantize (mainline's layouts, written independently), on random bytes;
* the NumPy reference against the Numba row decoder (quant.kernels.decode_rows_at).

Every product in these decoders is exact in f32, so the comparisons are of bit patterns.  MXFP4's
quantizer (ik ignores an imatrix for it) must give ik's bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GT

from quant import iquants, registry
from quant.kernels import F16_TO_F32, decode_rows_at, readonly, tag
from quant.types import type_info

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # inf / nan scales on purpose

GOLDEN = np.load(Path(__file__).parent / "data" / "golden_iquants.npz")
N = int(GOLDEN["n"])
TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "MXFP4"]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _numba(name: str, raw: np.ndarray, n: int) -> np.ndarray:
    t = type_info(name)
    raw = np.ascontiguousarray(raw)
    y = np.full((raw.shape[0], n), np.nan, np.float32)
    decode_rows_at(readonly(raw.reshape(-1)), tag(t.id), 0, raw.shape[1], raw.shape[0], n, 32, F16_TO_F32, y)
    return y


@pytest.mark.parametrize("name", TYPES)
def test_decoders_match_ik(name):
    raw, deq = GOLDEN[f"{name}_raw"], GOLDEN[f"{name}_deq"]
    ref = np.stack([registry.traits(name).dequantize(r, N) for r in raw])
    assert np.array_equal(_bits(ref), _bits(deq))
    assert np.array_equal(_bits(_numba(name, raw, N)), _bits(deq))


def _random_blocks(rng: np.random.Generator, name: str, nb: int) -> np.ndarray:
    ti = type_info(name)
    raw = rng.integers(0, 256, (nb, ti.type_size), dtype=np.uint8)
    if name == "MXFP4":
        raw[:, 0] = rng.integers(0, 256, nb)          # every exponent, subnormal halves included
    elif name == "IQ1_M":
        raw[:, 55] &= 0x7F                             # keep the packed f16 finite
        raw[rng.random(nb) < 0.1, 55] |= 0x7C          # ... and a few inf / nan scales
    else:
        d = rng.choice([0.0, -1e-3, 3e-8, 0.5, 2e-5], nb).astype(np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    return raw


@pytest.mark.parametrize("name", TYPES)
def test_random_blocks_match_gguf_and_numba(name):
    if name not in GT.__members__:
        pytest.skip(f"this gguf package has no {name}")
    rng = np.random.default_rng(type_info(name).id)
    raw = _random_blocks(rng, name, 64)
    bs = type_info(name).block_size
    want = gq.dequantize(raw.reshape(-1), GT[name]).reshape(-1)
    ref = registry.traits(name).dequantize(raw.reshape(-1), 64 * bs)
    assert np.array_equal(_bits(ref), _bits(want)) or np.array_equal(np.isnan(ref), np.isnan(want)) and \
        np.array_equal(_bits(ref)[~np.isnan(ref)], _bits(want)[~np.isnan(want)])
    rows = raw.reshape(8, -1)                           # 8 rows of 8 blocks
    y = _numba(name, rows, 8 * bs).reshape(-1)
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert np.array_equal(_bits(y)[~np.isnan(y)], _bits(ref)[~np.isnan(ref)])


def test_levels_are_the_integer_form():
    """levels(): value = d / DIV * scale * level, with IQ1's delta folded in as 8 g +- 1."""
    for name in TYPES[:-1]:
        t = type_info(name).id
        raw = GOLDEN[f"{name}_raw"][0]
        d, sc, lv = iquants.levels(raw, t, N)
        lim = {16: 43, 17: 43, 22: 43, 18: 62, 21: 15, 19: 9, 29: 9}[t]
        assert np.abs(lv).max() <= lim and np.all(sc % 2 == 1) and sc.max() <= 31
        y = (np.repeat(d[:, None] * sc.astype(np.float32) / np.float32(iquants.DIV[t]), 16, 1) * lv).reshape(-1)
        assert np.array_equal(_bits(y), _bits(GOLDEN[f"{name}_deq"][0]))


def test_mxfp4_quantizer_gives_iks_bytes():
    tr = registry.traits("MXFP4")
    x = GOLDEN["x"]
    assert np.array_equal(tr.quantize(x, None).reshape(x.shape[0], -1), GOLDEN["MXFP4_plain"])
    assert np.array_equal(tr.quantize(x, GOLDEN["imatrix"]).reshape(x.shape[0], -1), GOLDEN["MXFP4_raw"][:4])
    z = tr.quantize(np.zeros((1, 64), np.float32), None)
    assert not z.any()
