"""Quantized products on a CUDA GPU (numba.cuda): the GGUF blocks are decoded on the fly.

Imported only on the GPU path (engine.cuda_backend): importing it imports numba.cuda.  Under
NUMBA_ENABLE_CUDASIM=1 every kernel runs on Numba's CUDA simulator (the test suite's way; the
simulator has no warp shuffles, so this module gives it some, see _simulator_support).

Weights stay in GPU memory as the GGUF bytes, unchanged (`DeviceQTensor`: a uint8 device array
of (rows, row_bytes); the experts of a 3-D tensor stacked as (experts * rows, row_bytes)).

Decoders.  Every type has one device function `dec(d, r, c, y)` that writes values
[8c, 8c + 8) of row r into the 8-float local array y: the unit of work of every kernel is a
chunk of 8 consecutive values (a quarter of a 32-block, a 32nd of a 256-super-block; no type
has a sub-block shorter than 8, so a chunk needs one scale).  `d` is the row array seen in the
type's element: float32 for F32, uint16 for F16 / BF16, uint8 for the block types.  The
decoders follow quant/legacy.py, kquants.py, iqk.py (layouts in their docstrings) and give
the same f32 values as quant.matmul.dequantize, bit for bit (a product of two f32 roundings
in the IQK types, d*ls then *level, done in that order), except IQ6_K in the products: there
the decoder uses ik's integer levels (quant.iqk.IQ6K_INT_LEVELS), as ik's CUDA and CPU
matmuls and quant.simd_blocks do; get_rows / dequantize use dequantize_row_iq6_k's cubic.

Kernels: one generic kernel per job, specialised per type by a factory that closes over the
type's decoder and constants (compiled on first use, cached per type):

* matvec (n <= MATVEC_MAX_N activation rows, and MoE pairs up to MATVEC_MAX_PAIRS): a warp per
  weight row, its 32 lanes striding over the row's chunks (a 256-super-block per warp step:
  lane l decodes chunk l, so a warp reads one block's bytes together and the matching 256
  floats of x, coalesced), up to 8 activation rows (NT) accumulated per decoded chunk, so the
  weights are read once; a shuffle (xor butterfly) sums the lanes.  MV_WARPS warps (4, 128
  threads) per block, a grid of rows / 4 blocks (rows stride by the grid when capped by
  MAX_BLOCKS), grid.y over groups of NT tokens (or over the MoE pairs, one each).
* tiled (more rows): a block computes a TM x TN (tokens x weight rows) tile of the output,
  stepping through the columns TK = 32 values at a time: each thread decodes one 8-value chunk
  of the TN x 32 weight slab into shared memory (padded rows: no bank conflicts), the block
  loads the TM x 32 activations, then every thread accumulates an MM x MN register tile.
  Defaults TM = TN = 64, 256 threads, 4 x 4 per thread: 17 KB of shared memory, a weight slab
  decoded once per 64 tokens.  For MoE the pairs are grouped by expert on the host (ids come
  down once: a few hundred bytes) into tiles of one expert each.  Plain FP32 CUDA-core FMAs:
  a tensor-core / cuBLAS path is the next step for long prompts.
* get_rows / dequantize: one thread per chunk (256 per block), grid-strided.

Launch sizes are module constants (MV_WARPS, TILE, THREADS, MAX_BLOCKS); the tests shrink them
to 32-64 threads for the simulator, every kernel is correct for any of them (grid-stride loops).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import cuda_compat  # noqa: F401  (before numba.cuda compiles anything)
from numba import cuda, float32, int32, int64  # noqa: E402
from numba.core import config as _nb_config

from . import iqk as _iqk
from . import legacy as _lg
from .tensor import QTensor
from .types import type_info

SIM = bool(_nb_config.ENABLE_CUDASIM)

# ---- type ids ----
F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_0, IQ4_NL, MXFP4 = 2, 3, 6, 7, 8, 133, 20, 39
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_XS = 10, 11, 12, 13, 14, 15, 23
IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K = 137, 138, 139, 140, 141
IQ4_KS, IQ2_KS, IQ5_KS, IQ3_KS, IQ2_KL = 144, 145, 152, 156, 157

CUDA_TYPES: frozenset = frozenset({
    F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_0, IQ4_NL, MXFP4,
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_XS,
    IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, IQ2_KS, IQ5_KS, IQ3_KS, IQ2_KL})

# ---- launch configuration (see the module docstring; tests make them smaller) ----
MATVEC_MAX_N = 8          # activation rows up to which matmul takes the matvec kernel
MATVEC_MAX_PAIRS = 16     # MoE pairs up to which matmul_id takes it (one pair per grid.y)
MV_WARPS = 4              # warps per block of the matvec kernel
TILE = (64, 64, 4, 4)     # tiled kernel: TM tokens, TN rows, MM x MN outputs per thread
THREADS = 256             # threads per block of the element kernels (get_rows, dequantize)
MAX_BLOCKS = 1 << 16      # grid.x cap (kernels stride over what a capped grid leaves)
MAX_GRID_Y = 65535        # CUDA's grid.y limit (kernels stride over the rest)
TK = 32                   # columns per step of the tiled kernel (4 chunks)
FULL = 0xFFFFFFFF


# ------------------------------------------------------------------------------------------
# the simulator: warp shuffles and a race-free shared.array (device code only ever runs there
# under NUMBA_ENABLE_CUDASIM=1)
# ------------------------------------------------------------------------------------------
def _simulator_support() -> None:
    """Give Numba's CUDA simulator (which has none) warp shuffles, and make its shared.array
    thread-safe.  A shuffle is an exchange between the threads of one warp through a barrier
    of that warp's threads: as on a GPU, every lane of the warp must take part (full mask)."""
    from numba.cuda.simulator import kernelapi as ka
    if getattr(ka.FakeCUDAModule, "_ikcli_shuffles", False):
        return

    class _Warp:
        def __init__(self, n: int) -> None:
            self.barrier = threading.Barrier(n, action=self._reduce)
            self.vals: list = [None] * 32
            self.op = None          # a butterfly's kind while its lanes meet (the barrier's action runs it)

        def _reduce(self) -> None:
            if self.op is None:
                return
            n, is_max, v = self.barrier.parties, self.op, self.vals[:self.barrier.parties]
            for m in (16, 8, 4, 2, 1):
                v = [_step(v[i], v[i ^ m] if (i ^ m) < n else v[i], is_max) for i in range(n)]
            self.out, self.op = v, None

    def _step(a, b, is_max):
        return dmax.py_func(a, b) if is_max else a + b

    lock = threading.Lock()

    def _warp_state(self):
        t = threading.current_thread()
        bd = self.blockDim
        nthreads = bd.x * bd.y * bd.z
        w = t.thread_id // 32
        key = (tuple(t.blockIdx), w)
        with lock:
            states = self.__dict__.setdefault("_ikcli_warps", {})
            st = states.get(key)
            if st is None:
                st = states[key] = _Warp(min(32, nthreads - 32 * w))
        return st, t.thread_id % 32

    def _exchange(self, value, src_of):
        st, lane = _warp_state(self)
        st.vals[lane] = value
        st.barrier.wait()
        src = src_of(lane)
        out = st.vals[src] if 0 <= src < st.barrier.parties else value
        st.barrier.wait()
        return out

    def butterfly(self, value, is_max):
        """warp_sum / warp_max's xor butterfly in one exchange (the simulator's form): the lanes'
        values meet once and the barrier's action runs the five steps for all of them, with the
        same operations in the same order as the shuffles (a missing partner lane gives the lane's
        own value back, as _exchange), so the result is the shuffles' to the bit.  Five shuffles
        cost ten barrier rounds of 32 woken threads; this costs one."""
        st, lane = _warp_state(self)
        st.vals[lane] = value
        st.op = bool(is_max)
        st.barrier.wait()
        return st.out[lane]

    def shfl_xor_sync(self, mask, value, lane_mask):
        return _exchange(self, value, lambda lane: lane ^ int(lane_mask))

    def shfl_down_sync(self, mask, value, delta):
        return _exchange(self, value, lambda lane: lane + int(delta))

    def shfl_up_sync(self, mask, value, delta):
        return _exchange(self, value, lambda lane: lane - int(delta) if lane >= int(delta) else lane)

    def shfl_sync(self, mask, value, src_lane):
        return _exchange(self, value, lambda lane: int(src_lane) % 32)

    def syncwarp(self, mask=FULL):
        st, _ = _warp_state(self)
        st.barrier.wait()

    for f in (shfl_xor_sync, shfl_down_sync, shfl_up_sync, shfl_sync, syncwarp):
        setattr(ka.FakeCUDAModule, f.__name__, f)
    ka.FakeCUDAModule.ikcli_butterfly = butterfly

    orig_array = ka.FakeCUDAShared.array
    shared_lock = threading.Lock()

    def array(self, shape, dtype):       # the original's get-or-create races between threads
        import sys
        import traceback
        if shape == 0:
            return orig_array(self, shape, dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with shared_lock:
            res = self._allocations.get(caller)
            if res is None:
                from numba.core import types as nbtypes
                from numba.np import numpy_support
                dt = numpy_support.as_dtype(dtype) if isinstance(dtype, nbtypes.Type) else np.dtype(dtype)
                res = self._allocations[caller] = np.zeros(shape, dt)
        return res

    ka.FakeCUDAShared.array = array
    _patch_block_manager()
    ka.FakeCUDAModule._ikcli_shuffles = True


def _patch_block_manager() -> None:
    """The simulator's BlockManager.run, with a short sleep in its polling loop: the original
    spins holding the GIL, so every thread woken by a barrier (a shuffle's, syncthreads')
    waits up to a switch interval for it; with the sleep the kernels here run ~5x faster.
    Otherwise the same loop (numba 0.6x's)."""
    import time
    from numba.cuda.simulator import kernel as sk

    def run(self, grid_point, *args):
        threads, livethreads, blockedthreads = set(), set(), set()
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)
            t = sk.BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            livethreads.add(t)
        while livethreads:
            for t in livethreads:
                if t.syncthreads_blocked:
                    blockedthreads.add(t)
                elif t.exception:
                    for t_other in threads:
                        t_other.abort = True
                        t_other.syncthreads_blocked = False
                        t_other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if livethreads == blockedthreads:
                for t in blockedthreads:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blockedthreads = set()
            livethreads = set(t for t in livethreads if t.is_alive())
            time.sleep(0.0002)
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    if hasattr(sk, "BlockManager") and hasattr(sk, "BlockThread"):
        sk.BlockManager.run = run


