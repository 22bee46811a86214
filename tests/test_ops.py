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


def test_weighted_row_sums_matches_slot_by_slot_numpy():
    """engine.ops.weighted_row_sums (the MoE expert sum) against the NumPy it replaced:
    rows scaled by their weights, then added slot by slot from zeros; bitwise equal, with
    dropped slots (-1, as -ser leaves them)."""
    from engine.ops import weighted_row_sums
    rng = np.random.default_rng(3)
    T, S, C = 37, 6, 300
    idx = rng.permutation(T * S).reshape(T, S).astype(np.int64)
    idx[rng.random((T, S)) < 0.2] = -1
    y = rng.standard_normal((T * S, C)).astype(np.float32)
    w = rng.random((T, S)).astype(np.float32)
    ref = np.zeros((T, C), np.float32)
    ys = y.copy()
    for t in range(T):
        for j in range(S):
            if idx[t, j] >= 0:
                ys[idx[t, j]] *= w[t, j]
    for j in range(S):
        k = idx[:, j]
        m = k >= 0
        ref[m] += ys[k[m]]
    assert np.array_equal(weighted_row_sums(y, w, idx), ref)


def test_parallel_row_gather_and_scatter():
    from quant import kernels as K
    rng = np.random.default_rng(4)
    for dt in (np.int8, np.int32, np.float32):
        a = (rng.standard_normal((50, 70)) * 50).astype(dt)
        rows = rng.integers(0, 50, 120)
        out = np.empty((120, 70), dt)
        K.gather_rows(a, rows, out)
        assert np.array_equal(out, a[rows])
    src = rng.standard_normal((40, 9)).astype(np.float32)
    perm = rng.permutation(60)[:40]
    out = np.zeros((60, 9), np.float32)
    K.scatter_rows(src, perm, out)
    ref = np.zeros((60, 9), np.float32)
    ref[perm] = src
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("first", [0, 3, 128])
def test_heads_with_shared_equals_numpy(first):
    """DeepSeek's decompressed keys: each head's first values of x (a strided view too), then the
    row's shared values."""
    from engine.ops import heads_with_shared
    rng = np.random.default_rng(first)
    x = rng.standard_normal((37, 5, 256)).astype(np.float32)
    shared = rng.standard_normal((37, 64)).astype(np.float32)
    for xv in (x, x[:, :, 1:]):
        got = heads_with_shared(xv, first, shared)
        want = np.concatenate([xv[:, :, :first], np.broadcast_to(shared[:, None, :], (37, 5, 64))], axis=2)
        assert got.shape == (37, 5, first + 64) and np.array_equal(got, want)


def test_f16_cache_rows_read_as_numpy_converts_them():
    """RowStore.read of an F16 store (the compiled decoder, not NumPy's scalar f16 copy): the same
    f32 values, from any first row."""
    from engine.kv_cache import RowStore
    from quant.types import F16
    rng = np.random.default_rng(2)
    rs = RowStore(40, 96, F16)
    vals = (rng.standard_normal((40, 96)) * 1e3).astype(np.float16)
    vals[0, :6] = [np.inf, -np.inf, 6.1e-5, -0.0, 3e-6, -6e-8]      # and two subnormals
    rs.data[:] = vals.view(np.uint8).reshape(40, -1)
    for first, n in ((0, 40), (7, 20), (39, 1)):
        got = rs.read(n, first=first)
        assert np.array_equal(got.view(np.uint32), vals[first:first + n].astype(np.float32).view(np.uint32))
