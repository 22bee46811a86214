"""Quantizers of the mainline i-quants IQ3_XXS and IQ3_S (quant.iq3_quantize) against ik's bytes.

Golden data: tests/data/golden_quantize_iq3.npz (scripts/make_goldens_iq3_quantize.py: 64
weight-like rows of 1024 with edge-case groups, without and with an importance matrix) and
tests/data/golden_iquants.npz (scripts/make_goldens_iquants.py: 4 rows of 512), both written
with ik_llama.cpp's ggml_quantize_chunk.  Checked: ik's bytes super-block by super-block
(MIN_IDENTICAL: the share required), the (importance-weighted) RMSE no worse than ik's, the
round trip through quant.iquants' decoders, and the grid tables' neighbour lists.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import iq3_quantize, iquants
from quant.kernels import F16_TO_F32
from quant.types import type_info

DATA = Path(__file__).resolve().parent / "data"
TYPES = ["IQ3_XXS", "IQ3_S"]
MIN_IDENTICAL: dict[str, float] = {}          # default 1.0: every super-block identical
MAX_REL_RMSE = {"IQ3_XXS": 0.35, "IQ3_S": 0.28}  # loose bounds, weight-like rows (ik: 0.24-0.30 / 0.18-0.24)


@pytest.fixture(scope="module")
def golden():
    with np.load(DATA / "golden_quantize_iq3.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def golden_small():
    with np.load(DATA / "golden_iquants.npz") as z:
        return {k: z[k] for k in z.files}


def _decode(raw2d: np.ndarray, qtype: int, n: int) -> np.ndarray:
    return iquants.dequantize(raw2d.reshape(-1), qtype, raw2d.shape[0] * n).reshape(-1, n)


def _wrmse(x, y, w):
    w = np.ones(x.shape[-1]) if w is None else w.astype(np.float64)
    e = (x.astype(np.float64) - y) ** 2
    return float(np.sqrt((e * w).mean() / w.mean()))


def _check_against(name, x, im, ref):
    ti = type_info(name)
    ours = iq3_quantize.quantize(x, ti.id, im).reshape(ref.shape)
    a, b = ours.reshape(-1, ti.type_size), ref.reshape(-1, ti.type_size)
    same = (a == b).all(axis=1).mean()
    assert same >= MIN_IDENTICAL.get(name, 1.0), f"{name}: {same:.4f} of super-blocks identical"
    n = x.shape[1]
    r_ours, r_ik = _wrmse(x, _decode(ours, ti.id, n), im), _wrmse(x, _decode(ref, ti.id, n), im)
    assert r_ours <= r_ik * 1.001, (r_ours, r_ik)


@pytest.mark.parametrize("use_im", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_bytes_match_ik(golden, name, use_im):
    """64 rows of 1024 with edge cases (zero groups, sub-1e-8 groups, underflowing squares,
    a zero importance run that leaves IQ3_XXS on its carried-over levels)."""
    _check_against(name, golden["x"], golden["im"] if use_im else None,
                   golden[f"{name}/{'im' if use_im else 'plain'}"])


@pytest.mark.parametrize("name", TYPES)
def test_bytes_match_ik_carried_state(golden, name):
    """Rows whose first group has no winning trial scale: IQ3_XXS reuses the levels chosen
    last in the previous row, as ik does within one call."""
    _check_against(name, golden["carry_x"], golden["carry_im"], golden[f"{name}/carry"])


@pytest.mark.parametrize("use_im", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_bytes_match_ik_small(golden_small, name, use_im):
    ref = golden_small[f"{name}_raw"][:4] if use_im else golden_small[f"{name}_plain"]
    _check_against(name, golden_small["x"], golden_small["imatrix"] if use_im else None, ref)


def test_iq3_s_zero_group_shifts_later_groups(golden):
    """ik's IQ3_S writes no qs / signs for an all-zero 32-value group and does not skip their
    slots: row 3's group 2 (columns 64..95) is zero, so block 0's last qs / signs slots are 0."""
    ti = type_info("IQ3_S")
    x = golden["x"][3:4]
    blk = iq3_quantize.quantize(x, ti.id).reshape(-1, ti.type_size)[0]
    assert not blk[2 + 56:2 + 64].any() and not blk[74 + 28:74 + 32].any()
    assert blk[66 + 2] == 0 and (blk[106 + 1] & 15) == 0           # no high bits, ls 0
    assert blk[2 + 16:2 + 24].any()                                # group 3's indices, one slot early


@pytest.mark.parametrize("name", TYPES)
def test_round_trip(golden, name):
    """Our bytes decode (NumPy and Numba decoders agreeing) to values near x."""
    ti = type_info(name)
    x = golden["x"][9:17]
    n = x.shape[1]
    raw = iq3_quantize.quantize(x, ti.id).reshape(x.shape[0], -1)
    y = _decode(raw, ti.id, n)
    assert np.isfinite(y).all()
    rel = np.sqrt(((x - y) ** 2).mean(axis=1) / (x ** 2).mean(axis=1))
    assert (rel < MAX_REL_RMSE[name]).all(), rel
    buf = raw.reshape(-1)
    yn = np.empty(n, dtype=np.float32)
    for r in range(x.shape[0]):
        iquants.decode_row_iquants(buf, ti.id, r * raw.shape[1], n, F16_TO_F32, yn)
        assert np.array_equal(yn.view(np.uint32), y[r].view(np.uint32))
    # an imatrix lowers the error where it is large
    w = np.zeros(n, dtype=np.float32)
    w[:128] = 1.0
    w[128:] = 1e-4
    raw_w = iq3_quantize.quantize(x, ti.id, w).reshape(x.shape[0], -1)
    assert _wrmse(x, _decode(raw_w, ti.id, n), w) < _wrmse(x, y, w)


def test_flat_input_zero_rows_and_errors(golden_small):
    ti = type_info("IQ3_S")
    x, im = golden_small["x"], golden_small["imatrix"]
    assert np.array_equal(iq3_quantize.quantize(x.reshape(-1), ti.id, im), golden_small["IQ3_S_raw"][:4].reshape(-1))
    assert np.array_equal(iq3_quantize.quantize(x[0], ti.id), golden_small["IQ3_S_plain"][0])
    for t in TYPES:
        z = iq3_quantize.quantize(np.zeros((2, 256), np.float32), type_info(t).id)
        assert z.size == 2 * type_info(t).type_size and not z.any()
    with pytest.raises(ValueError):
        iq3_quantize.quantize(np.zeros((1, 300), np.float32), ti.id)
    with pytest.raises(ValueError):
        iq3_quantize.quantize(np.zeros((1, 512), np.float32), ti.id, np.ones(256, np.float32))
    with pytest.raises(NotImplementedError):
        iq3_quantize.quantize(np.zeros((1, 256), np.float32), type_info("IQ2_XXS").id)


@pytest.mark.parametrize("name,nwant", [("IQ3_XXS", 2), ("IQ3_S", 3)])
def test_grid_tables(name, nwant):
    """map / neigh: grid tuples map to their index; every other tuple lists exactly the grid
    points at its nwant smallest squared distances, ordered by (distance, index)."""
    lv = iq3_quantize._L_XXS if name == "IQ3_XXS" else iq3_quantize._L_S
    kmap, neigh = (iq3_quantize._MAP_XXS, iq3_quantize._NB_XXS) if name == "IQ3_XXS" else \
        (iq3_quantize._MAP_S, iq3_quantize._NB_S)
    grid = iquants.GRID_IQ3XXS if name == "IQ3_XXS" else iquants.GRID_IQ3S
    # the levels reproduce the decoder grid (IQ3_S: 2l+1; IQ3_XXS: 8l+4, 62 for l = 7)
    want = 2 * lv + 1 if name == "IQ3_S" else np.where(lv == 7, 62, 8 * lv + 4)
    assert np.array_equal(want, grid)
    codes = lv[:, 0] | lv[:, 1] << 3 | lv[:, 2] << 6 | lv[:, 3] << 9
    assert np.array_equal(kmap[codes], np.arange(len(lv)))
    assert (kmap < 0).sum() == 4096 - len(lv)
    rng = np.random.default_rng(1)
    for u in rng.choice(np.nonzero(kmap < 0)[0], 200, replace=False):
        start = -kmap[u] - 1
        ids = neigh[start + 1:start + 1 + neigh[start]]
        t = (u >> (3 * np.arange(4))) & 7
        d2 = ((2 * lv - 2 * t) ** 2).sum(axis=1)
        cut = np.unique(d2)[nwant - 1]
        expect = np.lexsort((np.arange(len(lv)), d2))
        assert np.array_equal(ids, expect[d2[expect] <= cut])
