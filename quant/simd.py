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

Development note: numba's cache=True keys a cached kernel on its own module's source file only;
after editing this module, delete quant/__pycache__/kernels.*.nb* (or touch quant/kernels.py),
or the kernels keep the previously compiled IR.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
QK = 32          # values per block, weights and activations


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
    """Q8_0 block: f16 d, then 32 int8 values: one part of 32 lanes (activation offset 0)."""
    return _f16_scale(builder, p), [(_load_vec(builder, builder.gep(p, [_const_i64(2)]), _I8, QK), 0)]


def _unpack_q4_0(builder: ir.IRBuilder, p):
    """Q4_0 block: f16 d, then 16 bytes; value j < 16 is the low nibble of byte j, value 16 + j
    the high nibble, each minus 8: two parts of 16 lanes (activation offsets 0 and 16), each
    one and / shift of the same load (joining them into 32 lanes, with per-lane byte shifts, cost
    more than a second pairwise sum: 20.6 -> 22.6 GB/s, 4096 x 4096, 2 threads, measured)."""
    b = _load_vec(builder, builder.gep(p, [_const_i64(2)]), _I8, QK // 2)
    splat = lambda v: ir.Constant(_vec(_I8, QK // 2), [v] * (QK // 2))  # noqa: E731
    lo = builder.sub(builder.and_(b, splat(15)), splat(8))
    hi = builder.sub(builder.lshr(b, splat(4)), splat(8))
    return _f16_scale(builder, p), [(lo, 0), (hi, QK // 2)]


def _pair_sum(builder: ir.IRBuilder, v, n: int):
    """Lanes (2j, 2j+1) of an n-lane vector added: n/2 lanes."""
    even = ir.Constant(_vec(_I32, n // 2), [2 * i for i in range(n // 2)])
    odd = ir.Constant(_vec(_I32, n // 2), [2 * i + 1 for i in range(n // 2)])
    return builder.add(builder.shuffle_vector(v, v, even), builder.shuffle_vector(v, v, odd))


NACC = 4         # independent accumulators per row, so consecutive blocks' FMAs do not wait on
                 # each other; one thread, 4096 x 4096 Q8_0 / Q4_0 measured the same with 1 (25.5
                 # / 12.5 GB/s): not latency-bound there, kept for cores that are


def _splat_f32(builder: ir.IRBuilder, v, n: int):
    sv = builder.insert_element(ir.Constant(_vec(_F32, n), None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(sv, sv, ir.Constant(_vec(_I32, n), [0] * n))


def _row_dot_intrinsic(block_bytes: int, unpack, lanes: int):
    """An intrinsic f(buf, base, q, s, nb) -> f32: the dot of the weight row of nb blocks at byte
    `base` of uint8 array buf with the activation row (q: int8 values, s: f32 block scales).
    unpack gives a block's scale and its values as parts (int8 vector, activation offset) of
    2 * lanes values each; their pairwise sums accumulate in `lanes` f32 lanes."""

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
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, lanes), None)) for _ in range(NACC)]

            def block(b, accp):
                d, parts = unpack(builder, builder.gep(row, [builder.mul(b, _const_i64(block_bytes))]))
                act = builder.gep(qa.data, [builder.mul(b, _const_i64(QK))])
                isum = None
                for w, off in parts:
                    a = _load_vec(builder, builder.gep(act, [_const_i64(off)]), _I8, 2 * lanes)
                    prod = builder.mul(builder.sext(w, _vec(_I32, 2 * lanes)), builder.sext(a, _vec(_I32, 2 * lanes)))
                    pairs = _pair_sum(builder, prod, 2 * lanes)         # vpmaddwd
                    isum = pairs if isum is None else builder.add(isum, pairs)
                sv = _splat_f32(builder, builder.fmul(d, builder.load(builder.gep(sa.data, [b]))), lanes)
                term = builder.fmul(builder.sitofp(isum, _vec(_F32, lanes)), sv, flags=["fast"])
                builder.store(builder.fadd(builder.load(accp), term, flags=["fast"]), accp)

            nb = args[4]
            with cgutils.for_range(builder, builder.udiv(nb, _const_i64(NACC))) as loop:
                for j in range(NACC):
                    block(builder.add(builder.mul(loop.index, _const_i64(NACC)), _const_i64(j)), accs[j])
            tail0 = builder.mul(builder.udiv(nb, _const_i64(NACC)), _const_i64(NACC))
            with cgutils.for_range_slice(builder, tail0, nb, _const_i64(1)) as (b, _):
                block(b, accs[0])
            acc = builder.load(accs[0])
            for j in range(1, NACC):
                acc = builder.fadd(acc, builder.load(accs[j]), flags=["fast"])
            red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _vec(_F32, lanes)]),
                                                 f"llvm.vector.reduce.fadd.v{lanes}f32")
            r = builder.call(red, [ir.Constant(_F32, 0.0), acc])
            r.fastmath.add("reassoc")           # a tree sum, not sequential adds
            return r
        return sig, codegen
    return row_dot


row_dot_q8_0 = _row_dot_intrinsic(2 + QK, _unpack_q8_0, 16)
row_dot_q4_0 = _row_dot_intrinsic(2 + QK // 2, _unpack_q4_0, 8)


# ----------------------------------------------------------------------------------------
# row-interleaved weights (ik_llama.cpp's Q8_0_R8 / Q4_0_R8): 8 rows per block group
# ----------------------------------------------------------------------------------------
# A group block holds the 8 rows' f16 scales, then their values in 4-byte runs: run l of
# row k (values 4l..4l+3 of one half of the block) sits at byte 32*l + 4*k.  One 32-byte load
# thus covers 8 rows x 4 values; the matching 4 activation bytes are broadcast to all 8 rows,
# the products are summed per 4 bytes (two pairwise adds) and the 8 row sums accumulate in 8
# lanes: the 8 results need no horizontal sum at all.
R8 = 8


def _unpack_q8_0_r8(builder: ir.IRBuilder, p):
    """Q8_0_R8 group block: 8 f16 scales, 128 bytes for values 0..15 of the 8 rows, 128 for
    16..31.  Returns (scales <8 x f32>, [(32 weight bytes, activation offset of their 4 values)])."""
    runs = []
    for half in range(2):
        for l in range(4):
            w = _load_vec(builder, builder.gep(p, [_const_i64(16 + 128 * half + 32 * l)]), _I8, 32)
            runs.append((w, 16 * half + 4 * l))
    return _f16_scales8(builder, p), runs


def _unpack_q4_0_r8(builder: ir.IRBuilder, p):
    """Q4_0_R8 group block: 8 f16 scales, 128 bytes whose low nibbles are values 0..15 and high
    nibbles 16..31 (each minus 8)."""
    splat = lambda v: ir.Constant(_vec(_I8, 32), [v] * 32)  # noqa: E731
    runs = []
    for l in range(4):
        b = _load_vec(builder, builder.gep(p, [_const_i64(16 + 32 * l)]), _I8, 32)
        runs.append((builder.sub(builder.and_(b, splat(15)), splat(8)), 4 * l))
        runs.append((builder.sub(builder.lshr(b, splat(4)), splat(8)), 16 + 4 * l))
    return _f16_scales8(builder, p), runs


def _f16_scales8(builder: ir.IRBuilder, p):
    h = builder.load(builder.bitcast(p, _vec(_I16, R8).as_pointer()), align=1)
    return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), R8)), _vec(_F32, R8))


def _group_dot_intrinsic(block_bytes: int, unpack):
    """An intrinsic f(buf, gbase, q, s, nb, out, r0): out[r0 + k] = dot of row k of the 8-row
    group at byte gbase (nb group blocks) with the activation row (q, s), k < 8."""

    @intrinsic
    def group_dot(typingctx, buf, gbase, q, s, nb, out, r0):
        if not all(isinstance(a, types.Array) for a in (buf, q, s, out)):
            return None
        sig = types.none(buf, types.int64, q, s, types.int64, out, types.int64)

        def codegen(context, builder, sig, args):
            wbuf = context.make_array(sig.args[0])(context, builder, args[0])
            qa = context.make_array(sig.args[2])(context, builder, args[2])
            sa = context.make_array(sig.args[3])(context, builder, args[3])
            oa = context.make_array(sig.args[5])(context, builder, args[5])
            grp = builder.gep(wbuf.data, [args[1]])
            accp = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, R8), None))
            bcast4 = ir.Constant(_vec(_I32, 32), [i % 4 for i in range(32)])
            with cgutils.for_range(builder, args[4]) as loop:
                b = loop.index
                d8, runs = unpack(builder, builder.gep(grp, [builder.mul(b, _const_i64(block_bytes))]))
                act = builder.gep(qa.data, [builder.mul(b, _const_i64(QK))])
                isum = None
                for w, off in runs:
                    a4 = _load_vec(builder, builder.gep(act, [_const_i64(off)]), _I8, 4)
                    a = builder.shuffle_vector(a4, a4, bcast4)
                    prod = builder.mul(builder.sext(w, _vec(_I32, 32)), builder.sext(a, _vec(_I32, 32)))
                    pairs = _pair_sum(builder, prod, 32)            # vpmaddwd
                    isum = pairs if isum is None else builder.add(isum, pairs)
                rows = _pair_sum(builder, isum, 16)                 # 8 lanes: one per row
                sa_b = builder.load(builder.gep(sa.data, [b]))
                sv = builder.insert_element(ir.Constant(_vec(_F32, R8), None), sa_b, ir.Constant(_I32, 0))
                sv = builder.shuffle_vector(sv, sv, ir.Constant(_vec(_I32, R8), [0] * R8))
                term = builder.fmul(builder.sitofp(rows, _vec(_F32, R8)), builder.fmul(d8, sv, flags=["fast"]),
                                    flags=["fast"])
                builder.store(builder.fadd(builder.load(accp), term, flags=["fast"]), accp)
            dst = builder.bitcast(builder.gep(oa.data, [args[6]]), _vec(_F32, R8).as_pointer())
            builder.store(builder.load(accp), dst, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return group_dot


group_dot_q8_0_r8 = _group_dot_intrinsic(16 + 8 * QK, _unpack_q8_0_r8)
group_dot_q4_0_r8 = _group_dot_intrinsic(16 + 4 * QK, _unpack_q4_0_r8)

