"""The CUDA backend: the engine's ops for weights, activations and caches in GPU memory.

engine.linear / ops / rope / attention / flash_attn / kv_cache call in here when their weight is a
`GpuTensor`, their activation an engine.device.DeviceArray, or their cache a `DeviceRowStore`; the
architectures never do.  An op runs where its weights live; an op without weights runs where its
input is; a host input to a GPU op is uploaded and a GPU input to a CPU op comes down, both counted
in engine.device.TRANSFERS.  Model constants (norm weights, biases, RoPE tables) are uploaded
once and not counted.

The kernels are quant.cuda_matmul (quantized products decoding the GGUF blocks on the fly) and
engine.cuda_ops (norms, RoPE, activations, flash attention, cache writes).  Where a GPU op has no
kernel of its own yet (GELU, the clamped SwiGLU, -fa off attention), it is computed on the host
and the result goes back up: correct, counted, and listed in the README.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import numpy as np

from quant import cuda_matmul
from quant.tensor import QTensor

from . import cuda_ops
from .device import (DEVICE_NAME, TRANSFERS, DeviceArray, const, is_contiguous, on_device, simulated, to_device,
                     to_host)


def _simulator_launches() -> None:
    """Numba's simulator runs every GPU thread as a Python thread: small blocks and few of them
    make a tiny model's forward take seconds, not minutes (the kernels are correct at any launch
    size; a real GPU keeps the modules' defaults)."""
    from . import device_kernels
    for mod, vals in ((cuda_matmul, dict(MV_WARPS=2, TILE=(16, 16, 2, 2), THREADS=64, MAX_BLOCKS=2,
                                         MATVEC_MAX_PAIRS=8)),
                      (cuda_ops, dict(THREADS=64, ROW_THREADS=64, MAX_BLOCKS=2, FA_WARPS=2, FA_MAX_BC=8,
                                      FA_MIN_SPLIT=8, FA_TARGET_BLOCKS=8)),
                      (device_kernels, dict(THREADS=64))):
        for k, v in vals.items():
            setattr(mod, k, v)


if simulated():
    _simulator_launches()


def supports(qtype: int) -> bool:
    """True when the GPU computes with this weight type (the _R4/_R8 layouts are CPU-only)."""
    return int(qtype) in cuda_matmul.CUDA_TYPES


# ------------------------------------------------------------------------------------- weights

class GpuTensor:
    """A weight in GPU memory (the GGUF bytes, uploaded once) with the QTensor interface the
    engine uses: qtype, shape, rows, cols, name, nbytes, expert selection, row blocks."""

    device = DEVICE_NAME

    def __init__(self, dq: Any, host: QTensor) -> None:
        self.dq, self.host = dq, host

    @classmethod
    def upload(cls, q: QTensor) -> "GpuTensor":
        return cls(cuda_matmul.upload(q), q)

    qtype = property(lambda self: self.host.qtype)
    shape = property(lambda self: self.host.shape)
    cols = property(lambda self: self.host.cols)
    rows = property(lambda self: self.host.rows)
    nbytes = property(lambda self: self.host.nbytes)

    @property
    def name(self) -> str:
        return self.host.name

    @name.setter
    def name(self, v: str) -> None:
        self.host.name = v

    @property
    def data(self) -> np.ndarray:
        """The host bytes (for code that reads a weight's values at load, e.g. deriving W_k_b)."""
        return self.host.data

    def row_block(self, r0: int, r1: int) -> "GpuTensor":
        """Rows [r0, r1) of a 2-D weight, a view of the same GPU memory."""
        d = self.dq.data
        return GpuTensor(dataclasses.replace(self.dq, data=d[r0:r1], shape=(r1 - r0, self.cols)),
                         self.host.row_block(r0, r1))


class GpuVector(np.ndarray):
    """A layer's small constant (a norm weight) placed with its layer on the GPU: an op taking it
    runs there (an RMSNorm of a host activation uploads the activation, not the norm's output for
    each product after it).  Still a NumPy array for host code."""
    on_gpu = True


def upload_weights(obj: Any, want: "callable", vectors: bool = False) -> tuple[Any, int]:
    """Replace, inside an architecture's containers (dicts, lists, tuples, dataclasses), every
    QTensor for which want(q) is true by its GpuTensor (and, with `vectors`, every 1-D f32 array by
    a GpuVector); returns the object and the bytes uploaded.  A tensor shared by two places is
    uploaded once."""
    done: dict[int, GpuTensor] = {}
    total = [0]

    def visit(o: Any) -> Any:
        if isinstance(o, QTensor):
            if id(o) in done:
                return done[id(o)]
            if not want(o):
                return o
            g = GpuTensor.upload(o)
            done[id(o)] = g
            total[0] += o.nbytes
            return g
        if vectors and isinstance(o, np.ndarray) and o.ndim == 1 and o.dtype == np.float32:
            return o.view(GpuVector)
        if isinstance(o, dict):
            for k, v in o.items():
                o[k] = visit(v)
            return o
        if isinstance(o, list):
            for i, v in enumerate(o):
                o[i] = visit(v)
            return o
        if isinstance(o, tuple):
            return type(o)(visit(v) for v in o) if not hasattr(o, "_fields") else type(o)(*(visit(v) for v in o))
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                setattr(o, f.name, visit(getattr(o, f.name)))
            return o
        return o

    return visit(obj), total[0]