if SIM:
    _simulator_support()


# ------------------------------------------------------------------------------------------
# scalar helpers: bit casts, f16 / bf16, signed bytes
# ------------------------------------------------------------------------------------------
if SIM:
    @cuda.jit(device=True)
    def bits_f32(u):
        """The f32 whose bits are the low 32 bits of the integer u."""
        return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_bits(x):
        """The bits of the f32 x as a non-negative int64."""
        return np.int64(np.array([x], dtype=np.float32).view(np.uint32)[0])
else:
    from numba.cuda import libdevice as _libdevice

    @cuda.jit(device=True, inline=True)
    def _i32(u):
        # the low 32 bits of u as a signed int32 (a truncation: no overflow check on the GPU)
        v = int64(u) & 0xFFFFFFFF
        return int32(v - 4294967296 if v >= 2147483648 else v)

    @cuda.jit(device=True, inline=True)
    def bits_f32(u):
        return _libdevice.int_as_float(_i32(u))

    @cuda.jit(device=True, inline=True)
    def f32_bits(x):
        return int64(_libdevice.float_as_int(x)) & 0xFFFFFFFF


@cuda.jit(device=True)
def f16_to_f32(h):
    """f32 value of the f16 bit pattern h (0..65535): exact, subnormals, inf and NaN included."""
    h = int64(h)
    s = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = float32(m) * float32(5.9604644775390625e-08)      # m * 2^-24
        return -v if s != 0 else v
    if e == 31:
        return bits_f32(s | 0x7F800000 | (m << 13))
    return bits_f32(s | ((e + 112) << 23) | (m << 13))


