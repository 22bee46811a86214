"""The CUDA kernels (quant.cuda_matmul, engine.cuda_ops) against the CPU / NumPy references.

Without a GPU they run on Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by conftest or by
hand before numba is imported), which runs every GPU thread as a Python thread: shapes are tiny
and the launch sizes are shrunk to 32-64 threads (the `small_launches` fixture), which also makes
the grid-stride loops take more than one turn.  The kernels are correct for any launch size.
Timings need a real GPU and skip without one.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from numba.core import config as _nb_config

SIM = bool(_nb_config.ENABLE_CUDASIM)

from numba import cuda  # noqa: E402

if not SIM and not cuda.is_available():
    pytest.skip("no CUDA GPU and NUMBA_ENABLE_CUDASIM is not 1", allow_module_level=True)

from engine import cuda_ops as OPS  # noqa: E402
from engine.flash_attn import flash_attn as cpu_flash_attn  # noqa: E402
from engine.kv_cache import RowStore  # noqa: E402
from engine.ops import rms_norm as cpu_rms_norm  # noqa: E402
from engine.rope import apply_rope as cpu_apply_rope, rope_cos_sin  # noqa: E402
from quant import cuda_matmul as CM  # noqa: E402
from quant import iqk  # noqa: E402
from quant.matmul import dequantize, quantize_tensor  # noqa: E402
from quant.tensor import QTensor  # noqa: E402
from quant.types import type_info  # noqa: E402

F32, F16, Q4_0, Q8_0, Q8_K, BF16, Q6_0, IQ6_K = 0, 1, 2, 8, 15, 30, 133, 141
TYPES = sorted(CM.CUDA_TYPES)
NAMES = [type_info(t).name for t in TYPES]


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    """32-64 threads per block and few blocks under the simulator (the defaults on a GPU)."""
    if SIM:
        for mod, vals in ((CM, dict(MV_WARPS=2, TILE=(16, 16, 2, 2), THREADS=64, MAX_BLOCKS=2,
                                    MATVEC_MAX_PAIRS=8)),
                          (OPS, dict(THREADS=64, ROW_THREADS=64, MAX_BLOCKS=2, FA_WARPS=2, FA_MAX_BC=8,
                                     FA_MIN_SPLIT=8, FA_TARGET_BLOCKS=8))):
            for k, v in vals.items():
                monkeypatch.setattr(mod, k, v)
    yield


def _cols(qt: int) -> int:
    bs = type_info(qt).block_size
    return 512 if bs == 256 else 96 if bs == 32 else 40       # several blocks; floats: 5 chunks


def _weights(qt: int, rows: int, cols: int, seed: int = 0, experts: int = 0) -> QTensor:
    rng = np.random.default_rng(seed + qt)
    shape = (experts, rows, cols) if experts else (rows, cols)
    w = rng.standard_normal(shape).astype(np.float32)
    if qt == Q8_K:          # no CPU quantizer: d (f32) | 256 int8 | 16 int16 sums per block
        nb = cols // 256
        blk = np.zeros((int(np.prod(shape[:-1])), nb, 296), np.uint8)
        blk[:, :, 0:4] = (rng.uniform(0.001, 0.02, blk.shape[:2]).astype(np.float32)
                          .view(np.uint8).reshape(*blk.shape[:2], 4))
        blk[:, :, 4:260] = rng.integers(-128, 128, (*blk.shape[:2], 256)).astype(np.int8).view(np.uint8)
        return QTensor.from_raw(blk.reshape(-1), Q8_K, shape)
    return quantize_tensor(w, qt)


def _ref_values(q: QTensor, products: bool) -> np.ndarray:
    """The f32 values the kernels must see (products: IQ6_K with ik's integer levels)."""
    if q.qtype == Q8_K:
        b = q.data.reshape(-1, 296)
        d = np.ascontiguousarray(b[:, 0:4]).view(np.float32)
        return (b[:, 4:260].view(np.int8).astype(np.float32) * d).reshape(q.shape)
    if q.qtype == IQ6_K and products:
        raw = q.data.reshape(-1)
        n = int(np.prod(q.shape))
        return iqk.dequantize(raw, IQ6_K, n, q.cols, iq6k_levels=iqk.IQ6K_INT_LEVELS).reshape(q.shape)
    return dequantize(q)


def _check_product(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= 2e-6 * bound + 1e-30), np.abs(y - ref).max()


# ------------------------------------------------------------------------------------------
# quant.cuda_matmul
# ------------------------------------------------------------------------------------------
def test_types_cover_the_brief():
    need = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL",
            "IQ4_K", "IQ4_KS", "IQ5_K", "IQ2_K", "IQ3_K"}
    names = set(NAMES)
    assert need <= names
    assert not any(type_info(t).interleave for t in TYPES)       # _R4/_R8: CPU-only