# ---------------------------------------------------------------------------------- products

def _dev(x: Any) -> Any:
    return to_device(x).dev


_IDS: "OrderedDict[bytes, Any]" = OrderedDict()
_IDS_MAX, _IDS_MAX_LEN = 256, 16384


def _ids(a: np.ndarray) -> Any:
    """int32 indices (expert ids, activation rows, cell positions) on the GPU.  Each upload is a
    synchronous copy that waits for the GPU's queue, and a token asks for the same few arrays again
    and again (the gate, up and down products of a layer share their expert ids; every layer has
    the same per-head ids and cell positions), so small ones are kept by content (the kernels only
    read them): 34 uploads of a 4-layer DeepSeek token become 4-6."""
    a = np.ascontiguousarray(a, dtype=np.int32)
    from numba import cuda
    if a.size > _IDS_MAX_LEN:
        return cuda.to_device(a)
    key = a.tobytes() + repr(a.shape).encode()
    d = _IDS.get(key)
    if d is None:
        d = _IDS[key] = cuda.to_device(a)
        if len(_IDS) > _IDS_MAX:
            _IDS.popitem(last=False)
    else:
        _IDS.move_to_end(key)
    return d


def matmul(w: GpuTensor, x: Any) -> DeviceArray:
    x = to_device(x)
    return DeviceArray(cuda_matmul.matmul(w.dq, x.contiguous().dev))


def matmul_id(w: GpuTensor, x: Any, ids: np.ndarray, x_rows: np.ndarray) -> DeviceArray:
    x = to_device(x)
    return DeviceArray(cuda_matmul.matmul_id(w.dq, x.contiguous().dev, _ids(ids), _ids(x_rows)))


def up_gate(gate: GpuTensor, up: GpuTensor, x: Any) -> DeviceArray:
    x = to_device(x).contiguous()
    return silu_mul(matmul(gate, x), matmul(up, x))


def moe_up_gate(gate: GpuTensor, up: GpuTensor, x: Any, ids: np.ndarray, x_rows: np.ndarray) -> DeviceArray:
    x = to_device(x).contiguous()
    return silu_mul(matmul_id(gate, x, ids, x_rows), matmul_id(up, x, ids, x_rows))


def dequantize(w: GpuTensor) -> np.ndarray:
    from quant.matmul import dequantize as host_dequantize
    return host_dequantize(w.host)


# --------------------------------------------------------------------------- element-wise ops

def rms_norm(x: DeviceArray, w: np.ndarray | None, eps: float) -> DeviceArray:
    shape = x.shape
    x2 = x.contiguous().reshape(-1, shape[-1])
    return DeviceArray(cuda_ops.rms_norm(x2.dev, None if w is None else const(w),
                                         float(eps))).reshape(shape)


def silu_mul(g: DeviceArray, u: DeviceArray) -> DeviceArray:
    return DeviceArray(cuda_ops.silu_mul(g.contiguous().dev, u.contiguous().dev))


def _unary(fn: Any, x: DeviceArray) -> DeviceArray:
    shape = x.shape
    return DeviceArray(fn(x.contiguous().reshape(-1, shape[-1]).dev)).reshape(shape)


def silu(x: DeviceArray) -> DeviceArray:
    return _unary(cuda_ops.silu, x)


def sigmoid(x: DeviceArray) -> DeviceArray:
    return _unary(cuda_ops.sigmoid, x)


def softmax(x: DeviceArray) -> DeviceArray:
    return _unary(cuda_ops.softmax_rows, x)


def on_host(fn: Any, *args: Any, **kw: Any) -> DeviceArray:
    """An op with no GPU kernel yet: its device inputs come down, its result goes back up."""
    return to_device(fn(*(to_host(a) for a in args), **kw))


# RoPE tables change with every micro-batch and are shared by its layers: a few kept on the GPU
_TABLES: "OrderedDict[int, tuple[np.ndarray, Any]]" = OrderedDict()


def _table(a: np.ndarray) -> Any:
    hit = _TABLES.get(id(a))
    if hit is not None and hit[0] is a:
        return hit[1]
    from numba import cuda
    d = cuda.to_device(np.ascontiguousarray(a, dtype=np.float32))
    _TABLES[id(a)] = (a, d)
    while len(_TABLES) > 8:
        _TABLES.popitem(last=False)
    return d


