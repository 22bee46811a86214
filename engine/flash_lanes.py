"""Token-generation flash attention with query rows in vector lanes: f32, bf16 or int8 products.

engine.flash_attn's portable kernel runs dot products along the head dimension, 4 rows x 4
cells per register block, and its (rows x dv) accumulator lives in memory; for DeepSeek's
576/512 latent heads with 16 query rows per kv head that is ~50 % of the f32 FMA peak of one
AVX-512 core, bound by loads.  The kernels here keep 16 query rows in the lanes of one zmm
register instead, so every K or V value is loaded once per block and broadcast into 16
multiply-adds:

* Q is packed once per call, per kv head, in chunks of 16 rows (padded with rows that see no
  cell): f32 Qt[j] = (q[r, j] for the 16 rows r), or bf16 Qp[j] = (q[r, 2j], q[r, 2j+1]);
* per block of CB = 16 cells, scores: S[c] += Qt[j] * broadcast k[c, j] (f32 FMA) or
  dpbf16(Qp[j], broadcast k[c, 2j..2j+1]): 16 accumulators, one per cell, of 16 rows.  bf16
  converts the block's K rows once (shared by every row of the kv head); f32 reads f16 / bf16 /
  f32 caches in place, converting 16 values of the 16 cells at a time into a 1 KiB tile (two
  of them, alternating: the next is converted while the current one is used) that stays in L1,
  q8_0 likewise or (Q8_SCORES, below) as integers, other quantized caches from their f32 decode;
* online softmax in the log2 domain, rows in lanes, f32 (shared by both kinds);
* P.V: acc[d] (16 rows, kept transposed) += P[c] * broadcast v[c, d], eight d at a time from
  the tiles of V (f32), or dpbf16 over cell pairs with V interleaved per pair (bf16).  The
  softmax rescale rides along the pass over acc.

f32 (`kind="f32"`): the same arithmetic as the portable kernel in another order (outputs equal
to ~1e-6).  Generic LLVM vector IR (fma.v16f32): it compiles on every CPU, and engine.flash_attn
uses it where the CPU has AVX-512 (16-lane registers; on AVX2 the 16 accumulators would spill).
Measured on the Intel AVX-512 VM, one thread, 16 rows of 576/512 over 3584 f16 cells: 1.29-1.38
ms against 1.65-1.77 for the portable kernel (scripts/bench_gen_attention.py; README,
twenty-fourth session); reading the cache a tile at a time instead of converting a whole 36 KiB
block before its passes: 1.17 -> 1.03 ms at one thread, 0.65 -> 0.56 at two (README,
twenty-ninth session).

q8_0 caches, f32 kind, where the CPU has VNNI (Q8_SCORES; IKCLI_FA_Q8_SCORES=0 turns it off):
the scores are integer dot products, as ik_llama.cpp's flash attention computes them for a
quantized K: the query rows are rounded to int8 per 32 values as the matmuls' activations are
(one scale each, rounded to bf16), and per
block the int8 K values (plus 128: vpdpbusd multiplies unsigned by signed bytes) meet them in
vpdpbusd, 64 products per instruction against an FMA's 16; f32 only combines the two scales.
P.V stays f32 from the q8_0 tiles.  Rounding q costs about what the q8_0 cache's own rounding
does (5.3e-3 relative L2 from the f32-score outputs on random rows; a tiny DeepSeek model's
logits 1.31e-2 from an f16 cache's against 1.12e-2 with f32 scores).  Measured on the Intel VM,
one thread, 3584 q8_0 cells (scripts/bench_gen_attention.py --type q8_0, README, thirtieth
session): 1.21-1.31 ms with f32 scores against 1.01-1.04, the f16 cache 1.02-1.12 in the same
minutes; ik_llama.cpp's kernel on the same shapes 1.10 at one thread, 0.55 at two, where this
one took 0.63-0.66 (README, thirty-first session).

bf16 (`kind="bf16"`): vdpbf16ps does 32 bf16 multiply-adds into 16 f32 lanes, twice an f32
FMA's.  It pays where it issues as often as an FMA (AMD Zen 4: ~1.7x the portable kernel,
measured; later AMD cores are assumed alike, unmeasured); Intel cores issue it once a cycle beside
two 512-bit FMAs (measured on the Intel VM: 2.2-2.4x slower than the f32 kind, random data).
The dot instructions are target intrinsics (llvm.x86.avx512bf16.dpbf16ps.512), so the bf16 kind
may only be compiled on a CPU with avx512_bf16: callers check `bf16_available()`
first.  Conversions to bf16 round to nearest even (vcvtne2ps2bf16, or a generic `fptrunc ... to
bfloat`); K rows of f16 / f32 caches are converted in place, quantized ones go through
quant.kernels.decode_cache_rows first.

bf16 accuracy.  q, k, p and v carry 8 significant bits; products and sums are f32.  Scores in
bf16 alone put ~1e-2 relative (L2) errors on the attention outputs of the 1B DeepSeek-shaped
test model (576-wide latent heads, score std ~2.9): half from q, half from k.  So the scores that
matter are refined: after the bf16 block product, every (row, cell) whose score is within
REFINE_LOG2 (4) log2 units of the row's running max is recomputed as an f32 dot from the
cache's own values (f16 -> f32 on the fly).  Cells further down carry weight <= 2**-4 of the
max each and keep their bf16 scores.  On that model ~5-10 % of the pairs are refined and the
output error drops to ~2.5e-3, what the rounding of p (~1.3e-3) and v (~1.8e-3) leaves.
IKCLI_FA_REFINE=-1 turns refinement off.  Measured: a random 2.2B DeepSeek-shaped model's
perplexity (chaotic: near-tie routing) 752486 -> 764758 (+1.6 %, 3 chunks of 512, -ub 4); the
trained demo model's with the kernel on for every token 25.4972 -> 25.4964 (40 chunks).
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
import numba
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from quant.fnptr import arrays_key, cached_address, call_at
from quant.kernels import QK, decode_cache_rows, quantize_act_q8_serial
from quant.simd import _const_i64 as _i64
from quant.simd import HAS_VNNI, _vec, cpu_features, dpbusd
from quant.simd import prefetch as simd_prefetch
from quant.types import BF16, F16, F32, Q8_0

from .flash_common import _combine, _exp2, _prefetch_rows, _split_cells

LANES = 16             # query rows per chunk = f32 lanes of one zmm
CB = 16                # cells per block: one score accumulator per cell
CHUNKS_PER_ITEM = 4    # row chunks per work item (T <= 4 with 16 heads: one item row)
# scores within this many log2 units of the running max are recomputed in f32 (IKCLI_FA_REFINE;
# a negative value turns it off)
REFINE_LOG2 = float(os.environ.get("IKCLI_FA_REFINE", "4"))
# q8_0 caches: scores as integer dot products of the int8 K blocks with the query rows quantized
# to int8 per 32 values (as ik_llama.cpp's flash attention does for quantized K), where the CPU
# has VNNI; else (and IKCLI_FA_Q8_SCORES=0) f32 products with K converted a tile at a time
Q8_SCORES = HAS_VNNI and os.environ.get("IKCLI_FA_Q8_SCORES", "1") != "0"

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


def bf16_available() -> bool:
    """True when numba's target has AVX512-BF16 (whether it is used: engine.flash_attn)."""
    return {"+avx512bf16", "+avx512bw", "+avx512f"} <= cpu_features()


