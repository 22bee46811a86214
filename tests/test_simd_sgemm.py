"""quant.simd_sgemm's f32 tile kernel (the prompt attention's products where numpy's OpenBLAS has
no AVX-512 kernels) against NumPy in float64, and the prompt flash attention with it against the
same attention through BLAS."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

import quant.gemm as qg
from engine.flash_attn import flash_attn
from engine.kv_cache import RowStore
from quant.simd_sgemm import tile_sgemm, tile_sgemm_t


@njit(cache=True)
def _run(transc, A, aoff, lda, B, boff, ldb, C, coff, ldc, M, N, K, acc):
    if transc:
        tile_sgemm_t(A, aoff, lda, B, boff, ldb, C, coff, ldc, M, N, K, acc)
    else:
        tile_sgemm(A, aoff, lda, B, boff, ldb, C, coff, ldc, M, N, K, acc)


@pytest.mark.parametrize("transc", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 16, 3), (8, 32, 5), (9, 33, 17), (17, 48, 64), (24, 100, 1),
                                   (31, 15, 40), (64, 64, 0)])
def test_tile_sgemm_matches_numpy(transc, M, N, K):
    """Whole 8 x 32 blocks, single rows, a whole and a partial 16-lane vector; row strides longer
    than the rows, offsets; C's other elements untouched; accumulate adds to C."""
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    lda, ldb, pad = K + 3, -(-N // 16) * 16 + 16, 5
    A = rng.standard_normal(2 + M * lda).astype(np.float32)
    B = rng.standard_normal(1 + K * ldb).astype(np.float32)
    a = A[2:].reshape(M, lda)[:, :K].astype(np.float64)
    b = B[1:].reshape(K, ldb)[:, :N].astype(np.float64) if K else np.zeros((0, N))
    want = a @ b
    if transc:
        want, rows, cols = want.T, N, M
    else:
        rows, cols = M, N
    ldc = cols + pad
    C0 = rng.standard_normal(3 + rows * ldc).astype(np.float32)
    for acc in (False, True):
        C = C0.copy()
        _run(transc, A, 2, lda, B, 1, ldb, C, 3, ldc, M, N, K, acc)
        got = C[3:].reshape(rows, ldc)
        ref = want + (C0[3:].reshape(rows, ldc)[:, :cols] if acc else 0)
        np.testing.assert_allclose(got[:, :cols], ref, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(ref).max()))
        np.testing.assert_array_equal(got[:, cols:], C0[3:].reshape(rows, ldc)[:, cols:])
        np.testing.assert_array_equal(C[:3], C0[:3])


def test_gemm_t_and_gemm_through_the_kernel_match_blas(monkeypatch):
    """quant.gemm's batched entry points with OWN on (the kernel) and off (BLAS / numpy)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 40, 24)).astype(np.float32)
    bt = np.zeros((3, 24, 48), np.float32)
    bt[:, :, :37] = rng.standard_normal((3, 24, 37))
    out = np.empty((3, 37, 40), np.float32)
    qg.gemm_t(a, bt, out)
    want = np.einsum("gmk,gkn->gnm", a.astype(np.float64), bt[:, :, :37].astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    p = rng.standard_normal((3, 40, 300)).astype(np.float32)
    v = rng.standard_normal((300, 3, 64)).astype(np.float32).transpose(1, 0, 2)
    res = {}
    for own in (False, True):
        monkeypatch.setattr(qg, "OWN", own)
        c = np.ones((3, 40, 64), np.float32)
        res[own] = qg.gemm(p, v, c, trans_b=False, accumulate=True)
    want = 1 + np.einsum("gmk,gkn->gmn", p.astype(np.float64), v.astype(np.float64))
    for own in (False, True):
        np.testing.assert_allclose(res[own], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("n_kv,T,hkv,window", [(300, 40, 4, 0), (1000, 257, 2, 0), (700, 100, 1, 200)])
def test_prompt_flash_attention_same_with_either_kernel(monkeypatch, n_kv, T, hkv, window):
    """The prompt flash attention's BLAS path (the -mla 2/3 prompt) with quant.simd_sgemm and with
    BLAS: the same attention up to f32 rounding (cell tiles of 256, a partial last one; causal
    queries; kv heads shared by 1, 2 or 4 query heads; a sliding window)."""
    rng = np.random.default_rng(n_kv)
    H, dk, dv = 4, 48, 32
    q = rng.standard_normal((T, H, dk)).astype(np.float32)
    k = RowStore.from_f32(rng.standard_normal((n_kv, hkv * dk)).astype(np.float32))
    v = RowStore.from_f32(rng.standard_normal((n_kv, hkv * dv)).astype(np.float32))
    cell_pos = np.arange(n_kv, dtype=np.int32)
    q_pos = np.arange(n_kv - T, n_kv, dtype=np.int32)
    res = {}
    for own in (False, True):
        monkeypatch.setattr(qg, "OWN", own)
        res[own] = flash_attn(q, k, v, n_kv, hkv, dk, dv, cell_pos, q_pos, 1 / np.sqrt(dk), window=window,
                              path="blas")
    assert np.all(np.isfinite(res[True]))
    np.testing.assert_allclose(res[True], res[False], rtol=1e-4, atol=1e-5)
