"""Quantizers of the mainline low-bit i-quants (quant.iq12_quantize) against ik_llama.cpp's bytes.

Golden data, both written with ik's ggml_quantize_chunk:
* tests/data/golden_quantize_iq12.npz (scripts/make_goldens_iq12_quantize.py): 64 weight-like
  rows of 1024 with zero / tiny blocks and ties, and 8 rows of 512 at extreme magnitudes, with
  an importance matrix and, for IQ2_S / IQ1_M, without;
* tests/data/golden_iquants.npz (scripts/make_goldens_iquants.py): its 4 quantizer rows.
Every super-block must be ik's (MIN_IDENTICAL: the share required), the (importance-weighted)
RMSE of the decoded values no worse than ik's, and the bytes must decode (quant.iquants) close to x.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import iq12_quantize, iquants
from quant.kernels import F16_TO_F32
from quant.types import type_info

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "golden_quantize_iq12.npz"
TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
NEEDS_IM = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}
CASES = [(t, c, im) for t in TYPES for c in ("w", "s") for im in (True, False) if im or t not in NEEDS_IM]
MIN_IDENTICAL: dict[str, float] = {}          # default 1.0: every super-block identical
# importance-weighted relative RMSE of decoded weight-like rows (measured per row: IQ2_XXS
# 0.10-0.32, IQ2_XS 0.07-0.19, IQ2_S 0.08-0.21, IQ1_S 0.14-0.32, IQ1_M 0.10-0.24): loose bounds
MAX_REL_RMSE = {"IQ2_XXS": 0.4, "IQ2_XS": 0.3, "IQ2_S": 0.3, "IQ1_S": 0.4, "IQ1_M": 0.35}


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _inputs(golden, case, use_im):
    return golden[f"x_{case}"].astype(np.float32), (golden[f"im_{case}"] if use_im else None)


def _wrmse(x, y, w):
    w = np.ones(x.shape[-1]) if w is None else w.astype(np.float64)
    return float(np.sqrt(((x.astype(np.float64) - y) ** 2 * w).mean() / w.mean()))


def _decode(raw2d, qtype, n):
    return iquants.dequantize(raw2d.reshape(-1), qtype, raw2d.shape[0] * n).reshape(-1, n)


@pytest.mark.parametrize("name,case,use_im", CASES, ids=[f"{t}-{c}-{'im' if u else 'plain'}" for t, c, u in CASES])
def test_bytes_and_rmse_match_ik(golden, name, case, use_im):
    ti = type_info(name)
    x, im = _inputs(golden, case, use_im)
    ref = golden[f"{name}/{case}" + ("/im" if use_im else "")]
    ours = iq12_quantize.quantize(x, ti.id, im).reshape(ref.shape)
    same = (ours.reshape(-1, ti.type_size) == ref.reshape(-1, ti.type_size)).all(axis=1)
    assert same.mean() >= MIN_IDENTICAL.get(name, 1.0), f"{name}/{case}: {same.sum()}/{same.size} identical"
    n = x.shape[1]
    assert _wrmse(x, _decode(ours, ti.id, n), im) <= _wrmse(x, _decode(ref, ti.id, n), im) * (1 + 1e-6)


@pytest.mark.parametrize("name", TYPES)
def test_iquants_goldens(name):
    """The 4 quantizer rows of golden_iquants.npz (with its imatrix; without where ik allows)."""
    ti = type_info(name)
    with np.load(DATA / "golden_iquants.npz") as z:
        x, im, raw = z["x"], z["imatrix"], z[f"{name}_raw"][:4]
        plain = z[f"{name}_plain"] if f"{name}_plain" in z.files else None
    assert np.array_equal(iq12_quantize.quantize(x, ti.id, im).reshape(raw.shape), raw)
    if plain is not None:
        assert np.array_equal(iq12_quantize.quantize(x, ti.id).reshape(plain.shape), plain)


@pytest.mark.parametrize("name", TYPES)
def test_round_trip(golden, name):
    """Our bytes decode (NumPy and Numba decoders agreeing) to values near x."""
    ti = type_info(name)
    x = golden["x_w"].astype(np.float32)[:16]
    im = golden["im_w"]
    n = x.shape[1]
    raw = iq12_quantize.quantize(x, ti.id, im).reshape(x.shape[0], -1)
    y = _decode(raw, ti.id, n)
    assert np.isfinite(y).all()
    w = im.astype(np.float64)
    rel = np.sqrt(((x - y) ** 2 * w).mean(axis=1) / (x ** 2 * w).mean(axis=1))
    assert (rel < MAX_REL_RMSE[name]).all(), rel
    assert (rel > 0.02).all(), rel                     # 1-2 bits per value cannot be near exact
    yn = np.empty(n, dtype=np.float32)
    buf = raw.reshape(-1)
    for r in range(0, x.shape[0], 5):
        iquants.decode_row_iquants(buf, ti.id, r * raw.shape[1], n, F16_TO_F32, yn)
        assert np.array_equal(yn.view(np.uint32), y[r].view(np.uint32))


def test_requires_imatrix_and_shapes(golden):
    x, im = _inputs(golden, "s", True)
    for name in NEEDS_IM:
        with pytest.raises(ValueError, match="imatrix"):
            iq12_quantize.quantize(x, type_info(name).id)
    ti = type_info("IQ1_M")
    ref = golden["IQ1_M/s/im"]
    assert np.array_equal(iq12_quantize.quantize(x.reshape(-1), ti.id, im), ref.reshape(-1))   # flat: rows of len(im)
    assert np.array_equal(iq12_quantize.quantize(x[0], ti.id), golden["IQ1_M/s"][0])
    with pytest.raises(ValueError):
        iq12_quantize.quantize(x[:, :500], ti.id)
    with pytest.raises(ValueError):
        iq12_quantize.quantize(x, ti.id, im[:256])
    with pytest.raises(NotImplementedError):
        iq12_quantize.quantize(x, type_info("Q4_0").id)
    assert iq12_quantize.quantize(np.zeros((0, 256), np.float32), ti.id).size == 0


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S"])
def test_grid_maps(name):
    """kmap sends each grid point to its index; each off-grid pattern's neighbour list is every
    grid point at its `nwant` smallest distances, ordered by (distance, index)."""
    qt = type_info(name).id
    pos, kmap, nbrs = iq12_quantize._grid_tables(qt)
    lv = (pos.astype(np.int64) - 1) // 2
    u = (lv << (2 * np.arange(8))).sum(axis=1)
    assert np.array_equal(kmap[u], np.arange(len(pos)))
    nwant = {"IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 1, "IQ1_S": 3}[name]
    rng = np.random.default_rng(1)
    digits = rng.integers(0, 3, (300, 8))
    for d in digits:
        k = int(kmap[(d << (2 * np.arange(8))).sum()])
        if k >= 0:
            continue
        s = -k - 1
        lst = nbrs[s + 1:s + 1 + nbrs[s]]
        d2 = ((pos.astype(np.int64) - (2 * d + 1)) ** 2).sum(axis=1)
        thr = np.unique(d2)[:nwant][-1]
        want = np.lexsort((np.arange(len(d2)), d2))
        want = want[d2[want] <= thr]
        assert np.array_equal(lst, want)