@cuda.jit(device=True)
def f32_to_f16_bits(x):
    """The f16 bits of the f32 x rounded to nearest even (NumPy's astype(float16): overflow to
    inf, NaN kept quiet with its top payload bits)."""
    u = f32_bits(x)
    s = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return s | 0x7C00
        r = 0x7C00 + ((a & 0x7FFFFF) >> 13)
        return s | (r + 1 if r == 0x7C00 else r)
    if a >= 0x47800000:
        return s | 0x7C00
    if a < 0x38800000:                        # |x| < 2^-14: an f16 subnormal (or zero)
        e = a >> 23
        m = (a & 0x7FFFFF) | (0x800000 if e > 0 else 0)
        sh = 126 - e if e > 0 else 126
        if sh >= 32:
            return s
        q = m >> sh
        rem = m & ((1 << sh) - 1)
        half = 1 << (sh - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
        return s | q
    r = a - 0x38000000
    r = (r + 0x0FFF + ((r >> 13) & 1)) >> 13
    return s | r


@cuda.jit(device=True)
def bf16_to_f32(h):
    return bits_f32(int64(h) << 16)


@cuda.jit(device=True)
def f32_to_bf16_bits(x):
    """ggml's fp32_to_bf16: round to nearest even, NaN forced quiet."""
    u = f32_bits(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 64
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


# min / max: numba's built-in CUDA target cannot compile the builtins (their overloads take
# *args, which its device-function compiler rejects), so device code uses these
@cuda.jit(device=True)
def dmin(a, b):
    return a if a < b else b


@cuda.jit(device=True)
def dmax(a, b):
    return a if a > b else b


@cuda.jit(device=True)
def i8(b):
    """A stored byte as a signed int8 value (int64)."""
    v = int64(b)
    return v - ((v & 128) << 1)


@cuda.jit(device=True)
def u16_at(d, r, o):
    return int64(d[r, o]) | (int64(d[r, o + 1]) << 8)


@cuda.jit(device=True)
def f16_at(d, r, o):
    return f16_to_f32(int64(d[r, o]) | (int64(d[r, o + 1]) << 8))


@cuda.jit(device=True)
def u32_at(d, r, o):
    return (int64(d[r, o]) | (int64(d[r, o + 1]) << 8) | (int64(d[r, o + 2]) << 16)
            | (int64(d[r, o + 3]) << 24))


@cuda.jit(device=True)
def f32_at(d, r, o):
    return bits_f32(u32_at(d, r, o))


# ------------------------------------------------------------------------------------------
# level tables (constant memory on the GPU)
# ------------------------------------------------------------------------------------------
KV_IQ4NL = np.asarray(_lg.KVALUES_IQ4NL, dtype=np.float32)
KV_MXFP4 = np.asarray(_lg.KVALUES_MXFP4, dtype=np.float32)
IQ2NL = np.ascontiguousarray(_iqk.IQ2NL, dtype=np.float32)
IQ3NL = np.ascontiguousarray(_iqk.IQ3NL, dtype=np.float32)
IQ4K = np.ascontiguousarray(_iqk.IQ4K, dtype=np.float32)
IQ5NL = np.ascontiguousarray(_iqk.IQ5NL, dtype=np.float32)
IQ6K_CUBIC = np.ascontiguousarray(_iqk.IQ6K_LEVELS, dtype=np.float32)
IQ6K_INT = np.ascontiguousarray(_iqk.IQ6K_INT_LEVELS, dtype=np.float32)
IQ2KL = np.ascontiguousarray(_iqk.IQ2KL_FLAT, dtype=np.float32)


# ------------------------------------------------------------------------------------------
# decoders: dec(d, r, c, y) -> values [8c, 8c + 8) of row r into y[0:8]
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def dec_f32(d, r, c, y):
    for j in range(8):
        y[j] = d[r, 8 * c + j]


@cuda.jit(device=True)
def dec_f16(d, r, c, y):
    for j in range(8):
        y[j] = f16_to_f32(d[r, 8 * c + j])


@cuda.jit(device=True)
def dec_bf16(d, r, c, y):
    for j in range(8):
        y[j] = bf16_to_f32(d[r, 8 * c + j])


@cuda.jit(device=True)
def dec_q8_0(d, r, c, y):
    o = (c >> 2) * 34
    dd = f16_at(d, r, o)
    o += 2 + 8 * (c & 3)
    for j in range(8):
        y[j] = dd * float32(i8(d[r, o + j]))


@cuda.jit(device=True)
def dec_q4_0(d, r, c, y):
    o = (c >> 2) * 18
    dd = f16_at(d, r, o)
    k = c & 3
    sh = 4 * (k >> 1)
    o += 2 + 8 * (k & 1)
    for j in range(8):
        y[j] = float32(((int64(d[r, o + j]) >> sh) & 15) - 8) * dd


@cuda.jit(device=True)
def dec_q4_1(d, r, c, y):
    o = (c >> 2) * 20
    dd = f16_at(d, r, o)
    m = f16_at(d, r, o + 2)
    k = c & 3
    sh = 4 * (k >> 1)
    o += 4 + 8 * (k & 1)
    for j in range(8):
        y[j] = float32((int64(d[r, o + j]) >> sh) & 15) * dd + m


@cuda.jit(device=True)
def dec_q5_0(d, r, c, y):
    o = (c >> 2) * 22
    dd = f16_at(d, r, o)
    qh = u32_at(d, r, o + 2)
    k = c & 3
    sh = 4 * (k >> 1)
    j0 = 8 * k
    o += 6 + 8 * (k & 1)
    for j in range(8):
        q = ((int64(d[r, o + j]) >> sh) & 15) | (((qh >> (j0 + j)) & 1) << 4)
        y[j] = float32(q - 16) * dd


@cuda.jit(device=True)
def dec_q5_1(d, r, c, y):
    o = (c >> 2) * 24
    dd = f16_at(d, r, o)
    m = f16_at(d, r, o + 2)
    qh = u32_at(d, r, o + 4)
    k = c & 3
    sh = 4 * (k >> 1)
    j0 = 8 * k
    o += 8 + 8 * (k & 1)
    for j in range(8):
        q = ((int64(d[r, o + j]) >> sh) & 15) | (((qh >> (j0 + j)) & 1) << 4)
        y[j] = float32(q) * dd + m


@cuda.jit(device=True)
def dec_q6_0(d, r, c, y):
    o = (c >> 2) * 26
    dd = f16_at(d, r, o)
    k = c & 3
    hi = k >> 1                     # values 16..31: high nibbles
    jj0 = 8 * (k & 1)               # first position in qs
    for j in range(8):
        jj = jj0 + j
        v = int64(d[r, o + 10 + jj])
        h = int64(d[r, o + 2 + (jj & 7)]) >> (4 * (jj >> 3))
        if hi == 0:
            q = (v & 15) | ((h << 4) & 0x30)
        else:
            q = (v >> 4) | ((h << 2) & 0x30)
        y[j] = float32(q - 32) * dd


@cuda.jit(device=True)
def table_levels(d, r, q0, sh, lmask, h0, hs, hmask, lbits, table, ex, dl, y):
    """The eight values of a non-linear type's chunk: y[j] = dl * table[ex + q] with q the low bits
    (byte q0 + j, >> sh, & lmask) and, when hmask, the high bits (byte h0 + j, >> hs, & hmask)
    above them (<< lbits).  IQ4_NL, MXFP4, IQ4_XS and the IQK types differ only in where those
    bits and scales sit, which their decoders compute."""
    for j in range(8):
        q = (int64(d[r, q0 + j]) >> sh) & lmask
        if hmask:
            q |= ((int64(d[r, h0 + j]) >> hs) & hmask) << lbits
        y[j] = dl * table[q + ex]


@cuda.jit(device=True)
def dec_iq4_nl(d, r, c, y):
    o = (c >> 2) * 18
    dd = f16_at(d, r, o)
    k = c & 3
    sh = 4 * (k >> 1)
    o += 2 + 8 * (k & 1)
    table_levels(d, r, o, sh, 15, 0, 0, 0, 0, KV_IQ4NL, 0, dd, y)


@cuda.jit(device=True)
def dec_mxfp4(d, r, c, y):
    o = (c >> 2) * 17
    e = int64(d[r, o])
    dd = bits_f32((e - 1) << 23 if e >= 2 else 0x00200000 << e)
    k = c & 3
    sh = 4 * (k >> 1)
    o += 1 + 8 * (k & 1)
    table_levels(d, r, o, sh, 15, 0, 0, 0, 0, KV_MXFP4, 0, dd, y)


# ---- k-quants (super-blocks of 256: 32 chunks) ----
@cuda.jit(device=True)
def dec_q2_k(d, r, c, y):
    o = (c >> 5) * 84
    i = 8 * (c & 31)                # value within the super-block
    s = i >> 4                      # sub-block of 16
    sc = int64(d[r, o + s])
    dl = f16_at(d, r, o + 80) * float32(sc & 15)
    ml = f16_at(d, r, o + 82) * float32(sc >> 4)
    n, w = i >> 7, i & 127
    sh = 2 * (w >> 5)
    q0 = o + 16 + 32 * n + (w & 31)
    for j in range(8):
        y[j] = dl * float32((int64(d[r, q0 + j]) >> sh) & 3) - ml


@cuda.jit(device=True)
def dec_q3_k(d, r, c, y):
    o = (c >> 5) * 110
    i = 8 * (c & 31)
    s = i >> 4
    lo = (int64(d[r, o + 96 + (s & 7)]) >> (4 * (s >> 3))) & 15
    hi = (int64(d[r, o + 104 + (s & 3)]) >> (2 * (s >> 2))) & 3
    dl = f16_at(d, r, o + 108) * float32((lo | (hi << 4)) - 32)
    n, w = i >> 7, i & 127
    jp = w >> 5                     # 2-bit plane
    l0 = w & 31
    hb = 4 * n + jp                 # hmask bit
    for j in range(8):
        q = (int64(d[r, o + 32 + 32 * n + l0 + j]) >> (2 * jp)) & 3
        if ((int64(d[r, o + l0 + j]) >> hb) & 1) == 0:
            q -= 4
        y[j] = dl * float32(q)


@cuda.jit(device=True)
def _scale_min_k4(d, r, o, s):
    """Q4_K / Q5_K: (scale, min) 6-bit of sub-block s from the 12 bytes at o."""
    if s < 4:
        return int64(d[r, o + s]) & 63, int64(d[r, o + s + 4]) & 63
    b = int64(d[r, o + s + 4])
    return (b & 15) | ((int64(d[r, o + s - 4]) >> 6) << 4), (b >> 4) | ((int64(d[r, o + s]) >> 6) << 4)


@cuda.jit(device=True)
def dec_q4_k(d, r, c, y):
    o = (c >> 5) * 144
    i = 8 * (c & 31)
    s = i >> 5
    sc, mn = _scale_min_k4(d, r, o + 4, s)
    dl = f16_at(d, r, o) * float32(sc)
    ml = f16_at(d, r, o + 2) * float32(mn)
    q0 = o + 16 + 32 * (s >> 1) + (i & 31)
    sh = 4 * (s & 1)
    for j in range(8):
        y[j] = dl * float32((int64(d[r, q0 + j]) >> sh) & 15) - ml


@cuda.jit(device=True)
def dec_q5_k(d, r, c, y):
    o = (c >> 5) * 176
    i = 8 * (c & 31)
    s = i >> 5
    sc, mn = _scale_min_k4(d, r, o + 4, s)
    dl = f16_at(d, r, o) * float32(sc)
    ml = f16_at(d, r, o + 2) * float32(mn)
    l0 = i & 31
    q0 = o + 48 + 32 * (s >> 1) + l0
    sh = 4 * (s & 1)
    for j in range(8):
        q = ((int64(d[r, q0 + j]) >> sh) & 15) | (((int64(d[r, o + 16 + l0 + j]) >> s) & 1) << 4)
        y[j] = dl * float32(q) - ml


@cuda.jit(device=True)
def dec_q6_k(d, r, c, y):
    o = (c >> 5) * 210
    i = 8 * (c & 31)
    dl = f16_at(d, r, o + 208) * float32(i8(d[r, o + 192 + (i >> 4)]))
    n, w = i >> 7, i & 127
    Q, l0 = w >> 5, w & 31
    ql0 = o + 64 * n + 32 * (Q & 1) + l0
    qh0 = o + 128 + 32 * n + l0
    shl = 4 * (Q >> 1)
    shh = 2 * Q
    for j in range(8):
        q = ((int64(d[r, ql0 + j]) >> shl) & 15) | (((int64(d[r, qh0 + j]) >> shh) & 3) << 4)
        y[j] = dl * float32(q - 32)


@cuda.jit(device=True)
def dec_q8_k(d, r, c, y):
    o = (c >> 5) * 296
    dd = f32_at(d, r, o)
    o += 4 + 8 * (c & 31)
    for j in range(8):
        y[j] = dd * float32(i8(d[r, o + j]))


@cuda.jit(device=True)
def dec_iq4_xs(d, r, c, y):
    o = (c >> 5) * 136
    i = 8 * (c & 31)
    ib = i >> 5
    lo = (int64(d[r, o + 4 + (ib >> 1)]) >> (4 * (ib & 1))) & 15
    hi = (u16_at(d, r, o + 2) >> (2 * ib)) & 3
    dl = f16_at(d, r, o) * float32((lo | (hi << 4)) - 32)
    l0 = i & 31
    q0 = o + 8 + 16 * ib + (l0 & 15)
    sh = 4 * (l0 >> 4)
    table_levels(d, r, q0, sh, 15, 0, 0, 0, 0, KV_IQ4NL, 0, dl, y)


# ---- IQK types (quant.iqk's docstring has the layouts; e = value within the super-block) ----
@cuda.jit(device=True)
def dec_iq2_k(d, r, c, y):
    o = (c >> 5) * 76
    e = 8 * (c & 31)
    g = e >> 4
    ls = ((int64(d[r, o + 4 + (g >> 1)]) >> (4 * (g & 1))) & 15) - 8
    dl = f16_at(d, r, o) * float32(ls)
    ex = 4 * ((u16_at(d, r, o + 2) >> g) & 1)
    q0 = o + 12 + 32 * (e >> 7) + (e & 31)
    sh = 2 * ((e >> 5) & 3)
    table_levels(d, r, q0, sh, 3, 0, 0, 0, 0, IQ2NL, ex, dl, y)


@cuda.jit(device=True)
def dec_iq3_k(d, r, c, y):
    o = (c >> 5) * 110
    e = 8 * (c & 31)
    g = e >> 4
    ls = 2 * ((int64(d[r, o + 6 + (g >> 1)]) >> (4 * (g & 1))) & 15) + 1
    if (u16_at(d, r, o + 4) >> g) & 1:
        ls = -ls
    dl = f16_at(d, r, o) * float32(ls)
    ex = 8 * ((u16_at(d, r, o + 2) >> g) & 1)
    q0 = o + 14 + 32 * (e >> 7) + (e & 31)
    sh = 2 * ((e >> 5) & 3)
    h0 = o + 78 + (e & 31)
    hs = e >> 5
    table_levels(d, r, q0, sh, 3, h0, hs, 1, 2, IQ3NL, ex, dl, y)


@cuda.jit(device=True)
def _ls6(d, r, o, g):
    """IQ4_K / IQ5_K: the 6-bit scale of sub-block g (scales_h at o, scales_l at o + 4), - 32."""
    lo = (int64(d[r, o + 4 + (g >> 1)]) >> (4 * (g & 1))) & 15
    hi = (int64(d[r, o + (g >> 2)]) >> (2 * (g & 3))) & 3
    return (lo | (hi << 4)) - 32


@cuda.jit(device=True)
def dec_iq4_k(d, r, c, y):
    o = (c >> 5) * 144
    e = 8 * (c & 31)
    g = e >> 4
    dl = f16_at(d, r, o) * float32(_ls6(d, r, o + 4, g))
    ex = 16 * ((u16_at(d, r, o + 2) >> g) & 1)
    q0 = o + 16 + 16 * (e >> 5) + (e & 15)
    sh = 4 * ((e & 31) >> 4)
    table_levels(d, r, q0, sh, 15, 0, 0, 0, 0, IQ4K, ex, dl, y)


@cuda.jit(device=True)
def dec_iq5_k(d, r, c, y):
    o = (c >> 5) * 176
    e = 8 * (c & 31)
    g = e >> 4
    dl = f16_at(d, r, o) * float32(_ls6(d, r, o + 4, g))
    ex = 32 * ((u16_at(d, r, o + 2) >> g) & 1)
    q0 = o + 16 + 32 * (e >> 6) + (e & 31)
    sh = 4 * ((e & 63) >> 5)
    h0 = o + 144 + (e & 31)
    hs = e >> 5
    table_levels(d, r, q0, sh, 15, h0, hs, 1, 4, IQ5NL, ex, dl, y)


def _make_dec_iq6_k(levels):
    @cuda.jit(device=True)
    def dec_iq6_k(d, r, c, y):
        o = (c >> 5) * 212
        e = 8 * (c & 31)
        g = e >> 4
        dl = f16_at(d, r, o) * float32(i8(d[r, o + 4 + g]))
        ex = 64 * ((u16_at(d, r, o + 2) >> g) & 1)
        q0 = o + 20 + 32 * (e >> 6) + (e & 31)
        sh = 4 * ((e & 63) >> 5)
        h0 = o + 148 + 32 * (e >> 7) + (e & 31)
        hs = 2 * ((e >> 5) & 3)
        table_levels(d, r, q0, sh, 15, h0, hs, 3, 4, levels, ex, dl, y)
    return dec_iq6_k


dec_iq6_k_int = _make_dec_iq6_k(IQ6K_INT)
dec_iq6_k_cubic = _make_dec_iq6_k(IQ6K_CUBIC)


@cuda.jit(device=True)
def dec_iq4_ks(d, r, c, y):
    o = 4 + (c >> 5) * 136
    e = 8 * (c & 31)
    s = int64(d[r, o + (e >> 5)])
    dl = f32_at(d, r, 0) * float32((s & 254) - 127)
    ex = 16 * (s & 1)
    q0 = o + 8 + 16 * (e >> 5) + (e & 15)
    sh = 4 * ((e & 31) >> 4)
    table_levels(d, r, q0, sh, 15, 0, 0, 0, 0, IQ4K, ex, dl, y)


@cuda.jit(device=True)
def dec_iq5_ks(d, r, c, y):
    o = 4 + (c >> 5) * 168
    e = 8 * (c & 31)
    s = int64(d[r, o + (e >> 5)])
    dl = f32_at(d, r, 0) * float32((s & 254) - 127)
    ex = 32 * (s & 1)
    q0 = o + 8 + 32 * (e >> 6) + (e & 31)
    sh = 4 * ((e & 63) >> 5)
    h0 = o + 136 + (e & 31)
    hs = e >> 5
    table_levels(d, r, q0, sh, 15, h0, hs, 1, 4, IQ5NL, ex, dl, y)


@cuda.jit(device=True)
def dec_iq2_ks(d, r, c, y):
    o = 2 + (c >> 5) * 70
    e = 8 * (c & 31)
    g = e >> 5
    extra = u16_at(d, r, o)
    ls = (((int64(d[r, o + 2 + (g >> 1)]) >> (4 * (g & 1))) & 15) | (((extra >> (8 + g)) & 1) << 4)) - 16
    dl = f16_at(d, r, 0) * float32(ls)
    ex = 4 * ((extra >> g) & 1)
    q0 = o + 6 + 32 * (e >> 7) + (e & 31)
    sh = 2 * ((e >> 5) & 3)
    table_levels(d, r, q0, sh, 3, 0, 0, 0, 0, IQ2NL, ex, dl, y)


@cuda.jit(device=True)
def dec_iq3_ks(d, r, c, y):
    o = 2 + (c >> 5) * 102
    e = 8 * (c & 31)
    g = e >> 5
    extra = u16_at(d, r, o)
    ls = (((int64(d[r, o + 2 + (g & 3)]) >> (4 * (g >> 2))) & 15) | (((extra >> g) & 1) << 4)) - 16
    dl = f16_at(d, r, 0) * float32(ls)
    ex = 8 * ((extra >> (8 + g)) & 1)
    q0 = o + 6 + 32 * (e >> 7) + (e & 31)
    sh = 2 * ((e >> 5) & 3)
    h0 = o + 70 + (e & 31)
    hs = e >> 5
    table_levels(d, r, q0, sh, 3, h0, hs, 1, 2, IQ3NL, ex, dl, y)


@cuda.jit(device=True)
def dec_iq2_kl(d, r, c, y):
    o = 2 + (c >> 5) * 86
    e = 8 * (c & 31)
    g = e >> 5
    sh_ = u16_at(d, r, o)
    ls = (((int64(d[r, o + 2 + (g & 3)]) >> (4 * (g >> 2))) & 15) | (((sh_ >> (2 * g)) & 3) << 4)) - 32
    dl = f16_at(d, r, 0) * float32(ls)
    p0 = (e & 31) >> 1               # first pair within the sub-block (0..15)
    qs0 = o + 6 + 16 * (g >> 1)
    nsh = 4 * (g & 1)
    for jp in range(4):
        jj = p0 + jp
        k = ((int64(d[r, qs0 + jj]) >> nsh) & 15) | (((int64(d[r, o + 70 + jj]) >> g) & 1) << 4)
        y[2 * jp] = dl * IQ2KL[2 * k]
        y[2 * jp + 1] = dl * IQ2KL[2 * k + 1]


# type id -> (decoder for products, decoder for get_rows / dequantize, element dtype of the rows)
_DECODERS: dict[int, tuple[Any, Any, Any]] = {
    F32: (dec_f32, dec_f32, np.float32), F16: (dec_f16, dec_f16, np.uint16),
    BF16: (dec_bf16, dec_bf16, np.uint16),
    Q8_0: (dec_q8_0, dec_q8_0, np.uint8), Q4_0: (dec_q4_0, dec_q4_0, np.uint8),
    Q4_1: (dec_q4_1, dec_q4_1, np.uint8), Q5_0: (dec_q5_0, dec_q5_0, np.uint8),
    Q5_1: (dec_q5_1, dec_q5_1, np.uint8), Q6_0: (dec_q6_0, dec_q6_0, np.uint8),
    IQ4_NL: (dec_iq4_nl, dec_iq4_nl, np.uint8), MXFP4: (dec_mxfp4, dec_mxfp4, np.uint8),
    Q2_K: (dec_q2_k, dec_q2_k, np.uint8), Q3_K: (dec_q3_k, dec_q3_k, np.uint8),
    Q4_K: (dec_q4_k, dec_q4_k, np.uint8), Q5_K: (dec_q5_k, dec_q5_k, np.uint8),
    Q6_K: (dec_q6_k, dec_q6_k, np.uint8), Q8_K: (dec_q8_k, dec_q8_k, np.uint8),
    IQ4_XS: (dec_iq4_xs, dec_iq4_xs, np.uint8),
    IQ2_K: (dec_iq2_k, dec_iq2_k, np.uint8), IQ3_K: (dec_iq3_k, dec_iq3_k, np.uint8),
    IQ4_K: (dec_iq4_k, dec_iq4_k, np.uint8), IQ5_K: (dec_iq5_k, dec_iq5_k, np.uint8),
    IQ6_K: (dec_iq6_k_int, dec_iq6_k_cubic, np.uint8),
    IQ4_KS: (dec_iq4_ks, dec_iq4_ks, np.uint8), IQ5_KS: (dec_iq5_ks, dec_iq5_ks, np.uint8),
    IQ2_KS: (dec_iq2_ks, dec_iq2_ks, np.uint8), IQ3_KS: (dec_iq3_ks, dec_iq3_ks, np.uint8),
    IQ2_KL: (dec_iq2_kl, dec_iq2_kl, np.uint8),
}
assert set(_DECODERS) == set(CUDA_TYPES)


def decoder(qtype: int, exact: bool = False) -> Any:
    """The device decoder of a type (exact: the get_rows / dequantize one; differs for IQ6_K)."""
    try:
        return _DECODERS[int(qtype)][1 if exact else 0]
    except KeyError:
        raise NotImplementedError(f"no CUDA kernels for tensor type {type_info(int(qtype)).name}") from None


def element_view(data: Any, qtype: int) -> Any:
    """A (rows, row_bytes) uint8 device array seen as the rows the type's decoder reads: f32
    values for F32, uint16 words for F16 / BF16, the bytes themselves for the block types."""
    dt = _DECODERS[int(qtype)][2]
    return data if dt is np.uint8 else data.view(dt)


# ------------------------------------------------------------------------------------------
# DeviceQTensor
# ------------------------------------------------------------------------------------------
@dataclass
class DeviceQTensor:
    """A weight in GPU memory: `data` a uint8 device array (n_rows_total, row_bytes) holding the
    GGUF bytes unchanged (experts stacked: (experts * rows, row_bytes)); qtype, shape (NumPy
    order, cols last) and name as QTensor's."""
    data: Any
    qtype: int
    shape: tuple
    name: str = ""
    _view: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0]) * int(self.data.shape[1])

    @property
    def cols(self) -> int:
        return int(self.shape[-1])

    @property
    def rows(self) -> int:
        return int(self.shape[-2]) if len(self.shape) >= 2 else 1

    @property
    def n_expert(self) -> int:
        return int(self.shape[0]) if len(self.shape) == 3 else 1

    def rows_view(self) -> Any:
        """data in the decoder's element type (kept: one view per tensor)."""
        if self._view is None:
            self._view = element_view(self.data, self.qtype)
        return self._view


