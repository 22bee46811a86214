"""An f32 GEMM tile kernel in 512-bit vectors, for the prompt attention's products where numpy's
BLAS runs without AVX-512 kernels (quant.gemm decides).

    C[i, j] (+)= sum_k A[i, k] B[k, j]      i < M, j < N

A is read one element at a time (broadcast), so any row stride lda works; B's rows are read as
whole 16-lane vectors: the caller keeps every row readable to a multiple of 16 columns (ldb and
the buffer), and C is written only in the columns j < N.  Blocks of 8 rows x 32 columns keep
16 accumulators in registers (two B vectors and 16 broadcast FMAs per k); the rows past the last
8 go one at a time, and the columns past the last 32 one 16-lane vector at a time.  The _t form
writes C transposed (the attention's scores as K . Q^T: Q^T is made once a query tile, and no
operand is repacked per cell tile).

Development note (as quant.simd): after editing this module delete quant/__pycache__/*.nb*.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _F32, _I32, _I64, _const_i64, _splat, _vec

_V16 = _vec(_F32, 16)
ROWS, COLS = 8, 32


def _fma(b: ir.IRBuilder, x, y, acc):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V16, [_V16, _V16, _V16]), "llvm.fma.v16f32")
    return b.call(fn, [x, y, acc])


def _store_lanes(module: ir.Module) -> ir.Function:
    """void store_lanes(<16 x float> x, float* p, i64 step, i64 n, i1 accumulate): p[l * step]
    (+)= x[l] for l < n.  One out-of-line loop instead of 16 unrolled scalar stores at each of the
    kernel's block sites: inlined, quant.gemm.gemm_t's first call (empty cache) took 13.1 s, with
    this 1.9 s; the stores are a small part of a block (8 x 32 outputs after K vector FMAs)."""
    fnty = ir.FunctionType(ir.VoidType(), [_V16, _F32.as_pointer(), _I64, _I64, ir.IntType(1)])
    fn = cgutils.get_or_insert_function(module, fnty, "ikcli_sgemm_store_lanes")
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, p, step, n, accum = fn.args
    with cgutils.for_range(b, n) as ll:
        v = b.extract_element(x, b.trunc(ll.index, _I32))
        sp = b.gep(p, [b.mul(ll.index, step)])
        v = b.select(accum, b.fadd(v, b.load(sp)), v)
        b.store(v, sp)
    b.ret_void()
    return fn


def _codegen(transc: bool):
    def codegen(context, b, sig, args):
        ap = b.gep(context.make_array(sig.args[0])(context, b, args[0]).data, [args[1]])
        bp = b.gep(context.make_array(sig.args[3])(context, b, args[3]).data, [args[4]])
        cp = b.gep(context.make_array(sig.args[6])(context, b, args[6]).data, [args[7]])
        lda, ldb, ldc, M, N, K, accum = args[2], args[5], args[8], args[9], args[10], args[11], args[12]
        zero = ir.Constant(_V16, [0.0] * 16)

        def block(i0, j0, nr: int, nv: int, ncols=None):
            """Rows i0 .. i0 + nr - 1, nv vectors of columns from j0; ncols (runtime): the columns
            of the last vector that are stored (None: all 16)."""
            accs = [cgutils.alloca_once_value(b, zero) for _ in range(nr * nv)]
            for a in accs:
                b.store(zero, a)
            arow = [b.gep(ap, [b.mul(b.add(i0, _const_i64(r)), lda)]) for r in range(nr)]
            with cgutils.for_range(b, K) as kl:
                k = kl.index
                brow = b.gep(bp, [b.add(b.mul(k, ldb), j0)])
                bv = [b.load(b.bitcast(b.gep(brow, [_const_i64(16 * v)]), _V16.as_pointer()), align=4)
                      for v in range(nv)]
                for r in range(nr):
                    av = _splat(b, b.load(b.gep(arow[r], [k])), _F32, 16)
                    for v in range(nv):
                        a = accs[r * nv + v]
                        b.store(_fma(b, av, bv[v], b.load(a)), a)
            for r in range(nr):
                crow = b.gep(cp, [b.add(b.mul(b.add(i0, _const_i64(r)), ldc), j0)])   # (not transc)
                for v in range(nv):
                    res = b.load(accs[r * nv + v])
                    dst = b.gep(crow, [_const_i64(16 * v)])
                    if transc or ncols is not None:
                        # lane by lane: C's row may end inside the vector, or (transc) each lane is
                        # C[j0 + 16 v + lane, i0 + r], in a column of its own
                        if transc:
                            sp = b.gep(cp, [b.add(b.mul(b.add(j0, _const_i64(16 * v)), ldc), b.add(i0, _const_i64(r)))])
                            step = ldc
                        else:
                            sp, step = dst, _const_i64(1)
                        b.call(_store_lanes(b.module), [res, sp, step, _const_i64(16) if ncols is None else ncols,
                                                        accum])
                    else:
                        vp = b.bitcast(dst, _V16.as_pointer())
                        with b.if_then(accum):
                            b.store(b.fadd(res, b.load(vp, align=4)), accs[r * nv + v])
                        b.store(b.load(accs[r * nv + v]), vp, align=4)

        m8 = b.mul(b.udiv(M, _const_i64(ROWS)), _const_i64(ROWS))
        n32 = b.mul(b.udiv(N, _const_i64(COLS)), _const_i64(COLS))
        n16 = b.mul(b.udiv(N, _const_i64(16)), _const_i64(16))

        def rows_of(i0, nr: int):
            with cgutils.for_range(b, b.udiv(n32, _const_i64(COLS))) as jl:
                block(i0, b.mul(jl.index, _const_i64(COLS)), nr, 2)
            with b.if_then(b.icmp_unsigned("<", n32, n16)):          # one whole vector left
                block(i0, n32, nr, 1)
            with b.if_then(b.icmp_unsigned("<", n16, N)):            # a part of one
                block(i0, n16, nr, 1, b.sub(N, n16))

        with cgutils.for_range(b, b.udiv(M, _const_i64(ROWS))) as il:
            rows_of(b.mul(il.index, _const_i64(ROWS)), ROWS)
        with cgutils.for_range(b, b.sub(M, m8)) as il:
            rows_of(b.add(m8, il.index), 1)
        return context.get_dummy_value()
    return codegen


def _intrinsic(transc: bool):
    @intrinsic
    def sgemm(typingctx, A, aoff, lda, B, boff, ldb, C, coff, ldc, M, N, K, accumulate):
        if not all(isinstance(x, types.Array) and x.dtype == types.float32 for x in (A, B, C)):
            return None
        i64 = types.int64
        return types.void(A, i64, i64, B, i64, i64, C, i64, i64, i64, i64, i64, types.boolean), _codegen(transc)
    return sgemm


# tile_sgemm(A, aoff, lda, B, boff, ldb, C, coff, ldc, M, N, K, accumulate): C (+coff, ldc) = A
# (+aoff, lda) . B (+boff, ldb) (+ C when accumulate); offsets and strides in elements of the f32
# arrays' data (any layout: only their data pointers are used).  tile_sgemm_t: the same product
# written transposed, C[j, i] (+coff, ldc) for j < N, i < M.
tile_sgemm = _intrinsic(False)
tile_sgemm_t = _intrinsic(True)
