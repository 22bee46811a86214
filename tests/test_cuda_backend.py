"""The CUDA backend: placement (-ngl / -ot / -nkvo), GPU activations (engine.device), and a whole
DeepSeek model with its attention on the GPU and its routed experts on the CPU, against the CPU path.

Without a GPU these run on Numba's CUDA simulator (conftest sets NUMBA_ENABLE_CUDASIM=1).  The
simulator runs every GPU thread as a Python thread and is slow, so the whole-model checks run a
two-layer model of small widths for a few tokens; the kernels themselves are checked type by type
in tests/test_cuda_kernels.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.placement import CPU, GPU, Placement


# ------------------------------------------------------------------------------------ placement

def test_ngl_places_the_last_layers_and_the_output_after_all_layers() -> None:
    pl = Placement(n_layer=4, n_gpu_layers=2, gpu=True)
    assert [pl.buffer(f"blk.{i}.attn_norm.weight") for i in range(4)] == [CPU, CPU, GPU, GPU]
    assert pl.buffer("output.weight") == CPU and pl.buffer("token_embd.weight") == CPU
    full = Placement(n_layer=4, n_gpu_layers=99, gpu=True)
    assert full.buffer("output.weight") == GPU and full.buffer("output_norm.weight") == GPU
    assert full.buffer("token_embd.weight") == CPU          # the input layer always stays on the CPU
    assert Placement(n_layer=4, n_gpu_layers=5, gpu=True).buffer("output.weight") == GPU
    assert Placement(n_layer=4, n_gpu_layers=4, gpu=True).buffer("output.weight") == CPU


def test_overrides_first_match_wins_and_kv_follows_attention() -> None:
    pl = Placement(n_layer=3, n_gpu_layers=99, overrides=[("exps", CPU), (r"blk\.0\.", CPU), ("ffn", GPU)], gpu=True)
    assert pl.buffer("blk.2.ffn_up_exps.weight") == CPU       # first rule
    assert pl.buffer("blk.0.attn_q_a.weight") == CPU           # second rule
    assert pl.buffer("blk.0.ffn_up_shexp.weight") == CPU       # second rule before the third
    assert pl.buffer("blk.1.ffn_up_shexp.weight") == GPU
    assert [pl.kv_on_gpu(i) for i in range(3)] == [False, True, True]
    nkvo = Placement(n_layer=3, n_gpu_layers=99, kv_offload=False, gpu=True)
    assert not any(nkvo.kv_on_gpu(i) for i in range(3))
    cpu_only = Placement(n_layer=3, n_gpu_layers=99, gpu=False)
    assert cpu_only.buffer("blk.2.attn_norm.weight") == CPU and not cpu_only.any_gpu


def test_offload_log_lines() -> None:
    lines: list[str] = []
    Placement(n_layer=27, n_gpu_layers=99, gpu=True).log_offload(lines.append)
    assert lines == ["llm_load_tensors: offloading 27 repeating layers to GPU",
                     "llm_load_tensors: offloading non-repeating layers to GPU",
                     "llm_load_tensors: offloaded 28/28 layers to GPU"]


def test_numba_cuda_settings_before_the_first_compile(monkeypatch) -> None:
    """quant.cuda_compat: np.row_stack exists for numba-cuda's registry (NumPy 2.5 removed it), and
    numba-cuda's low-occupancy warnings (one per small launch, seen filling sweep-bench's output on
    an H200) are silenced; other warnings are not."""
    import importlib
    import warnings

    import quant.cuda_compat
    monkeypatch.delattr(np, "row_stack", raising=False)    # as under NumPy 2.5
    importlib.reload(quant.cuda_compat)     # (pytest also restores the filters of the collection it imported in)
    assert np.row_stack is np.vstack
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("Grid size 3 will likely result in GPU under-utilization due to low occupancy.")
        warnings.warn("something else")
    assert [str(w.message) for w in seen] == ["something else"]


# -------------------------------------------------------------------------------- GPU arrays

cuda = pytest.importorskip("numba.cuda")
if not cuda.is_available():
    pytest.skip("no CUDA device and NUMBA_ENABLE_CUDASIM is not 1", allow_module_level=True)


def test_device_arrays_follow_numpy_and_count_transfers() -> None:
    from engine.device import TRANSFERS, to_device, to_host
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    TRANSFERS.reset()
    d = to_device(a)
    np.testing.assert_array_equal(to_host(d + b), a + b)
    np.testing.assert_array_equal(to_host(b * d), b * a)
    np.testing.assert_array_equal(to_host(d[:, 1:3, 2:].contiguous()), a[:, 1:3, 2:])
    e = np.zeros_like(d)
    e[:, :, 4:] = d[:, :, :4]
    want = np.zeros_like(a)
    want[:, :, 4:] = a[:, :, :4]
    np.testing.assert_array_equal(to_host(e), want)
    d *= to_device(np.full((3, 1, 1), 2.0, np.float32))
    np.testing.assert_array_equal(to_host(d.reshape(12, -1)), (a * 2).reshape(12, -1))
    with pytest.raises(TypeError):
        np.asarray(d)                                   # a transfer is always explicit
    h = np.ones_like(a)
    h += d                                              # host op= device: the device operand comes down
    np.testing.assert_array_equal(h, 1 + 2 * a)
    assert (TRANSFERS.h2d, TRANSFERS.d2h) == (4, 6)      # a, b twice, the factors; 5 to_host + the +=

def test_constants_upload_once_and_leave_with_their_array() -> None:
    """engine.device.const: a norm weight goes up once (it was uploaded again at every call, and
    kept: 17 device copies more per generated token of a 4-layer DeepSeek model), and an entry
    leaves with its host array."""
    import gc

    from engine import device
    w = np.arange(8, dtype=np.float16)
    d = device.const(w)
    assert device.const(w) is d and d.dtype == np.float32
    np.testing.assert_array_equal(d.copy_to_host(), w.astype(np.float32))
    n = len(device._CONSTS)
    for _ in range(3):
        device.const(np.ones(4, np.float32))             # temporaries: uploaded, then gone
    gc.collect()
    assert len(device._CONSTS) == n
    del w, d
    gc.collect()
    assert len(device._CONSTS) == n - 1


def test_index_arrays_are_uploaded_once_per_content(monkeypatch) -> None:
    """engine.cuda_backend._ids keeps small int32 index arrays by content (a layer's gate, up and
    down products share their expert ids): equal contents give the same device array, other
    contents or shapes another, the oldest goes past the bound, large ones are not kept."""
    from engine import cuda_backend as cb
    monkeypatch.setattr(cb, "_IDS", type(cb._IDS)())
    monkeypatch.setattr(cb, "_IDS_MAX", 3)
    a = cb._ids(np.array([3, 1, 2], dtype=np.int64))
    assert cb._ids(np.array([3, 1, 2], dtype=np.int32)) is a and a.dtype == np.int32
    np.testing.assert_array_equal(a.copy_to_host(), [3, 1, 2])
    b = cb._ids(np.array([[3, 1, 2]]))
    assert b is not a and b.shape == (1, 3)
    c, d = cb._ids(np.array([7])), cb._ids(np.array([8]))
    assert len(cb._IDS) == 3 and cb._ids(np.array([3, 1, 2])) is not a      # a was the oldest
    assert cb._ids(np.array([8])) is d and c.copy_to_host()[0] == 7
    big = np.arange(cb._IDS_MAX_LEN + 1)
    assert cb._ids(big) is not cb._ids(big)


def test_device_indices_reach_numba_cuda_without_ellipsis() -> None:
    """numba.cuda's device arrays take no Ellipsis (the simulator's, being NumPy arrays, do: the
    model test first failed on a real GPU at `x[...] = part`), so DeviceArray expands it."""
    from engine.device import to_device, to_host
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    d = to_device(a)
    for idx in [..., (..., 1), (0, ...), (0, ..., slice(1, 3)), (slice(None), 1, ...), 1, (1, 2, 3, ...)]:
        full = d.basic_index(idx)
        assert all(i is not Ellipsis for i in full)
        np.testing.assert_array_equal(a[full], a[idx])
    with pytest.raises(IndexError):
        d.basic_index((..., 0, ...))
    d[...] = 0
    d[0, ..., 1:3] = np.ones((3, 2), np.float32)
    b = np.zeros_like(a)
    b[0, :, 1:3] = 1
    np.testing.assert_array_equal(to_host(d), b)



# ------------------------------------------------------------------------------- whole model

def _decode(path: str, toks: np.ndarray, gen: list[int], log=None, **placement):
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.device import TRANSFERS
    from engine.model import load_model, quiet_log
    log = log or quiet_log
    cfg = EngineConfig(path, n_ctx=256, mla=3, flash_attn=True, type_k="q8_0", **placement)
    m = load_model(path, log, mla=3, overrides=cfg.tensor_overrides, n_gpu_layers=cfg.n_gpu_layers,
                   kv_offload=cfg.kv_offload)
    ctx = Context(m, cfg, log)
    out = [ctx.decode(toks)]
    TRANSFERS.reset()
    for t in gen:
        out.append(ctx.decode(np.array([t], dtype=np.int32)))
    return np.concatenate(out), (TRANSFERS.h2d, TRANSFERS.d2h)


# a dense layer and a MoE layer, small enough for the simulator; latent rows of 48 + 16: Q8_0 blocks
_SMALL = dict(preset="tiny", qtype="f16", kv_lora_rank=48, n_layer=2, n_embd=32, n_head=2, q_lora_rank=32, n_ff=64,
              n_ff_exp=32, n_expert=4, qk_nope=16, v_head=16)


def _check_gpu_run(make_model, n_gpu_layers: int) -> tuple[str, tuple[int, int]]:
    path = make_model(**_SMALL)
    toks = np.array([3, 17, 101], dtype=np.int32)
    ref, _ = _decode(path, toks, [42])
    lines: list[str] = []
    got, transfers = _decode(path, toks, [42], log=lines.append, n_gpu_layers=n_gpu_layers,
                             tensor_overrides=[("exps", "CPU")])
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    text = "\n".join(lines)
    assert "Tensor blk.1.ffn_up_exps.weight" in text and "buffer type overridden to CPU" in text
    assert "     CUDA0 buffer size" in text and "     CUDA0 KV buffer size" in text
    return text, transfers


def test_deepseek_all_layers_on_gpu_experts_on_cpu_matches_cpu(make_model) -> None:
    """-ngl 99 -ot exps=CPU -mla 3 -fa -ctk q8_0 (the seeds' hybrid set-up): every layer's attention,
    dense FFN, shared expert, router and the output on the GPU, the latent cache in GPU memory, the
    routed experts on the CPU; logits as the CPU path's."""
    text, (h2d, d2h) = _check_gpu_run(make_model, 99)
    assert "llm_load_tensors: offloaded 3/3 layers to GPU" in text
    # one generated token.  Up: the token's embedding (once, for the first layer's norm and its
    # residual), the routed experts' sum.  Down: the MoE layer's router logits and normed state
    # (for the experts), the logits.  The hidden state crosses twice a MoE layer, never per product.
    assert (h2d, d2h) == (2, 3), (h2d, d2h)


def test_deepseek_attention_on_gpu_experts_on_cpu_matches_cpu(make_model) -> None:
    """-ngl 1 -ot exps=CPU: the last layer's attention, shared expert and router on the GPU (its
    cache in GPU memory), the dense first layer and the output on the CPU."""
    text, (h2d, d2h) = _check_gpu_run(make_model, 1)
    assert "llm_load_tensors: offloaded 1/3 layers to GPU" in text
    # Up: the residual for the attention norm and for the residual add (ggml would reuse one copy),
    # the routed experts' sum.  Down: the router's logits, the normed state for the routed
    # experts, the final state for the CPU output.  Not one transfer per product.
    assert (h2d, d2h) == (3, 3), (h2d, d2h)


def test_moe_ffn_experts_on_gpu_with_pairs_sorted_by_expert(monkeypatch) -> None:
    """A batch's MoE on GPU experts: the pairs go to the products sorted by expert (engine.ffn
    sorts from _SORT_PAIRS pairs), and each result row keeps its pair's weight in the GPU's
    combine: bit for bit the sums of the pairs in token order, and near the CPU's (whose
    activations are Q8-rounded)."""
    import engine.ffn as F
    from engine.cuda_backend import upload_weights
    from engine.device import to_host
    from engine.ffn import MoEWeights, moe_ffn
    from engine.hparams import GATING_SIGMOID
    from quant.matmul import quantize_tensor
    from quant.types import F32, Q8_0
    rng = np.random.default_rng(4)
    ne, nd, nf, T = 8, 64, 32, 20

    def q(shape, t, s=1.0):
        return quantize_tensor((rng.standard_normal(shape) * s).astype(np.float32), t)
    m = MoEWeights(router=q((ne, nd), F32, 0.5), probs_bias=None, gate=q((ne, nf, nd), Q8_0),
                   up=q((ne, nf, nd), Q8_0), down=q((ne, nd, nf), Q8_0, 0.5))
    x = rng.standard_normal((T, nd)).astype(np.float32)
    assert T * 4 >= F._SORT_PAIRS
    ref = moe_ffn(x, m, 4, GATING_SIGMOID, True, 2.5)
    gm, _ = upload_weights(m, lambda t: t.qtype == Q8_0)
    got = to_host(moe_ffn(x, gm, 4, GATING_SIGMOID, True, 2.5))
    monkeypatch.setattr(F, "_SORT_PAIRS", 1 << 62)
    assert np.array_equal(to_host(moe_ffn(x, gm, 4, GATING_SIGMOID, True, 2.5)), got)
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-2 * np.abs(ref).max())
