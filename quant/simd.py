"""Explicit-vector row dots for the integer kernels, written in LLVM IR through numba intrinsics.

Why IR: numba's loops over one 32-value block (int16 products summed into one int32) vectorize,
but every block still ends in a horizontal sum before its scale is applied, and that bounded
the Q8_0 / Q4_0 matvecs at ~10 GB/s on two Zen 4 cores (ik_llama.cpp's reach ~26).  Attempts
to keep per-lane accumulators in numba code did not vectorize.  Here each block is

    w, a   = 32 int8 weights, 32 int8 activations      (one 256-bit load each)
    s16    = pairwise sums of the 32 int32 products    (LLVM selects vpmaddwd)
    acc16 += float(s16) * (d_w * d_a)                   (vcvtdq2ps + one FMA)

and the 16 lanes are summed once per row.  That IR is generic (no target intrinsics): LLVM
lowers it for whatever the host has (AVX2: two halves; AVX-512BW: one zmm; other targets:
their own vectors), so the kernels stay portable.

Where numba's target has AVX512-VNNI (HAS_VNNI), the block products use vpdpbusd instead
(`llvm.x86.avx512.vpdpbusd.256`: 32 unsigned x signed byte products summed 4 per int32 lane).
Its first operand is unsigned, so the weights go in offset to unsigned bytes (Q4_0: the raw
nibbles, value + 8; Q8_0: value + 128, a sign-bit flip) and the lanes start from
-offset * (sum of the block's activations): quantize_act_q8 returns those sums with the
values.  The integer block sums are the generic path's exactly.  Measured (4096 x 4096, one
token, 2 threads, cache-hot, scripts/bench_matmul.py): Q8_0 50 -> 72 GB/s, Q4_0 25 -> 35,
Q8_0_R8 81 -> 129, Q4_0_R8 36 -> 79 (the 8-row groups need no pairwise sums at all: one
vpdpbusd per 4 activation bytes puts each row's products in its own lane).  The generic forms
keep their names with a `_generic` suffix; tests run both where the CPU allows.

A weight family only differs in how one block becomes (scale, int8 or offset-uint8 values in
activation order); `_row_dot_intrinsic` / `_group_dot_intrinsic` build the row loop around a
block function, so each family is one short function, not a copy of the loop.  Activation
blocks are those of quant.kernels.quantize_act_q8: 32 int8 values, one f32 scale and one int32
sum per block.

Exactness: the block sums are exact integers as in the scalar kernels; only the order of the
f32 additions differs (lanes, then a tree), which is within f32 rounding of the scalar loop.
tests/test_quant_kernels.py compares both forms with an exact emulation and the NumPy
references.

Development note: numba's cache=True keys a cached kernel on its own module's source file only;
after editing this module, delete quant/__pycache__/kernels.*.nb* (or touch quant/kernels.py),
or the kernels keep the previously compiled IR.
"""
from __future__ import annotations

from contextlib import contextmanager

import numba
from llvmlite import binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
QK = 32          # values per block, weights and activations


def cpu_features() -> set[str]:
    """The target features numba compiles for (its NUMBA_CPU_NAME / NUMBA_CPU_FEATURES rules),
    e.g. {"+avx512vnni", ...}: target intrinsics may only be emitted when these have them."""
    cfg = numba.config
    if cfg.CPU_FEATURES is not None:
        return set(cfg.CPU_FEATURES.split(","))
    if cfg.CPU_NAME not in (None, "host"):
        return set()                     # a named CPU without explicit features: assume none
    try:
        return set(llb.get_host_cpu_features().flatten().split(","))
    except RuntimeError:
        return set()


# vpdpbusd on 256-bit vectors (AVX512-VNNI + VL).  numba's cache keys compiled code on the CPU
# features too, so a cached VNNI kernel is never loaded on a CPU without them.  (No switch to
# turn it off: the cache would not see it.  The generic forms stay importable for tests.)
HAS_VNNI = {"+avx512vnni", "+avx512vl", "+avx512bw", "+avx512f"} <= cpu_features()
# Without VNNI, AVX2's vpmaddubsw / vpmaddwd / vpsignb (signed_pairs) in place of the generic IR's
# products widened to int32 (its assembly not inspected; measured: Zen 3, one thread, 4096^2, one
# token, Q4_K 2.10 -> 0.90 ms, README)
HAS_AVX2 = "+avx2" in cpu_features()


