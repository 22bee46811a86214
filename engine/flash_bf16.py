"""Token-generation flash attention with AVX512-BF16 dot products (vdpbf16ps).

engine.flash_attn's f32 kernel runs near the f32 FMA peak of the cores; vdpbf16ps does 32
bf16 multiply-adds into 16 f32 lanes per instruction, twice the f32 FMA rate.  This module is
the same split-K online-softmax kernel with both products in bf16 and every sum in f32:

* query rows go in the 16 lanes.  Q is rounded to bf16 once per call and laid out per kv head
  in chunks of 16 rows (padded with rows that see no cell): Qp[j] holds (q[r, 2j], q[r, 2j+1])
  for the 16 rows r, so one 64-byte load serves a pair of dimensions for all rows;
* per block of 16 cells, the block's K rows are converted to bf16 once (shared by every
  query row of the kv head).  Scores: S[c] += dpbf16(Qp[j], broadcast k[c, 2j..2j+1]): 16
  accumulators (one per cell) of 16 rows, the (k pair) broadcast is a 32-bit load;
* online softmax as the f32 kernel (log2 domain, rows in lanes, f32);
* P.V: contraction over cells, so cells go in pairs: P2[cp] = (p[2cp, r], p[2cp+1, r]) for
  16 rows, built from S in registers; V rows are interleaved per cell pair, Vi[cp, d] =
  (v[2cp, d], v[2cp+1, d]); acc[d] (16 rows) += dpbf16(P2[cp], broadcast Vi[cp, d]).  The
  accumulator is kept transposed, acc[d, row], so the softmax rescale is one vector
  multiply per d.

The dot instructions are target intrinsics (llvm.x86.avx512bf16.dpbf16ps.512), so nothing here
may be compiled on a CPU without avx512_bf16: callers check `available()` first and keep the
f32 kernel as the fallback (and the reference in tests).  Conversions to bf16 round to nearest
even (vcvtne2ps2bf16, or a generic `fptrunc ... to bfloat`); K rows of f16 / f32 caches are
converted in place, quantized ones go through quant.kernels.decode_cache_rows first.

Accuracy.  q, k, p and v carry 8 significant bits; products and sums are f32.  Scores in bf16
alone put ~1e-2 relative (L2) errors on the attention outputs of the 1B DeepSeek-shaped test
model (576-wide latent heads, score std ~2.9): half from q, half from k.  So the scores that
matter are refined: after the bf16 block product, every (row, cell) whose score is within
REFINE_LOG2 (4) log2 units of the row's running max is recomputed as an f32 dot from the
cache's own values (f16 -> f32 on the fly).  Cells further down carry weight <= 2**-4 of the
max each and keep their bf16 scores.  On that model ~5-10 % of the pairs are refined and the
output error drops to ~2.5e-3, what the rounding of p (~1.3e-3) and v (~1.8e-3) leaves.
IKCLI_FA_REFINE=-1 turns refinement off.  The kernel is the default where the CPU has AVX512-BF16
and a kv head serves >= 12 query heads (engine.flash_attn.USE_BF16, _bf16_ok); IKCLI_FA_BF16=0
keeps the f32 kernel of engine.flash_attn, which also runs on other CPUs.  Measured: a random 2.2B
DeepSeek-shaped model's perplexity (chaotic: near-tie routing) 752486 -> 764758 (+1.6 %, 3 chunks
of 512, -ub 4); the trained demo model's with the kernel on for every token 25.4972 -> 25.4964
(40 chunks); generation at 3584 cells keeps 0.79-0.91 of its N_KV 0 speed instead of 0.70-0.75
(README, performance).
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from quant.kernels import QK, decode_cache_rows
from quant.simd import cpu_features
from quant.types import BF16, F16, F32

from .flash_common import _combine, _exp2, _split_cells

LANES = 16             # query rows per chunk = f32 lanes of one zmm
CB = 16                # cells per block: one score accumulator per cell
CHUNKS_PER_ITEM = 4    # row chunks per work item (T <= 4 with 16 heads: one item row)
# scores within this many log2 units of the running max are recomputed in f32 (IKCLI_FA_REFINE;
# a negative value turns it off)
REFINE_LOG2 = float(os.environ.get("IKCLI_FA_REFINE", "4"))

_F32 = ir.FloatType()
_I16, _I32, _I64, _I8 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.IntType(8)


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no such type)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_BF = _BFloat()


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def available() -> bool:
    """True when numba's target has AVX512-BF16 (whether it is used: engine.flash_attn.USE_BF16)."""
    return {"+avx512bf16", "+avx512bw", "+avx512f"} <= cpu_features()


