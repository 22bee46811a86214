"""Activations in GPU memory: `DeviceArray`, the array type of the CUDA backend.

The architectures are written against NumPy arrays. When a layer's weights live on the GPU its
products return DeviceArrays, and the next ops (norms, RoPE, attention, adds) see a DeviceArray and
run on the GPU too (engine.ops / linear / rope / attention dispatch on the array type).  So the
hidden state stays in GPU memory until an op whose weights are on the CPU needs it, as ggml's
scheduler moves a tensor only where the backend changes.

A DeviceArray supports the NumPy the architectures use: shape / dtype / reshape, basic slicing
(views), slice assignment, `+ - *` with broadcasting (in place too), `np.ascontiguousarray`,
`np.empty_like` / `np.zeros_like` / `np.copy`.  Anything else raises TypeError, and so does
`np.asarray(d)`: a transfer to the host is always explicit (`to_host`), and counted in
`TRANSFERS`, which the tests read to check that a layer costs two transfers, not one per op.

numba.cuda is imported only when a GPU path is used (never by `ikcli --help` or a CPU run).  With
NUMBA_ENABLE_CUDASIM=1 everything runs on Numba's CUDA simulator (the test suite's way).
"""
from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

import quant.cuda_compat  # noqa: F401  (NumPy only; before numba.cuda compiles anything)

DEVICE_NAME = "CUDA0"


@dataclass
class Transfers:
    """Host <-> device copies of activations (weights and caches are not counted)."""
    h2d: int = 0
    d2h: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def reset(self) -> None:
        self.h2d = self.d2h = self.h2d_bytes = self.d2h_bytes = 0


TRANSFERS = Transfers()


@functools.lru_cache(maxsize=1)
def gpu_status() -> str:
    """"" when a CUDA device (or Numba's simulator) can be used, else why not, in a few words."""
    try:
        from numba import cuda
    except Exception as e:                              # noqa: BLE001 - any import failure means no GPU
        return f"numba.cuda cannot be imported ({type(e).__name__})"
    try:
        if not cuda.is_available():
            return "no CUDA device found"
    except Exception as e:                              # noqa: BLE001
        return f"CUDA is not usable ({type(e).__name__}: {e})"
    return ""


def simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def device_name() -> str:
    """The GPU's name for the log ("Numba CUDA simulator" under NUMBA_ENABLE_CUDASIM)."""
    from numba import cuda
    if simulated():
        return "Numba CUDA simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def free_memory() -> tuple[int, int]:
    """(free, total) bytes of device memory."""
    from numba import cuda
    if simulated():
        return 1 << 40, 1 << 40
    return tuple(int(v) for v in cuda.current_context().get_memory_info())


# --------------------------------------------------------------------------- element-wise kernels

_OPS = {"copy": 0, "add": 1, "sub": 2, "mul": 3}


def _kernels() -> dict:
    from . import device_kernels       # imports numba.cuda: only on the GPU path
    return device_kernels.KERNELS


def _same_rank(d: Any, ndim: int) -> Any:
    """d with leading axes of length 1 added up to rank ndim (a copy if d is not contiguous)."""
    if d.ndim == ndim:
        return d
    if not is_contiguous(d):
        d = _contiguous_copy(d)
    return d.reshape((1,) * (ndim - d.ndim) + tuple(d.shape))


def is_contiguous(d: Any) -> bool:
    return d.is_c_contiguous() if hasattr(d, "is_c_contiguous") else bool(d.flags["C_CONTIGUOUS"])


def _empty(shape: tuple, dtype=np.float32) -> Any:
    from numba import cuda
    return cuda.device_array(tuple(int(s) for s in shape), dtype=dtype)


def elementwise(out: Any, a: Any, b: Any, op: str) -> Any:
    """out = a (op) b on numba device arrays, op "copy" (b), "add", "sub" or "mul"; a and b broadcast
    to out's shape (axes of length 1, fewer leading axes).  The element-wise kernels of the GPU path
    (engine.cuda_ops' add / mul / scale call this too).  Returns out."""
    _elementwise(out, a, b, _OPS[op])
    return out


def _elementwise(out: Any, a: Any, b: Any, op: int) -> None:
    n = int(np.prod(out.shape))
    if n == 0:
        return
    if out.ndim > 4:
        raise TypeError(f"device arrays of rank {out.ndim} are not supported")
    a, b = _same_rank(a, out.ndim), _same_rank(b, out.ndim)
    _kernels()[out.ndim][_kernels()["launch"](n)](out, a, b, op)