def apply_rope(x: DeviceArray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> DeviceArray:
    """x rotated in place: contiguous, or a 3-D view (the rope part of each head), which the
    kernel indexes through its strides (a copy out and back cost two launches a call)."""
    if x.ndim != 3 and not is_contiguous(x.dev):
        raise ValueError("RoPE on the GPU rotates 3-D views or contiguous arrays in place")
    cuda_ops.apply_rope(x.dev, _table(cos), _table(sin), bool(neox))
    return x


# ----------------------------------------------------------------------------------- caches

class DeviceRowStore:
    """engine.kv_cache.RowStore's rows in GPU memory: n_ctx rows of `width` values in `qtype`."""

    device = DEVICE_NAME

    def __init__(self, n_ctx: int, width: int, qtype: int, row_bytes: int) -> None:
        from numba import cuda
        self.n_ctx, self.width, self.qtype = n_ctx, width, qtype
        self.data = cuda.to_device(np.zeros((n_ctx, row_bytes), dtype=np.uint8))

    @classmethod
    def like(cls, store: Any) -> "DeviceRowStore":
        return cls(store.n_ctx, store.width, store.qtype, store.data.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0] * self.data.shape[1])

    def write(self, i0: int, x: Any) -> None:
        x = to_device(x).contiguous().reshape(-1, self.width)
        cuda_ops.write_rows(self.data, self.qtype, int(i0), x.dev)

    def read(self, n: int) -> DeviceArray:
        """Rows [0, n) as f32 (n, width) on the GPU."""
        dq = cuda_matmul.DeviceQTensor(self.data[:n], self.qtype, (n, self.width), "")
        return DeviceArray(cuda_matmul.dequantize(dq)).reshape(n, self.width)

    def move(self, src: np.ndarray, dst0: int) -> None:
        """Cache compaction (rare: the server's seq_rm): through host memory, not counted."""
        rows = self.data.copy_to_host()
        rows[dst0:dst0 + len(src)] = rows[src]
        self.data.copy_to_device(rows)


def flash_attn(q: Any, k: Any, v: Any, n_kv: int, n_head_kv: int, dk: int, dv: int, cell_pos: np.ndarray,
               q_pos: np.ndarray, scale: float, window: int = 0, sinks: np.ndarray | None = None) -> DeviceArray:
    """engine.flash_attn.flash_attn for caches in GPU memory (v None: V is a view of K)."""
    q = to_device(q).contiguous()
    out = cuda_ops.flash_attn(q.dev, k.data, k.qtype, None if v is None else v.data, None if v is None else v.qtype,
                              int(n_kv), int(n_head_kv), int(dk), int(dv),
                              _ids(np.asarray(cell_pos[:n_kv])), _ids(np.asarray(q_pos)), float(scale),
                              window=int(window), sinks=None if sinks is None else const(sinks))
    return DeviceArray(out)


class _F32Rows:
    """f32 rows already on the GPU, seen as a cache store (for attention over computed K / V)."""

    def __init__(self, x: DeviceArray) -> None:
        from quant.types import F32
        x = x.contiguous().reshape(x.shape[0], -1)
        self.qtype, self.data = F32, x.dev.view(np.uint8)


def causal_attention(q: Any, k: Any, v: Any, cell_pos: np.ndarray, q_pos: np.ndarray, scale: float,
                     window: int = 0, sinks: np.ndarray | None = None) -> DeviceArray:
    """engine.attention.causal_attention (q (T, H, dk), k (n_kv, Hkv, dk), v (n_kv, Hkv, dv)) on the GPU,
    computed by the flash kernel over f32 rows: the same softmax, without a materialized K*Q."""
    k, v = to_device(k).contiguous(), to_device(v).contiguous()
    n_kv, hkv, dv = v.shape
    dk = k.shape[-1]
    return flash_attn(q, _F32Rows(k), _F32Rows(v), n_kv, hkv, dk, dv, cell_pos, q_pos, scale, window, sinks)


def take_rows(x: DeviceArray, rows: np.ndarray) -> DeviceArray:
    """x[rows] for a 2-D device array (the rows whose logits are wanted)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and np.all(np.diff(rows) == 1):
        return x[int(rows[0]):int(rows[-1]) + 1].contiguous()
    from .device_kernels import gather_rows
    return DeviceArray(gather_rows(x.contiguous().dev, _ids(rows)))


def all_finite(x: DeviceArray) -> bool:
    from .device_kernels import count_nonfinite
    return count_nonfinite(x.contiguous().dev) == 0


def moe_combine(y: DeviceArray, slot_pair: np.ndarray, n_out: int) -> DeviceArray:
    """out[t] = sum over slots j (in slot order) of y[slot_pair[t, j]], skipping -1 (dropped experts)."""
    from .device_kernels import gather_sum
    return DeviceArray(gather_sum(y.contiguous().dev, _ids(slot_pair)))


__all__ = ["GpuTensor", "DeviceRowStore", "supports", "upload_weights", "TRANSFERS", "on_device"]
