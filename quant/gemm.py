"""f32 GEMMs run by numba's thread pool: each pool thread calls numpy's BLAS, serially, on its
share of the work.

Why: numba's OpenMP pool and OpenBLAS's threads are two pools on the same cores.  Idle threads
of either busy-wait for a while after their work, taking a core from the other: numba's spin
(GOMP_SPINCOUNT) had to stay short for prompt processing, and token generation then paid a
pool wake-up on each of its ~100 kernel calls a token (a parallel call measured ~1.5 us while
the pool spins; after a 2 ms pause, min 26 us, median 67 us).  With every many-token GEMM
issued from inside numba's pool and OpenBLAS kept at one thread there is one pool, and it can
spin.  Measured on 2 cores (512 x 1024 x 4096, f32): one BLAS call per pool thread takes what
OpenBLAS's own two threads take (22.6 vs 23.1 ms); timed right after OpenBLAS's own threads
had run, it took 35-46 ms.

The BLAS entry point is numpy's OpenBLAS (found as in quant.blas_threads), called through its
address passed in as an integer: the compiled code holds no process-specific pointer, so the
kernels stay cacheable.  Where numpy's BLAS has no CBLAS sgemm we can find (MKL, Accelerate),
available() is False and gemm() falls back to numpy's matmul (quant.matmul then leaves the
BLAS thread count alone).

Operands are row-major f32 matrices whose rows may be spaced (the last axis contiguous):
C = A . B^T (trans_b, the engine's x @ W.T) or C = A . B, optionally accumulated (beta = 1).
"""
from __future__ import annotations

import ctypes
import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import blas_threads
from . import simd_sgemm as _own
from .fnptr import call_at, one_form
from .kernels import rows_address
from .simd import cpu_features
from .typetag import QType

_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112        # CBLAS enum values

# (prefix, suffix, blasint is 64-bit): numpy >= 2's scipy-openblas wheels first, then plain
# OpenBLAS; the symbols are PREFIX + "sgemm" / "sgemv" + SUFFIX
_SYMBOLS = (("scipy_cblas_", "64_", True), ("cblas_", "64_", True), ("scipy_cblas_", "", False),
            ("cblas_", "", False))
_FN: tuple[int, int, bool] | None = None


def _find() -> tuple[int, int, bool]:
    """(address of the CBLAS sgemm or 0, of its sgemv, whether their integers are 64-bit)."""
    global _FN
    if _FN is None:
        _FN = (0, 0, False)
        lib = blas_threads._openblas()
        for pre, suf, ilp64 in _SYMBOLS if lib is not None else ():
            mm, mv = getattr(lib, f"{pre}sgemm{suf}", None), getattr(lib, f"{pre}sgemv{suf}", None)
            if mm is not None and mv is not None:
                _FN = (ctypes.cast(mm, ctypes.c_void_p).value or 0, ctypes.cast(mv, ctypes.c_void_p).value or 0,
                       ilp64)
                break
    return _FN


# OpenBLAS's kernel sets with AVX-512; on an AVX-512 CPU whose numpy OpenBLAS runs another
# (OPENBLAS_CORETYPE=Haswell on the Zen 5 test VM) quant.simd_sgemm's tile kernel takes the
# prompt attention's products (scripts/bench_prompt_attention.py)
_AVX512_CORES = ("skylakex", "cooperlake", "sapphirerapids")


def _own_kernel() -> bool:
    """Whether the prompt attention's f32 products go through quant.simd_sgemm: IKCLI_SGEMM=own /
    blas forces it (other values: the rule); by default on AVX-512 CPUs where numpy's OpenBLAS
    runs no AVX-512 kernels (with them OpenBLAS measured faster: 130 vs 140 ms in
    scripts/bench_prompt_attention.py, one thread)."""
    v = os.environ.get("IKCLI_SGEMM", "").strip().lower()
    if v in ("own", "blas"):
        return v == "own"
    core = blas_threads.blas_core()
    return core is not None and "+avx512f" in cpu_features() and core.lower() not in _AVX512_CORES


OWN = _own_kernel()


def available() -> bool:
    """Whether numpy's BLAS offers a CBLAS sgemm and sgemv the pool can call."""
    return _find()[0] != 0 and _find()[1] != 0