# ----------------------------------------------------------------------------------------
# IR helpers
# ----------------------------------------------------------------------------------------
def _ptr(context, builder, aty, arr, off_elems):
    """i8* to element off_elems of a numba array."""
    a = context.make_array(aty)(context, builder, arr)
    return builder.bitcast(builder.gep(a.data, [off_elems]), _I8.as_pointer())


def _at(builder, p, byte_off):
    return builder.gep(p, [byte_off if isinstance(byte_off, ir.Value) else ir.Constant(_I64, byte_off)])


def _load(builder, p, t, n=None):
    ty = t if n is None else _vec(t, n)
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=1)


def _store(builder, v, p):
    builder.store(v, builder.bitcast(p, v.type.as_pointer()), align=1)


def _splat_i32(builder, x):
    v = builder.insert_element(ir.Constant(_vec(_I32, 16), None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, 16), [0] * 16))


def _dp(builder, acc, a, b):
    """acc (16 f32) += pairwise bf16 products of a, b (32 bf16 each)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_F32, 16), [_vec(_F32, 16), _vec(_BF, 32), _vec(_BF, 32)]),
        "llvm.x86.avx512bf16.dpbf16ps.512")
    return builder.call(fn, [acc, a, b])


def _cvt2_fn(builder):
    """vcvtne2ps2bf16: (a, b) -> 32 bf16, b's 16 values first."""
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_BF, 32), [_vec(_F32, 16), _vec(_F32, 16)]),
        "llvm.x86.avx512bf16.cvtne2ps2bf16.512")


def _i64(v):
    return ir.Constant(_I64, v)


