"""The element-wise kernels behind engine.device.DeviceArray (imported only on the GPU path).

One broadcasting kernel per rank (1..4): out = a (op) b, where a and b have out's rank and each of
their axes has out's length or 1 (broadcast); op 0 copies b, 1 adds, 2 subtracts, 3 multiplies.
Strided views are read and written in place (the kernels index with the arrays' own strides), so
slice assignment into a view needs no temporary.  One thread per element (`launch`).
"""
import numpy as np

import quant.cuda_compat  # noqa: F401  (before numba.cuda compiles anything)
from numba import cuda  # noqa: E402

THREADS = 256          # threads per block (engine.cuda_backend lowers it on the simulator)


def launch(n: int) -> tuple[int, int]:
    """(blocks, threads) for one thread per element of n."""
    return max(1, (n + THREADS - 1) // THREADS), THREADS


@cuda.jit(device=True, inline=True)
def apply(op, x, y):
    if op == 0:
        return y
    if op == 1:
        return x + y
    if op == 2:
        return x - y
    return x * y


@cuda.jit(device=True, inline=True)
def bi(i, n):           # index along an axis of length n (1: broadcast)
    return i if n > 1 else 0


@cuda.jit
def k1(out, a, b, op):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = apply(op, a[bi(i, a.shape[0])], b[bi(i, b.shape[0])])


@cuda.jit
def k2(out, a, b, op):
    t = cuda.grid(1)
    n1 = out.shape[1]
    if t < out.shape[0] * n1:
        i, j = t // n1, t % n1
        out[i, j] = apply(op, a[bi(i, a.shape[0]), bi(j, a.shape[1])], b[bi(i, b.shape[0]), bi(j, b.shape[1])])


@cuda.jit
def k3(out, a, b, op):
    t = cuda.grid(1)
    n1, n2 = out.shape[1], out.shape[2]
    if t < out.shape[0] * n1 * n2:
        i, r = t // (n1 * n2), t % (n1 * n2)
        j, k = r // n2, r % n2
        out[i, j, k] = apply(op, a[bi(i, a.shape[0]), bi(j, a.shape[1]), bi(k, a.shape[2])],
                             b[bi(i, b.shape[0]), bi(j, b.shape[1]), bi(k, b.shape[2])])


@cuda.jit
def k4(out, a, b, op):
    t = cuda.grid(1)
    n1, n2, n3 = out.shape[1], out.shape[2], out.shape[3]
    if t < out.shape[0] * n1 * n2 * n3:
        i, r = t // (n1 * n2 * n3), t % (n1 * n2 * n3)
        j, r = r // (n2 * n3), r % (n2 * n3)
        k, m = r // n3, r % n3
        out[i, j, k, m] = apply(op, a[bi(i, a.shape[0]), bi(j, a.shape[1]), bi(k, a.shape[2]), bi(m, a.shape[3])],
                                b[bi(i, b.shape[0]), bi(j, b.shape[1]), bi(k, b.shape[2]), bi(m, b.shape[3])])


@cuda.jit
def fill(out, v):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = v

KERNELS = {1: k1, 2: k2, 3: k3, 4: k4, "fill": fill, "launch": launch}


@cuda.jit
def _gather_rows(out, x, rows):
    t = cuda.grid(1)
    n = out.shape[1]
    if t < out.shape[0] * n:
        i, j = t // n, t % n
        out[i, j] = x[rows[i], j]


def gather_rows(x, rows):
    """out[i] = x[rows[i]] for a 2-D device array x and device int rows."""
    out = cuda.device_array((rows.shape[0], x.shape[1]), dtype=x.dtype)
    n = out.shape[0] * out.shape[1]
    if n:
        _gather_rows[launch(n)](out, x, rows)
    return out


@cuda.jit
def _gather_sum(out, y, slot_pair):
    # one thread per output value; the slots are summed in slot order, as the CPU path does
    t = cuda.grid(1)
    n = out.shape[1]
    if t < out.shape[0] * n:
        i, j = t // n, t % n
        acc = 0.0
        for s in range(slot_pair.shape[1]):
            p = slot_pair[i, s]
            if p >= 0:
                acc += y[p, j]
        out[i, j] = acc


def gather_sum(y, slot_pair):
    """out[t] = sum over j of y[slot_pair[t, j]] (entries -1 skipped): the MoE expert combine."""
    out = cuda.device_array((slot_pair.shape[0], y.shape[1]), dtype=np.float32)
    n = out.shape[0] * out.shape[1]
    if n:
        _gather_sum[launch(n)](out, y, slot_pair)
    return out


@cuda.jit
def _count_nonfinite(x, count):
    t = cuda.grid(1)
    if t < x.shape[0]:
        v = x[t]
        if not (v - v == 0.0):          # NaN or +-inf
            cuda.atomic.add(count, 0, 1)


def count_nonfinite(x) -> int:
    flat = x.reshape(x.size) if hasattr(x, "size") else x.ravel()
    count = cuda.to_device(np.zeros(1, dtype=np.int32))
    n = flat.shape[0]
    if n:
        _count_nonfinite[launch(n)](flat, count)
    return int(count.copy_to_host()[0])