def f32_preferred() -> bool:
    """True when the f32 kind should replace the portable kernel: 16-lane registers (AVX-512F)."""
    return "+avx512f" in cpu_features()


def bf16_preferred() -> bool:
    """True where bf16 products measured faster than f32 ones: AVX512-BF16 on AMD cores (LLVM's
    host name znver*).  Zen 4; Zen 5 too, in the model (scripts/bench_tg_depth.py, ds2b-recipe at
    3584 cells, one thread: 4.11 / 3.84 against 5.13 / 4.55 ms of attention a token), although
    scripts/bench_gen_attention.py's random data, where the bf16 kind refines many more scores,
    shows it slower than f32 there (1.45 against ~1.0 ms)."""
    from llvmlite import binding as llb
    return bf16_available() and llb.get_host_cpu_name().startswith("znver")


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


def _load_f32x16(builder, p, src: str, k):
    """Values 16k..16k+15 of a row at p stored as `src` (f16, bf16, f32 or q8_0), as 16 f32."""
    if src == "q8_0":           # 34-byte blocks (f16 scale, 32 int8): half k & 1 of block k >> 1
        blk = _at(builder, p, builder.mul(builder.lshr(k, _i64(1)), _i64(34)))
        d = builder.fpext(_load(builder, blk, ir.HalfType()), _F32)
        qs = _load(builder, _at(builder, blk, builder.add(_i64(2), builder.mul(builder.and_(k, _i64(1)), _i64(16)))),
                   _I8, 16)
        dv = builder.insert_element(ir.Constant(_vec(_F32, 16), None), d, ir.Constant(_I32, 0))
        dv = builder.shuffle_vector(dv, dv, ir.Constant(_vec(_I32, 16), [0] * 16))
        return builder.fmul(builder.sitofp(qs, _vec(_F32, 16)), dv)
    if src == "f32":
        return _load(builder, _at(builder, p, builder.mul(k, _i64(64))), _F32, 16)
    if src == "f16":
        return builder.fpext(_load(builder, _at(builder, p, builder.mul(k, _i64(32))), ir.HalfType(), 16),
                             _vec(_F32, 16))
    h = _load(builder, _at(builder, p, builder.mul(k, _i64(32))), _I16, 16)     # bf16: an f32's top half
    return builder.bitcast(builder.shl(builder.zext(h, _vec(_I32, 16)), ir.Constant(_vec(_I32, 16), [16] * 16)),
                           _vec(_F32, 16))


# ----------------------------------------------------------------------------------------
# intrinsics
# ----------------------------------------------------------------------------------------
def _splat_word(builder, p, kind: str):
    """The 4 bytes at p in all 16 lanes, as 16 f32 (kind f32) or 16 bf16 pairs (bf16)."""
    v = builder.bitcast(_splat_i32(builder, _load(builder, p, _I32)), _vec(_F32, 16))
    return v if kind == "f32" else builder.bitcast(v, _vec(_BF, 32))


def _madd(builder, kind: str, acc, a, b):
    """acc (16 f32) += a * b: an f32 FMA, or pairwise bf16 products (vdpbf16ps)."""
    if kind == "bf16":
        return _dp(builder, acc, a, b)
    v16 = _vec(_F32, 16)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, acc])