def upload(q: QTensor) -> DeviceQTensor:
    """A QTensor's bytes copied once into GPU memory (3-D: the experts' rows stacked)."""
    qt = int(q.qtype)
    if qt not in CUDA_TYPES:
        raise NotImplementedError(f"no CUDA kernels for tensor type {type_info(qt).name}")
    data = np.asarray(q.data)
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    rb = data.shape[-1]
    if rb != type_info(qt).row_bytes(q.cols):
        raise ValueError(f"row of {rb} bytes does not hold {q.cols} {type_info(qt).name} values")
    if q.cols % 8:
        raise ValueError(f"CUDA kernels need rows of a multiple of 8 values, not {q.cols}")
    host = np.ascontiguousarray(data.reshape(-1, rb))
    return DeviceQTensor(cuda.to_device(host), qt, tuple(int(s) for s in q.shape), q.name)


# ------------------------------------------------------------------------------------------
# kernel factories
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def warp_sum_shuffles(v):
    """Sum of v over the 32 lanes of a warp, in every lane (xor butterfly)."""
    v += cuda.shfl_xor_sync(FULL, v, 16)
    v += cuda.shfl_xor_sync(FULL, v, 8)
    v += cuda.shfl_xor_sync(FULL, v, 4)
    v += cuda.shfl_xor_sync(FULL, v, 2)
    v += cuda.shfl_xor_sync(FULL, v, 1)
    return v


