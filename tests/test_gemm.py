"""quant.gemm (BLAS called from numba's pool) against NumPy's matmul, and the tile path that uses it."""
from __future__ import annotations

import numpy as np
import pytest

from quant import gemm as G
from quant import kernels as K
from quant import matmul as Q
from quant.types import F16, Q4_0, Q8_0

needs_blas = pytest.mark.skipif(not G.available(), reason="numpy's BLAS has no callable CBLAS sgemm")


@pytest.fixture
def pool_always(monkeypatch):
    """Every product through the pool, however small (gemm() keeps small ones on numpy)."""
    monkeypatch.setattr(G, "SMALL_WORK", 0)


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max() + 1))


@needs_blas
@pytest.mark.parametrize("M,N,Kd", [(1, 1, 1), (3, 70, 33), (64, 257, 96), (5, 16, 0)])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_2d_matches_numpy(M, N, Kd, trans_b, accumulate, pool_always):
    rng = np.random.default_rng(M * 1000 + N)
    a = rng.standard_normal((M, Kd), dtype=np.float32)
    b = rng.standard_normal((N, Kd) if trans_b else (Kd, N), dtype=np.float32)
    out = rng.standard_normal((M, N), dtype=np.float32)
    ref = (out.copy() if accumulate else 0) + a @ (b.T if trans_b else b)
    r = G.gemm(a, b, out, trans_b=trans_b, accumulate=accumulate)
    assert r is out
    _close(out, ref)


@needs_blas
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("rows", [9, 1])
def test_gemm_batched_strided_views(trans_b, rows, pool_always):
    """The operands flash attention passes: heads taken out of (cells, heads, d) tiles by
    transposed views, rows spaced by the other heads' values (one row: the sgemv form)."""
    rng = np.random.default_rng(7)
    H, cells, d = 5, 40, 24
    q = rng.standard_normal((H, rows, d), dtype=np.float32)
    kf = rng.standard_normal((cells, H, 2 * d), dtype=np.float32)[:, :, :d]     # spaced rows
    s = rng.standard_normal((H, rows, cells), dtype=np.float32)
    if trans_b:
        b = kf.transpose(1, 0, 2)                               # (H, cells, d)
        out = np.empty((H, rows, cells), dtype=np.float32)
        G.gemm(q, b, out)
        _close(out, np.matmul(q, kf.transpose(1, 2, 0)))
    else:
        b = kf.transpose(1, 0, 2)                               # (H, cells, d) as the V side
        acc = rng.standard_normal((H, rows, d), dtype=np.float32)
        ref = acc + np.matmul(s, b)
        G.gemm(s, b, acc, trans_b=False, accumulate=True)
        _close(acc, ref)


@needs_blas
def test_gemm_out_view_and_single_rows(pool_always):
    """out as a column slice of a wider array (rows spaced), and size-1 axes with odd strides."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((1, 50), dtype=np.float32)
    b = rng.standard_normal((30, 50), dtype=np.float32)
    wide = np.zeros((1, 64), dtype=np.float32)
    G.gemm(a[:, :], b, wide[:, 10:40])
    _close(wide[:, 10:40], a @ b.T)
    assert not wide[:, :10].any() and not wide[:, 40:].any()
    a2 = rng.standard_normal((3, 50), dtype=np.float32)      # pool path: more than one row
    wide2 = np.zeros((3, 64), dtype=np.float32)
    G.gemm(a2, b, wide2[:, 10:40])
    _close(wide2[:, 10:40], a2 @ b.T)
    assert not wide2[:, :10].any() and not wide2[:, 40:].any()
    b1 = rng.standard_normal((1, 50), dtype=np.float32)       # one weight row (N = 1)
    o1 = np.empty((3, 1), dtype=np.float32)
    G.gemm(a2, b1, o1)
    _close(o1, a2 @ b1.T)
    a3 = rng.standard_normal((2, 1, 50), dtype=np.float32)[:, :, :]
    out = np.empty((2, 1, 30), dtype=np.float32)
    G.gemm(a3, np.broadcast_to(b, (2, 30, 50)), out)
    _close(out, a3 @ b.T)


@needs_blas
def test_every_layout_runs_through_one_compiled_form(pool_always):
    """C-contiguous, strided, read-only and broadcast operands: one compiled form of the batched
    loop for all of them (quant.fnptr.one_form), each product still numpy's."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 4, 40), dtype=np.float32)
    b = rng.standard_normal((3, 24, 40), dtype=np.float32)
    ro = b.copy()
    ro.flags.writeable = False
    wide = np.zeros((3, 4, 64), dtype=np.float32)
    cases = [(a, b, np.empty((3, 4, 24), np.float32)),
             (a[:, :, :32], b[:, :, :32], np.empty((3, 4, 24), np.float32)),
             (a, ro, wide[:, :, 8:32]),
             (a[:, :1], np.broadcast_to(b[0], (3, 24, 40)), np.empty((3, 1, 24), np.float32))]
    for x, w, out in cases:
        G.gemm(x, w, out)
        _close(out, np.matmul(x, np.swapaxes(w, -1, -2)))
    assert list(G._gemm_batched.overloads) == [G._BATCHED_SIG]
    # an output that form cannot take (misaligned) goes to numpy's matmul
    odd = np.frombuffer(bytearray(4 * 96 + 1), dtype=np.float32, offset=1, count=96).reshape(1, 4, 24)
    assert not odd.flags.aligned
    G.gemm(a[:1], b[:1], odd)
    _close(odd, np.matmul(a[:1], np.swapaxes(b[:1], -1, -2)))