def _sgemm_intrinsic(ilp64: bool):
    bi = _I64 if ilp64 else _I32

    @intrinsic
    def sgemm(typingctx, fn, transb, M, N, K, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):
        """One CBLAS sgemm on the calling thread (fn: its address): C (+coff, ldc) = A (+aoff, lda)
        . op(B) (+boff, ldb) + beta C, row-major, op = transpose when transb; offsets in elements."""
        if not all(isinstance(a, types.Array) for a in (A, B, C)):
            return None
        i64 = types.int64
        sig = types.none(i64, types.boolean, i64, i64, i64, A, i64, i64, B, i64, i64, types.float32, C, i64, i64)

        def codegen(context, builder, sig, args):
            fp = _F32.as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, bi, bi, bi, _F32, fp, bi, fp, bi, _F32, fp, bi])
            f = builder.inttoptr(args[0], fnty.as_pointer())

            def ptr(i, off):
                arr = context.make_array(sig.args[i])(context, builder, args[i])
                return builder.bitcast(builder.gep(arr.data, [args[off]]), fp)

            dim = (lambda v: v) if ilp64 else (lambda v: builder.trunc(v, _I32))  # noqa: E731
            tb = builder.select(args[1], ir.Constant(_I32, _TRANS), ir.Constant(_I32, _NO_TRANS))
            builder.call(f, [ir.Constant(_I32, _ROW_MAJOR), ir.Constant(_I32, _NO_TRANS), tb,
                             dim(args[2]), dim(args[3]), dim(args[4]), ir.Constant(_F32, 1.0),
                             ptr(5, 6), dim(args[7]), ptr(8, 9), dim(args[10]), args[11], ptr(12, 13), dim(args[14])])
            return context.get_dummy_value()
        return sig, codegen
    return sgemm


def _sgemv_intrinsic(ilp64: bool):
    bi = _I64 if ilp64 else _I32

    @intrinsic
    def sgemv(typingctx, fn, trans, rows, cols, B, boff, ldb, x, xoff, beta, y, yoff):
        """One CBLAS sgemv on the calling thread (fn: its address): y (+yoff) = op(B) (+boff, ldb;
        rows x cols, row-major) . x (+xoff) + beta y, op = transpose when trans; unit strides."""
        if not all(isinstance(a, types.Array) for a in (B, x, y)):
            return None
        i64 = types.int64
        sig = types.none(i64, types.boolean, i64, i64, B, i64, i64, x, i64, types.float32, y, i64)

        def codegen(context, builder, sig, args):
            fp = _F32.as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I32, bi, bi, _F32, fp, bi, fp, bi, _F32, fp, bi])
            f = builder.inttoptr(args[0], fnty.as_pointer())

            def ptr(i, off):
                arr = context.make_array(sig.args[i])(context, builder, args[i])
                return builder.bitcast(builder.gep(arr.data, [args[off]]), fp)

            dim = (lambda v: v) if ilp64 else (lambda v: builder.trunc(v, _I32))  # noqa: E731
            one = ir.Constant(bi, 1)
            tr = builder.select(args[1], ir.Constant(_I32, _TRANS), ir.Constant(_I32, _NO_TRANS))
            builder.call(f, [ir.Constant(_I32, _ROW_MAJOR), tr, dim(args[2]), dim(args[3]), ir.Constant(_F32, 1.0),
                             ptr(4, 5), dim(args[6]), ptr(7, 8), one, args[9], ptr(10, 11), one])
            return context.get_dummy_value()
        return sig, codegen
    return sgemv


_sgemm64 = _sgemm_intrinsic(True)
_sgemm32 = _sgemm_intrinsic(False)
_sgemv64 = _sgemv_intrinsic(True)
_sgemv32 = _sgemv_intrinsic(False)

_opts = dict(cache=True, nogil=True)
SMALL_WORK = 1 << 18     # multiply-adds under which gemm() stays on the calling thread


@njit(**_opts)
def _sgemm(fn, ilp64, transb, M, N, K, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):
    if ilp64:
        _sgemm64(fn, transb, M, N, K, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc)
    else:
        _sgemm32(fn, transb, M, N, K, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc)


@njit(**_opts)
def _sgemv(fn, ilp64, trans, rows, cols, B, boff, ldb, x, xoff, beta, y, yoff):
    if ilp64:
        _sgemv64(fn, trans, rows, cols, B, boff, ldb, x, xoff, beta, y, yoff)
    else:
        _sgemv32(fn, trans, rows, cols, B, boff, ldb, x, xoff, beta, y, yoff)


@njit(**_opts)
def _shares(n, parts, align):
    """Starts of `parts` shares of n items, each a multiple of align (the last one ragged)."""
    per = (n + parts - 1) // parts
    per = (per + align - 1) // align * align
    st = np.empty(parts + 1, np.int64)
    for p in range(parts + 1):
        st[p] = min(n, p * per)
    return st