@pytest.mark.parametrize("qt", TYPES, ids=NAMES)
def test_dequantize_and_get_rows_bitexact(qt):
    """Every decoder gives quant.matmul.dequantize's f32 values bit for bit (3 rows, several blocks)."""
    cols = _cols(qt)
    q = _weights(qt, 3, cols)
    ref = _ref_values(q, products=False)
    dq = CM.upload(q)
    assert dq.nbytes == q.nbytes and dq.shape == (3, cols) and dq.data.shape == q.data.shape
    got = CM.dequantize(dq).copy_to_host()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    ids = np.array([2, 0, 2], np.int32)
    rows = CM.get_rows(dq, cuda.to_device(ids)).copy_to_host()
    np.testing.assert_array_equal(rows.view(np.uint32), ref[ids].view(np.uint32))


@pytest.mark.parametrize("qt", TYPES, ids=NAMES)
def test_matvec_one_token(qt):
    cols = _cols(qt)
    q = _weights(qt, 5, cols)
    w = _ref_values(q, products=True)
    x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    y = CM.matmul(CM.upload(q), cuda.to_device(x)).copy_to_host()
    _check_product(y, x, w)


@pytest.mark.parametrize("qt", TYPES, ids=NAMES)
def test_tiled_many_tokens(qt):
    """n = 20 > MATVEC_MAX_N: two token tiles (TM 16 under the simulator), 5 rows of a 16-row tile;
    the columns in 32-value steps (F32 / F16 / BF16: 40, a partial last step)."""
    cols = min(_cols(qt), 256)
    q = _weights(qt, 5, cols)
    w = _ref_values(q, products=True)
    x = np.random.default_rng(2).standard_normal((20, cols)).astype(np.float32)
    y = CM.matmul(CM.upload(q), cuda.to_device(x)).copy_to_host()
    _check_product(y, x, w)


@pytest.mark.parametrize("qt,n", [(F16, 3), (Q4_0, 7), (Q8_0, 3), (12, 7), (14, 3), (IQ6_K, 7), (144, 3), (157, 7)],
                         ids=["F16-3", "Q4_0-7", "Q8_0-3", "Q4_K-7", "Q6_K-3", "IQ6_K-7", "IQ4_KS-3", "IQ2_KL-7"])
def test_matvec_few_tokens(qt, n):
    """n = 3 and 7: NT 4 and 8 tokens per decoded chunk, the last group partly empty; out= given."""
    cols = _cols(qt)
    q = _weights(qt, 7, cols)
    w = _ref_values(q, products=True)
    x = np.random.default_rng(3).standard_normal((n, cols)).astype(np.float32)
    out = cuda.device_array((n, 7), np.float32)
    y = CM.matmul(CM.upload(q), cuda.to_device(x), out=out)
    assert y is out
    _check_product(out.copy_to_host(), x, w)


def test_matmul_row_block_view():
    """A row block of an uploaded tensor (engine.cuda_backend.GpuTensor.row_block) is a view."""
    import dataclasses
    q = _weights(12, 6, 256)
    w = _ref_values(q, products=True)
    dq = CM.upload(q)
    blk = dataclasses.replace(dq, data=dq.data[2:5], shape=(3, 256))
    x = np.random.default_rng(4).standard_normal((1, 256)).astype(np.float32)
    _check_product(CM.matmul(blk, cuda.to_device(x)).copy_to_host(), x, w[2:5])