# ----------------------------------------------------------------------------------------
# intrinsics
# ----------------------------------------------------------------------------------------
@intrinsic
def _qk_block(typingctx, qp, qoff, kb, dk, s):
    """s[c * 16 + r] = sum_j q[r, j] k[c, j] for 16 cells c and 16 rows r.
    qp (uint16 bf16 bits) at element qoff: dk/2 vectors of 16 row pairs; kb: 16 bf16 rows of dk."""
    if not all(isinstance(a, types.Array) for a in (qp, kb, s)):
        return None
    sig = types.none(qp, types.int64, kb, types.int64, s)

    def codegen(context, builder, sig, args):
        q0 = _ptr(context, builder, sig.args[0], args[0], args[1])
        k0 = _ptr(context, builder, sig.args[2], args[2], _i64(0))
        s0 = _ptr(context, builder, sig.args[4], args[4], _i64(0))
        dk = args[3]
        rowb = builder.mul(dk, _i64(2))                   # bytes per bf16 K row
        zero = ir.Constant(_vec(_F32, 16), None)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(CB)]
        kp = [builder.gep(k0, [builder.mul(rowb, _i64(c))]) for c in range(CB)]
        with cgutils.for_range(builder, builder.udiv(dk, _i64(2))) as loop:
            j = loop.index
            qv = _load(builder, _at(builder, q0, builder.mul(j, _i64(64))), _BF, 32)
            jb = builder.mul(j, _i64(4))
            for c in range(CB):
                kk = _splat_i32(builder, _load(builder, builder.gep(kp[c], [jb]), _I32))
                kv = builder.bitcast(kk, _vec(_BF, 32))
                builder.store(_dp(builder, builder.load(accs[c]), qv, kv), accs[c])
        for c in range(CB):
            _store(builder, builder.load(accs[c]), _at(builder, s0, 64 * c))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _pv_block(typingctx, s, vi, dv, acc, aoff, alpha, rescale):
    """acc[aoff + 16 d + r] = acc[...] * alpha[r] (only if rescale) + sum_c p[c, r] v[c, d]:
    p = s (16 cells x 16 rows, f32, rounded to bf16 here); vi: the interleaved V block, 8
    cell pairs of dv (v[2cp, d], v[2cp+1, d]).  The softmax rescale rides along the pass over
    acc: a separate numba loop over acc cost ~20 % of the kernel on random scores."""
    if not all(isinstance(a, types.Array) for a in (s, vi, acc, alpha)):
        return None
    sig = types.none(s, vi, types.int64, acc, types.int64, alpha, types.boolean)

    def codegen(context, builder, sig, args):
        s0 = _ptr(context, builder, sig.args[0], args[0], _i64(0))
        v0 = _ptr(context, builder, sig.args[1], args[1], _i64(0))
        a0 = _ptr(context, builder, sig.args[3], args[3], args[4])
        al = _load(builder, _ptr(context, builder, sig.args[5], args[5], _i64(0)), _F32, 16)
        dv = args[2]
        inter = ir.Constant(_vec(_I32, 32), [(i // 2) + 16 * (i % 2) for i in range(32)])
        P = []
        for cp in range(CB // 2):
            e = _load(builder, _at(builder, s0, 64 * (2 * cp)), _F32, 16)
            o = _load(builder, _at(builder, s0, 64 * (2 * cp + 1)), _F32, 16)
            P.append(builder.fptrunc(builder.shuffle_vector(e, o, inter), _vec(_BF, 32)))
        pairb = builder.mul(dv, _i64(4))                  # bytes per cell pair of vi
        vp = [builder.gep(v0, [builder.mul(pairb, _i64(cp))]) for cp in range(CB // 2)]
        def pass_over_acc(scale: bool) -> None:
            with cgutils.for_range(builder, builder.udiv(dv, _i64(16))) as loop:
                d0 = builder.mul(loop.index, _i64(16))
                for dd in range(16):
                    d = builder.add(d0, _i64(dd))
                    ap = _at(builder, a0, builder.mul(d, _i64(64)))
                    a = _load(builder, ap, _F32, 16)
                    if scale:
                        a = builder.fmul(a, al)
                    db = builder.mul(d, _i64(4))
                    for cp in range(CB // 2):
                        vv = builder.bitcast(_splat_i32(builder, _load(builder, builder.gep(vp[cp], [db]), _I32)),
                                             _vec(_BF, 32))
                        a = _dp(builder, a, P[cp], vv)
                    _store(builder, a, ap)

        with builder.if_else(builder.trunc(args[6], ir.IntType(1)) if args[6].type != ir.IntType(1) else args[6]) \
                as (then, otherwise):
            with then:
                pass_over_acc(True)
            with otherwise:
                pass_over_acc(False)
        return context.get_dummy_value()
    return sig, codegen


def _rows_to_bf16_intrinsic(src_t: ir.Type, src_bytes: int):
    @intrinsic
    def rows_to_bf16(typingctx, src, off, stride, nrows, n, dst, dstride):
        """dst[i * dstride + k] = bf16(row i at byte off + i * stride of src, value k), k < n
        (n a multiple of 16)."""
        if not (isinstance(src, types.Array) and isinstance(dst, types.Array)):
            return None
        sig = types.none(src, types.int64, types.int64, types.int64, types.int64, dst, types.int64)

        def codegen(context, builder, sig, args):
            s0 = _ptr(context, builder, sig.args[0], args[0], _i64(0))
            d0 = _ptr(context, builder, sig.args[5], args[5], _i64(0))
            off, stride, nrows, n, dstride = args[1], args[2], args[3], args[4], args[6]
            with cgutils.for_range(builder, nrows) as rl:
                i = rl.index
                sp = _at(builder, s0, builder.add(off, builder.mul(i, stride)))
                dp = _at(builder, d0, builder.mul(builder.mul(i, dstride), _i64(2)))
                def step(k, w):                   # w values from value k on
                    x = _load(builder, _at(builder, sp, builder.mul(k, _i64(src_bytes))), src_t, w)
                    if src_t != _F32:
                        x = builder.fpext(x, _vec(_F32, w))
                    if w == 32:                   # one vcvtne2ps2bf16 instead of two converts + a join
                        lo = builder.shuffle_vector(x, x, ir.Constant(_vec(_I32, 16), list(range(16))))
                        hi = builder.shuffle_vector(x, x, ir.Constant(_vec(_I32, 16), list(range(16, 32))))
                        y = builder.call(_cvt2_fn(builder), [hi, lo])
                    else:
                        y = builder.fptrunc(x, _vec(_BF, w))
                    _store(builder, y, _at(builder, dp, builder.mul(k, _i64(2))))

                with cgutils.for_range(builder, builder.udiv(n, _i64(32))) as cl:
                    step(builder.mul(cl.index, _i64(32)), 32)
                with builder.if_then(builder.icmp_unsigned("!=", builder.urem(n, _i64(32)), _i64(0))):
                    step(builder.sub(n, _i64(16)), 16)
            return context.get_dummy_value()
        return sig, codegen
    return rows_to_bf16


_f16_rows_to_bf16 = _rows_to_bf16_intrinsic(ir.HalfType(), 2)
_f32_rows_to_bf16 = _rows_to_bf16_intrinsic(_F32, 4)


@intrinsic
def _interleave_pairs(typingctx, kb, kstride, dv, vi):
    """vi[(cp * dv + d) * 2 + e] = kb[(2 cp + e) * kstride + d]: cell pairs of a 16-row bf16
    block interleaved for the P.V dots (dv a multiple of 16)."""
    if not (isinstance(kb, types.Array) and isinstance(vi, types.Array)):
        return None
    sig = types.none(kb, types.int64, types.int64, vi)

    def codegen(context, builder, sig, args):
        k0 = _ptr(context, builder, sig.args[0], args[0], _i64(0))
        v0 = _ptr(context, builder, sig.args[3], args[3], _i64(0))
        kstride, dv = args[1], args[2]
        rowb = builder.mul(kstride, _i64(2))
        inter = ir.Constant(_vec(_I32, 32), [(i // 2) + 16 * (i % 2) for i in range(32)])
        for cp in range(CB // 2):
            ea = builder.gep(k0, [builder.mul(rowb, _i64(2 * cp))])
            oa = builder.gep(k0, [builder.mul(rowb, _i64(2 * cp + 1))])
            va = builder.gep(v0, [builder.mul(builder.mul(dv, _i64(4)), _i64(cp))])
            with cgutils.for_range(builder, builder.udiv(dv, _i64(16))) as loop:
                b = builder.mul(loop.index, _i64(32))
                e = _load(builder, builder.gep(ea, [b]), _I16, 16)
                o = _load(builder, builder.gep(oa, [b]), _I16, 16)
                _store(builder, builder.shuffle_vector(e, o, inter), builder.gep(va, [builder.mul(b, _i64(2))]))
        return context.get_dummy_value()
    return sig, codegen


def _dot_intrinsic(kind: str):
    @intrinsic
    def dot(typingctx, q, qoff, src, off, n):
        """f32 dot of q[qoff:qoff + n] (f32) with the n values at byte off of src, stored as
        `kind` (f16, f32 or bf16); n a multiple of 16.  Four accumulators: one FMA chain
        would wait on its latency."""
        if not (isinstance(q, types.Array) and isinstance(src, types.Array)):
            return None
        sig = types.float32(q, types.int64, src, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            q0 = _ptr(context, builder, sig.args[0], args[0], args[1])
            s0 = _at(builder, _ptr(context, builder, sig.args[2], args[2], _i64(0)), args[3])
            n = args[4]
            zero = ir.Constant(_vec(_F32, 16), None)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]

            def step(k, accp):
                x = builder.mul(k, _i64(16))
                qv = _load(builder, _at(builder, q0, builder.mul(x, _i64(4))), _F32, 16)
                if kind == "f16":
                    kv = builder.fpext(_load(builder, _at(builder, s0, builder.mul(x, _i64(2))), ir.HalfType(), 16),
                                       _vec(_F32, 16))
                elif kind == "bf16":
                    h = _load(builder, _at(builder, s0, builder.mul(x, _i64(2))), _I16, 16)
                    kv = builder.bitcast(builder.shl(builder.zext(h, _vec(_I32, 16)),
                                                     ir.Constant(_vec(_I32, 16), [16] * 16)), _vec(_F32, 16))
                else:
                    kv = _load(builder, _at(builder, s0, builder.mul(x, _i64(4))), _F32, 16)
                # contract only: with reassoc LLVM merged the four chains back into one
                prod = builder.fmul(qv, kv, flags=["contract"])
                builder.store(builder.fadd(builder.load(accp), prod, flags=["contract"]), accp)

            nv = builder.udiv(n, _i64(16))
            with cgutils.for_range(builder, builder.udiv(nv, _i64(4))) as loop:
                for j in range(4):
                    step(builder.add(builder.mul(loop.index, _i64(4)), _i64(j)), accs[j])
            tail0 = builder.mul(builder.udiv(nv, _i64(4)), _i64(4))
            with cgutils.for_range_slice(builder, tail0, nv, _i64(1)) as (k, _):
                step(k, accs[0])
            acc = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1]), flags=["fast"]),
                               builder.fadd(builder.load(accs[2]), builder.load(accs[3]), flags=["fast"]),
                               flags=["fast"])
            red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _vec(_F32, 16)]),
                                                 "llvm.vector.reduce.fadd.v16f32")
            r = builder.call(red, [ir.Constant(_F32, 0.0), acc])
            r.fastmath.add("reassoc")
            return r
        return sig, codegen
    return dot


_dot_f16 = _dot_intrinsic("f16")
_dot_f32 = _dot_intrinsic("f32")
_dot_bf16 = _dot_intrinsic("bf16")


# ----------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------
_opts = dict(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp", "afn"}, nogil=True)
NO_POS = np.iinfo(np.int64).min        # position of padding rows: they see no cell


@njit(**_opts)
def _block_to_bf16(buf, qt, base, stride, nb, n, lut, fb, dst, dstride):
    """Rows base + i * stride (i < nb) of the cache, n values each, into the bf16 block dst;
    rows nb..CB-1 are zeroed (their p is 0, but 0 * garbage could be NaN)."""
    if qt == F16:
        _f16_rows_to_bf16(buf, base, stride, nb, n, dst, dstride)
    elif qt == F32:
        _f32_rows_to_bf16(buf, base, stride, nb, n, dst, dstride)
    elif qt == BF16:
        src = buf.view(np.uint16)
        for i in range(nb):
            o = (base + i * stride) // 2
            dst[i * dstride:i * dstride + n] = src[o:o + n]
    else:                                 # quantized: the shared decoder, then round
        decode_cache_rows(buf, qt, base, stride, nb, n, QK, lut, fb)
        _f32_rows_to_bf16(fb, 0, fb.shape[1] * 4, nb, n, dst, dstride)
    for i in range(nb, CB):
        dst[i * dstride:i * dstride + n] = 0


@njit(**_opts)
def _exact_score(qf, qoff, buf, qt, base, fb, b, dk):
    """q row (f32, at qoff of qf) . cell b of the block, in f32 from the cache's own values
    (quantized types: their f32 decode in fb)."""
    if qt == F16:
        return _dot_f16(qf, qoff, buf, base, dk)
    if qt == BF16:
        return _dot_bf16(qf, qoff, buf, base, dk)
    if qt == F32:
        return _dot_f32(qf, qoff, buf, base, dk)
    return _dot_f32(qf, qoff, fb, b * fb.shape[1] * 4, dk)


@njit(**_opts)
def _attend_range_bf16(kbuf, kqt, khead, kstride, vbuf, vqt, vhead, vstride, v_is_k, c0, c1, dk, dv,
                       cell_pos, qp, qf, rpos, ch0, ch1, s, lut, refine, acc, m, l):
    """Online softmax of row chunks ch0..ch1 of every kv head over cells [c0, c1).
    qp (Hkv, nch, dk * 16) bf16 pairs, qf (Hkv, nch * 16, dk) the same rows in f32; rpos
    (nch * 16) row positions; acc (Hkv, nsplit, nch, dv * 16) transposed accumulators; m / l
    (Hkv, nsplit, nch * 16).  Scores within `refine` (log2 units) of the running max are
    recomputed in f32 (see flash_kernel_bf16)."""
    hkv = qp.shape[0]
    kb = np.zeros(CB * dk, dtype=np.uint16)
    vb = kb if v_is_k else np.zeros(CB * dv, dtype=np.uint16)
    vi = np.zeros(CB * dv, dtype=np.uint16)
    fbk = np.zeros((CB, dk), dtype=np.float32)
    fbv = np.zeros((CB, dv), dtype=np.float32)
    S = np.empty(CB * LANES, dtype=np.float32)
    mnew = np.empty(LANES, dtype=np.float32)
    alpha = np.empty(LANES, dtype=np.float32)
    thr = np.empty(LANES, dtype=np.float32)
    maxpos = rpos[ch0 * LANES:ch1 * LANES].max()
    for g in range(hkv):
        for ch in range(ch0, ch1):
            m[g, s, ch * LANES:(ch + 1) * LANES] = -np.inf
            l[g, s, ch * LANES:(ch + 1) * LANES] = 0.0
            acc[g, s, ch] = 0.0
    for j0 in range(c0, c1, CB):
        nb = min(CB, c1 - j0)
        cp = cell_pos[j0:j0 + nb]
        if cp.min() > maxpos:
            continue                      # no row sees any of these cells
        for g in range(hkv):
            kbase = g * khead + j0 * kstride
            qrow0 = g * qf.shape[1] * dk      # flat offsets into qf: a view per refined score
                                              # cost a shared refcount update (~200 ns)
            _block_to_bf16(kbuf, kqt, kbase, kstride, nb, dk, lut, fbk, kb, dk)
            if not v_is_k:
                _block_to_bf16(vbuf, vqt, g * vhead + j0 * vstride, vstride, nb, dv, lut, fbv, vb, dv)
            _interleave_pairs(vb, dk if v_is_k else dv, dv, vi)
            for ch in range(ch0, ch1):
                rp = rpos[ch * LANES:(ch + 1) * LANES]
                mg = m[g, s, ch * LANES:(ch + 1) * LANES]
                lg = l[g, s, ch * LANES:(ch + 1) * LANES]
                a = acc[g, s, ch]
                _qk_block(qp[g, ch], 0, kb, dk, S)
                # cells a row does not see (and the block's padding cells) score -inf; all the
                # loops over r below are branch-free 16-lane vector code
                for b in range(CB):
                    sb = S[b * LANES:(b + 1) * LANES]
                    cb = cp[b] if b < nb else maxpos + 1
                    for r in range(LANES):
                        sb[r] = sb[r] if cb <= rp[r] else -np.inf
                for r in range(LANES):
                    mnew[r] = mg[r]
                for b in range(nb):
                    sb = S[b * LANES:(b + 1) * LANES]
                    for r in range(LANES):
                        mnew[r] = max(mnew[r], sb[r])
                # the cells that carry weight get their scores in f32: bf16 q and k alone put
                # ~1 % errors on the outputs of a 576-wide latent head
                for r in range(LANES):        # rows that see nothing (padding) refine nothing
                    thr[r] = mnew[r] - refine if mnew[r] > -np.inf else np.inf
                for b in range(nb):
                    sb = S[b * LANES:(b + 1) * LANES]
                    hits = 0
                    for r in range(LANES):
                        hits += sb[r] >= thr[r]
                    if hits == 0:
                        continue
                    for r in range(LANES):
                        if sb[r] >= thr[r]:
                            x = _exact_score(qf, qrow0 + (ch * LANES + r) * dk, kbuf, kqt,
                                             kbase + b * kstride, fbk, b, dk)
                            sb[r] = x
                            mnew[r] = max(mnew[r], x)
                moved = False
                for r in range(LANES):
                    if mnew[r] > mg[r]:   # the running max moved: rescale (rare after the start)
                        alpha[r] = _exp2(mg[r] - mnew[r]) if mg[r] > -np.inf else np.float32(0.0)
                        lg[r] *= alpha[r]
                        mg[r] = mnew[r]
                        moved = True
                    else:
                        alpha[r] = 1.0
                for b in range(CB):
                    sb = S[b * LANES:(b + 1) * LANES]
                    for r in range(LANES):
                        p = _exp2(sb[r] - mg[r]) if sb[r] > -np.inf else np.float32(0.0)
                        sb[r] = p
                        lg[r] += p
                _pv_block(S, vi, dv, a, 0, alpha, moved)


@njit(parallel=True, **_opts)
def _fa_kernel_bf16(q, scale2, q_pos, hkv, kbuf, kqt, kstride, khead, vbuf, vqt, vstride, vhead, v_is_k, n_kv, dv,
                    cell_pos, nsplit, lut, refine, out):
    """The whole call in one compiled function: pack the query rows, one work item per (group of
    CHUNKS_PER_ITEM row chunks, range of cells), merge the ranges into out (Hkv, R, dv).  Packing,
    attending and merging as three calls cost ~25 us of dispatch and allocation a call, half of
    a 64-cell generation step."""
    T, H, dk = q.shape
    R = T * (H // hkv)
    nch = (R + LANES - 1) // LANES
    qpad = np.empty((hkv, nch * LANES, dk), dtype=np.float32)
    qp = np.empty((hkv, nch, dk * LANES), dtype=np.uint16)
    rp = np.empty(nch * LANES, dtype=np.int64)
    _pack_q(q, scale2, q_pos, qpad, qp, rp)
    acc = np.empty((hkv, nsplit, nch, dv * LANES), dtype=np.float32)
    m = np.empty((hkv, nsplit, nch * LANES), dtype=np.float32)
    l = np.zeros((hkv, nsplit, nch * LANES), dtype=np.float32)
    ngr = (nch + CHUNKS_PER_ITEM - 1) // CHUNKS_PER_ITEM
    for it in prange(ngr * nsplit):
        gr, s = it // nsplit, it % nsplit
        ch0, ch1 = gr * CHUNKS_PER_ITEM, min(nch, gr * CHUNKS_PER_ITEM + CHUNKS_PER_ITEM)
        c0, c1 = _split_cells(n_kv, nsplit, s, CB)
        if c0 < c1:
            _attend_range_bf16(kbuf, kqt, khead, kstride, vbuf, vqt, vhead, vstride, v_is_k, c0, c1, dk, dv,
                               cell_pos, qp, qpad, rp, ch0, ch1, s, lut, refine, acc, m, l)
        else:
            for g in range(hkv):
                for ch in range(ch0, ch1):
                    m[g, s, ch * LANES:(ch + 1) * LANES] = -np.inf
    _combine(acc, m, l, R, LANES, out)


@njit(**_opts)
def _pack_q(q, scale2, q_pos, qpad, qp, rp):
    """The query rows of each kv head g, row t * G + i = head g * G + i of token t (G query heads
    per kv head) times scale2, padded to chunks of 16 (zeros, position NO_POS: they see nothing):
    f32 in qpad, and as bf16 pairs in qp[g, ch, (j * 16 + r) * 2 + e] = row ch * 16 + r, value
    2j + e.  One pass in numba: the NumPy version (scale, transpose, pad, round) cost ~30 us a
    call, its scale and transpose alone ~10 us in generation."""
    T, H, dk = q.shape
    hkv = qpad.shape[0]
    G = H // hkv
    qpad[:] = 0.0
    rp[:] = NO_POS
    for t in range(T):
        for i in range(G):
            rp[t * G + i] = q_pos[t]
            for g in range(hkv):
                qpad[g, t * G + i] = q[t, g * G + i] * scale2
    b = qpad.view(np.uint32)
    for g in range(hkv):
        for ch in range(qp.shape[1]):
            for r in range(LANES):
                row = b[g, ch * LANES + r]
                for d in range(dk):
                    x = row[d]
                    qp[g, ch, ((d >> 1) * LANES + r) * 2 + (d & 1)] = np.uint16(
                        (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round f32 to bf16 (nearest even), as uint16 bit patterns (finite inputs)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def supports(n_rows: int, dk: int, dv: int) -> bool:
    """Shapes the bf16 kernel takes: dk / dv in 16-value steps, and enough query rows per kv
    head that padding them to chunks of 16 wastes at most a quarter of the lanes (a single
    standard head per kv head would waste 15/16 of every dot)."""
    if dk % 16 or dv % 16:
        return False
    nch = -(-n_rows // LANES)
    return 4 * n_rows >= 3 * nch * LANES


def flash_kernel_bf16(q: np.ndarray, scale2: float, q_pos: np.ndarray, hkv: int, k, v, n_kv: int, dk: int, dv: int,
                      cell_pos: np.ndarray, nsplit: int, lut: np.ndarray, khead: int, vhead: int) -> np.ndarray:
    """q (T, H, dk) f32 query heads (C order), scale2 the score scale in the log2 domain, q_pos (T,)
    their positions, hkv kv heads -> (Hkv, T * G, dv) f32, row t * G + i of kv head g = query head
    g * G + i of token t.  k / v: RowStores (v None: V is the first dv values of each K head)."""
    T, H, _ = q.shape
    vs = k if v is None else v
    out = np.empty((hkv, T * (H // hkv), dv), dtype=np.float32)
    _fa_kernel_bf16(q, np.float32(scale2), q_pos, hkv, k.data.reshape(-1), k.qtype, k.data.shape[1], khead,
                    vs.data.reshape(-1), vs.qtype, vs.data.shape[1], vhead, v is None, n_kv, dv, cell_pos, nsplit, lut,
                    np.float32(REFINE_LOG2), out)
    return out