if SIM:     # the same butterfly in one exchange (tests/test_cuda_kernels.py checks it against the shuffles)
    @cuda.jit(device=True)
    def warp_sum(v):
        return cuda.ikcli_butterfly(v, False)
else:
    warp_sum = warp_sum_shuffles


_KERNELS: dict = {}


def _matvec_kernel(qtype: int, NT: int, INDEXED: bool) -> Any:
    """out[t, r] = x[t] . W[r] for up to NT rows t of x per grid.y group (INDEXED: one MoE pair
    p per group: out[p, r] = x[x_rows[p]] . W[ids[p] * rows + r])."""
    key = ("mv", qtype, NT, INDEXED)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    dec = decoder(qtype)

    @cuda.jit
    def matvec(d, x, out, ids, x_rows, n):
        lane = cuda.threadIdx.x & 31
        wpb = cuda.blockDim.x >> 5
        warp0 = cuda.blockIdx.x * wpb + (cuda.threadIdx.x >> 5)
        nwarps = cuda.gridDim.x * wpb
        rows = out.shape[1]
        nch = x.shape[1] >> 3
        y = cuda.local.array(8, float32)
        acc = cuda.local.array(NT, float32)
        ngroups = n if INDEXED else (n + NT - 1) // NT
        for g in range(cuda.blockIdx.y, ngroups, cuda.gridDim.y):
            if INDEXED:
                base = int64(ids[g]) * rows
                t0 = int64(x_rows[g])
                nt = 1
            else:
                base = 0
                t0 = g * NT
                nt = dmin(NT, n - t0)
            for r in range(warp0, rows, nwarps):       # warp-uniform
                for t in range(NT):
                    acc[t] = 0.0
                for c in range(lane, nch, 32):
                    dec(d, base + r, c, y)
                    for t in range(NT):
                        if t < nt:
                            s = float32(0.0)
                            for j in range(8):
                                s += y[j] * x[t0 + t, 8 * c + j]
                            acc[t] += s
                for t in range(NT):
                    v = warp_sum(acc[t])
                    if lane == 0 and t < nt:
                        out[g if INDEXED else t0 + t, r] = v

    _KERNELS[key] = matvec
    return matvec