@intrinsic
def _qk_bf16(typingctx, qp, qoff, kb, dk, s):
    """bf16 kind: s[c * 16 + r] = sum_j q[r, j] k[c, j] for CB cells c and 16 rows r: qp (uint16
    bf16 bits) at element qoff holds dk/2 vectors of 16 row pairs, kb CB bf16 rows of dk.  A step
    loads one 64-byte q vector and broadcasts 4 bytes (a value pair) of each cell's row."""
    if not all(isinstance(a, types.Array) for a in (qp, kb, s)):
        return None
    sig = types.none(qp, types.int64, kb, types.int64, s)

    def codegen(context, builder, sig, args):
        q0 = _ptr(context, builder, sig.args[0], args[0], args[1])
        k0 = _ptr(context, builder, sig.args[2], args[2], _i64(0))
        s0 = _ptr(context, builder, sig.args[4], args[4], _i64(0))
        dk = args[3]
        rowb = builder.mul(dk, _i64(2))                     # bytes per K row of the block
        zero = ir.Constant(_vec(_F32, 16), None)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(CB)]
        kp = [builder.gep(k0, [builder.mul(rowb, _i64(c))]) for c in range(CB)]
        with cgutils.for_range(builder, builder.udiv(dk, _i64(2))) as loop:
            j = loop.index
            qv = _load(builder, _at(builder, q0, builder.mul(j, _i64(64))), _BF, 32)
            jb = builder.mul(j, _i64(4))
            for c in range(CB):
                kv = _splat_word(builder, builder.gep(kp[c], [jb]), "bf16")
                builder.store(_madd(builder, "bf16", builder.load(accs[c]), qv, kv), accs[c])
        for c in range(CB):
            _store(builder, builder.load(accs[c]), _at(builder, s0, 64 * c))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _pv_bf16(typingctx, s, vb, dv, acc, alpha, rescale):
    """bf16 kind: acc[16 d + r] = acc[...] * alpha[r] (only if rescale) + sum_c p[c, r] v[c, d]:
    p = s (CB cells x 16 rows, f32), rounded to bf16 here; vb the interleaved block, CB/2 cell
    pairs of dv (v[2cp, d], v[2cp+1, d]).  One accumulator chain at a time, 16 unrolled (as
    measured on Zen 4).  The softmax rescale rides along the pass over acc: a separate numba loop
    over acc cost ~20 % of the kernel on random scores."""
    if not all(isinstance(a, types.Array) for a in (s, vb, acc, alpha)):
        return None
    sig = types.none(s, vb, types.int64, acc, alpha, types.boolean)
    unroll = 16

    def codegen(context, builder, sig, args):
        s0 = _ptr(context, builder, sig.args[0], args[0], _i64(0))
        v0 = _ptr(context, builder, sig.args[1], args[1], _i64(0))
        a0 = _ptr(context, builder, sig.args[3], args[3], _i64(0))
        al = _load(builder, _ptr(context, builder, sig.args[4], args[4], _i64(0)), _F32, 16)
        dv = args[2]
        inter = ir.Constant(_vec(_I32, 32), [(i // 2) + 16 * (i % 2) for i in range(32)])
        P = []                    # one term per cell pair: (p[2cp], p[2cp+1]) interleaved
        for cp in range(CB // 2):
            e = _load(builder, _at(builder, s0, 64 * (2 * cp)), _F32, 16)
            o = _load(builder, _at(builder, s0, 64 * (2 * cp + 1)), _F32, 16)
            P.append(builder.fptrunc(builder.shuffle_vector(e, o, inter), _vec(_BF, 32)))
        termb = builder.mul(dv, _i64(4))
        vp = [builder.gep(v0, [builder.mul(termb, _i64(t))]) for t in range(len(P))]

        def pass_over_acc(scale: bool) -> None:
            with cgutils.for_range(builder, builder.udiv(dv, _i64(unroll))) as loop:
                base = builder.mul(loop.index, _i64(unroll))
                for u in range(unroll):
                    d0 = builder.add(base, _i64(u))
                    ap = _at(builder, a0, builder.mul(d0, _i64(64)))
                    a = _load(builder, ap, _F32, 16)
                    if scale:
                        a = builder.fmul(a, al)
                    db = builder.mul(d0, _i64(4))
                    for t in range(len(P)):
                        a = _madd(builder, "bf16", a, P[t], _splat_word(builder, builder.gep(vp[t], [db]), "bf16"))
                    _store(builder, a, ap)

        _both_ways(builder, args[5], pass_over_acc)
        return context.get_dummy_value()
    return sig, codegen


def _both_ways(builder, flag, emit) -> None:
    """emit(True) where the numba boolean argument flag holds, emit(False) where not: two copies
    of a loop, each without the test inside."""
    flag = flag if flag.type == ir.IntType(1) else builder.trunc(flag, ir.IntType(1))
    with builder.if_else(flag) as (then, otherwise):
        with then:
            emit(True)
        with otherwise:
            emit(False)


# ---- f32 kind: the cache rows read in place, a tile of 16 values of the CB cells at a time ----
TILE_BYTES = CB * 64


def _convert_tile(builder, rows, stride, nrows, t, dst, src: str) -> None:
    """Values 16t..16t+15 of the CB cache rows at rows + c * stride (stored as src) into dst, CB
    vectors of 16 f32; rows c >= nrows zeros, unread (past the block: their p is 0, but 0 * inf
    would be NaN, and past the last cell there may be no row)."""
    for c in range(CB):
        out = _at(builder, dst, 64 * c)
        with builder.if_else(builder.icmp_signed("<", _i64(c), nrows)) as (then, otherwise):
            with then:
                row = _at(builder, rows, builder.mul(_i64(c), stride))
                _store(builder, _load_f32x16(builder, row, src, t), out)
            with otherwise:
                _store(builder, ir.Constant(_vec(_F32, 16), None), out)


def _over_tiles(builder, rows, stride, nrows, ntiles, scr, src: str, body) -> None:
    """body(t, tile) for t < ntiles, tile the half of scr (2 tiles) holding tile t in f32.  Tile
    t + 1 is converted into the other half before body(t) runs, so its stores have a tile's work
    to retire before they are read (converting in place and reading right away measured slower:
    0.75-0.95 against 0.70-0.80 of the separate-pass kernel's time, noisy)."""
    _convert_tile(builder, rows, stride, nrows, _i64(0), scr, src)
    with cgutils.for_range(builder, ntiles) as loop:
        t = loop.index
        odd = builder.trunc(t, ir.IntType(1))
        cur = builder.select(odd, _at(builder, scr, TILE_BYTES), scr)
        nxt = builder.select(odd, scr, _at(builder, scr, TILE_BYTES))
        t1 = builder.add(t, _i64(1))
        with builder.if_then(builder.icmp_signed("<", t1, ntiles)):
            _convert_tile(builder, rows, stride, nrows, t1, nxt, src)
        body(t, cur)


def _score_sig(q, buf, s, scr, pf):
    """The signature of a block-score intrinsic (q, buf, off, stride, nrows, dk, s, scr, pf,
    pfoff, pflines), or None for other argument types."""
    if not all(isinstance(a, types.Array) for a in (q, buf, s, scr, pf)):
        return None
    i64 = types.int64
    return types.none(q, buf, i64, i64, i64, i64, s, scr, pf, i64, i64)


def _score_ptrs(context, builder, sig, args):
    """A block-score intrinsic's pointers: packed query, the block's first K row, scores,
    scratch, first prefetch line."""
    def ptr(i):
        return _ptr(context, builder, sig.args[i], args[i], _i64(0))
    return ptr(0), _at(builder, ptr(1), args[2]), ptr(6), ptr(7), _at(builder, ptr(8), args[9])


def _qk_rows_intrinsic(src: str):
    @intrinsic
    def qk_rows(typingctx, qp, buf, off, stride, nrows, dk, s, scr, pf, pfoff, pflines):
        """f32 kind: s[c * 16 + r] = sum_j q[r, j] k[c, j] for 16 rows r (qp: dk vectors Qt[j]) and
        CB cells c, K row c at byte off + c * stride of buf, stored as src (rows c >= nrows: 0).
        Per tile of 16 j: 16 q vector loads, 256 FMAs with a broadcast of the tile.  Meanwhile
        the pflines cache lines from byte pfoff of pf go towards L2, spread over the tiles (the
        next block: as one burst before the block they held up the loads of this one)."""
        sig = _score_sig(qp, buf, s, scr, pf)
        if sig is None:
            return None

        def codegen(context, builder, sig, args):
            q0, rows, s0, scr, p0 = _score_ptrs(context, builder, sig, args)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None)) for _ in range(CB)]
            ntiles = builder.udiv(args[5], _i64(16))

            def body(t, tile):
                with cgutils.for_range_slice(builder, t, args[10], ntiles) as (line, _):
                    simd_prefetch(builder, _at(builder, p0, builder.mul(line, _i64(64))), 0, 64, locality=2)
                qt = _at(builder, q0, builder.mul(t, _i64(16 * 64)))
                for jj in range(16):
                    qv = _load(builder, _at(builder, qt, 64 * jj), _F32, 16)
                    for c in range(CB):
                        kv = _splat_word(builder, _at(builder, tile, 64 * c + 4 * jj), "f32")
                        builder.store(_madd(builder, "f32", builder.load(accs[c]), qv, kv), accs[c])
            _over_tiles(builder, rows, args[3], args[4], ntiles, scr, src, body)
            for c in range(CB):
                _store(builder, builder.load(accs[c]), _at(builder, s0, 64 * c))
            return context.get_dummy_value()
        return sig, codegen
    return qk_rows


def _pv_rows_intrinsic(src: str):
    nd = 8    # eight chains: two FMAs issue a cycle at a latency of four (P.V with four: 0.42 ms
    #           against 0.355, 3584 cells, one thread, in a scratch loop)

    @intrinsic
    def pv_rows(typingctx, s, buf, off, stride, nrows, dv, acc, alpha, rescale, scr):
        """f32 kind: acc[16 d + r] = acc[16 d + r] * alpha[r] (only if rescale) + sum_c p[c, r]
        v[c, d]: p = s (CB cells x 16 rows), V row c the first dv values at byte off + c * stride
        of buf, stored as src (rows c >= nrows: 0).  Per tile of 16 d: the 16 accumulator
        vectors loaded and stored once, in two passes of eight.  The softmax rescale rides along
        (a separate loop over acc cost ~20 % of the kernel on random scores)."""
        if not all(isinstance(a, types.Array) for a in (s, buf, acc, alpha, scr)):
            return None
        i64 = types.int64
        sig = types.none(s, buf, i64, i64, i64, i64, acc, alpha, types.boolean, scr)

        def codegen(context, builder, sig, args):
            s0 = _ptr(context, builder, sig.args[0], args[0], _i64(0))
            rows = _at(builder, _ptr(context, builder, sig.args[1], args[1], _i64(0)), args[2])
            a0 = _ptr(context, builder, sig.args[6], args[6], _i64(0))
            al = _load(builder, _ptr(context, builder, sig.args[7], args[7], _i64(0)), _F32, 16)
            scr = _ptr(context, builder, sig.args[9], args[9], _i64(0))
            P = [_load(builder, _at(builder, s0, 64 * c), _F32, 16) for c in range(CB)]

            def pass_over_acc(scale: bool) -> None:
                def body(t, tile):
                    at = _at(builder, a0, builder.mul(t, _i64(16 * 64)))
                    for h in range(0, 16, nd):
                        accs = [_load(builder, _at(builder, at, 64 * (h + k)), _F32, 16) for k in range(nd)]
                        if scale:
                            accs = [builder.fmul(a, al) for a in accs]
                        for c in range(CB):
                            for k in range(nd):
                                vv = _splat_word(builder, _at(builder, tile, 64 * c + 4 * (h + k)), "f32")
                                accs[k] = _madd(builder, "f32", accs[k], P[c], vv)
                        for k, a in enumerate(accs):
                            _store(builder, a, _at(builder, at, 64 * (h + k)))
                _over_tiles(builder, rows, args[3], args[4], builder.udiv(args[5], _i64(16)), scr, src, body)

            _both_ways(builder, args[8], pass_over_acc)
            return context.get_dummy_value()
        return sig, codegen
    return pv_rows


# by source: the float caches read in place, quantized ones from their f32 decode
# ---- q8_0 caches: int8 scores ----
Q8_BLOCK = 32 * LANES + 2 * 4 * LANES     # packed query bytes per 32 values of a row chunk


@intrinsic
def _qk_q8_scores(typingctx, q8c, buf, off, stride, nrows, dk, s, scr, pf, pfoff, pflines):
    """s[c * 16 + r] = sum over 32-value blocks b of dq[b, r] dk[c, b] (q8[r, b] . k8[c, b]) for CB
    cells c (q8_0 K row c at byte off + c * stride of buf; rows c >= nrows: 0) and the 16 rows r
    packed by _pack_q8 in q8c.  First the block's int8 K values go into scr plus 128 (vpdpbusd
    multiplies unsigned by signed bytes; the packed -128 * sum q8 undoes it) with their scales as
    f32; then per 32 values and 8 cells: 8 query vectors, 64 vpdpbusd with a broadcast of 4 K bytes,
    one int -> f32 conversion and FMA per cell.  pflines cache lines from byte pfoff of pf go
    towards L2 on the way (the next block)."""
    sig = _score_sig(q8c, buf, s, scr, pf)
    if sig is None:
        return None

    def codegen(context, builder, sig, args):
        q0, rows, s0, k8, p0 = _score_ptrs(context, builder, sig, args)
        stride, nrows = args[3], args[4]
        nblk = builder.udiv(args[5], _i64(32))
        ks0 = _at(builder, k8, builder.mul(nblk, _i64(32 * CB)))     # K scales, (nblk, CB) f32
        top = ir.Constant(_vec(_I8, 32), [-128] * 32)
        for c in range(CB):
            kc = _at(builder, k8, 32 * c)
            ksc = _at(builder, ks0, 4 * c)
            with builder.if_else(builder.icmp_signed("<", _i64(c), nrows)) as (then, otherwise):
                with then:
                    row = _at(builder, rows, builder.mul(_i64(c), stride))
                    with cgutils.for_range(builder, nblk) as loop:
                        blk = _at(builder, row, builder.mul(loop.index, _i64(34)))
                        d = builder.fpext(_load(builder, blk, ir.HalfType()), _F32)
                        _store(builder, d, _at(builder, ksc, builder.mul(loop.index, _i64(4 * CB))))
                        v = builder.xor(_load(builder, _at(builder, blk, 2), _I8, 32), top)
                        _store(builder, v, _at(builder, kc, builder.mul(loop.index, _i64(32 * CB))))
                with otherwise:           # scale 0: whatever bytes lie there add nothing
                    with cgutils.for_range(builder, nblk) as loop:
                        zero = ir.Constant(_F32, 0.0)
                        _store(builder, zero, _at(builder, ksc, builder.mul(loop.index, _i64(4 * CB))))
        half = CB // 2
        for grp in range(2):
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), None)) for _ in range(half)]
            with cgutils.for_range(builder, nblk) as loop:
                b = loop.index
                if grp == 0:
                    with cgutils.for_range_slice(builder, b, args[10], nblk) as (line, _):
                        simd_prefetch(builder, _at(builder, p0, builder.mul(line, _i64(64))), 0, 64, locality=2)
                qb = _at(builder, q0, builder.mul(b, _i64(Q8_BLOCK)))
                qv = [_load(builder, _at(builder, qb, 64 * i), _I8, 64) for i in range(8)]
                corr = _load(builder, _at(builder, qb, 32 * LANES + 4 * LANES), _I32, 16)
                dq = _load(builder, _at(builder, qb, 32 * LANES), _F32, 16)
                kb = _at(builder, k8, builder.mul(b, _i64(32 * CB)))
                dots = [corr] * half
                for i in range(8):
                    for c in range(half):
                        w = _splat_i32(builder, _load(builder, _at(builder, kb, 32 * (grp * half + c) + 4 * i), _I32))
                        dots[c] = dpbusd(builder, dots[c], builder.bitcast(w, _vec(_I8, 64)), qv[i], vnni=HAS_VNNI)
                ksb = _at(builder, ks0, builder.mul(b, _i64(4 * CB)))
                for c in range(half):
                    ks = builder.bitcast(_splat_i32(builder, _load(builder, _at(builder, ksb, 4 * (grp * half + c)),
                                                                    _I32)), _vec(_F32, 16))
                    f = builder.sitofp(dots[c], _vec(_F32, 16))
                    builder.store(_madd(builder, "f32", builder.load(accs[c]), f, builder.fmul(dq, ks)), accs[c])
            for c in range(half):
                _store(builder, builder.load(accs[c]), _at(builder, s0, 64 * (grp * half + c)))
        return context.get_dummy_value()
    return sig, codegen


