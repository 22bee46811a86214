"""RoPE tables and rotation against the formulas written out directly."""
from __future__ import annotations

import math

import numpy as np

from engine.rope import apply_rope, rope_cos_sin, yarn_corr_dims


def test_plain_rope_and_freq_factors():
    pos = np.array([0, 1, 7, 300])
    ff = np.array([1.0, 2.0, 4.0, 8.0], dtype=np.float32)   # llama3-style rope_freqs: theta / ff
    cos, sin = rope_cos_sin(pos, 8, 10000.0, 1.0, 0.0, 1.0, 2048, 32.0, 1.0, ff)
    for i in range(4):
        th = pos * 10000.0 ** (-2 * i / 8) / ff[i]
        np.testing.assert_allclose(cos[:, i], np.cos(th), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sin[:, i], np.sin(th), rtol=1e-5, atol=1e-6)


def test_yarn_ramp_and_magnitude():
    """YaRN: dims below the correction range extrapolate, above it interpolate; cos/sin scaled."""
    n, base, fs, orig = 64, 10000.0, 0.25, 4096
    lo, hi = yarn_corr_dims(n, orig, base, 32.0, 1.0)
    assert 0 <= lo < hi <= n - 1
    pos = np.array([5000])
    cos, sin = rope_cos_sin(pos, n, base, fs, 1.0, 1.0, orig, 32.0, 1.0)
    mscale = 1.0 + 0.1 * math.log(1.0 / fs)
    for i in (0, n // 2 - 1):
        ext = 5000 * base ** (-2 * i / n)
        ramp = 1 - min(1, max(0, (i - lo) / max(0.001, hi - lo)))
        th = fs * ext * (1 - ramp) + ext * ramp
        assert abs(cos[0, i] - math.cos(th) * mscale) < 1e-4
        assert abs(sin[0, i] - math.sin(th) * mscale) < 1e-4


def test_norm_and_neox_rotate_different_pairs():
    x = np.arange(8, dtype=np.float32).reshape(1, 1, 8) + 1
    cos, sin = rope_cos_sin(np.array([3]), 8, 10000.0, 1.0, 0.0, 1.0, 2048, 32.0, 1.0)
    a = apply_rope(x.copy(), cos, sin, neox=False)
    b = apply_rope(x.copy(), cos, sin, neox=True)
    c, s = cos[0], sin[0]
    v = x[0, 0]
    np.testing.assert_allclose(a[0, 0, 0:2], [v[0] * c[0] - v[1] * s[0], v[0] * s[0] + v[1] * c[0]], rtol=1e-6)
    np.testing.assert_allclose(b[0, 0, [0, 4]], [v[0] * c[0] - v[4] * s[0], v[0] * s[0] + v[4] * c[0]], rtol=1e-6)
    # rotations keep each pair's norm
    assert np.isclose(np.linalg.norm(a), np.linalg.norm(x)) and np.isclose(np.linalg.norm(b), np.linalg.norm(x))