def _tiled_kernel(qtype: int, INDEXED: bool, tile: tuple) -> Any:
    """A TM x TN tile of out = x @ W^T per block (see the module docstring).  INDEXED: the
    block's tokens are MoE pairs order[start:start + count] of one expert (the tile tables)."""
    TM, TN, MM, MN = tile
    key = ("tiled", qtype, INDEXED, tile)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    dec = decoder(qtype)
    NTX = TN // MN                  # threads along rows
    NTY = TM // MM                  # threads along tokens
    NTH = NTX * NTY
    CPR = TK // 8                   # chunks per slab row
    TKP = TK + 1                    # padded shared row

    @cuda.jit
    def tiled(d, x, out, n, order, x_rows, tile_e, tile_start, tile_cnt):
        tid = cuda.threadIdx.x
        tx = tid % NTX
        ty = tid // NTX
        rows = out.shape[1]
        cols = x.shape[1]
        nch = cols >> 3
        sW = cuda.shared.array((TN, TKP), float32)
        sX = cuda.shared.array((TM, TKP), float32)
        y = cuda.local.array(8, float32)
        acc = cuda.local.array((MM, MN), float32)
        a = cuda.local.array(MM, float32)
        b = cuda.local.array(MN, float32)
        ntile_r = (rows + TN - 1) // TN
        ntile_t = tile_e.shape[0] if INDEXED else (n + TM - 1) // TM
        for tt in range(cuda.blockIdx.y, ntile_t, cuda.gridDim.y):
            if INDEXED:
                base = int64(tile_e[tt]) * rows
                p0 = int64(tile_start[tt])
                cnt = int64(tile_cnt[tt])
            else:
                base = 0
                p0 = tt * TM
                cnt = dmin(TM, n - p0)
            for rt in range(cuda.blockIdx.x, ntile_r, cuda.gridDim.x):
                r0 = rt * TN
                for i in range(MM):
                    for j in range(MN):
                        acc[i, j] = 0.0
                for k0 in range(0, cols, TK):
                    # decode the TN x TK weight slab, one chunk per thread and step
                    for q in range(tid, TN * CPR, NTH):
                        rr = q // CPR
                        cc = q % CPR
                        if r0 + rr < rows and (k0 >> 3) + cc < nch:
                            dec(d, base + r0 + rr, (k0 >> 3) + cc, y)
                            for j in range(8):
                                sW[rr, 8 * cc + j] = y[j]
                        else:
                            for j in range(8):
                                sW[rr, 8 * cc + j] = 0.0
                    # the TM x TK activations
                    for q in range(tid, TM * TK, NTH):
                        i = q // TK
                        kk = q % TK
                        v = float32(0.0)
                        if i < cnt and k0 + kk < cols:
                            if INDEXED:
                                v = x[x_rows[order[p0 + i]], k0 + kk]
                            else:
                                v = x[p0 + i, k0 + kk]
                        sX[i, kk] = v
                    cuda.syncthreads()
                    for kk in range(TK):
                        for i in range(MM):
                            a[i] = sX[ty + i * NTY, kk]
                        for j in range(MN):
                            b[j] = sW[tx + j * NTX, kk]
                        for i in range(MM):
                            for j in range(MN):
                                acc[i, j] += a[i] * b[j]
                    cuda.syncthreads()
                for i in range(MM):
                    ti = ty + i * NTY
                    if ti < cnt:
                        orow = order[p0 + ti] if INDEXED else p0 + ti
                        for j in range(MN):
                            rj = r0 + tx + j * NTX
                            if rj < rows:
                                out[orow, rj] = acc[i, j]

    _KERNELS[key] = tiled
    return tiled