def _contiguous_copy(d: Any) -> Any:
    out = _empty(d.shape, d.dtype)
    _elementwise(out, d, d, _OPS["copy"])
    return out


# --------------------------------------------------------------------------------- DeviceArray

class DeviceArray:
    """An array in GPU memory (a numba.cuda device array, `dev`) with the NumPy surface above."""

    __slots__ = ("dev",)
    device = DEVICE_NAME

    def __init__(self, dev: Any) -> None:
        self.dev = dev

    # ---- shape ----
    @property
    def shape(self) -> tuple:
        return tuple(self.dev.shape)

    @property
    def ndim(self) -> int:
        return len(self.dev.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.dev.dtype)

    @property
    def size(self) -> int:
        return int(np.prod(self.dev.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.dev.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def contiguous(self) -> "DeviceArray":
        return self if is_contiguous(self.dev) else DeviceArray(_contiguous_copy(self.dev))

    def reshape(self, *shape: Any) -> "DeviceArray":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        return DeviceArray(self.contiguous().dev.reshape(shape))

    # ---- indexing (basic only: ints, slices with step 1, Ellipsis) ----
    def basic_index(self, idx: Any) -> tuple:
        """idx as a tuple of ints and slices: Ellipsis expanded into full slices, since numba.cuda's
        device arrays take no Ellipsis (the simulator's, NumPy arrays, do)."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        for i in idx:
            if not (isinstance(i, (int, np.integer, slice)) or i is Ellipsis):
                raise TypeError(f"device arrays take basic indexing only, not {type(i).__name__}")
            if isinstance(i, slice) and i.step not in (None, 1):
                raise TypeError("device arrays take slices with step 1 only")
        dots = [k for k, i in enumerate(idx) if i is Ellipsis]
        if len(dots) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if dots:
            k = dots[0]
            idx = idx[:k] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[k + 1:]
        return idx

    def __getitem__(self, idx: Any) -> "DeviceArray":
        return DeviceArray(self.dev[self.basic_index(idx)])

    def __setitem__(self, idx: Any, value: Any) -> None:
        view = self.dev[self.basic_index(idx)]
        if np.isscalar(value):
            if not is_contiguous(view):
                raise TypeError("filling a strided device view is not supported")
            flat = view.reshape(int(np.prod(view.shape)))
            _kernels()["fill"][_kernels()["launch"](flat.shape[0])](flat, self.dtype.type(value))
            return
        src = to_device(value).dev if not isinstance(value, DeviceArray) else value.dev
        if tuple(view.shape) == () or view.ndim == 0:
            raise TypeError("scalar element assignment on a device array is not supported")
        _elementwise(view, view, src, _OPS["copy"])

    # ---- arithmetic (broadcasting; host operands are uploaded) ----
    def _binary(self, other: Any, op: str, out: Any = None, reverse: bool = False) -> "DeviceArray":
        b = _operand(other, self.dtype)
        a = self.dev
        if reverse:
            a, b = b, a
        shape = np.broadcast_shapes(tuple(a.shape), tuple(b.shape))
        if out is None:
            out = _empty(shape, self.dtype)
        elif tuple(out.shape) != shape:
            raise ValueError(f"in-place operation would change the shape {tuple(out.shape)} -> {shape}")
        _elementwise(out, a, b, _OPS[op])
        return DeviceArray(out)

    def __add__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "add")

    def __radd__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "add", reverse=True)

    def __sub__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "sub")

    def __rsub__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "sub", reverse=True)

    def __mul__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "mul")

    def __rmul__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "mul", reverse=True)

    def __iadd__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "add", out=self.dev)

    def __isub__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "sub", out=self.dev)

    def __imul__(self, o: Any) -> "DeviceArray":
        return self._binary(o, "mul", out=self.dev)

    def __neg__(self) -> "DeviceArray":
        return self._binary(-1.0, "mul")

    # ---- NumPy protocols: explicit transfers only ----
    def __array__(self, *args: Any, **kw: Any) -> np.ndarray:
        raise TypeError("a GPU array was used as a host array; call engine.device.to_host() where a transfer is meant")

    __array_priority__ = 1000

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        """host (op) device: np.add(host, dev) etc. as the operators above; other ufuncs refuse."""
        names = {np.add: "add", np.subtract: "sub", np.multiply: "mul"}
        if method != "__call__" or ufunc not in names or len(inputs) != 2:
            return NotImplemented
        out = kw.get("out")
        a, b = inputs
        if out is not None:
            tgt = out[0]
            if not isinstance(tgt, DeviceArray):
                # host_array op= device_array: the result must land in the host array (Python cannot
                # rebind it here), so the device operand comes down; write `h = h + d` to stay on the GPU
                return ufunc(*(to_host(v) for v in inputs), out=tgt)
            if tgt is a:
                return a._binary(b, names[ufunc], out=tgt.dev)
            if tgt is b and ufunc is not np.subtract:
                return b._binary(a, names[ufunc], out=tgt.dev)
            return NotImplemented
        if isinstance(a, DeviceArray):
            return a._binary(b, names[ufunc])
        return b._binary(a, names[ufunc], reverse=True)

    def __array_function__(self, func, types, args, kwargs):
        handler = _FUNCTIONS.get(func)
        if handler is None:
            return NotImplemented
        return handler(*args, **kwargs)


def _operand(x: Any, dtype: np.dtype) -> Any:
    if isinstance(x, DeviceArray):
        return x.dev
    if np.isscalar(x):
        return _const_scalar(float(x), np.dtype(dtype).str)
    return to_device(np.asarray(x, dtype=dtype)).dev


@functools.lru_cache(maxsize=64)
def _const_scalar(v: float, dtype: str) -> Any:
    from numba import cuda
    return cuda.to_device(np.array([v], dtype=np.dtype(dtype)))


def _ascontiguousarray(a: DeviceArray, dtype: Any = None) -> DeviceArray:
    if dtype is not None and np.dtype(dtype) != a.dtype:
        raise TypeError("device arrays are not converted between types")
    return a.contiguous()


def _empty_like(a: DeviceArray, dtype: Any = None, shape: Any = None) -> DeviceArray:
    return DeviceArray(_empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype))


def _zeros_like(a: DeviceArray, dtype: Any = None, shape: Any = None) -> DeviceArray:
    d = _empty_like(a, dtype, shape)
    d[...] = 0
    return d


def _copy(a: DeviceArray) -> DeviceArray:
    return DeviceArray(_contiguous_copy(a.dev))


_FUNCTIONS = {np.ascontiguousarray: _ascontiguousarray, np.empty_like: _empty_like,
              np.zeros_like: _zeros_like, np.copy: _copy}


# ------------------------------------------------------------------------------------ transfers

def on_device(x: Any) -> bool:
    return isinstance(x, DeviceArray)


def to_device(x: Any) -> DeviceArray:
    """A host array copied into GPU memory (counted); a DeviceArray as it is."""
    if isinstance(x, DeviceArray):
        return x
    from numba import cuda
    h = np.ascontiguousarray(x)
    TRANSFERS.h2d += 1
    TRANSFERS.h2d_bytes += h.nbytes
    return DeviceArray(cuda.to_device(h))


def to_host(x: Any) -> np.ndarray:
    """A DeviceArray copied to host memory (counted); a host array as it is."""
    if not isinstance(x, DeviceArray):
        return x
    d = x.contiguous().dev
    TRANSFERS.d2h += 1
    TRANSFERS.d2h_bytes += x.nbytes
    return d.copy_to_host()


def empty(shape: tuple, like: Any, dtype=np.float32) -> Any:
    """An uninitialised array on the same side as `like` (host ndarray or DeviceArray)."""
    if isinstance(like, DeviceArray):
        return DeviceArray(_empty(shape, dtype))
    return np.empty(shape, dtype=dtype)


_CONSTS: dict[int, tuple[Any, Any]] = {}     # id(host array) -> (weak reference to it, device copy)


def const(x: np.ndarray, dtype: Any = np.float32) -> Any:
    """A device copy (as dtype, contiguous) of a host constant (a norm weight, sinks), made once per
    host array and kept while that array lives: model constants are uploaded on first use, not per
    call, and not counted as transfers.  Pass the model's own array, not a converted temporary
    (a temporary is uploaded at every call; its entry goes with it, so nothing accumulates)."""
    key = id(x)
    hit = _CONSTS.get(key)
    if hit is not None and hit[0]() is x:
        return hit[1]
    from numba import cuda
    d = cuda.to_device(np.ascontiguousarray(x, dtype=dtype))
    _CONSTS[key] = (weakref.ref(x), d)
    weakref.finalize(x, _CONSTS.pop, key, None)
    return d