@pytest.mark.parametrize("qt", [F16, Q8_0, 12, 144, 157], ids=["F16", "Q8_0", "Q4_K", "IQ4_KS", "IQ2_KL"])
@pytest.mark.parametrize("P", [6, 21], ids=["matvec", "tiled"])
def test_matmul_id(qt, P):
    """MoE pairs, experts repeated and out of order; 21 pairs > MATVEC_MAX_PAIRS take the tiled
    kernel over tiles of one expert each (expert 1 gets more than a 16-pair tile)."""
    E, rows = 4, 3
    cols = _cols(qt)
    q = _weights(qt, rows, cols, experts=E)
    w = _ref_values(q, products=True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    ids = rng.integers(0, E, P).astype(np.int32)
    if P > 16:
        ids[:17] = 1
        rng.shuffle(ids)
    x_rows = rng.integers(0, 5, P).astype(np.int32)
    dq = CM.upload(q)
    assert dq.data.shape == (E * rows, q.data.shape[-1])
    y = CM.matmul_id(dq, cuda.to_device(x), cuda.to_device(ids), cuda.to_device(x_rows)).copy_to_host()
    for p in range(P):
        _check_product(y[p:p + 1], x[x_rows[p]:x_rows[p] + 1], w[ids[p]])


def test_matmul_rejects_bad_shapes():
    dq = CM.upload(_weights(Q8_0, 3, 96))
    with pytest.raises(ValueError):
        CM.matmul(dq, cuda.to_device(np.zeros((1, 64), np.float32)))
    with pytest.raises(NotImplementedError):
        CM.upload(QTensor(np.zeros((2, 34), np.uint8), 208, (2, 32)))       # Q8_0_R8: CPU only


@pytest.mark.skipif(not CM.SIM, reason="the one-exchange butterfly is the simulator's form")
def test_simulator_butterfly_is_the_shuffles_to_the_bit():
    """Under the simulator warp_sum / warp_max reduce in one exchange (quant.cuda_matmul's
    butterfly); on a GPU they are the five shuffles.  Both forms, in both modules, on values whose
    sums depend on the order (wide exponents): the same bits in every lane."""
    @cuda.jit
    def reduce(x, out):
        i = cuda.grid(1)
        v = x[i]
        out[0, i] = CM.warp_sum(v)
        out[1, i] = CM.warp_sum_shuffles(v)
        out[2, i] = OPS.warp_sum(v)
        out[3, i] = OPS.warp_sum_shuffles(v)
        out[4, i] = OPS.warp_max(v)
        out[5, i] = OPS.warp_max_shuffles(v)

    rng = np.random.default_rng(11)
    x = (rng.standard_normal(64) * np.exp2(rng.integers(-20, 20, 64))).astype(np.float32)
    x[37] = np.nan                     # max: a NaN lane, as the shuffles' comparisons leave it
    out = cuda.device_array((6, 64), np.float32)
    reduce[2, 32](_d(x), out)
    got = out.copy_to_host()
    for a, b in ((0, 1), (2, 3), (4, 5)):
        np.testing.assert_array_equal(got[a].view(np.uint32), got[b].view(np.uint32))
    assert np.all(got[1, :32] == got[1, 0]) and got[1, 0] != np.sum(x[:32], dtype=np.float64)  # order mattered
    assert got[5, 0] == np.max(x[:32])


# ------------------------------------------------------------------------------------------
# engine.cuda_ops: element-wise, rows, RoPE
# ------------------------------------------------------------------------------------------
def _d(a):
    return cuda.to_device(np.ascontiguousarray(a))


def test_elementwise_ops():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((3, 50)).astype(np.float32) * 4
    b = rng.standard_normal((3, 50)).astype(np.float32)
    bias = rng.standard_normal(50).astype(np.float32)
    tol = dict(rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(OPS.add(_d(a), _d(b)).copy_to_host(), a + b, **tol)
    np.testing.assert_allclose(OPS.add(_d(a), _d(bias)).copy_to_host(), a + bias, **tol)
    np.testing.assert_allclose(OPS.mul(_d(a), _d(b)).copy_to_host(), a * b, **tol)
    np.testing.assert_allclose(OPS.mul(_d(a), _d(bias)).copy_to_host(), a * bias, **tol)
    np.testing.assert_allclose(OPS.scale(_d(a), 0.37).copy_to_host(), a * np.float32(0.37), **tol)
    silu = a / (1 + np.exp(-a.astype(np.float64)))
    np.testing.assert_allclose(OPS.silu_mul(_d(a), _d(b)).copy_to_host(), silu * b, **tol)
    np.testing.assert_allclose(OPS.sigmoid(_d(a)).copy_to_host(), 1 / (1 + np.exp(-a.astype(np.float64))), **tol)
    out = cuda.device_array((3, 50), np.float32)
    assert OPS.add(_d(a), _d(b), out=out) is out
    with pytest.raises(ValueError):
        OPS.add(_d(a), _d(bias[:7]))


@pytest.mark.parametrize("with_w", [True, False])
def test_rms_norm(with_w):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 200)).astype(np.float32) * 3       # 200: not a multiple of 64 threads
    w = rng.standard_normal(200).astype(np.float32) if with_w else None
    got = OPS.rms_norm(_d(x), None if w is None else _d(w), 1e-5).copy_to_host()
    np.testing.assert_allclose(got, cpu_rms_norm(x, w, 1e-5), rtol=3e-6, atol=1e-6)
    x3 = x.reshape(5, 4, 50)
    got3 = OPS.rms_norm(_d(x3), None, 1e-6).copy_to_host()
    assert got3.shape == (5, 4, 50)
    np.testing.assert_allclose(got3, cpu_rms_norm(x3, None, 1e-6), rtol=3e-6, atol=1e-6)