def _rows_kernel(qtype: int, INDEXED: bool) -> Any:
    """out[i, 8c:8c + 8] = chunk c of row ids[i] (INDEXED) or of row i: get_rows, dequantize."""
    key = ("rows", qtype, INDEXED)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    dec = decoder(qtype, exact=True)

    @cuda.jit
    def rows_k(d, ids, out):
        nch = out.shape[1] >> 3
        total = out.shape[0] * nch
        y = cuda.local.array(8, float32)
        for q in range(cuda.grid(1), total, cuda.gridsize(1)):
            i = q // nch
            c = q % nch
            dec(d, int64(ids[i]) if INDEXED else i, c, y)
            for j in range(8):
                out[i, 8 * c + j] = y[j]

    _KERNELS[key] = rows_k
    return rows_k


# ------------------------------------------------------------------------------------------
# host entry points
# ------------------------------------------------------------------------------------------
def _blocks(n: int, per: int) -> int:
    return max(1, min(MAX_BLOCKS, (n + per - 1) // per))


def _empty(shape: tuple, dtype=np.float32) -> Any:
    return cuda.device_array(tuple(int(s) for s in shape), dtype=dtype)


_DUMMY: dict = {}


def _dummy_i32() -> Any:
    """A one-element device int32 array for kernel arguments a specialisation never reads."""
    d = _DUMMY.get("i32")
    if d is None:
        d = _DUMMY["i32"] = cuda.to_device(np.zeros(1, dtype=np.int32))
    return d


def _check_x(w: DeviceQTensor, x: Any) -> tuple[int, int]:
    if len(x.shape) != 2 or int(x.shape[1]) != w.cols:
        raise ValueError(f"activations must be (n, {w.cols}), got {tuple(x.shape)}")
    if np.dtype(x.dtype) != np.float32:
        raise TypeError("activations must be float32")
    return int(x.shape[0]), w.cols


def _out(out: Any, n: int, rows: int) -> Any:
    if out is None:
        return _empty((n, rows))
    if tuple(out.shape) != (n, rows):
        raise ValueError(f"out must be float32 of shape {(n, rows)}, got {tuple(out.shape)}")
    return out


def _nt(n: int) -> int:
    return 1 if n <= 1 else 2 if n <= 2 else 4 if n <= 4 else 8


def matmul(w: DeviceQTensor, x: Any, out: Any = None, stream: Any = 0) -> Any:
    """y (n, rows) f32 = x (n, cols) f32 @ W^T for a 2-D weight on the GPU."""
    if len(w.shape) != 2:
        raise ValueError(f"matmul needs a 2-D weight, got shape {w.shape}; use matmul_id for experts")
    n, _ = _check_x(w, x)
    rows = w.rows
    out = _out(out, n, rows)
    if n == 0 or rows == 0:
        return out
    d = w.rows_view()
    if n <= MATVEC_MAX_N:
        k = _matvec_kernel(w.qtype, _nt(n), False)
        groups = -(-n // _nt(n))
        dum = _dummy_i32()
        k[(_blocks(rows, MV_WARPS), min(groups, MAX_GRID_Y)), 32 * MV_WARPS, stream](d, x, out, dum, dum, n)
    else:
        TM, TN, MM, MN = TILE
        k = _tiled_kernel(w.qtype, False, TILE)
        dum = _dummy_i32()
        grid = (_blocks(rows, TN), min(-(-n // TM), MAX_GRID_Y))
        k[grid, (TM // MM) * (TN // MN), stream](d, x, out, n, dum, dum, dum, dum, dum)
    return out


def _as_i32(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a, dtype=np.int32))
    if np.dtype(a.dtype) != np.int32:
        raise TypeError("ids / x_rows must be int32 device arrays")
    return a


def matmul_id(w3: DeviceQTensor, x: Any, ids: Any, x_rows: Any, out: Any = None, stream: Any = 0) -> Any:
    """MoE pairs: y[p] = x[x_rows[p]] @ W[ids[p]]^T (ids, x_rows: device int32 (P,)), as
    quant.matmul.matmul_id.  A 2-D weight counts as one expert."""
    _check_x(w3, x)
    ids, x_rows = _as_i32(ids), _as_i32(x_rows)
    P = int(ids.shape[0])
    if int(x_rows.shape[0]) != P:
        raise ValueError(f"{P} expert ids but {int(x_rows.shape[0])} activation rows")
    rows = w3.rows
    out = _out(out, P, rows)
    if P == 0 or rows == 0:
        return out
    d = w3.rows_view()
    if P <= MATVEC_MAX_PAIRS:
        k = _matvec_kernel(w3.qtype, 1, True)
        k[(_blocks(rows, MV_WARPS), min(P, MAX_GRID_Y)), 32 * MV_WARPS, stream](d, x, out, ids, x_rows, P)
        return out
    # group the pairs by expert on the host (P int32 values come down) into tiles of TM pairs
    TM, TN, MM, MN = TILE
    e_h = ids.copy_to_host().astype(np.int64)
    if e_h.min() < 0 or e_h.max() >= w3.n_expert:
        raise IndexError(f"expert id out of range 0..{w3.n_expert - 1}")
    order = np.argsort(e_h, kind="stable")
    counts = np.bincount(e_h, minlength=w3.n_expert)
    te, ts, tc = [], [], []
    start = 0
    for e in np.flatnonzero(counts):
        for s in range(0, int(counts[e]), TM):
            te.append(e)
            ts.append(start + s)
            tc.append(min(TM, int(counts[e]) - s))
        start += int(counts[e])
    tabs = [cuda.to_device(np.asarray(a, dtype=np.int32)) for a in (order, te, ts, tc)]
    k = _tiled_kernel(w3.qtype, True, TILE)
    grid = (_blocks(rows, TN), min(len(te), MAX_GRID_Y))
    k[grid, (TM // MM) * (TN // MN), stream](d, x, out, P, tabs[0], x_rows, tabs[1], tabs[2], tabs[3])
    return out


def get_rows(w: DeviceQTensor, ids: Any, stream: Any = 0) -> Any:
    """Rows `ids` (device int32; of the stacked rows for a 3-D tensor) as f32 (len(ids), cols)."""
    ids = _as_i32(ids)
    n = int(ids.shape[0])
    out = _empty((n, w.cols))
    if n:
        k = _rows_kernel(w.qtype, True)
        k[_blocks(n * (w.cols // 8), THREADS), THREADS, stream](w.rows_view(), ids, out)
    return out


def dequantize(w: DeviceQTensor, stream: Any = 0) -> Any:
    """The whole tensor as f32 of shape w.shape, on the GPU (for tests and fallbacks)."""
    nrows = int(w.data.shape[0])
    out = _empty((nrows, w.cols))
    if nrows:
        k = _rows_kernel(w.qtype, False)
        k[_blocks(nrows * (w.cols // 8), THREADS), THREADS, stream](w.rows_view(), _dummy_i32(), out)
    return out.reshape(tuple(int(s) for s in w.shape)) if len(w.shape) != 2 else out


__all__ = ["CUDA_TYPES", "DeviceQTensor", "upload", "matmul", "matmul_id", "get_rows", "dequantize",
           "decoder", "element_view", "warp_sum", "dmin", "dmax", "f16_to_f32", "f32_to_f16_bits", "bf16_to_f32",
           "f32_to_bf16_bits", "bits_f32", "f32_bits"]
