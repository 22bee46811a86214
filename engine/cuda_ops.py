"""The forward pass's kernels on a CUDA GPU (numba.cuda): norms, element-wise ops, RoPE, cache
writes and flash attention over a cache kept in its stored type.

Imported only on the GPU path (engine.cuda_backend); under NUMBA_ENABLE_CUDASIM=1 on Numba's
simulator (quant.cuda_matmul gives it warp shuffles).  Arguments and results are numba.cuda
device arrays, f32 unless said; every function takes an optional `stream` (default 0).

Launch configuration (module constants; the tests shrink them to 32-64 threads):

* element-wise ops (add, mul, scale, silu_mul, sigmoid) and RoPE: one thread per element / pair,
  THREADS = 256 per block, a grid of up to MAX_BLOCKS blocks striding over the rest.
* rows (rms_norm, softmax_rows): one block of ROW_THREADS = 256 per row (grid-strided over the
  rows); a warp-shuffle sum / max, then the warps' partials through shared memory.
* write_rows: one thread per value (F32 / F16 / BF16) or per 32-block (Q8_0, Q4_0, Q6_0).
* flash_attn: one kernel for generation and prompts.  A block (FA_WARPS = 4 warps, 128
  threads) takes FA_WARPS * FA_ROWS_PER_WARP (8) query rows of one kv head (GQA: the rows are
  (token, head of the group)) and one range of cells (split-K); it walks its cells FA_BC at a
  time (<= 32, so that the decoded K and V tiles fit 40 KB of shared memory: 16 for the 576-wide
  MLA rows), every thread decoding 8-value chunks of K (and V) into shared memory, then each
  warp updates its rows' online softmax cell by cell (lanes over the head's values, a shuffle
  sum per score, exp and the running max / sum / accumulator in registers).  Cell tiles that
  no row of the block sees (causal mask, window) are skipped.  Generation (few rows) splits
  the cells into ranges so that there are at least FA_TARGET_BLOCKS (2 per H100 SM) blocks,
  none shorter than FA_MIN_SPLIT cells; a second kernel (one thread per output value) merges
  the ranges and adds the sinks.  Prompts get one range (the row tiles fill the GPU).
  MLA (v_rows None): V is the first dv values of each K head, read from the same decoded K
  tile: a quantized (Q8_0) latent row is decoded once, by K's own row stride and head offset.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, int64

from quant import cuda_matmul as CM
from quant.cuda_matmul import dmax, dmin
from quant.types import type_info

from .device import elementwise

F32, F16, Q4_0, Q8_0, BF16, Q6_0 = 0, 1, 2, 8, 30, 133
CACHE_TYPES = frozenset({F32, F16, BF16, Q8_0, Q4_0, Q6_0})     # flash_attn reads these
WRITE_TYPES = frozenset({F32, F16, BF16, Q8_0, Q4_0, Q6_0})     # write_rows writes these

THREADS = 256            # element-wise kernels
ROW_THREADS = 256        # rms_norm / softmax: threads per row (a multiple of 32)
MAX_BLOCKS = 1 << 16
FA_WARPS = 4             # flash attention: warps per block
FA_ROWS_PER_WARP = 2     # query rows per warp
FA_MAX_BC = 32           # cells per shared-memory tile at most
FA_SMEM_FLOATS = 10240   # 40 KB of decoded K (+ V) per tile
FA_TARGET_BLOCKS = 264   # generation: split the cells until there are this many blocks
FA_MIN_SPLIT = 128       # ... with ranges of this many cells at least
FULL = 0xFFFFFFFF
NEG_INF = float("-inf")


def _blocks(n: int, per: int) -> int:
    return max(1, min(MAX_BLOCKS, (n + per - 1) // per))


def _empty(shape: tuple, dtype=np.float32) -> Any:
    return cuda.device_array(tuple(int(s) for s in shape), dtype=dtype)


def _flat(a: Any) -> Any:
    n = int(np.prod(a.shape))
    return a if len(a.shape) == 1 else a.reshape(n)


def _dev(a: Any, dtype=np.float32) -> Any:
    """A host array uploaded (tests, small tables); a device array as it is."""
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a, dtype=dtype))
    return a


# the shuffles live in this module too: a device function that calls `cuda.*` must be in the
# kernel's own module under the simulator (it swaps the `cuda` global of the kernel's module)
@cuda.jit(device=True)
def warp_sum_shuffles(v):
    v += cuda.shfl_xor_sync(FULL, v, 16)
    v += cuda.shfl_xor_sync(FULL, v, 8)
    v += cuda.shfl_xor_sync(FULL, v, 4)
    v += cuda.shfl_xor_sync(FULL, v, 2)
    v += cuda.shfl_xor_sync(FULL, v, 1)
    return v


@cuda.jit(device=True)
def warp_max_shuffles(v):
    v = dmax(v, cuda.shfl_xor_sync(FULL, v, 16))
    v = dmax(v, cuda.shfl_xor_sync(FULL, v, 8))
    v = dmax(v, cuda.shfl_xor_sync(FULL, v, 4))
    v = dmax(v, cuda.shfl_xor_sync(FULL, v, 2))
    v = dmax(v, cuda.shfl_xor_sync(FULL, v, 1))
    return v


if CM.SIM:      # the simulator's one-exchange butterfly (see quant.cuda_matmul.warp_sum)
    @cuda.jit(device=True)
    def warp_sum(v):
        return cuda.ikcli_butterfly(v, False)

    @cuda.jit(device=True)
    def warp_max(v):
        return cuda.ikcli_butterfly(v, True)
else:
    warp_sum, warp_max = warp_sum_shuffles, warp_max_shuffles


_KERNELS: dict = {}


# ------------------------------------------------------------------------------------------
# element-wise ops: one kernel, specialised per op
# ------------------------------------------------------------------------------------------
_SILU_MUL, _SIGMOID, _SILU = 3, 4, 5     # add / mul / scale: engine.device.elementwise


def _ew_kernel(op: int) -> Any:
    k = _KERNELS.get(("ew", op))
    if k is not None:
        return k
    OP = op

    @cuda.jit
    def ew(a, b, out, s):
        # out[i] = act(a[i]) (* b[i]): the activations (the arithmetic is engine.device's)
        for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
            x = a[i]
            if OP == 3:
                out[i] = x / (float32(1.0) + math.exp(-x)) * b[i]
            elif OP == 4:
                out[i] = float32(1.0) / (float32(1.0) + math.exp(-x))
            else:
                out[i] = x / (float32(1.0) + math.exp(-x))

    _KERNELS[("ew", op)] = ew
    return ew


def _binary(op: int, a: Any, b: Any, out: Any, stream: Any) -> Any:
    """An activation kernel over a (and b, of a's shape, for silu_mul)."""
    out = _checked_out(a, b, out)
    n = int(np.prod(a.shape))
    if n:
        _ew_kernel(op)[_blocks(n, THREADS), THREADS, stream](_flat(a), _flat(a if b is None else b), _flat(out),
                                                            float32(0.0))
    return out


def _checked_out(a: Any, b: Any, out: Any) -> Any:
    if out is None:
        out = _empty(a.shape)
    elif tuple(out.shape) != tuple(a.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(a.shape)}")
    if b is not None and not (tuple(b.shape) == tuple(a.shape) or (len(b.shape) == 1 and b.shape[0] == tuple(a.shape)[-1])):
        raise ValueError(f"operand of shape {tuple(b.shape)} does not fit {tuple(a.shape)} "
                         "(same shape, or a row of the last axis)")
    return out


def add(a: Any, b: Any, out: Any = None, stream: Any = 0) -> Any:
    """a + b: b of a's shape, or (n,) broadcast over the rows of a (..., n) (a bias)."""
    return elementwise(_checked_out(a, b, out), a, b, "add")


def mul(a: Any, b: Any, out: Any = None, stream: Any = 0) -> Any:
    """a * b, shapes as add."""
    return elementwise(_checked_out(a, b, out), a, b, "mul")


def scale(a: Any, s: float, out: Any = None, stream: Any = 0) -> Any:
    """a * s for a scalar s."""
    return elementwise(_checked_out(a, None, out), a, cuda.to_device(np.array([s], dtype=np.float32)), "mul")


def silu(x: Any, out: Any = None, stream: Any = 0) -> Any:
    """x * sigmoid(x)."""
    return _binary(_SILU, x, None, out, stream)


def silu_mul(g: Any, u: Any, out: Any = None, stream: Any = 0) -> Any:
    """silu(g) * u (same shapes)."""
    if tuple(g.shape) != tuple(u.shape):
        raise ValueError(f"silu_mul: {tuple(g.shape)} and {tuple(u.shape)} differ")
    return _binary(_SILU_MUL, g, u, out, stream)


def sigmoid(x: Any, out: Any = None, stream: Any = 0) -> Any:
    return _binary(_SIGMOID, x, None, out, stream)


# ------------------------------------------------------------------------------------------
# row reductions: rms_norm, softmax_rows
# ------------------------------------------------------------------------------------------
_RMS, _SOFTMAX = 0, 1


def _row_kernel(kind: int) -> Any:
    k = _KERNELS.get(("row", kind))
    if k is not None:
        return k
    KIND = kind

    @cuda.jit(device=True)
    def block_reduce(v, part, is_max):
        # every thread gets the block's sum (or max) of v; part: shared (32,)
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        nw = cuda.blockDim.x >> 5
        v = warp_max(v) if is_max else warp_sum(v)
        if lane == 0:
            part[w] = v
        cuda.syncthreads()
        r = part[0]
        for i in range(1, nw):
            r = dmax(r, part[i]) if is_max else r + part[i]
        cuda.syncthreads()
        return r

    @cuda.jit
    def rowk(x, w, has_w, eps, out):
        part = cuda.shared.array(32, float32)
        n = x.shape[1]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):      # block-uniform
            if KIND == 0:
                ss = float32(0.0)
                for j in range(tid, n, nt):
                    v = x[r, j]
                    ss += v * v
                ss = block_reduce(ss, part, False)
                sc = float32(1.0) / math.sqrt(ss / float32(n) + eps)
                for j in range(tid, n, nt):
                    if has_w:
                        out[r, j] = x[r, j] * sc * w[j]
                    else:
                        out[r, j] = x[r, j] * sc
            else:
                m = float32(NEG_INF)
                for j in range(tid, n, nt):
                    m = dmax(m, x[r, j])
                m = block_reduce(m, part, True)
                s = float32(0.0)
                for j in range(tid, n, nt):
                    s += math.exp(x[r, j] - m)
                s = block_reduce(s, part, False)
                inv = float32(1.0) / s
                for j in range(tid, n, nt):
                    out[r, j] = math.exp(x[r, j] - m) * inv

    _KERNELS[("row", kind)] = rowk
    return rowk