def test_softmax_rows():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((4, 130)) * 10).astype(np.float32)
    x[1, :] = -1e30
    x[1, 7] = 3.0
    got = OPS.softmax_rows(_d(x)).copy_to_host()
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("neox", [False, True])
def test_rope(neox):
    T, H, D = 3, 4, 32
    rng = np.random.default_rng(9)
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    cos, sin = rope_cos_sin(np.array([0, 5, 17]), D, 10000.0, 0.5, 1.0, 1.0, 4096, 32.0, 1.0)
    ref = cpu_apply_rope(x.copy(), cos, sin, neox)
    xd = _d(x)
    assert OPS.apply_rope(xd, _d(cos), _d(sin), neox) is xd
    np.testing.assert_allclose(xd.copy_to_host(), ref, rtol=1e-5, atol=1e-6)


def test_rope_rotates_a_strided_view_in_place():
    """DeepSeek rotates q[:, :, nope:] (the last 32 of each head's 48 values) in place: the kernel
    takes the view's strides, and the values around it stay as they were."""
    T, H, nope, D = 3, 4, 16, 32
    rng = np.random.default_rng(19)
    q = rng.standard_normal((T, H, nope + D)).astype(np.float32)
    cos, sin = rope_cos_sin(np.array([2, 3, 40]), D, 10000.0, 0.5, 1.0, 1.0, 4096, 32.0, 1.0)
    ref = q.copy()
    ref[:, :, nope:] = cpu_apply_rope(np.ascontiguousarray(q[:, :, nope:]), cos, sin, False)
    qd = _d(q)
    OPS.apply_rope(qd[:, :, nope:], _d(cos), _d(sin), False)
    got = qd.copy_to_host()
    np.testing.assert_array_equal(got[:, :, :nope], q[:, :, :nope])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# cache writes
