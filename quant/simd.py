"""Explicit-vector row dots for the integer kernels, written in LLVM IR through numba intrinsics.

Why IR: numba's loops over one 32-value block (int16 products summed into one int32) vectorize,
but every block still ends in a horizontal sum before its scale is applied, and that bounded
the Q8_0 / Q4_0 matvecs at ~10 GB/s on two Zen 4 cores (ik_llama.cpp's reach ~26).  Attempts
to keep per-lane accumulators in numba code did not vectorize.  Here each block is

    w, a   = 32 int8 weights, 32 int8 activations      (one 256-bit load each)
    s16    = pairwise sums of the 32 int32 products    (LLVM selects vpmaddwd)
    acc16 += float(s16) * (d_w * d_a)                   (vcvtdq2ps + one FMA)

and the 16 lanes are summed once per row.  The IR is generic (no target intrinsics): LLVM
lowers it for whatever the host has (AVX2: two halves; AVX-512BW: one zmm; other targets:
their own vectors), so the kernels stay portable and numba's cache=True still works.

A weight family only differs in how one block becomes (scale, 32 int8 values in activation
order); `_row_dot_intrinsic` builds the row loop around such an `unpack` function, so each
family is one short function, not a copy of the loop.  Activation blocks are the Q8 blocks of
quant.kernels.quantize_act_q8: 32 int8 values and one f32 scale per block.

Exactness: the block sums are exact integers as in the scalar kernels; only the order of the
f32 additions differs (16 lanes, then a tree), which is within f32 rounding of the scalar
loop.  tests/test_quant_kernels.py compares both against the NumPy references.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
QK = 32          # values per block, weights and activations
LANES = 16       # int32 pair sums per block = f32 accumulator lanes


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _const_i64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _load_vec(builder: ir.IRBuilder, ptr, t: ir.Type, n: int):
    """Unaligned load of n values of type t at byte pointer ptr."""
    return builder.load(builder.bitcast(ptr, _vec(t, n).as_pointer()), align=1)


def _f16_scale(builder: ir.IRBuilder, p):
    """The little-endian f16 at byte pointer p, as f32."""
    h = builder.load(builder.bitcast(p, _I16.as_pointer()), align=1)
    return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)


def _unpack_q8_0(builder: ir.IRBuilder, p):
    """Q8_0 block: f16 d, then 32 int8 values."""
    return _f16_scale(builder, p), _load_vec(builder, builder.gep(p, [_const_i64(2)]), _I8, QK)


def _unpack_q4_0(builder: ir.IRBuilder, p):
    """Q4_0 block: f16 d, then 16 bytes; value j < 16 is the low nibble of byte j, value 16 + j
    the high nibble, each minus 8."""
    b = _load_vec(builder, builder.gep(p, [_const_i64(2)]), _I8, QK // 2)
    splat = lambda v: ir.Constant(_vec(_I8, QK // 2), [v] * (QK // 2))  # noqa: E731
    lo = builder.sub(builder.and_(b, splat(15)), splat(8))
    hi = builder.sub(builder.lshr(b, splat(4)), splat(8))
    return _f16_scale(builder, p), builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, QK), list(range(QK))))


def _row_dot_intrinsic(block_bytes: int, unpack):
    """An intrinsic f(buf, base, q, s, nb) -> f32: the dot of the weight row of nb blocks at byte
    `base` of uint8 array buf with the activation row (q: int8 values, s: f32 block scales)."""

    @intrinsic
    def row_dot(typingctx, buf, base, q, s, nb):
        if not (isinstance(buf, types.Array) and isinstance(q, types.Array) and isinstance(s, types.Array)):
            return None
        sig = types.float32(buf, types.int64, q, s, types.int64)

        def codegen(context, builder, sig, args):
            wbuf = context.make_array(sig.args[0])(context, builder, args[0])
            qa = context.make_array(sig.args[2])(context, builder, args[2])
            sa = context.make_array(sig.args[3])(context, builder, args[3])
            row = builder.gep(wbuf.data, [args[1]])
            accp = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, LANES), None))
            even = ir.Constant(_vec(_I32, LANES), [2 * i for i in range(LANES)])
            odd = ir.Constant(_vec(_I32, LANES), [2 * i + 1 for i in range(LANES)])
            with cgutils.for_range(builder, args[4]) as loop:
                b = loop.index
                d, w = unpack(builder, builder.gep(row, [builder.mul(b, _const_i64(block_bytes))]))
                a = _load_vec(builder, builder.gep(qa.data, [builder.mul(b, _const_i64(QK))]), _I8, QK)
                prod = builder.mul(builder.sext(w, _vec(_I32, QK)), builder.sext(a, _vec(_I32, QK)))
                pairs = builder.add(builder.shuffle_vector(prod, prod, even), builder.shuffle_vector(prod, prod, odd))
                scale = builder.fmul(d, builder.load(builder.gep(sa.data, [b])))
                sv = builder.insert_element(ir.Constant(_vec(_F32, LANES), None), scale, ir.Constant(_I32, 0))
                sv = builder.shuffle_vector(sv, sv, ir.Constant(_vec(_I32, LANES), [0] * LANES))
                term = builder.fmul(builder.sitofp(pairs, _vec(_F32, LANES)), sv, flags=["fast"])
                builder.store(builder.fadd(builder.load(accp), term, flags=["fast"]), accp)
            red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _vec(_F32, LANES)]),
                                                 f"llvm.vector.reduce.fadd.v{LANES}f32")
            r = builder.call(red, [ir.Constant(_F32, 0.0), builder.load(accp)])
            r.fastmath.add("reassoc")           # a tree sum, not 16 sequential adds
            return r
        return sig, codegen
    return row_dot


row_dot_q8_0 = _row_dot_intrinsic(2 + QK, _unpack_q8_0)
row_dot_q4_0 = _row_dot_intrinsic(2 + QK // 2, _unpack_q4_0)