_TILE_SOURCES = ("f16", "bf16", "f32", "q8_0")
_qk_f16_rows, _qk_bf16_rows, _qk_f32_rows, _qk_q8_0_rows = (_qk_rows_intrinsic(k) for k in _TILE_SOURCES)
_pv_f16_rows, _pv_bf16_rows, _pv_f32_rows, _pv_q8_0_rows = (_pv_rows_intrinsic(k) for k in _TILE_SOURCES)


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
                kv = _load_f32x16(builder, s0, kind, k)
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
def _aligned_empty(n, like):
    """n elements of like's dtype, uninitialised, from a 64-byte boundary: zmm loads and stores
    across two cache lines cost up to twice as much (a whole-block f16 -> f32 conversion, as this
    kernel had before its tiles, measured ~35 % slower from a 16-byte boundary)."""
    raw = np.empty(n + 64 // like.itemsize, like.dtype)
    o = ((-raw.ctypes.data) & 63) // like.itemsize
    return raw[o:o + n]


_F32_TOKEN = np.empty(0, np.float32)
_U8_TOKEN = np.empty(0, np.uint8)


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


def _prefetch_next(qp, kbuf, vbuf, v_is_k, j1, n, kstride, vstride):
    """The next block's rows (cells j1 .. j1 + n - 1) towards L2 while this one is computed: deep
    in a context the cache comes from memory, and the kernel's compute phases leave the hardware
    prefetchers idle.  Returns how many cache lines of K, from cell j1 on, the block's first score
    pass should prefetch (f32 kind: spread over its steps; the bf16 kind prefetches them all here)."""


@overload(_prefetch_next)
def _prefetch_next_kind(qp, kbuf, vbuf, v_is_k, j1, n, kstride, vstride):
    if _is_bf16(qp):
        def burst(qp, kbuf, vbuf, v_is_k, j1, n, kstride, vstride):
            """(measured with the f32 kind before its K prefetch was spread, 3584 cells, one thread:
            1.53-2.04 against 1.54-2.44 ms a call without; the bf16 kind did not move on the Intel VM)."""
            if n > 0:
                _prefetch_rows(kbuf, j1, n, kstride)
                if not v_is_k:
                    _prefetch_rows(vbuf, j1, n, vstride)
            return 0
        return burst

    def spread(qp, kbuf, vbuf, v_is_k, j1, n, kstride, vstride):
        """(16 rows of 576 over 3584 f16 cells from memory, one thread: 1.17-1.18 ms a call
        against 1.30-1.35 for the burst and 1.26-1.28 without)."""
        if n <= 0:
            return 0
        if not v_is_k:
            _prefetch_rows(vbuf, j1, n, vstride)
        return (n * kstride + 63) // 64 + 1          # + 1: a row need not start a line
    return spread


@njit(**_opts)
def _start_item(m, l, acc, s, ch0, ch1):
    """A work item's running max / sum / accumulators of row chunks ch0..ch1: -inf, 0, 0."""
    for g in range(m.shape[0]):
        for ch in range(ch0, ch1):
            m[g, s, ch * LANES:(ch + 1) * LANES] = -np.inf
            l[g, s, ch * LANES:(ch + 1) * LANES] = 0.0
            acc[g, s, ch] = 0.0


@njit(**_opts)
def _mask_and_max(S, cp, nb, maxpos, rp, mg, mnew):
    """Scores of cells a row does not see (and of the block's padding cells) -> -inf; mnew = the
    rows' running max over mg and this block.  All loops over r are branch-free 16-lane code."""
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


@njit(**_opts)
def _to_probabilities(S, mnew, mg, lg, alpha):
    """Move the running max to mnew (alpha: the rescale of each row's sum and accumulator, 1 where
    it stayed), scores -> probabilities in place, added to lg.  True when some max moved (rare
    after the first blocks)."""
    moved = False
    for r in range(LANES):
        if mnew[r] > mg[r]:
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
    return moved


@njit(**_opts)
def _attend_range(kbuf, kqt, khead, kstride, vbuf, vqt, vhead, vstride, v_is_k, c0, c1, dk, dv, cell_pos,
                  qp, q8, qf, rpos, ch0, ch1, s, lut, refine, acc, m, l):
    """Online softmax of row chunks ch0..ch1 of every kv head over cells [c0, c1), in the kind
    qp's dtype names (the hooks below are chosen while typing: the f32 kind never compiles a
    bf16 intrinsic).  qp (Hkv, nch, dk * 16): Qt[j] (f32) or bf16 pairs of each chunk; qf (Hkv,
    nch * 16, dk) the same rows in f32; rpos (nch * 16) row positions; acc (Hkv, nsplit, nch,
    dv * 16) transposed accumulators; m / l (Hkv, nsplit, nch * 16).  bf16: scores within
    `refine` (log2 units) of the running max are recomputed in f32 (module docstring)."""
    hkv = qp.shape[0]
    blk = _new_block(qp, dk, dv, v_is_k, kqt, vqt)
    S = _aligned_empty(CB * LANES, _F32_TOKEN)
    mnew = np.empty(LANES, dtype=np.float32)
    alpha = np.empty(LANES, dtype=np.float32)
    maxpos = rpos[ch0 * LANES:ch1 * LANES].max()
    _start_item(m, l, acc, s, ch0, ch1)
    for j0 in range(c0, c1, CB):
        nb = min(CB, c1 - j0)
        cp = cell_pos[j0:j0 + nb]
        if cp.min() > maxpos:
            continue                      # no row sees any of these cells
        pfl = _prefetch_next(qp, kbuf, vbuf, v_is_k, j0 + CB, min(CB, c1 - j0 - CB), kstride, vstride)
        for g in range(hkv):
            kbase, vbase = g * khead + j0 * kstride, g * vhead + j0 * vstride
            _fill_block(qp, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dk, dv, lut)
            for ch in range(ch0, ch1):
                rp = rpos[ch * LANES:(ch + 1) * LANES]
                mg = m[g, s, ch * LANES:(ch + 1) * LANES]
                lg = l[g, s, ch * LANES:(ch + 1) * LANES]
                _block_scores(qp[g, ch], q8[g, ch], blk, kbuf, kqt, kbase, kstride, nb, dk, S, (j0 + CB) * kstride,
                              pfl if g == 0 and ch == ch0 else 0)
                _mask_and_max(S, cp, nb, maxpos, rp, mg, mnew)
                _refine_scores(qp, qf, (g * qf.shape[1] + ch * LANES) * dk, kbuf, kqt, kbase, kstride, blk, nb, dk,
                               S, mnew, refine)
                moved = _to_probabilities(S, mnew, mg, lg, alpha)
                _block_values(qp, S, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dv,
                              acc[g, s, ch], alpha, moved)


# ---- the kinds' hooks, chosen by the packed query's dtype (uint16: bf16 pairs, float32: f32) ----
def _is_bf16(qp) -> bool:
    return qp.dtype == types.uint16


@njit(**_opts)
def _in_place(qt):
    """The cache types the f32 kind reads in place, converting a tile at a time."""
    return qt == F16 or qt == BF16 or qt == F32 or qt == Q8_0


def _new_block(qp, dk, dv, v_is_k, kqt, vqt):
    """A block's scratch: bf16 (K rows, V rows, V interleaved per cell pair, f32 K rows, f32 V rows),
    f32 (f32 K rows, f32 V rows: the same array when v_is_k, each with no rows where its cache is
    read in place; two tiles of 16 values of the CB cells)."""


@overload(_new_block)
def _new_block_kind(qp, dk, dv, v_is_k, kqt, vqt):
    if _is_bf16(qp):
        def bf16(qp, dk, dv, v_is_k, kqt, vqt):
            kb = np.zeros(CB * dk, dtype=np.uint16)
            vb = kb if v_is_k else np.zeros(CB * dv, dtype=np.uint16)
            return (kb, vb, np.zeros(CB * dv, dtype=np.uint16), np.zeros((CB, dk), dtype=np.float32),
                    np.zeros((CB, dv), dtype=np.float32))
        return bf16

    def f32(qp, dk, dv, v_is_k, kqt, vqt):
        nk = 0 if _in_place(kqt) else CB          # decoded rows only for a quantized cache
        kb = _aligned_empty(nk * dk, _F32_TOKEN).reshape(nk, dk)
        if v_is_k:
            vb = kb
        else:
            nv = 0 if _in_place(vqt) else CB
            vb = _aligned_empty(nv * dv, _F32_TOKEN).reshape(nv, dv)
        n8 = CB * dk + dk // 32 * CB * 4 if kqt == Q8_0 else 0     # int8 K + 128, their scales
        return kb, vb, _aligned_empty(2 * CB * 16, _F32_TOKEN), _aligned_empty(n8, _U8_TOKEN)
    return f32


def _fill_block(qp, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dk, dv, lut):
    """The nb cache rows of a block (kv head slices at kbase / vbase, one row per stride) into blk."""


@overload(_fill_block)
def _fill_block_kind(qp, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dk, dv, lut):
    if _is_bf16(qp):
        def bf16(qp, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dk, dv, lut):
            kb, vb, vi, fbk, fbv = blk
            _block_to_bf16(kbuf, kqt, kbase, kstride, nb, dk, lut, fbk, kb, dk)
            if not v_is_k:
                _block_to_bf16(vbuf, vqt, vbase, vstride, nb, dv, lut, fbv, vb, dv)
            _interleave_pairs(vb, dk if v_is_k else dv, dv, vi)
        return bf16

    def f32(qp, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dk, dv, lut):
        kb, vb, _, _ = blk                # the float caches and q8_0 are read in place
        if not _in_place(kqt):
            decode_cache_rows(kbuf, kqt, kbase, kstride, nb, dk, QK, lut, kb)
        if not v_is_k and not _in_place(vqt):
            decode_cache_rows(vbuf, vqt, vbase, vstride, nb, dv, QK, lut, vb)
    return f32


def _block_scores(qc, q8c, blk, kbuf, kqt, kbase, kstride, nb, dk, S, pfoff, pflines):
    """S[c * 16 + r] = q row r of the chunk qc . K row c of the block (f32 kind: pflines cache
    lines of kbuf from byte pfoff prefetched on the way; a q8_0 cache with the chunk packed as
    int8 in q8c (not empty): integer products)."""


@overload(_block_scores)
def _block_scores_kind(qc, q8c, blk, kbuf, kqt, kbase, kstride, nb, dk, S, pfoff, pflines):
    if _is_bf16(qc):
        return lambda qc, q8c, blk, kbuf, kqt, kbase, kstride, nb, dk, S, pfoff, pflines: _qk_bf16(qc, 0, blk[0], dk, S)

    def f32(qc, q8c, blk, kbuf, kqt, kbase, kstride, nb, dk, S, pfoff, pflines):
        kb, _, scr, k8 = blk
        if q8c.size:
            _qk_q8_scores(q8c, kbuf, kbase, kstride, nb, dk, S, k8, kbuf, pfoff, pflines)
            return
        if kqt == F16:
            _qk_f16_rows(qc, kbuf, kbase, kstride, nb, dk, S, scr, kbuf, pfoff, pflines)
        elif kqt == BF16:
            _qk_bf16_rows(qc, kbuf, kbase, kstride, nb, dk, S, scr, kbuf, pfoff, pflines)
        elif kqt == F32:
            _qk_f32_rows(qc, kbuf, kbase, kstride, nb, dk, S, scr, kbuf, pfoff, pflines)
        elif kqt == Q8_0:
            _qk_q8_0_rows(qc, kbuf, kbase, kstride, nb, dk, S, scr, kbuf, pfoff, pflines)
        else:
            _qk_f32_rows(qc, kb, 0, dk * 4, nb, dk, S, scr, kbuf, pfoff, pflines)
    return f32


def _refine_scores(qp, qf, qoff, kbuf, kqt, kbase, kstride, blk, nb, dk, S, mnew, refine):
    """bf16: the scores within `refine` of the rows' running max mnew recomputed in f32 (the cells
    that carry weight: bf16 q and k alone put ~1 % errors on the outputs of a 576-wide latent head);
    f32: nothing.  qoff: flat offset of the chunk's first row in qf (a view per refined score cost
    a shared refcount update, ~200 ns)."""


@overload(_refine_scores)
def _refine_scores_kind(qp, qf, qoff, kbuf, kqt, kbase, kstride, blk, nb, dk, S, mnew, refine):
    if not _is_bf16(qp):
        return lambda qp, qf, qoff, kbuf, kqt, kbase, kstride, blk, nb, dk, S, mnew, refine: None

    def bf16(qp, qf, qoff, kbuf, kqt, kbase, kstride, blk, nb, dk, S, mnew, refine):
        fbk = blk[3]
        thr = np.empty(LANES, dtype=np.float32)
        for r in range(LANES):            # rows that see nothing (padding) refine nothing
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
                    x = _exact_score(qf, qoff + r * dk, kbuf, kqt, kbase + b * kstride, fbk, b, dk)
                    sb[r] = x
                    mnew[r] = max(mnew[r], x)
    return bf16


def _block_values(qp, S, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dv, a, alpha, moved):
    """a (dv * 16, transposed) = a * alpha (if moved) + the probabilities S times the block's V rows
    (v_is_k: the first dv values of the K rows)."""


@overload(_block_values)
def _block_values_kind(qp, S, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dv, a, alpha,
                       moved):
    if _is_bf16(qp):
        def bf16(qp, S, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dv, a, alpha, moved):
            _pv_bf16(S, blk[2], dv, a, alpha, moved)
        return bf16

    def f32(qp, S, blk, kbuf, kqt, kbase, kstride, vbuf, vqt, vbase, vstride, v_is_k, nb, dv, a, alpha, moved):
        kb, vb, scr, _ = blk
        if v_is_k:
            _values_from(S, kbuf, kqt, kbase, kstride, kb, nb, dv, a, alpha, moved, scr)
        else:
            _values_from(S, vbuf, vqt, vbase, vstride, vb, nb, dv, a, alpha, moved, scr)
    return f32


@njit(**_opts)
def _values_from(S, buf, qt, base, stride, fb, nb, dv, a, alpha, moved, scr):
    """f32 kind: P.V from the cache rows at base (float caches) or their f32 decode fb."""
    if qt == F16:
        _pv_f16_rows(S, buf, base, stride, nb, dv, a, alpha, moved, scr)
    elif qt == BF16:
        _pv_bf16_rows(S, buf, base, stride, nb, dv, a, alpha, moved, scr)
    elif qt == F32:
        _pv_f32_rows(S, buf, base, stride, nb, dv, a, alpha, moved, scr)
    elif qt == Q8_0:
        _pv_q8_0_rows(S, buf, base, stride, nb, dv, a, alpha, moved, scr)
    else:
        _pv_f32_rows(S, fb, 0, fb.shape[1] * 4, nb, dv, a, alpha, moved, scr)


def _pack_lanes(qpad, qp):
    """qpad's chunks of 16 rows into lanes: qp[g, ch] from rows ch * 16 .. ch * 16 + 15."""


@overload(_pack_lanes)
def _pack_lanes_kind(qpad, qp):
    if _is_bf16(qp):
        def bf16(qpad, qp):
            """qp[g, ch, (j * 16 + r) * 2 + e] = bf16 of row ch * 16 + r, value 2j + e (nearest even)."""
            b = qpad.view(np.uint32)
            for g in range(qp.shape[0]):
                for ch in range(qp.shape[1]):
                    for r in range(LANES):
                        row = b[g, ch * LANES + r]
                        for d in range(row.shape[0]):
                            x = row[d]
                            qp[g, ch, ((d >> 1) * LANES + r) * 2 + (d & 1)] = np.uint16(
                                (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return bf16

    def f32(qpad, qp):
        """qp[g, ch, j * 16 + r] = row ch * 16 + r, value j."""
        dk = qpad.shape[2]
        for g in range(qp.shape[0]):
            for ch in range(qp.shape[1]):
                t = qp[g, ch].reshape(dk, LANES)        # bare loop counters: no wrap-around checks
                for r in range(LANES):
                    row = qpad[g, ch * LANES + r]
                    for d in range(dk):
                        t[d, r] = row[d]
    return f32


@njit(parallel=True, **_opts)
def _fa_kernel(q, scale2, q_pos, hkv, kbuf, kqt, kstride, khead, vbuf, vqt, vstride, vhead, v_is_k, n_kv, dv,
               cell_pos, nsplit, lut, refine, qkind, q8scores, out, attend):
    """The whole call in one compiled function: pack the query rows into qp (qkind's dtype picks
    the kind), one work item per (group of CHUNKS_PER_ITEM row chunks, range of cells), merge the
    ranges into out (Hkv, R, dv).  Packing, attending and merging as three calls cost ~25 us of
    dispatch and allocation a call, half of a 64-cell generation step.  attend: the address of
    _attend_range compiled for these arguments (_attend_address): called by address, its code is
    compiled once, not again in the parallel loop's gufunc and its wrappers (quant.fnptr)."""
    T, H, dk = q.shape
    R = T * (H // hkv)
    nch = (R + LANES - 1) // LANES
    qpad = np.empty((hkv, nch * LANES, dk), dtype=np.float32)
    rp = np.empty(nch * LANES, dtype=np.int64)
    _pack_q(q, scale2, q_pos, qpad, rp)
    qp = _aligned_empty(hkv * nch * dk * LANES, qkind).reshape(hkv, nch, dk * LANES)
    _pack_lanes(qpad, qp)
    q8 = _aligned_empty(hkv * nch * (dk // 32) * Q8_BLOCK if q8scores and kqt == Q8_0 else 0,
                        _U8_TOKEN).reshape(hkv, nch, -1)
    if q8.size:
        _pack_q8(qpad, q8)
    acc = _aligned_empty(hkv * nsplit * nch * dv * LANES, _F32_TOKEN).reshape(hkv, nsplit, nch, dv * LANES)
    m = np.empty((hkv, nsplit, nch * LANES), dtype=np.float32)
    l = np.zeros((hkv, nsplit, nch * LANES), dtype=np.float32)
    ngr = (nch + CHUNKS_PER_ITEM - 1) // CHUNKS_PER_ITEM
    for it in prange(ngr * nsplit):
        gr, s = it // nsplit, it % nsplit
        ch0, ch1 = gr * CHUNKS_PER_ITEM, min(nch, gr * CHUNKS_PER_ITEM + CHUNKS_PER_ITEM)
        c0, c1 = _split_cells(n_kv, nsplit, s, CB)
        if c0 < c1:       # the arguments' types are _attend_address's signature: scalars made int64 here
            call_at(attend, (kbuf, np.int64(kqt), np.int64(khead), np.int64(kstride), vbuf, np.int64(vqt),
                             np.int64(vhead), np.int64(vstride), v_is_k, np.int64(c0), np.int64(c1), np.int64(dk),
                             np.int64(dv), cell_pos, qp, q8, qpad, rp, np.int64(ch0), np.int64(ch1), np.int64(s), lut,
                             refine, acc, m, l))
        else:
            for g in range(hkv):
                for ch in range(ch0, ch1):
                    m[g, s, ch * LANES:(ch + 1) * LANES] = -np.inf
    _combine(acc, m, l, R, LANES, out)


@njit(**_opts)
def _pack_q(q, scale2, q_pos, qpad, rp):
    """The query rows of each kv head g, row t * G + i = head g * G + i of token t (G query heads
    per kv head) times scale2, padded to chunks of 16 (zeros, position NO_POS: they see nothing).
    One pass in numba with _pack_lanes: the NumPy version (scale, transpose, pad, round) cost ~30
    us a call, its scale and transpose alone ~10 us in generation."""
    T, H, dk = q.shape
    hkv = qpad.shape[0]
    G = H // hkv
    qpad[:, T * G:] = 0.0
    rp[T * G:] = NO_POS
    for t in range(T):
        for i in range(G):
            rp[t * G + i] = q_pos[t]
            for g in range(hkv):
                src, dst = q[t, g * G + i], qpad[g, t * G + i]
                for d in range(dk):             # a loop: the array expression allocated per row
                    dst[d] = src[d] * scale2


@njit(**_opts)
def _pack_q8(qpad, q8):
    """q8[g, ch]: the chunk's 16 rows quantized as the matmuls' activations (quant.kernels'
    quantize_act_q8_serial: int8 per 32 values, d = max |x| / 127 rounded to bf16, ik's rule) and
    laid out for vpdpbusd: per 32-value block b (Q8_BLOCK bytes at b * Q8_BLOCK) value 4i + e of
    row r at byte (i * 16 + r) * 4 + e (4 a lane), then d (16 f32) and -128 * the block's sum of
    q (16 int32: the products are taken with K + 128)."""
    hkv, nch, dk = q8.shape[0], q8.shape[1], qpad.shape[2]
    nb = dk // 32
    rows = qpad.reshape(hkv * nch * LANES, dk)
    q = np.empty((rows.shape[0], dk), dtype=np.int8)
    d = np.empty((rows.shape[0], nb), dtype=np.float32)
    bs = np.empty((rows.shape[0], nb), dtype=np.int32)
    quantize_act_q8_serial(rows, QK, q, d, bs, np.empty((0, 0), np.float32), np.empty((0, 0), np.int32))
    for g in range(hkv):
        for ch in range(nch):
            out = q8[g, ch]
            qs = out.view(np.int8)
            for b in range(nb):
                o = b * Q8_BLOCK
                sc = out[o + 32 * LANES:o + 36 * LANES].view(np.float32)
                cr = out[o + 36 * LANES:o + Q8_BLOCK].view(np.int32)
                for r in range(LANES):
                    t = (g * nch + ch) * LANES + r
                    for j in range(32):
                        qs[o + ((j >> 2) * LANES + r) * 4 + (j & 3)] = q[t, b * 32 + j]
                    sc[r] = d[t, b]
                    cr[r] = -128 * bs[t, b]


def supports(n_rows: int, dk: int, dv: int) -> bool:
    """Shapes the lanes kernels take: dk / dv in 16-value steps, and enough query rows per kv
    head that padding them to chunks of 16 wastes at most a quarter of the lanes (a single
    standard head per kv head would waste 15/16 of every dot)."""
    if dk % 16 or dv % 16:
        return False
    nch = -(-n_rows // LANES)
    return 4 * n_rows >= 3 * nch * LANES


def flash_kernel_lanes(q: np.ndarray, scale2: float, q_pos: np.ndarray, hkv: int, k, v, n_kv: int, dk: int,
                       dv: int, cell_pos: np.ndarray, nsplit: int, lut: np.ndarray, khead: int, vhead: int,
                       kind: str = "f32") -> np.ndarray:
    """q (T, H, dk) f32 query heads (C order), scale2 the score scale in the log2 domain, q_pos (T,)
    their positions, hkv kv heads -> (Hkv, T * G, dv) f32, row t * G + i of kv head g = query head
    g * G + i of token t.  k / v: RowStores (v None: V is the first dv values of each K head).
    kind: "f32" or "bf16" products (bf16 only where bf16_available())."""
    T, H, _ = q.shape
    vs = k if v is None else v
    qkind = _QKIND[kind]
    out = np.empty((hkv, T * (H // hkv), dv), dtype=np.float32)
    kbuf, vbuf = k.data.reshape(-1), vs.data.reshape(-1)
    _fa_kernel(q, np.float32(scale2), q_pos, hkv, kbuf, k.qtype, k.data.shape[1], khead, vbuf, vs.qtype,
               vs.data.shape[1], vhead, v is None, n_kv, dv, cell_pos, nsplit, lut, np.float32(REFINE_LOG2), qkind,
               Q8_SCORES, out,
               _attend_address(kbuf, vbuf, cell_pos, qkind, lut))
    return out


# the packed queries' dtype (and array type) of each kind: _fa_kernel allocates them, aligned
_QKIND = {"f32": np.empty((0, 0, 0), np.float32), "bf16": np.empty((0, 0, 0), np.uint16)}
# (argument kinds) -> (_attend_range, its address for them)
_ATTEND: dict = {}
_INT = types.int64
_F32_3 = types.Array(types.float32, 3, "C")


def _attend_address(kbuf: np.ndarray, vbuf: np.ndarray, cell_pos: np.ndarray, qp: np.ndarray, lut: np.ndarray) -> int:
    """The address of _attend_range compiled for _fa_kernel's argument types (the arrays it makes
    itself have fixed types), compiled or loaded from the cache on first use."""
    def make():
        ty = numba.typeof
        return _attend_range, (ty(kbuf), _INT, _INT, _INT, ty(vbuf), _INT, _INT, _INT, types.boolean, _INT, _INT, _INT,
                               _INT, ty(cell_pos), ty(qp), types.Array(types.uint8, 3, "C"), _F32_3,
                               types.Array(types.int64, 1, "C"), _INT, _INT, _INT, ty(lut), types.float32,
                               types.Array(types.float32, 4, "C"), _F32_3, _F32_3)
    return cached_address(_ATTEND, arrays_key(kbuf, vbuf, cell_pos, qp, lut), make)
