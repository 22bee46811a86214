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


def _hp(scaling: str, factor: float, ext_file: float = -1.0):
    from engine.hparams import HParams
    hp = HParams(arch="deepseek2", n_vocab=8, n_ctx_train=4096, n_embd=64, n_layer=1, n_head=4, n_head_kv=4,
                 n_embd_head_k=16, n_embd_head_v=16, n_ff=32, rms_eps=1e-6, n_rot=8, rope_freq_base=10000.0,
                 rope_freq_scale=1.0 if scaling == "none" else 1.0 / factor, rope_scaling=scaling,
                 n_ctx_orig_yarn=4096, yarn_ext_factor=ext_file if ext_file >= 0 else float(scaling == "yarn"),
                 yarn_attn_factor=0.5, yarn_beta_fast=32.0, yarn_beta_slow=1.0, rope_yarn_log_mul=0.1,
                 rope_neox=False)
    hp.yarn_ext_factor_file, hp.rope_freq_scale_file = ext_file, 1.0 / factor
    return hp


def test_rope_overrides_follow_ik_context_rules():
    """--rope-* / --yarn-*: set values win; 'none' never scales; the YaRN mix follows the scaling in
    force unless the file or the flag sets it; --yarn-attn-factor multiplies the model's factor."""
    from engine.config import RopeOverrides
    from engine.hparams import override_rope
    hp = _hp("yarn", 40.0)
    override_rope(hp, RopeOverrides())                                   # nothing set: nothing moves
    assert (hp.rope_freq_scale, hp.yarn_ext_factor, hp.yarn_attn_factor) == (1 / 40, 1.0, 0.5)
    override_rope(hp, RopeOverrides(freq_base=5e4, orig_ctx=2048, attn_factor=2.0, beta_fast=16.0, beta_slow=2.0))
    assert (hp.rope_freq_base, hp.n_ctx_orig_yarn, hp.yarn_attn_factor, hp.yarn_beta_fast, hp.yarn_beta_slow) == \
        (5e4, 2048, 1.0, 16.0, 2.0)
    hp = _hp("yarn", 40.0)
    override_rope(hp, RopeOverrides(scaling="none", freq_scale=0.5))    # none: never scaled
    assert (hp.rope_scaling, hp.rope_freq_scale, hp.yarn_ext_factor) == ("none", 1.0, 0.0)
    hp = _hp("none", 4.0)
    override_rope(hp, RopeOverrides(scaling="linear"))                  # the file's factor comes back
    assert (hp.rope_freq_scale, hp.yarn_ext_factor) == (0.25, 0.0)
    hp = _hp("linear", 4.0, ext_file=0.25)
    override_rope(hp, RopeOverrides(scaling="yarn"))                    # the file's own mix wins
    assert hp.yarn_ext_factor == 0.25
    override_rope(hp, RopeOverrides(scaling="yarn", ext_factor=0.0, freq_scale=0.125))
    assert (hp.yarn_ext_factor, hp.rope_freq_scale) == (0.0, 0.125)


def test_compiled_rotation_matches_numpy_bit_for_bit():
    """apply_rope's compiled pass (serial and parallel, strided views as the architectures pass
    them) gives the NumPy reference's bytes, in both pair layouts."""
    from engine.rope import apply_rope_reference
    rng = np.random.default_rng(3)
    for T, H, n, wide in ((1, 16, 64, 64), (3, 4, 8, 12), (80, 16, 64, 192)):
        cos, sin = rope_cos_sin(np.arange(T) * 37, n, 10000.0, 1.0, 0.0, 1.0, 2048, 32.0, 1.0)
        base = (rng.standard_normal((T, H, wide)) * 10).astype(np.float32)
        for neox in (False, True):
            a, b = base.copy(), base.copy()
            apply_rope(a[..., :n], cos, sin, neox)          # a view of the first n dims, in place
            apply_rope_reference(b[..., :n], cos, sin, neox)
            assert a.tobytes() == b.tobytes()


def _tables_uncached(pos, n_dims, freq_base, freq_scale, ext_factor, attn_factor, n_ctx_orig, beta_fast,
                     beta_slow, freq_factors=None):
    """rope_cos_sin's formula with nothing kept between calls (its state before the constants
    were cached)."""
    i0 = np.arange(0, n_dims, 2, dtype=np.float64)
    inv = (freq_base ** (-2.0 / n_dims)) ** (i0 / 2)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)[: n_dims // 2]
    theta_extrap = pos.astype(np.float64)[:, None] * inv[None, :]
    theta = freq_scale * theta_extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        lo, hi = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        ramp = (1.0 - np.clip((np.floor(i0 / 2) - lo) / max(0.001, hi - lo), 0.0, 1.0)) * ext_factor
        theta = theta * (1 - ramp) + theta_extrap * ramp
        mscale = mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


def test_cached_constants_give_the_same_tables():
    """rope_cos_sin keeps each model's frequencies and YaRN ramp between calls: the tables stay
    bit for bit what the formula gives, call after call, with and without YaRN and freq factors,
    and the kept arrays cannot be written."""
    ff = np.array([1.0, 2.0, 4.0, 8.0, 1.5, 1.0, 3.0, 2.5], dtype=np.float32)
    cases = [(16, 10000.0, 1.0, 0.0, 1.0, 4096, 32.0, 1.0, None), (64, 10000.0, 0.25, 1.0, 1.2, 4096, 32.0, 1.0, None),
             (16, 500000.0, 1.0, 0.0, 1.0, 8192, 32.0, 1.0, ff), (64, 10000.0, 0.025, 1.0, 1.0, 4096, 32.0, 1.0, None)]
    for args in cases:
        for pos in (np.array([0]), np.array([3, 4, 5, 4095, 70000])):
            got, want = rope_cos_sin(pos, *args), _tables_uncached(pos, *args)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), args
    from engine.rope import _rope_consts
    inv = _rope_consts(16, 10000.0, 1.0, 0.0, 1.0, 4096, 32.0, 1.0, None)[0]
    assert not inv.flags.writeable