def _rows2d(x: Any) -> Any:
    if len(x.shape) == 2:
        return x
    n = int(tuple(x.shape)[-1])
    return x.reshape(int(np.prod(x.shape)) // max(n, 1), n)


def rms_norm(x: Any, w: Any, eps: float, out: Any = None, stream: Any = 0) -> Any:
    """RMSNorm of the rows of x (T, n) (any rank: the last axis), times w (n,) unless None."""
    shape = tuple(x.shape)
    x2 = _rows2d(x)
    o = _empty(x2.shape) if out is None else _rows2d(out)
    wd = x2[0] if w is None else _dev(w)
    if int(x2.shape[0]) and int(x2.shape[1]):
        _row_kernel(_RMS)[_blocks(int(x2.shape[0]), 1), ROW_THREADS, stream](
            x2, wd, w is not None, float32(eps), o)
    return out if out is not None else o if len(shape) == 2 else o.reshape(shape)


def softmax_rows(x: Any, out: Any = None, stream: Any = 0) -> Any:
    """Softmax over the last axis."""
    shape = tuple(x.shape)
    x2 = _rows2d(x)
    o = _empty(x2.shape) if out is None else _rows2d(out)
    if int(x2.shape[0]) and int(x2.shape[1]):
        _row_kernel(_SOFTMAX)[_blocks(int(x2.shape[0]), 1), ROW_THREADS, stream](x2, x2[0], False, float32(0), o)
    return out if out is not None else o if len(shape) == 2 else o.reshape(shape)


# ------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------
@cuda.jit
def _rope(x, cos, sin, neox):
    # x (T, H, D) in place; pairs i < n/2 of the first n = 2 * cos.shape[1] values of each head
    T, H = x.shape[0], x.shape[1]
    half = cos.shape[1]
    total = T * H * half
    for q in range(cuda.grid(1), total, cuda.gridsize(1)):
        i = q % half
        th = q // half
        h = th % H
        t = th // H
        if neox:
            i0 = i
            i1 = i + half
        else:
            i0 = 2 * i
            i1 = 2 * i + 1
        a = x[t, h, i0]
        b = x[t, h, i1]
        c = cos[t, i]
        s = sin[t, i]
        x[t, h, i0] = a * c - b * s
        x[t, h, i1] = a * s + b * c


def apply_rope(x: Any, cos: Any, sin: Any, neox: bool, stream: Any = 0) -> Any:
    """Rotate x (T, H, D) in place as engine.rope.apply_rope (cos, sin (T, D/2) f32, uploaded).
    A (T, D) x counts as one head.  Returns x."""
    x3 = x if len(x.shape) == 3 else x.reshape(int(x.shape[0]), 1, int(tuple(x.shape)[-1]))
    cos, sin = _dev(cos), _dev(sin)
    if int(cos.shape[0]) != int(x3.shape[0]) or 2 * int(cos.shape[1]) > int(x3.shape[2]):
        raise ValueError(f"RoPE tables {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    n = int(x3.shape[0]) * int(x3.shape[1]) * int(cos.shape[1])
    if n:
        _rope[_blocks(n, THREADS), THREADS, stream](x3, cos, sin, bool(neox))
    return x


# ------------------------------------------------------------------------------------------
# cache writes
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _put_f16(o, r, off, v):
    h = CM.f32_to_f16_bits(v)
    o[r, off] = h & 0xFF
    o[r, off + 1] = (h >> 8) & 0xFF


@cuda.jit(device=True)
def _rnd_away(v):
    """C's roundf for |v| < 2^23, as an int64."""
    a = abs(v)
    t = int64(a)
    if a - float32(t) >= float32(0.5):
        t += 1
    return -t if v < 0 else t


def _write_kernel(qtype: int) -> Any:
    k = _KERNELS.get(("write", qtype))
    if k is not None:
        return k
    QT = qtype

    @cuda.jit
    def write(o, i0, x):
        # x (t, width) f32 -> rows i0.. of o (the store seen as f32 / uint16 / bytes)
        width = x.shape[1]
        if QT == 0 or QT == 1 or QT == 30:
            total = x.shape[0] * width
            for q in range(cuda.grid(1), total, cuda.gridsize(1)):
                t = q // width
                j = q % width
                if QT == 0:
                    o[i0 + t, j] = x[t, j]
                elif QT == 1:
                    o[i0 + t, j] = CM.f32_to_f16_bits(x[t, j]) & 0xFFFF
                else:
                    o[i0 + t, j] = CM.f32_to_bf16_bits(x[t, j]) & 0xFFFF
        else:
            nb = width >> 5
            total = x.shape[0] * nb
            for q in range(cuda.grid(1), total, cuda.gridsize(1)):
                t = q // nb
                b = q % nb
                r = i0 + t
                j0 = 32 * b
                if QT == 8:                                   # Q8_0: quantize_row_q8_0_ref
                    amax = float32(0.0)
                    for j in range(32):
                        amax = dmax(amax, abs(x[t, j0 + j]))
                    dd = amax / float32(127.0)
                    inv = float32(1.0) / dd if dd != float32(0.0) else float32(0.0)
                    ob = 34 * b
                    _put_f16(o, r, ob, dd)
                    for j in range(32):
                        o[r, ob + 2 + j] = _rnd_away(x[t, j0 + j] * inv) & 0xFF
                else:
                    # Q4_0 / Q6_0: the value of largest magnitude (first on ties) / -8 or -32
                    mx = float32(0.0)
                    amax = float32(0.0)
                    for j in range(32):
                        v = x[t, j0 + j]
                        if abs(v) > amax:
                            amax = abs(v)
                            mx = v
                    if QT == 2:
                        dd = mx / float32(-8.0)
                        inv = float32(1.0) / dd if dd != float32(0.0) else float32(0.0)
                        ob = 18 * b
                        _put_f16(o, r, ob, dd)
                        for j in range(16):
                            q0 = dmin(15, int64(x[t, j0 + j] * inv + float32(8.5)))
                            q1 = dmin(15, int64(x[t, j0 + j + 16] * inv + float32(8.5)))
                            o[r, ob + 2 + j] = (q0 | (q1 << 4)) & 0xFF
                    else:                                     # Q6_0, refitted d (legacy._quantize_q6_0)
                        dd = mx / float32(-32.0)
                        inv = float32(1.0) / dd if dd != float32(0.0) else float32(0.0)
                        sqx = float32(0.0)
                        sq2 = float32(0.0)
                        for j in range(16):
                            for hh in range(2):
                                v = x[t, j0 + j + 16 * hh]
                                xs = v * inv
                                q = dmin(63, int64(xs + float32(32.5)))
                                qf = float32(q - 32)
                                wgt = xs * xs
                                sqx += wgt * v * qf
                                sq2 += wgt * qf * qf
                        d2 = sqx / sq2 if sq2 > float32(0.0) else dd
                        ob = 26 * b
                        _put_f16(o, r, ob, d2)
                        for j in range(8):
                            o[r, ob + 2 + j] = 0
                        for j in range(16):
                            qa = dmin(63, int64(x[t, j0 + j] * inv + float32(32.5)))
                            qb = dmin(63, int64(x[t, j0 + j + 16] * inv + float32(32.5)))
                            o[r, ob + 10 + j] = ((qa & 15) | ((qb & 15) << 4)) & 0xFF
                            hbits = (qa >> 4) | ((qb >> 4) << 2)
                            o[r, ob + 2 + (j & 7)] = (int64(o[r, ob + 2 + (j & 7)]) | (hbits << (4 * (j >> 3)))) & 0xFF

    _KERNELS[("write", qtype)] = write
    return write


def write_rows(rows_dev: Any, qtype: int, i0: int, x_dev: Any, stream: Any = 0) -> None:
    """Rows [i0, i0 + t) of a cache store (a (n_ctx, row_bytes) uint8 device array of qtype) =
    x (t, width) f32, converted / quantized on the GPU as engine.kv_cache.RowStore.write does:
    F32, F16, BF16 and Q8_0 give the reference's bytes exactly; Q4_0 and Q6_0 can differ from
    them by one quant where x * (1/d) + 8.5 (32.5) lands within an ulp of an integer, as the
    GPU may fuse that product and sum, and Q6_0's refitted d by an ulp for the same reason."""
    qtype = int(qtype)
    if qtype not in WRITE_TYPES:
        raise NotImplementedError(f"write_rows: no GPU conversion to {type_info(qtype).name}")
    x = _dev(x_dev)
    if len(x.shape) != 2:
        x = x.reshape(int(x.shape[0]), int(np.prod(x.shape[1:])))
    t, width = int(x.shape[0]), int(x.shape[1])
    if type_info(qtype).row_bytes(width) != int(rows_dev.shape[1]):
        raise ValueError(f"rows of {width} values do not fit the store's {int(rows_dev.shape[1])} bytes")
    if i0 < 0 or i0 + t > int(rows_dev.shape[0]):
        raise IndexError(f"rows {i0}..{i0 + t} outside the store's {int(rows_dev.shape[0])}")
    if t == 0:
        return
    o = CM.element_view(rows_dev, qtype)
    items = t * width if qtype in (F32, F16, BF16) else t * (width // 32)
    _write_kernel(qtype)[_blocks(items, THREADS), THREADS, stream](o, int(i0), x)


# ------------------------------------------------------------------------------------------
# flash attention
# ------------------------------------------------------------------------------------------
def _fa_bc(dk: int, dv: int, v_is_k: bool) -> int:
    width = dk + (0 if v_is_k else dv)
    return max(1, min(FA_MAX_BC, FA_SMEM_FLOATS // width))


def _fa_kernel(kqt: int, vqt: int, dk: int, dv: int, v_is_k: bool, RW: int, BC: int) -> Any:
    key = ("fa", kqt, vqt, dk, dv, v_is_k, RW, BC)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    deck = CM.decoder(kqt)
    decv = CM.decoder(vqt) if not v_is_k else deck
    NQ = (dk + 31) // 32           # q values per lane
    NV = (dv + 31) // 32           # accumulator values per lane
    CK = dk // 8                   # chunks per K head
    CV = dv // 8
    VW = 1 if v_is_k else dv       # shared V tile width (unused for MLA)
    VIK = v_is_k

    @cuda.jit
    def fa(q, kd, vd, n_kv, G, cell_pos, q_pos, window, scale, per, part_acc, part_m, part_l):
        tid = cuda.threadIdx.x
        lane = tid & 31
        wp = tid >> 5
        nthr = cuda.blockDim.x
        RB = (nthr >> 5) * RW
        H = q.shape[1]
        T = q.shape[0]
        R = T * G
        g = cuda.blockIdx.y
        s = cuda.blockIdx.z
        c0 = s * per
        c1 = dmin(n_kv, c0 + per)
        sK = cuda.shared.array((BC, dk), float32)
        sV = cuda.shared.array((BC, VW), float32)
        y = cuda.local.array(8, float32)
        qr = cuda.local.array((RW, NQ), float32)
        acc = cuda.local.array((RW, NV), float32)
        mr = cuda.local.array(RW, float32)
        lr = cuda.local.array(RW, float32)
        nrt = (R + RB - 1) // RB
        for rt in range(cuda.blockIdx.x, nrt, cuda.gridDim.x):            # block-uniform
            # this block's rows: positions they see, and the warp's own rows into registers
            pmax = int64(-1)
            pmin = int64(1) << 62
            for rr in range(RB):
                r = rt * RB + rr
                if r < R:
                    p = int64(q_pos[r // G])
                    pmax = dmax(pmax, p)
                    pmin = dmin(pmin, p)
            for i in range(RW):
                r = rt * RB + wp * RW + i
                mr[i] = NEG_INF
                lr[i] = 0.0
                for kv in range(NV):
                    acc[i, kv] = 0.0
                for kq in range(NQ):
                    dd = lane + 32 * kq
                    v = float32(0.0)
                    if r < R and dd < dk:
                        v = q[r // G, g * G + r % G, dd] * scale
                    qr[i, kq] = v
            for j0 in range(c0, c1, BC):
                nb = dmin(BC, c1 - j0)
                # skip the tile if no row of the block sees any of its cells
                cmin = int64(1) << 62
                cmax = int64(-(1 << 62))
                for c in range(nb):
                    cp = int64(cell_pos[j0 + c])
                    cmin = dmin(cmin, cp)
                    cmax = dmax(cmax, cp)
                if cmin > pmax or (window > 0 and cmax <= pmin - window):
                    continue
                for qq in range(tid, nb * CK, nthr):
                    c = qq // CK
                    kc = qq % CK
                    deck(kd, j0 + c, g * CK + kc, y)
                    for j in range(8):
                        sK[c, 8 * kc + j] = y[j]
                if not VIK:
                    for qq in range(tid, nb * CV, nthr):
                        c = qq // CV
                        kc = qq % CV
                        decv(vd, j0 + c, g * CV + kc, y)
                        for j in range(8):
                            sV[c, 8 * kc + j] = y[j]
                cuda.syncthreads()
                for i in range(RW):
                    r = rt * RB + wp * RW + i
                    if r < R:                                          # warp-uniform
                        qp = int64(q_pos[r // G])
                        for c in range(nb):
                            cp = int64(cell_pos[j0 + c])
                            if cp <= qp and (window <= 0 or qp - cp < window):
                                part = float32(0.0)
                                for kq in range(NQ):
                                    dd = lane + 32 * kq
                                    if dd < dk:
                                        part += qr[i, kq] * sK[c, dd]
                                sc = warp_sum(part)
                                mnew = dmax(mr[i], sc)
                                corr = math.exp(mr[i] - mnew)
                                p = math.exp(sc - mnew)
                                lr[i] = lr[i] * corr + p
                                mr[i] = mnew
                                for kv in range(NV):
                                    dd = lane + 32 * kv
                                    if dd < dv:
                                        if VIK:
                                            vv = sK[c, dd]
                                        else:
                                            vv = sV[c, dd]
                                        acc[i, kv] = acc[i, kv] * corr + p * vv
                cuda.syncthreads()
            for i in range(RW):
                r = rt * RB + wp * RW + i
                if r < R:
                    o = (r // G) * H + g * G + r % G
                    if lane == 0:
                        part_m[s, o] = mr[i]
                        part_l[s, o] = lr[i]
                    for kv in range(NV):
                        dd = lane + 32 * kv
                        if dd < dv:
                            part_acc[s, o, dd] = acc[i, kv]

    _KERNELS[key] = fa
    return fa


@cuda.jit
def _fa_combine(part_acc, part_m, part_l, sinks, has_sinks, H, out):
    # out[o, d] = sum_s e^(m_s - M) acc_s[o, d] / (sum_s e^(m_s - M) l_s (+ e^(sink - M)))
    nsplit = part_m.shape[0]
    nrow = part_m.shape[1]
    dv = out.shape[1]
    for q in range(cuda.grid(1), nrow * dv, cuda.gridsize(1)):
        o = q // dv
        d = q % dv
        mx = float32(NEG_INF)
        for s in range(nsplit):
            mx = dmax(mx, part_m[s, o])
        if mx == float32(NEG_INF):
            out[o, d] = 0.0
            continue
        sk = float32(0.0)
        if has_sinks:
            sk = sinks[o % H]
            mx = dmax(mx, sk)
        tot = float32(0.0)
        num = float32(0.0)
        for s in range(nsplit):
            m = part_m[s, o]
            if m != float32(NEG_INF):
                w = math.exp(m - mx)
                tot += w * part_l[s, o]
                num += w * part_acc[s, o, d]
        if has_sinks:
            tot += math.exp(sk - mx)
        out[o, d] = num / tot


def flash_attn(q: Any, k_rows: Any, k_qtype: int, v_rows: Any, v_qtype: int | None, n_kv: int, n_head_kv: int,
               dk: int, dv: int, cell_pos: Any, q_pos: Any, scale: float, window: int = 0, sinks: Any = None,
               stream: Any = 0) -> Any:
    """softmax(scale * q.k) . v over cells 0..n_kv-1 of a cache in GPU memory, as
    engine.flash_attn.flash_attn: query t sees cell j iff cell_pos[j] <= q_pos[t] and, with a
    window, q_pos[t] - cell_pos[j] < window; sinks (H,) add a logit with no value; a query that
    sees no cell gets zeros.  q (T, H, dk) f32 -> (T, H, dv) f32.  k_rows / v_rows: (n_ctx,
    row_bytes) uint8 stores (F32, F16, BF16, Q8_0, Q4_0, Q6_0) of n_head_kv heads of dk / dv
    values; v_rows None: V is the first dv values of each K head (the MLA latent cache).
    cell_pos, q_pos: int32 (device or host) arrays."""
    k_qtype = int(k_qtype)
    v_is_k = v_rows is None
    v_qtype = k_qtype if v_is_k else int(v_qtype)
    for qt in (k_qtype, v_qtype):
        if qt not in CACHE_TYPES:
            raise NotImplementedError(f"flash_attn: no GPU kernel for a {type_info(qt).name} cache")
    T, H = int(q.shape[0]), int(q.shape[1])
    if len(q.shape) != 3 or int(q.shape[2]) != dk or H % n_head_kv:
        raise ValueError(f"flash_attn: q {tuple(q.shape)} does not fit {n_head_kv} kv heads of {dk} values")
    if v_is_k and dv > dk:
        raise ValueError("flash_attn: V inside K needs dv <= dk")
    bk, bv = type_info(k_qtype).block_size, type_info(v_qtype).block_size
    if dk % max(8, bk) or (not v_is_k and dv % max(8, bv)) or dv % 8:
        raise ValueError(f"flash_attn: head sizes {dk}/{dv} are not whole blocks of the cache types")
    if int(k_rows.shape[1]) != type_info(k_qtype).row_bytes(n_head_kv * dk):
        raise ValueError("flash_attn: K rows do not hold n_head_kv heads of dk values")
    if not v_is_k and int(v_rows.shape[1]) != type_info(v_qtype).row_bytes(n_head_kv * dv):
        raise ValueError("flash_attn: V rows do not hold n_head_kv heads of dv values")
    out = _empty((T, H, dv))
    if T == 0 or H == 0:
        return out
    if n_kv <= 0:
        elementwise(out, out, cuda.to_device(np.zeros(1, np.float32)), "copy")
        return out
    cell_pos = _dev(cell_pos, np.int32)
    q_pos = _dev(q_pos, np.int32)
    G = H // n_head_kv
    RW = FA_ROWS_PER_WARP
    RB = FA_WARPS * RW
    BC = _fa_bc(dk, dv, v_is_k)
    nrt = -(-(T * G) // RB)
    nrt_grid = min(nrt, MAX_BLOCKS)
    nsplit = 1
    if nrt_grid * n_head_kv < FA_TARGET_BLOCKS:
        nsplit = max(1, min(-(-FA_TARGET_BLOCKS // (nrt_grid * n_head_kv)), n_kv // max(1, FA_MIN_SPLIT)))
        nsplit = min(nsplit, 65535)
    per = -(-n_kv // nsplit)
    per = -(-per // BC) * BC
    nsplit = -(-n_kv // per)
    part_acc = _empty((nsplit, T * H, dv))
    part_m = _empty((nsplit, T * H))
    part_l = _empty((nsplit, T * H))
    kd = CM.element_view(k_rows, k_qtype)
    vd = kd if v_is_k else CM.element_view(v_rows, v_qtype)
    k = _fa_kernel(k_qtype, v_qtype, int(dk), int(dv), v_is_k, RW, BC)
    k[(nrt_grid, n_head_kv, nsplit), 32 * FA_WARPS, stream](
        q, kd, vd, int(n_kv), G, cell_pos, q_pos, int(window), float32(scale), per, part_acc, part_m, part_l)
    has_s = sinks is not None
    sk = _dev(sinks) if has_s else part_m[0]
    _fa_combine[_blocks(T * H * dv, THREADS), THREADS, stream](part_acc, part_m, part_l, sk, has_s, H,
                                                                out.reshape(T * H, dv))
    return out


__all__ = ["rms_norm", "add", "mul", "scale", "silu", "silu_mul", "softmax_rows", "sigmoid", "apply_rope",
           "flash_attn", "write_rows", "CACHE_TYPES", "WRITE_TYPES"]