@njit(**_opts)
def _item(it, nsplit, st):
    """Work item it of the batched products: (batch index, its share st[p]:st[p + 1])."""
    p = it % nsplit
    return it // nsplit, st[p], st[p + 1]


# the batched loops' one form each (quant.fnptr.one_form): operands as strided ('A') arrays, the
# inputs read-only, whatever the callers' layouts (a test run had compiled 9 forms of _gemm_batched)
_A3 = types.Array(types.float32, 3, "A")
_A3_IN = types.Array(types.float32, 3, "A", readonly=True)
_BATCHED_SIG = (types.int64, types.int64, types.boolean, types.boolean, _A3_IN, _A3_IN, _A3, types.float32,
                types.int64, types.boolean)
_T_BATCHED_SIG = (_A3_IN, _A3_IN, _A3, types.int64)


@njit(parallel=True, **_opts)
def _gemm_batched(fn, fnv, ilp64, transb, a, b, c, beta, nsplit, own):
    """c[g] = a[g] . op(b[g]) + beta c[g] for every g, one work item per (g, share of c's columns);
    a single row of a goes to sgemv (fnv): sgemm with M = 1 measured 2.7-6x slower than gemv
    (1 x 64..4096 x 1024), and (16, 1, 576) x (16, 3584, 576)^T took 4.7 ms, as numpy with
    OpenBLAS at two threads, against 9.4 ms in numpy at one."""
    nbat, M, K = a.shape
    N = c.shape[2]
    st = _shares(N, nsplit, 16)
    for it in prange(nbat * nsplit):
        g, n0, n1 = _item(it, nsplit, st)
        if n1 <= n0:
            continue
        if transb:      # rows n0:n1 of b[g]
            boff = (g * b.strides[0] + n0 * b.strides[1]) // 4
        else:           # columns n0:n1 of b[g]
            boff = g * b.strides[0] // 4 + n0
        aoff, coff = g * a.strides[0] // 4, g * c.strides[0] // 4 + n0
        if M == 1:      # y = B_share . a (transb) or B_share^T . a, B_share row-major
            if transb:
                _sgemv(fnv, ilp64, False, n1 - n0, K, b, boff, b.strides[1] // 4, a, aoff, beta, c, coff)
            else:
                _sgemv(fnv, ilp64, True, K, n1 - n0, b, boff, b.strides[1] // 4, a, aoff, beta, c, coff)
        elif own and not transb and (n1 - n0) % 16 == 0:     # b's rows read as whole 16-lane vectors
            _own.tile_sgemm(a, aoff, a.strides[1] // 4, b, boff, b.strides[1] // 4, c, coff, c.strides[1] // 4,
                            M, n1 - n0, K, beta != 0)
        else:
            _sgemm(fn, ilp64, transb, M, n1 - n0, K, a, aoff, a.strides[1] // 4,
                   b, boff, b.strides[1] // 4, beta, c, coff, c.strides[1] // 4)


@njit(parallel=True, **_opts)
def _gemm_tiles(fn, ilp64, qt, rows, buf, stride, n_rows, cols, qk, lut, x, out, tile_rows, parts):
    """out = x @ W.T for packed weight rows (row r at byte r * stride of buf): each pool thread
    decodes its share of the rows tile_rows at a time into its own f32 scratch and multiplies.
    qt: the plain type id; rows: the address of its group's row decoder (quant.kernels.rows_address),
    so this loop compiles once for every type."""
    st = _shares(n_rows, parts, 16)
    M = x.shape[0]
    for p in prange(parts):
        r0, r1 = st[p], st[p + 1]
        if r1 <= r0:
            continue
        tile = np.empty((min(tile_rows, r1 - r0), cols), dtype=np.float32)
        for a in range(r0, r1, tile_rows):
            n = min(tile_rows, r1 - a)
            call_at(rows, (np.int64(qt), buf, np.int64(a * stride), np.int64(stride), np.int64(n), np.int64(cols),
                           np.int64(qk), lut, tile))
            _sgemm(fn, ilp64, True, M, n, cols, x, 0, x.strides[0] // 4, tile, 0, cols,
                   np.float32(0.0), out, a, out.strides[0] // 4)


def _operand(m: np.ndarray) -> np.ndarray:
    """m as a 3-D f32 array BLAS can read: last axis contiguous, rows spaced at least a row apart."""
    m = m if m.ndim == 3 else m[None]
    it = 4
    if (m.dtype != np.float32 or m.strides[2] != it or m.strides[1] < m.shape[2] * it or m.strides[1] % it
            or m.strides[0] % it or m.strides[0] < 0 or m.__array_interface__["data"][0] % it):
        m = np.ascontiguousarray(m, dtype=np.float32)
    if m.shape[1] == 1 and m.strides[1] != m.shape[2] * it:       # a size-1 axis may carry any stride
        m = np.lib.stride_tricks.as_strided(m, strides=(m.strides[0], m.shape[2] * it, it))
    return m


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray, trans_b: bool = True, accumulate: bool = False) -> np.ndarray:
    """out = a @ b.T (trans_b) or a @ b; accumulate: out += instead.  2-D (M, K) operands, or 3-D
    with a leading batch axis; out (.., M, N) f32 whose last axis is contiguous.  Parallel over
    numba's pool; numpy's matmul for products under SMALL_WORK multiply-adds, for an out that is
    not an aligned, writable f32 array, or where available() is False."""
    # small products stay on the calling thread: the router's 1 x 64 x 1024 took 3.7 us in numpy,
    # 10 us through the pool
    small = a.shape[-2] * out.shape[-1] * a.shape[-1] * (out.shape[0] if out.ndim == 3 else 1) < SMALL_WORK
    # (an out the pool's one compiled form cannot take, misaligned or read-only, goes to numpy too)
    fits = out.dtype == np.float32 and out.strides[-1] == 4 and out.flags.aligned and out.flags.writeable
    if not available() or not fits or small:
        r = np.matmul(a, np.swapaxes(b, -1, -2) if trans_b else b)
        if accumulate:
            out += r
        else:
            out[...] = r
        return out
    a3, b3 = _operand(a), _operand(b)
    c3 = out if out.ndim == 3 else out[None]
    if c3.size == 0:
        return out
    if a3.shape[2] == 0:                                           # K = 0: a sum of nothing
        if not accumulate:
            out[...] = 0.0
        return out
    fn, fnv, ilp64 = _find()
    nt = numba.get_num_threads()
    nsplit = max(1, -(-nt // c3.shape[0]))
    one_form(_gemm_batched, _BATCHED_SIG)(fn, fnv, ilp64, bool(trans_b), a3, b3, c3,
                                          np.float32(1.0 if accumulate else 0.0), nsplit, OWN)
    return out


@njit(parallel=True, **_opts)
def _gemm_t_batched(a, bt, c, nsplit):
    """c[g] = (a[g] . bt[g])^T, one work item per (g, share of a's rows = c's columns)."""
    nbat, M, K = a.shape
    N = c.shape[1]
    st = _shares(M, nsplit, 8)
    for it in prange(nbat * nsplit):
        g, m0, m1 = _item(it, nsplit, st)
        if m1 <= m0:
            continue
        _own.tile_sgemm_t(a, (g * a.strides[0] + m0 * a.strides[1]) // 4, a.strides[1] // 4, bt,
                          g * bt.strides[0] // 4, bt.strides[1] // 4, c, (g * c.strides[0]) // 4 + m0,
                          c.strides[1] // 4, m1 - m0, N, K, False)


def gemm_t(a: np.ndarray, bt: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[g] = (a[g] @ bt[g]).T through quant.simd_sgemm (3-D f32 operands, last axes
    contiguous): a (G, M, K), bt (G, K, >= N) whose rows hold at least N rounded up to 16 readable
    columns (the prompt attention's K . Q^T, with Q^T padded), out (G, N, M).  For OWN hosts."""
    if out.size == 0:
        return out
    if a.shape[2] == 0:
        out[...] = 0.0
        return out
    if a.strides[2] != 4 or bt.strides[2] != 4 or out.strides[2] != 4 or bt.shape[2] < -(-out.shape[1] // 16) * 16:
        raise ValueError("gemm_t: last axes must be contiguous and bt's rows padded to 16 columns")
    nsplit = max(1, -(-numba.get_num_threads() // out.shape[0]))
    one_form(_gemm_t_batched, _T_BATCHED_SIG)(a, bt, out, nsplit)
    return out


def gemm_tiles(buf: np.ndarray, qtype: int | QType, stride: int, n_rows: int, cols: int, lut: np.ndarray,
               x: np.ndarray, out: np.ndarray, tile_rows: int, qk: int = 32) -> None:
    """out (M, n_rows) = x @ W.T for the packed weight rows of buf (row r at byte r * stride),
    decoded by each pool thread tile_rows at a time (qtype: an id, or a quant.typetag tag).
    x, out: f32 with contiguous rows.  Requires available()."""
    fn, _, ilp64 = _find()
    _gemm_tiles(fn, ilp64, int(qtype), rows_address(qtype, buf, lut), buf, stride, n_rows, cols, qk, lut, x, out,
                tile_rows, numba.get_num_threads())
