"""quant.kernels.exp_f32 (the vectorizable exp of the fused experts' silu) against float64 exp,
and the fused silu * up loop against NumPy's silu."""
from __future__ import annotations

import numpy as np
from numba import njit

from quant import kernels as K


@njit(cache=False)
def _exp_all(x, y):
    for i in range(x.shape[0]):
        y[i] = K.exp_f32(x[i])


def test_exp_f32_within_2_ulp_over_its_range():
    x = np.concatenate([np.linspace(-87.3, 88.0, 2_000_001, dtype=np.float32),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, 0.3465736, -0.3465736, 88.0, -87.3])])
    y = np.empty_like(x)
    _exp_all(x, y)
    ref = np.exp(x.astype(np.float64))
    ulp = np.abs(y - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert ulp.max() <= 2.0, (ulp.max(), x[ulp.argmax()])


def test_exp_f32_clamps_outside_the_f32_range():
    x = np.float32([-1e30, -200.0, -90.0, 100.0, 1e30])
    y = np.empty_like(x)
    _exp_all(x, y)
    assert np.all(np.isfinite(y)) and np.all(y >= 0)
    assert y[0] == y[1] == y[2] and y[2] < 1e-37       # e^-87.33: the smallest normal's order
    assert y[3] == y[4] and y[3] > 1e38                 # e^88


def test_fused_silu_mul_matches_numpy():
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((37, 53)) * 8).astype(np.float32)
    g[0, :6] = [-200.0, -88.5, -87.0, 0.0, 90.0, 200.0]
    u = rng.standard_normal(g.shape).astype(np.float32)
    with np.errstate(over="ignore"):
        ref = g / (np.float32(1) + np.exp(-g)) * u
    out = g.copy()
    K._silu_mul_run(3, 50, 1, 36, out, u)           # rows 1..35, columns 3..49 only
    np.testing.assert_array_equal(out[0], g[0])
    np.testing.assert_array_equal(out[:, :3], g[:, :3])
    np.testing.assert_array_equal(out[:, 50:], g[:, 50:])
    np.testing.assert_allclose(out[1:36, 3:50], ref[1:36, 3:50], rtol=2e-6, atol=1e-35)
    row = g[:1].copy()
    K._silu_mul_run(0, 6, 0, 1, row, np.ones_like(row))
    assert abs(row[0, 0]) < 1e-35 and abs(row[0, 1]) < 1e-35 and row[0, 4] == 90.0 and row[0, 5] == 200.0
