"""engine.flash_attn against a plain NumPy attention on the dequantized cache, both paths."""
from __future__ import annotations

import numpy as np
import pytest

from engine import flash_attn as fa
from engine import flash_lanes
from engine.flash_attn import flash_attn, use_kernel_path
from engine.kv_cache import CACHE_TYPES, RowStore

# name: (H, n_head_kv, dk, dv, latent)
LAYOUTS = {
    "gqa": (8, 2, 64, 32, False),
    "mha": (4, 4, 64, 32, False),        # one row per kv head: the kernel's remainder rows
    "latent": (16, 1, 96, 64, True),     # MLA: [c (64) | k_pe (32)], V = c
}


@pytest.fixture(autouse=True)
def f32_scores(monkeypatch):
    """q8_0 caches with f32 scores in the lanes kernel too, so every path meets the f32 reference;
    its integer scores (int8 query rows) have their own tests in test_flash_lanes."""
    monkeypatch.setattr(flash_lanes, "Q8_SCORES", False)


def reference(q, K, V, cell_pos, q_pos, scale):
    """q (T, H, dk), K (n, Hkv, dk), V (n, Hkv, dv): materialized scores, mask, softmax, @ V."""
    T, H, _ = q.shape
    G = H // K.shape[1]
    out = np.zeros((T, H, V.shape[2]))
    visible = cell_pos[None, :] <= q_pos[:, None]
    K, V = K.astype(np.float64), V.astype(np.float64)      # (mixed-type matmuls skip BLAS)
    for h in range(H):
        s = scale * (q[:, h].astype(np.float64) @ K[:, h // G].T)
        s[~visible] = -np.inf
        mx = s.max(axis=1, keepdims=True)
        mx[~np.isfinite(mx)] = 0.0
        p = np.exp(s - mx)
        den = p.sum(axis=1, keepdims=True)
        den[den == 0] = 1.0                          # a query that sees nothing gets zeros
        out[:, h] = (p / den) @ V[:, h // G]
    return out


def make_case(layout, qtype, n_kv, T, rng, cell_pos=None, q_pos=None):
    H, hkv, dk, dv, latent = LAYOUTS[layout]
    k = RowStore(n_kv + 5, hkv * dk, qtype, dk)      # rows past n_kv must be ignored; a unit per head (q8_KV)
    k.write(0, rng.standard_normal((n_kv + 5, hkv * dk), dtype=np.float32))
    v = None
    if not latent:
        v = RowStore(n_kv + 5, hkv * dv, qtype, dv)
        v.write(0, rng.standard_normal((n_kv + 5, hkv * dv), dtype=np.float32))
    K = k.read(n_kv).reshape(n_kv, hkv, dk)
    V = K[:, :, :dv] if latent else v.read(n_kv).reshape(n_kv, hkv, dv)
    if cell_pos is None:
        cell_pos = np.arange(n_kv, dtype=np.int32)
    if q_pos is None:
        q_pos = np.arange(n_kv - T, n_kv)
    q = rng.standard_normal((T, H, dk), dtype=np.float32)
    return dict(q=q, k=k, v=v, n_kv=n_kv, n_head_kv=hkv, dk=dk, dv=dv, cell_pos=cell_pos, q_pos=q_pos,
                scale=2.0 / np.sqrt(dk)), K, V


def check(case, K, V, path, rtol=1e-4):
    ref = reference(case["q"], K, V, case["cell_pos"], case["q_pos"], case["scale"])
    out = flash_attn(**case, path=path)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    return out


SCENARIOS = ["generate", "prompt", "shuffled"]


def scenario(name, layout, qtype, rng):
    if name == "generate":        # one new token sees the whole cache, last block partial
        return make_case(layout, qtype, 37, 1, rng)
    if name == "prompt":          # causal prompt of the last 300 of 700 cells: many blocks
        return make_case(layout, qtype, 700, 300, rng)
    # cells out of position order with gaps, queries anywhere, one before every cell
    n = 300
    cell_pos = (2 * rng.permutation(n) + 10).astype(np.int32)
    q_pos = np.array([5, 10, 311, 400, 700, 612, 13])
    return make_case(layout, qtype, n, len(q_pos), rng, cell_pos, q_pos)


@pytest.mark.parametrize("path", ["kernel", "blas"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("qtype", list(CACHE_TYPES))
@pytest.mark.parametrize("scen", SCENARIOS)
def test_matches_reference(scen, qtype, layout, path):
    rng = np.random.default_rng([SCENARIOS.index(scen), list(CACHE_TYPES).index(qtype), list(LAYOUTS).index(layout)])
    case, K, V = scenario(scen, layout, CACHE_TYPES[qtype], rng)
    out = check(case, K, V, path)
    if scen == "shuffled":        # q_pos 5 precedes every cell (positions >= 10)
        assert not out[0].any()


@pytest.mark.parametrize("path", ["kernel", "blas"])
def test_fully_masked_queries_give_zeros(path):
    rng = np.random.default_rng(1)
    case, K, V = make_case("gqa", CACHE_TYPES["f16"], 50, 3, rng, q_pos=np.array([-1, -1, -1]))
    out = flash_attn(**case, path=path)
    assert np.array_equal(out, np.zeros_like(out))


@pytest.mark.parametrize("layout", ["gqa", "latent"])
def test_kernel_many_splits(layout, monkeypatch):
    # short cell ranges: many split-K partial results (some empty) merged
    monkeypatch.setattr(fa, "MIN_SPLIT_CELLS", 8)
    monkeypatch.setattr(fa, "ROW_BLOCK", 8)
    rng = np.random.default_rng(2)
    for T in (1, 4):
        case, K, V = make_case(layout, CACHE_TYPES["q8_0"], 203, T, rng)
        check(case, K, V, "kernel")


@pytest.mark.parametrize("layout", ["gqa", "latent"])
def test_blas_small_tiles(layout, monkeypatch):
    # several query tiles and cell tiles, partial ones, and tiles skipped by the causal mask
    monkeypatch.setattr(fa, "CELL_TILE", 96)        # the default of `block`
    monkeypatch.setattr(fa, "Q_TILE_ROWS", 160)
    rng = np.random.default_rng(3)
    case, K, V = make_case(layout, CACHE_TYPES["q4_0"], 650, 290, rng, q_pos=np.arange(290) * 2)
    check(case, K, V, "blas")


def test_paths_agree_and_auto_choice():
    rng = np.random.default_rng(4)
    case, K, V = make_case("latent", CACHE_TYPES["bf16"], 129, 2, rng)
    a = flash_attn(**case, path="kernel")
    b = flash_attn(**case, path="blas")
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(flash_attn(**case), a if use_kernel_path(2, 16, 96, 64) else b)
    # generation with DeepSeek's 128 latent heads: kernel; prompt processing: BLAS
    assert use_kernel_path(1, 128, 576, 512) and not use_kernel_path(512, 16, 192, 128)


def test_empty_cache_and_bad_path():
    rng = np.random.default_rng(5)
    case, _, _ = make_case("gqa", CACHE_TYPES["f32"], 10, 2, rng)
    case["n_kv"] = 0
    assert not flash_attn(**case).any()
    case["n_kv"] = 10
    with pytest.raises(ValueError):
        flash_attn(**case, path="nope")


@pytest.mark.parametrize("T", [1, 400])
def test_rows_with_strided_values(T, monkeypatch):
    # decompressed MLA heads: values a strided view of the product (n, Hkv, nope + dv); a prompt
    # goes through HeadRows (head-major values, several cell tiles), a token through the kernel
    monkeypatch.setattr(fa, "CELL_TILE", 96)
    rng = np.random.default_rng(6)
    n, hkv, nope, dv = 601, 4, 24, 32
    kv = rng.standard_normal((n, hkv, nope + dv), dtype=np.float32)
    k = np.ascontiguousarray(kv[:, :, :nope].repeat(2, axis=2))          # dk 48
    v = kv[:, :, nope:]
    q = rng.standard_normal((T, 2 * hkv, 2 * nope), dtype=np.float32)
    cell_pos, q_pos = np.arange(n), np.arange(n - T, n)
    assert use_kernel_path(T, 2 * hkv, 2 * nope, dv) == (T == 1)
    out = fa.flash_attn_rows(q, k, v, cell_pos, q_pos, 0.3)
    ref = reference(q, k, np.ascontiguousarray(v), cell_pos, q_pos, 0.3)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    store = RowStore.from_f32(k.reshape(n, -1))
    with pytest.raises(ValueError):
        flash_attn(q, store, fa.HeadRows(v), n, hkv, 2 * nope, dv, cell_pos, q_pos, 0.3, path="kernel")