@contextmanager
def stack_scope(builder: ir.IRBuilder):
    """Allocas made inside the block are freed when it ends (llvm.stacksave / stackrestore).
    An alloca outside a function's entry block is dynamic: inside a loop it takes new stack on
    every iteration until the function returns, and a kernel that loops over thousands of rows
    and token passes ran out of a thread's stack (segfault)."""
    i8p = ir.IntType(8).as_pointer()
    sfx = ".p0" if llb.llvm_version_info[0] >= 18 else ""
    save = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8p, []), "llvm.stacksave" + sfx)
    restore = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]),
                                             "llvm.stackrestore" + sfx)
    sp = builder.call(save, [])
    yield
    builder.call(restore, [sp])


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


def _sign_flip(builder: ir.IRBuilder, w, n: int):
    """int8 values as unsigned bytes offset by 128 (value + 128: the sign bit flipped)."""
    return builder.xor(w, ir.Constant(_vec(_I8, n), [-128] * n))


def _unpack_q8_0(builder: ir.IRBuilder, p, u8: bool = False):
    """Q8_0 block: f16 d, then 32 int8 values: one part of 32 lanes (activation offset 0);
    u8: the values plus 128, for vpdpbusd."""
    w = _load_vec(builder, builder.gep(p, [_const_i64(2)]), _I8, QK)
    return _f16_scale(builder, p), [(_sign_flip(builder, w, QK) if u8 else w, 0)]


