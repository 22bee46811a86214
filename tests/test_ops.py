"""engine.ops against float64 NumPy."""
from __future__ import annotations

import numpy as np
import pytest

from engine.ops import rms_norm


@pytest.mark.parametrize("shape", [(1, 1024), (3, 16, 128), (7, 512)])
@pytest.mark.parametrize("scaled", [True, False])
def test_rms_norm(shape, scaled):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0.0                  # an all-zero row: eps keeps it finite
    w = rng.standard_normal(shape[-1]).astype(np.float32) if scaled else None
    eps = 1e-6
    xd = x.astype(np.float64)
    ref = xd / np.sqrt(np.mean(xd * xd, axis=-1, keepdims=True) + eps) * (1.0 if w is None else w.astype(np.float64))
    y = rms_norm(x, w, eps)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.allclose(y, ref, rtol=2e-6, atol=1e-6)
    # a strided view (a slice of the last axis, as for the latent part of kv_a) gives the same
    wide = np.concatenate([x, x[..., :64]], axis=-1)
    assert np.array_equal(rms_norm(wide[..., :shape[-1]], w, eps), y)