# ------------------------------------------------------------------------------------------
def _special_values(n: int) -> np.ndarray:
    rng = np.random.default_rng(10)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-12, 12, n))).astype(np.float32)
    sp = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8, 2.98e-8, 1e-9,
                   np.inf, -np.inf, 1.0009765625, 1.00048828125, 1.00146484375, 3.0e-5, -7.0e-6], np.float32)
    x[:sp.size] = sp
    return x


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("qt", [F32, F16, BF16, Q8_0, Q4_0, Q6_0], ids=["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q6_0"])
def test_write_rows(qt):
    """Rows written on the GPU hold the CPU store's bytes: exactly for F32/F16/BF16/Q8_0 (F16 and
    BF16 with overflow, subnormals, ties and infinities); Q4_0 / Q6_0 exactly on the simulator,
    within one quant step on a GPU (which may contract x * (1/d) + 8.5 into an FMA)."""
    width, n_ctx, i0, t = 64, 6, 2, 3
    rng = np.random.default_rng(11)
    x = rng.standard_normal((t, width)).astype(np.float32)
    if qt in (F16, BF16, F32):
        x = _special_values(t * width).reshape(t, width)
    cpu = RowStore(n_ctx, width, qt)
    cpu.write(i0, x)
    dev = cuda.to_device(np.zeros_like(cpu.data))
    OPS.write_rows(dev, qt, i0, _d(x))
    got = dev.copy_to_host()
    if qt in (Q4_0, Q6_0) and not SIM:     # a GPU may fuse x * (1/d) + 8.5: one quant off at most
        a = dequantize(QTensor(got, qt, (n_ctx, width)))
        b = dequantize(QTensor(cpu.data, qt, (n_ctx, width)))
        step = np.abs(b).max() / 4
        assert np.abs(a - b).max() <= step
        assert (got != cpu.data).mean() < 0.05
    else:
        np.testing.assert_array_equal(got, cpu.data)


def test_write_rows_bad_type():
    with pytest.raises(NotImplementedError):
        OPS.write_rows(cuda.to_device(np.zeros((2, 36), np.uint8)), 3, 0, _d(np.zeros((1, 32), np.float32)))


# ------------------------------------------------------------------------------------------
# flash attention
# ------------------------------------------------------------------------------------------
def _cache(qt: int, vals: np.ndarray) -> tuple[RowStore, object]:
    st = RowStore(vals.shape[0], vals.shape[1], qt)
    st.write(0, vals)
    return st, cuda.to_device(st.data)


def _fa_case(kqt, vqt, T, H, hkv, dk, dv, n_kv, q_pos, cell_pos=None, window=0, sinks=None, mla=False, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, dk)).astype(np.float32)
    n_ctx = n_kv + 3
    kv = rng.standard_normal((n_ctx, hkv * dk)).astype(np.float32)
    ks, kd = _cache(kqt, kv)
    if mla:
        vs, vd = None, None
    else:
        vs, vd = _cache(vqt, rng.standard_normal((n_ctx, hkv * dv)).astype(np.float32))
    if cell_pos is None:
        cell_pos = np.arange(n_kv)
    cell_pos = np.asarray(cell_pos, np.int64)
    q_pos = np.asarray(q_pos, np.int64)
    scale = 1 / np.sqrt(dk)
    ref = cpu_flash_attn(q, ks, vs, n_kv, hkv, dk, dv, cell_pos, q_pos, scale, window=window, sinks=sinks)
    got = OPS.flash_attn(_d(q), kd, kqt, vd, None if mla else vqt, n_kv, hkv, dk, dv,
                         _d(cell_pos.astype(np.int32)), _d(q_pos.astype(np.int32)), scale, window=window,
                         sinks=None if sinks is None else _d(np.asarray(sinks, np.float32))).copy_to_host()
    assert got.shape == (T, H, dv)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)
    return got


def test_flash_attn_generation_gqa_split():
    """One query, 4 heads over 2 kv heads (GQA), 37 cells (not a multiple of the 8-cell tile),
    split into ranges, f16 cache."""
    _fa_case(F16, F16, 1, 4, 2, 32, 32, 37, [40])


def test_flash_attn_prompt_causal_masked_rows():
    """5 queries (2 row tiles of one kv head), causal by cell positions (cells out of order);
    the first query is before every cell and gets zeros; f32 K, bf16 V."""
    cell_pos = np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 20, 21][::-1])
    got = _fa_case(F32, BF16, 5, 2, 1, 32, 64, 13, [1, 4, 9, 12, 30], cell_pos=cell_pos)
    assert np.all(got[0] == 0)