def _unpack_q4_0(builder: ir.IRBuilder, p, u8: bool = False):
    """Q4_0 block: f16 d, then 16 bytes; value j < 16 is the low nibble of byte j, value 16 + j
    the high nibble, each minus 8 (u8: the nibbles themselves, value + 8, for vpdpbusd): two
    parts of 16 lanes (activation offsets 0 and 16), each one and / shift of the same load.
    (For the generic path, joining them into 32 lanes with per-lane byte shifts measured
    20.6 GB/s against 22.6 for two parts, 4096 x 4096, 2 threads.)"""
    b = _load_vec(builder, builder.gep(p, [_const_i64(2)]), _I8, QK // 2)
    splat = lambda v: ir.Constant(_vec(_I8, QK // 2), [v] * (QK // 2))  # noqa: E731
    lo, hi = builder.and_(b, splat(15)), builder.lshr(b, splat(4))
    if not u8:
        lo, hi = builder.sub(lo, splat(8)), builder.sub(hi, splat(8))
    return _f16_scale(builder, p), [(lo, 0), (hi, QK // 2)]


def _pair_sum(builder: ir.IRBuilder, v, n: int):
    """Lanes (2j, 2j+1) of an n-lane vector added: n/2 lanes."""
    even = ir.Constant(_vec(_I32, n // 2), [2 * i for i in range(n // 2)])
    odd = ir.Constant(_vec(_I32, n // 2), [2 * i + 1 for i in range(n // 2)])
    return builder.add(builder.shuffle_vector(v, v, even), builder.shuffle_vector(v, v, odd))


NACC = 4         # independent accumulators per row, so consecutive blocks' FMAs do not wait on
                 # each other; one thread, 4096 x 4096 Q8_0 / Q4_0 measured the same with 1 (25.5
                 # / 12.5 GB/s): not latency-bound there, kept for cores that are


def _generic_block(unpack, lanes: int):
    """Block product of the generic IR: unpack's int8 parts times the activations, int32
    products summed in pairs (LLVM selects vpmaddwd) into `lanes` int32 lanes."""
    def block_isum(builder: ir.IRBuilder, wp, act, bsum):
        d, parts = unpack(builder, wp)
        isum = None
        for w, off in parts:
            a = _load_vec(builder, builder.gep(act, [_const_i64(off)]), _I8, 2 * lanes)
            if HAS_AVX2:        # sums of 4 in the first half of the lanes (one scale: only the total counts)
                q = signed_quads(builder, w, a)
                pairs = builder.shuffle_vector(q, ir.Constant(q.type, [0] * (lanes // 2)),
                                               ir.Constant(_vec(_I32, lanes), list(range(lanes))))
            else:
                prod = builder.mul(builder.sext(w, _vec(_I32, 2 * lanes)), builder.sext(a, _vec(_I32, 2 * lanes)))
                pairs = _pair_sum(builder, prod, 2 * lanes)
            isum = pairs if isum is None else builder.add(isum, pairs)
        return d, isum
    return block_isum


def _vnni_block(unpack, shift: int):
    """Block product with AVX512-VNNI: unpack(u8=True) gives the block's 32 weights as unsigned
    bytes that are the true values plus 2**shift (parts in activation order, joined into one
    32-byte vector); vpdpbusd sums 4 (u8 x s8) products per int32 lane and starts from
    -(2**shift) * (sum of the block's activations) in lane 0, so the 8 lanes add up to the exact
    integer block sum of the generic path."""
    def block_isum(builder: ir.IRBuilder, wp, act, bsum):
        d, parts = unpack(builder, wp, u8=True)
        wu = parts[0][0]
        if len(parts) == 2:               # Q4_0: low and high nibbles, activations 0..15, 16..31
            wu = builder.shuffle_vector(wu, parts[1][0], ir.Constant(_vec(_I32, QK), list(range(QK))))
        a = _load_vec(builder, act, _I8, QK)
        corr = builder.neg(builder.shl(bsum, ir.Constant(_I32, shift)))
        init = builder.insert_element(ir.Constant(_vec(_I32, 8), None), corr, ir.Constant(_I32, 0))
        return d, dpbusd(builder, init, wu, a)
    return block_isum


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def _halves(builder: ir.IRBuilder, v, f):
    """f applied to each 256-bit half of 512-bit vectors (AVX2's width), results joined."""
    n = v[0].type.count
    if n * v[0].type.element.width <= 256:
        return f(*v)
    parts = [f(*[builder.shuffle_vector(x, x, ir.Constant(_vec(_I32, n // 2), list(range(h, h + n // 2))))
                 for x in v]) for h in (0, n // 2)]
    m = parts[0].type.count
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_vec(_I32, 2 * m), list(range(2 * m))))


def signed_pairs(builder: ir.IRBuilder, w, a, mag=None):
    """AVX2 (SSSE3 for 16 bytes): per int16 lane the sum of 2 consecutive products w x a of int8
    vectors of 16 or 32 bytes, exact for w in [-128, 127] and a in [-127, 127] (the activations'
    range): vpmaddubsw of |w| as unsigned bytes (mag, when the caller made it once for many a) and
    a with w's sign (vpsignb), whose pairs stay within 2 * 128 * 127 < 2**15 (no saturation)."""
    n = w.type.count
    v8, v16 = _vec(_I8, n), _vec(_I16, n // 2)
    sign, madd = (("llvm.x86.avx2.psign.b", "llvm.x86.avx2.pmadd.ub.sw") if n == 32 else
                  ("llvm.x86.ssse3.psign.b.128", "llvm.x86.ssse3.pmadd.ub.sw.128"))
    if mag is None:
        mag = _call(builder, sign, v8, w, w)
    return _call(builder, madd, v16, mag, _call(builder, sign, v8, a, w))


def unsigned_pairs(builder: ir.IRBuilder, u, a):
    """AVX2: per int16 lane the sum of 2 consecutive products of u (32 unsigned bytes, each < 128
    or the pair sums saturate) and a (32 signed bytes): one vpmaddubsw, no sign trick."""
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), u, a)


def _quads(builder: ir.IRBuilder, p16):
    """int16 pair sums -> int32 sums of 4 (vpmaddwd with ones)."""
    n = p16.type.count
    name = "llvm.x86.avx2.pmadd.wd" if n == 16 else "llvm.x86.sse2.pmadd.wd"
    return _call(builder, name, _vec(_I32, n // 2), p16, ir.Constant(_vec(_I16, n), [1] * n))


def signed_quads(builder: ir.IRBuilder, w, a):
    """Per int32 lane the sum of 4 consecutive products w x a of int8 vectors (16, 32 or 64 bytes;
    ranges as signed_pairs), with AVX2 where the CPU has it, else widened products."""
    if HAS_AVX2:
        return _halves(builder, (w, a), lambda x, y: _quads(builder, signed_pairs(builder, x, y)))
    n = w.type.count
    prod = builder.mul(builder.sext(w, _vec(_I32, n)), builder.sext(a, _vec(_I32, n)))
    return _pair_sum(builder, _pair_sum(builder, prod, n), n // 2)


def dpbusd(builder: ir.IRBuilder, acc, u8, s8, vnni: bool = True):
    """acc (8 or 16 x i32) + per lane the sum of its 4 products u8 (unsigned bytes) x s8 (signed
    bytes, -127..127), no saturation: vpdpbusd (256 / 512-bit) with vnni; else with AVX2 the levels
    u8 - 128 (a sign flip) through signed_quads plus 128 * the activations' sums (vpmaddubsw of
    128s: exact), or widened products and two pairwise adds (what LLVM lowers for any target)."""
    n = acc.type.count
    if vnni:
        vi = _vec(_I32, n)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vi, vi, vi]),
                                            f"llvm.x86.avx512.vpdpbusd.{32 * n}")
        return builder.call(fn, [acc, builder.bitcast(u8, vi), builder.bitcast(s8, vi)])
    if HAS_AVX2:
        u8, s8 = (builder.bitcast(x, _vec(_I8, 4 * n)) for x in (u8, s8))
        m = 4 * n
        top = ir.Constant(_vec(_I8, m), [-128] * m)

        def asum128(y):     # 128 * the 4-byte sums of y
            return _quads(builder, unsigned_pairs(builder, ir.Constant(_vec(_I8, 32), [-128] * 32), y))
        lev = signed_quads(builder, builder.xor(u8, top), s8)
        return builder.add(acc, builder.add(lev, _halves(builder, (s8,), asum128)))
    prod = builder.mul(builder.zext(u8, _vec(_I32, 4 * n)), builder.sext(s8, _vec(_I32, 4 * n)))
    return builder.add(acc, _pair_sum(builder, _pair_sum(builder, prod, 4 * n), 2 * n))


# 8 KiB ahead, in every row loop (here and quant.simd_blocks / simd_r4).  In the model
# (bench_tg_calls.py, ds2b-q4_k_m, one thread) the Q4_K experts read 25 GB/s at 2048 bytes ahead,
# 29 at 4096, 31 at 8192; the Q6_K output matrix, without prefetch before, 32 -> 39-40 GB/s (two
# threads: 48 -> 50-51); ds2b-pure-q8_0's output (none before either) 32-34 -> 40 GB/s
PREFETCH_BYTES = 8192


def prefetch(b: ir.IRBuilder, p, ahead: int, span: int, locality: int = 3) -> None:
    """Software prefetch of the cache lines [p + ahead, p + ahead + span): the hardware
    prefetcher alone left the compute-heavy row loops reading DRAM at 12-16 GB/s on one
    thread where Q8_0's light loop reaches 30 (102400 x 2048, cold)."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")
    for o in range(0, span, 64):
        q = b.gep(b.bitcast(p, ir.IntType(8).as_pointer()), [ir.Constant(_I64, ahead + o)])
        b.call(fn, [q, ir.Constant(_I32, 0), ir.Constant(_I32, locality), ir.Constant(_I32, 1)])


def _row_dot_intrinsic(block_bytes: int, block_isum, lanes: int):
    """An intrinsic f(buf, base, q, s, bs, nb) -> f32: the dot of the weight row of nb blocks at
    byte `base` of uint8 array buf with the activation row (q: int8 values, s: f32 block scales,
    bs: int32 block sums).  block_isum gives a block's weight scale and its integer products
    with the activations in `lanes` int32 lanes; they accumulate, scaled, in `lanes` f32 lanes."""

    @intrinsic
    def row_dot(typingctx, buf, base, q, s, bs, nb):
        if not all(isinstance(a, types.Array) for a in (buf, q, s, bs)):
            return None
        sig = types.float32(buf, types.int64, q, s, bs, types.int64)

        def codegen(context, builder, sig, args):
            wbuf = context.make_array(sig.args[0])(context, builder, args[0])
            qa = context.make_array(sig.args[2])(context, builder, args[2])
            sa = context.make_array(sig.args[3])(context, builder, args[3])
            ba = context.make_array(sig.args[4])(context, builder, args[4])
            row = builder.gep(wbuf.data, [args[1]])
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, lanes), None)) for _ in range(NACC)]

            def block(b, accp):
                act = builder.gep(qa.data, [builder.mul(b, _const_i64(QK))])
                d, isum = block_isum(builder, builder.gep(row, [builder.mul(b, _const_i64(block_bytes))]), act,
                                     builder.load(builder.gep(ba.data, [b])))
                sv = _splat(builder, builder.fmul(d, builder.load(builder.gep(sa.data, [b]))), _F32, lanes)
                term = builder.fmul(builder.sitofp(isum, _vec(_F32, lanes)), sv, flags=["fast"])
                builder.store(builder.fadd(builder.load(accp), term, flags=["fast"]), accp)

            nb = args[5]
            with cgutils.for_range(builder, builder.udiv(nb, _const_i64(NACC))) as loop:
                prefetch(builder, builder.gep(row, [builder.mul(loop.index, _const_i64(NACC * block_bytes))]),
                         PREFETCH_BYTES, NACC * block_bytes)
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


# generic IR (any target) and AVX512-VNNI forms; row_dot_* is the one the kernels use
row_dot_q8_0_generic = _row_dot_intrinsic(2 + QK, _generic_block(_unpack_q8_0, 16), 16)
row_dot_q4_0_generic = _row_dot_intrinsic(2 + QK // 2, _generic_block(_unpack_q4_0, 8), 8)
row_dot_q8_0_vnni = _row_dot_intrinsic(2 + QK, _vnni_block(_unpack_q8_0, 7), 8)
row_dot_q4_0_vnni = _row_dot_intrinsic(2 + QK // 2, _vnni_block(_unpack_q4_0, 3), 8)
row_dot_q8_0 = row_dot_q8_0_vnni if HAS_VNNI else row_dot_q8_0_generic
row_dot_q4_0 = row_dot_q4_0_vnni if HAS_VNNI else row_dot_q4_0_generic


# ----------------------------------------------------------------------------------------
# row-interleaved weights (ik_llama.cpp's Q8_0_R8 / Q4_0_R8): 8 rows per block group
# ----------------------------------------------------------------------------------------
# A group block holds the 8 rows' f16 scales, then their values in 4-byte runs: run l of
# row k (values 4l..4l+3 of one half of the block) sits at byte 32*l + 4*k.  One 32-byte load
# thus covers 8 rows x 4 values; the matching 4 activation bytes are broadcast to all 8 rows,
# the products are summed per 4 bytes (two pairwise adds) and the 8 row sums accumulate in 8
# lanes: the 8 results need no horizontal sum at all.
R8 = 8


def _unpack_q8_0_r8(builder: ir.IRBuilder, p, u8: bool = False):
    """Q8_0_R8 group block: 8 f16 scales, 128 bytes for values 0..15 of the 8 rows, 128 for
    16..31.  Returns (scales <8 x f32>, [(32 weight bytes, activation offset of their 4 values)]);
    u8: the values plus 128, for vpdpbusd."""
    runs = []
    for half in range(2):
        for l in range(4):
            w = _load_vec(builder, builder.gep(p, [_const_i64(16 + 128 * half + 32 * l)]), _I8, 32)
            runs.append((_sign_flip(builder, w, 32) if u8 else w, 16 * half + 4 * l))
    return _f16_scales8(builder, p), runs


def _unpack_q4_0_r8(builder: ir.IRBuilder, p, u8: bool = False):
    """Q4_0_R8 group block: 8 f16 scales, 128 bytes whose low nibbles are values 0..15 and high
    nibbles 16..31 (each minus 8; u8: the nibbles themselves, for vpdpbusd)."""
    splat = lambda v: ir.Constant(_vec(_I8, 32), [v] * 32)  # noqa: E731
    fix = (lambda v: v) if u8 else (lambda v: builder.sub(v, splat(8)))  # noqa: E731
    runs = []
    for l in range(4):
        b = _load_vec(builder, builder.gep(p, [_const_i64(16 + 32 * l)]), _I8, 32)
        runs.append((fix(builder.and_(b, splat(15))), 4 * l))
        runs.append((fix(builder.lshr(b, splat(4))), 16 + 4 * l))
    return _f16_scales8(builder, p), runs


def _f16_scales8(builder: ir.IRBuilder, p):
    h = builder.load(builder.bitcast(p, _vec(_I16, R8).as_pointer()), align=1)
    return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), R8)), _vec(_F32, R8))


def _act4(builder: ir.IRBuilder, act, off: int):
    """The 4 activation bytes at act + off as one int32 (little-endian)."""
    return builder.load(builder.bitcast(builder.gep(act, [_const_i64(off)]), _I32.as_pointer()), align=1)


def _generic_group(unpack):
    """8 row sums of a group block in the generic IR: each 32-byte run times its 4 activation
    bytes broadcast to the 8 rows, int32 products summed per 4 bytes (two pairwise adds)."""
    def block_rows(builder: ir.IRBuilder, gp, act, bsum):
        d8, runs = unpack(builder, gp)
        isum = None
        for w, off in runs:
            a4 = builder.bitcast(_act4(builder, act, off), _vec(_I8, 4))
            a = builder.shuffle_vector(a4, a4, ir.Constant(_vec(_I32, 32), [i % 4 for i in range(32)]))
            if HAS_AVX2:        # lane k: row k's 4 products
                q = signed_quads(builder, w, a)
                isum = q if isum is None else builder.add(isum, q)
                continue
            prod = builder.mul(builder.sext(w, _vec(_I32, 32)), builder.sext(a, _vec(_I32, 32)))
            pairs = _pair_sum(builder, prod, 32)                    # vpmaddwd
            isum = pairs if isum is None else builder.add(isum, pairs)
        return d8, isum if HAS_AVX2 else _pair_sum(builder, isum, 16)     # 8 lanes: one per row
    return block_rows


def _vnni_group(unpack, shift: int):
    """8 row sums of a group block with AVX512-VNNI: one vpdpbusd per run (the 4 activation
    bytes broadcast as an int32) lands each row's 4 products in its own lane; the weights are
    unsigned (true value + 2**shift), so every lane starts from -(2**shift) * block sum."""
    def block_rows(builder: ir.IRBuilder, gp, act, bsum):
        d8, runs = unpack(builder, gp, u8=True)
        corr = builder.neg(builder.shl(bsum, ir.Constant(_I32, shift)))
        isum = _splat(builder, corr, _I32, R8)
        for w, off in runs:
            isum = dpbusd(builder, isum, w, _splat(builder, _act4(builder, act, off), _I32, R8))
        return d8, isum
    return block_rows


def _splat(builder: ir.IRBuilder, v, t: ir.Type, n: int):
    sv = builder.insert_element(ir.Constant(_vec(t, n), None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(sv, sv, ir.Constant(_vec(_I32, n), [0] * n))


def _group_dot_intrinsic(block_bytes: int, block_rows):
    """An intrinsic f(buf, gbase, q, s, bs, nb, out, r0): out[r0 + k] = dot of row k of the
    8-row group at byte gbase (nb group blocks) with the activation row (q, s, bs), k < 8."""

    @intrinsic
    def group_dot(typingctx, buf, gbase, q, s, bs, nb, out, r0):
        if not all(isinstance(a, types.Array) for a in (buf, q, s, bs, out)):
            return None
        sig = types.none(buf, types.int64, q, s, bs, types.int64, out, types.int64)

        def codegen(context, builder, sig, args):
            wbuf = context.make_array(sig.args[0])(context, builder, args[0])
            qa = context.make_array(sig.args[2])(context, builder, args[2])
            sa = context.make_array(sig.args[3])(context, builder, args[3])
            ba = context.make_array(sig.args[4])(context, builder, args[4])
            oa = context.make_array(sig.args[6])(context, builder, args[6])
            grp = builder.gep(wbuf.data, [args[1]])
            accp = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, R8), None))
            with cgutils.for_range(builder, args[5]) as loop:
                b = loop.index
                prefetch(builder, builder.gep(grp, [builder.mul(b, _const_i64(block_bytes))]), PREFETCH_BYTES, block_bytes)
                act = builder.gep(qa.data, [builder.mul(b, _const_i64(QK))])
                d8, rows = block_rows(builder, builder.gep(grp, [builder.mul(b, _const_i64(block_bytes))]), act,
                                      builder.load(builder.gep(ba.data, [b])))
                sv = _splat(builder, builder.load(builder.gep(sa.data, [b])), _F32, R8)
                term = builder.fmul(builder.sitofp(rows, _vec(_F32, R8)), builder.fmul(d8, sv, flags=["fast"]),
                                    flags=["fast"])
                builder.store(builder.fadd(builder.load(accp), term, flags=["fast"]), accp)
            dst = builder.bitcast(builder.gep(oa.data, [args[7]]), _vec(_F32, R8).as_pointer())
            builder.store(builder.load(accp), dst, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return group_dot


group_dot_q8_0_r8_generic = _group_dot_intrinsic(16 + 8 * QK, _generic_group(_unpack_q8_0_r8))
group_dot_q4_0_r8_generic = _group_dot_intrinsic(16 + 4 * QK, _generic_group(_unpack_q4_0_r8))
group_dot_q8_0_r8_vnni = _group_dot_intrinsic(16 + 8 * QK, _vnni_group(_unpack_q8_0_r8, 7))
group_dot_q4_0_r8_vnni = _group_dot_intrinsic(16 + 4 * QK, _vnni_group(_unpack_q4_0_r8, 3))
group_dot_q8_0_r8 = group_dot_q8_0_r8_vnni if HAS_VNNI else group_dot_q8_0_r8_generic
group_dot_q4_0_r8 = group_dot_q4_0_r8_vnni if HAS_VNNI else group_dot_q4_0_r8_generic


# ----------------------------------------------------------------------------------------
# activation quantization (quant.kernels): one block of 32 values as vectors; the scalar loops
# stayed scalar (32 vroundss and conversions a block), 3072 x 1536 values with the per-16 sums,
# one thread: 0.52 -> 0.27 ns a value (scripts/bench_act_quant.py).  The arrays must be C-contiguous
# (vector loads at data + o).
# ----------------------------------------------------------------------------------------
def _vcall(b: ir.IRBuilder, name: str, ret: ir.Type, *vals):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, [v.type for v in vals]), name)
    return b.call(fn, list(vals))


def _vload(context, b: ir.IRBuilder, aty, arr, o, t: ir.Type, n: int, align: int):
    data = context.make_array(aty)(context, b, arr).data
    return b.load(b.bitcast(b.gep(data, [o]), _vec(t, n).as_pointer()), align=align)


def _c_arrays(*arrs) -> bool:
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrs)


@intrinsic
def amax32(typingctx, xr, o):
    """max |xr[o:o + 32]| (f32): fabs, then a halving tree of vector maxima."""
    if not _c_arrays(xr):
        return None

    def codegen(context, b, sig, args):
        v = _vcall(b, "llvm.fabs.v32f32", _vec(_F32, 32), _vload(context, b, sig.args[0], args[0], args[1], _F32, 32, 4))
        n = 32
        while n > 1:
            n //= 2
            lo = b.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), list(range(n))))
            hi = b.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), list(range(n, 2 * n))))
            v = b.select(b.fcmp_ordered(">", hi, lo), hi, lo)
        return b.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(xr, types.int64), codegen


@intrinsic
def isum16(typingctx, qr, o):
    """The int32 sum of the int8 values qr[o:o + 16]."""
    if not _c_arrays(qr):
        return None

    def codegen(context, b, sig, args):
        v = b.sext(_vload(context, b, sig.args[0], args[0], args[1], _I8, 16, 1), _vec(_I32, 16))
        return _vcall(b, "llvm.vector.reduce.add.v16i32", _I32, v)
    return types.int32(qr, types.int64), codegen


@intrinsic
def q8_block32(typingctx, xr, o, inv, qr):
    """qr[o:o + 32] = xr[o:o + 32] * inv rounded to nearest even and saturated to -127..127; returns
    the int32 sum of those 32 values.  (The callers' inv keeps |x * inv| < 127.5, so the bound
    never binds; it is the activations' range every kernel relies on: AVX2's signed_pairs.)"""
    if not _c_arrays(xr, qr):
        return None

    def codegen(context, b, sig, args):
        vf, vi = _vec(_F32, 32), _vec(_I32, 32)
        x = _vload(context, b, sig.args[0], args[0], args[1], _F32, 32, 4)
        r = _vcall(b, "llvm.rint.v32f32", vf, b.fmul(x, _splat(b, args[2], _F32, 32)))
        lo, hi = ir.Constant(vf, [-127.0] * 32), ir.Constant(vf, [127.0] * 32)
        qi = b.fptosi(b.select(b.fcmp_ordered(">", r, hi), hi, b.select(b.fcmp_ordered("<", r, lo), lo, r)), vi)
        qdata = context.make_array(sig.args[3])(context, b, args[3]).data
        b.store(b.trunc(qi, _vec(_I8, 32)), b.bitcast(b.gep(qdata, [args[1]]), _vec(_I8, 32).as_pointer()), align=1)
        return _vcall(b, "llvm.vector.reduce.add.v32i32", _I32, qi)
    return types.int32(xr, types.int64, types.float32, qr), codegen