def test_read_only_and_writable_weights_share_one_row_decoder():
    """rows_address types the weight bytes read-only either way (a mapped file's tensors and a
    quantized cache or freshly quantized rows): one compiled decoder and address for both."""
    rng = np.random.default_rng(4)
    w = Q.quantize_tensor(rng.standard_normal((8, 64), dtype=np.float32), Q8_0)
    v = Q._view(w)
    wr = np.array(v.buf)                      # a writable copy of the same bytes
    ro = wr.copy()
    ro.flags.writeable = False
    assert K.rows_address(v.tag, wr, K.F16_TO_F32) == K.rows_address(v.tag, ro, K.F16_TO_F32)
    outs = []
    for buf in (wr, ro):
        out = np.empty((8, 64), np.float32)
        K.dequant_rows(buf, v.tag, v.stride, np.arange(8), 64, 32, K.F16_TO_F32, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], Q.dequantize(w))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_gemm_small_products_stay_on_numpy_and_agree():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1, 1024), dtype=np.float32)
    b = rng.standard_normal((64, 1024), dtype=np.float32)
    assert a.shape[0] * b.shape[0] * a.shape[1] < G.SMALL_WORK
    out = np.empty((1, 64), dtype=np.float32)
    _close(G.gemm(a, b, out), a @ b.T)


def test_gemm_without_blas_falls_back(monkeypatch):
    monkeypatch.setattr(G, "_FN", (0, 0, False))
    assert not G.available()
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 8), dtype=np.float32)
    b = rng.standard_normal((6, 8), dtype=np.float32)
    out = np.ones((4, 6), dtype=np.float32)
    G.gemm(a, b, out, accumulate=True)
    _close(out, 1 + a @ b.T)


@needs_blas
@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, F16])
@pytest.mark.parametrize("rows,tile", [(200, 16), (48, 512), (1000, 64)])
def test_gemm_tiles_matches_decoded_matmul(qtype, rows, tile):
    rng = np.random.default_rng(rows)
    w = Q.quantize_tensor(rng.standard_normal((rows, 96), dtype=np.float32), qtype)
    x = rng.standard_normal((20, 96), dtype=np.float32)
    v = Q._view(w)
    out = np.full((20, rows), np.nan, dtype=np.float32)
    G.gemm_tiles(v.buf, v.tag, v.stride, v.rows, v.cols, K.F16_TO_F32, x, out, tile)
    _close(out, x @ Q.dequantize(w).T)


@needs_blas
def test_gemm_tiles_interleaved_rows():
    """Row-interleaved weights are decoded in groups of 8: shares and tiles stay multiples of 16."""
    rng = np.random.default_rng(11)
    w = Q.quantize_tensor(rng.standard_normal((96, 64), dtype=np.float32), Q8_0)
    from quant import interleaved as il
    from quant.tensor import QTensor
    from quant.types import type_info
    r8 = QTensor(il.repack(w.data, Q8_0, 96, 64).reshape(96, -1), type_info("Q8_0_R8").id, (96, 64))
    x = rng.standard_normal((17, 64), dtype=np.float32)
    out = np.empty((17, 96), dtype=np.float32)
    v = Q._view(r8)
    G.gemm_tiles(v.buf, v.tag, v.stride, v.rows, v.cols, K.F16_TO_F32, x, out, 16)
    _close(out, x @ Q.dequantize(w).T)


@needs_blas
def test_set_num_threads_keeps_openblas_at_one_thread():
    from quant.blas_threads import get_blas_threads
    prev = Q.get_num_threads()
    try:
        Q.set_num_threads(2)
        if get_blas_threads() is not None:
            assert get_blas_threads() == 1
    finally:
        Q.set_num_threads(prev[0])


@pytest.mark.parametrize("use_pool", [True, False])
def test_matmul_tile_path_with_and_without_the_pool(use_pool, monkeypatch):
    """quant.matmul's many-token path gives the same products whether the pool calls BLAS
    (quant.gemm) or numpy's matmul does (a numpy without a callable CBLAS)."""
    if use_pool and not G.available():
        pytest.skip("numpy's BLAS has no callable CBLAS sgemm")
    if not use_pool:
        monkeypatch.setattr(G, "_FN", (0, 0, False))
    rng = np.random.default_rng(5)
    # F16 (Q8_0 and the other integer types take quant.simd_gemm's integer GEMM with VNNI; the
    # tile path is theirs without it: called directly)
    w16 = Q.quantize_tensor(rng.standard_normal((300, 128), dtype=np.float32), 1)
    x = rng.standard_normal((40, 128), dtype=np.float32)
    assert x.shape[0] >= Q.many_tokens(1)
    _close(Q.matmul(w16, x), x @ Q.dequantize(w16).T)
    w = Q.quantize_tensor(rng.standard_normal((300, 128), dtype=np.float32), Q8_0)
    got = np.empty((40, 300), np.float32)
    Q._tiles(Q._view(w), Q._q8_rounded(x), got)
    _close(got, Q._q8_rounded(x) @ Q.dequantize(w).T)
    wf = Q.quantize_tensor(rng.standard_normal((70, 128), dtype=np.float32), 0)      # F32 weights
    _close(Q.matmul(wf, x), x @ Q.dequantize(wf).T)