def test_flash_attn_window_and_sinks():
    _fa_case(BF16, F16, 3, 4, 2, 32, 32, 29, [20, 25, 28], window=6, sinks=np.array([0.5, -1.0, 2.0, 0.0]),
             seed=1)


def test_flash_attn_quantized_caches():
    """Q8_0 K with Q4_0 V, and Q6_0 K with Q8_0 V (dk 64: two blocks per head)."""
    _fa_case(Q8_0, Q4_0, 2, 2, 2, 64, 32, 19, [17, 18], seed=2)
    _fa_case(Q6_0, Q8_0, 1, 2, 1, 64, 64, 11, [10], seed=3)


def test_flash_attn_mla_q8_0_latent_small():
    """V inside K (v_rows None) on a Q8_0 cache: K rows of 3 blocks, V = the first 2 blocks of the
    same row (ik's bug #400 read V with a wrong stride): n_kv 21 > 1, 4 heads on one latent head."""
    _fa_case(Q8_0, Q8_0, 2, 4, 1, 96, 64, 21, [20, 15], mla=True, seed=4)


def test_flash_attn_mla_q8_0_latent_576():
    """The real FlashMLA-3 shape: one kv head of 576 = [512 | 64], V its first 512 values, Q8_0
    (18 blocks of 34 bytes per row, V = the first 16 blocks), 2 heads, n_kv 9, generation."""
    _fa_case(Q8_0, Q8_0, 1, 2, 1, 576, 512, 9, [8], mla=True, seed=5)


def test_flash_attn_no_cells():
    q = np.ones((1, 2, 32), np.float32)
    kd = cuda.to_device(np.zeros((4, 64), np.uint8))
    got = OPS.flash_attn(_d(q), kd, F16, None, None, 0, 1, 32, 32, _d(np.zeros(4, np.int32)),
                         _d(np.zeros(1, np.int32)), 0.1).copy_to_host()
    assert np.all(got == 0)


def test_default_launch_configuration(monkeypatch):
    """One run of each big kernel at the launch sizes a GPU gets (128-256 threads per block)."""
    monkeypatch.undo()          # the small_launches settings
    q = _weights(12, 5, 256)
    w = _ref_values(q, products=True)
    dq = CM.upload(q)
    x = np.random.default_rng(12).standard_normal((9, 256)).astype(np.float32)
    _check_product(CM.matmul(dq, cuda.to_device(x[:1])).copy_to_host(), x[:1], w)
    _check_product(CM.matmul(dq, cuda.to_device(x)).copy_to_host(), x, w)
    _fa_case(Q8_0, Q8_0, 1, 8, 1, 64, 32, 5, [4], mla=True, seed=6)


# ------------------------------------------------------------------------------------------
# timings: a real GPU only
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(SIM, reason="timings need a real GPU (the simulator runs threads in Python)")
def test_gpu_timings(capsys):
    rows, cols = 4096, 4096
    res = []
    for qt in (Q8_0, 12, 139):
        q = _weights(qt, 256, cols)      # quantize a slab, tile it to the full matrix
        data = np.tile(q.data, (rows // 256, 1))
        dq = CM.upload(QTensor(data, qt, (rows, cols)))
        for n in (1, 512):
            x = cuda.to_device(np.random.default_rng(0).standard_normal((n, cols)).astype(np.float32))
            out = cuda.device_array((n, rows), np.float32)
            CM.matmul(dq, x, out=out)
            cuda.synchronize()
            t = time.perf_counter()
            reps = 20
            for _ in range(reps):
                CM.matmul(dq, x, out=out)
            cuda.synchronize()
            dt = (time.perf_counter() - t) / reps
            res.append((type_info(qt).name, n, dt * 1e3, dq.nbytes / dt / 1e9))
    with capsys.disabled():
        for name, n, ms, gbs in res:
            print(f"\n{name} 4096x4096 n={n}: {ms:.3f} ms ({gbs:.0f} GB/s of weights)", end="")
        print()
