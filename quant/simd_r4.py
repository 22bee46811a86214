"""Integer dots of ik_llama.cpp's 4-row interleaved K-quant and IQK layouts (_R4), in LLVM IR.

An _R4 block column holds the same 256-value blocks of 4 rows, their levels "woven"
(quant.interleaved): for 32-value sub-block s, byte 16*m + 4*k + i of a 32-byte run holds
fields of row k, values i + off(m, t) (t: the field within the byte).  Each run is one
32-byte load; a field's shift/mask gives 32 unsigned levels whose dword lane (m, k) covers
4 values of row k.  For every run the matching 4 activation bytes are shuffled into the same
lanes (one constant shuffle of the sub-block's 32 activations), so one vpdpbusd (generic IR:
widened products summed by fours) adds the 4 products of every row into its own lane.  In
every layout here m = 0 and m = 1 of a run cover the first and the second 16 values of the
sub-block, so the 8 int32 lanes are (half h, row k): per-16 scales, "extra" offsets and mins
are lane vectors read straight from the packed per-row fields (field (k, j) sits at index
4*j + k), and no horizontal sums are needed until the 4 row results leave the group.

    lanes(h, k) = sum_runs dpbusd(u, a_shuffled) - off(h, k) * asum16(h)
    facc       += float(lanes * scale(h, k)) * s_a              (per sub-block)
    acc        += facc * d(k);  macc += float(min(h, k) * asum16(h)) * s_a * dm(k)

With VNNI two sub-blocks share each 512-bit vpdpbusd, scale multiply and convert (lanes
(sub-block parity, h, k): quant.simd_blocks._width); the generic IR keeps one per 256-bit vector.
Records (R4Dot) name the layout's byte offsets through their unpack functions; types without a
record here are unpacked to their plain type at load (engine) and use quant.simd_blocks.
Results equal the plain kernels' up to the order of f32 additions (same integer sums).
Development note (as quant.simd): after editing this module delete quant/__pycache__/*.nb*.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llvmlite import ir
from numba.core import cgutils

from .simd import (HAS_AVX2, HAS_VNNI, PREFETCH_BYTES, _F32, _I8, _I16, _I32, _const_i64, _quads, _vec,
                   dpbusd, prefetch, signed_pairs, unsigned_pairs)
from . import simd_blocks as _blk
from .simd_blocks import TMAX, _bit_to, _c, _cat, _cv, _gep, _ld, _lookup, dot_intrinsic, token_accs, tree_sum
from .types import type_info

_V8I = _vec(_I32, 8)
_V8F = _vec(_F32, 8)
Q4_PAIRS = ((0, 8), (16, 24), (4, 12), (20, 28))   # quant.interleaved: the 4-bit weave
CRUMBS = ((0, 4, 8, 12), (16, 20, 24, 28))          # ... and the 2-bit one


@dataclass
class R4Sub:
    """One 32-value sub-block of a block column: runs = [(u <32 x i8>, (off0, off1))], each run's
    dword lane (m, k) holding row k's values off_m .. off_m + 3; scale and off: <8 x i32> lane
    vectors over (h, k) (off may be a plain int)."""
    runs: list
    scale: object
    off: object


@dataclass
class R4Block:
    d: object            # <4 x f32>: the 4 rows' block scales
    subs: list
    dm: object = None    # <4 x f32> min scales (types with mins)
    mins: object = None  # <32 x i8> the mins, lane 4 s + k (sub-block s, row k)


@dataclass(frozen=True)
class R4Dot:
    name: str
    nbytes: int          # bytes of one block column (4 rows)
    unpack: Callable
    row_scale: str = ""  # "f32": 4 f32 row scales head every group (IQ4_KS_R4)
    # the plain type's level offset and bound (quant.simd_blocks.BlockDot off / lmax): they choose
    # the AVX2 products (_avx2_runs)
    off: int = 128
    lmax: int = 128
    # unpack(b, p, bias) stores the levels plus any bias in 0..128 (lookup-table types: the tables
    # are constants either way), so an AVX2 CPU can take them signed or shifted into 0..127
    biased: bool = False


# ----------------------------------------------------------------------------------------
# lane helpers
# ----------------------------------------------------------------------------------------
def _i32x8(b: ir.IRBuilder, v8):
    """<8 x i8> -> <8 x i32> zero-extended."""
    return b.zext(v8, _V8I)


def _lane_fields(b: ir.IRBuilder, p, off: int, shift: int, mask: int, dup: bool = False, signed: bool = False):
    """8 lanes (h, k) of per-row fields: byte off + 4h + k (dup: byte off + k for both h),
    (>> shift) & mask, as i32."""
    if dup:
        v4 = _ld(b, p, off, 4)
        v8 = b.shuffle_vector(v4, v4, ir.Constant(_vec(_I32, 8), [0, 1, 2, 3, 0, 1, 2, 3]))
    else:
        v8 = _ld(b, p, off, 8)
    v = b.sext(v8, _V8I) if signed else _i32x8(b, v8)
    if shift:
        v = b.lshr(v, _c(shift, 8, _I32)) if not signed else b.ashr(v, _c(shift, 8, _I32))
    return b.and_(v, _c(mask, 8, _I32)) if mask is not None else v


def _d4(b: ir.IRBuilder, p, off: int):
    """4 f16 at p + off -> <4 x f32>."""
    h = _ld(b, p, off, 4, _I16)
    return b.fpext(b.bitcast(h, _vec(ir.HalfType(), 4)), _vec(_F32, 4))


def _dup8(b: ir.IRBuilder, v4):
    return b.shuffle_vector(v4, v4, ir.Constant(_vec(_I32, 8), [0, 1, 2, 3, 0, 1, 2, 3]))


def _runs4(b: ir.IRBuilder, p, off: int, fix=None):
    """The two 32-byte runs of a 4-bit sub-block (64 bytes at off, Q4_PAIRS) as 4 nibble runs
    [(levels, activation offsets)]; fix(levels, run index) may add high bits."""
    runs = []
    for half in range(2):
        v = _ld(b, p, off + 32 * half)
        for t in range(2):
            u = b.and_(b.lshr(v, _c(4)) if t else v, _c(15))
            ao = (Q4_PAIRS[2 * half][t], Q4_PAIRS[2 * half + 1][t])
            runs.append((u if fix is None else fix(u, 2 * half + t), ao))
    return runs


def _runs2(b: ir.IRBuilder, p, off: int, fix=None):
    """The 32-byte run of a 2-bit sub-block (CRUMBS) as 4 crumb runs."""
    v = _ld(b, p, off)
    runs = []
    for t in range(4):
        u = b.and_(b.lshr(v, _c(2 * t)) if t else v, _c(3))
        runs.append((u if fix is None else fix(u, t), (CRUMBS[0][t], CRUMBS[1][t])))
    return runs


def _bitplanes(b: ir.IRBuilder, p, off: int, delta: int):
    """A 1-bit weave (16 bytes at off: byte 4k + i) as 32 lanes (m, k, i), the m = 1 lanes shifted
    right by delta: bit t of a lane is then the bit of run t's value, in both halves (one shift
    and mask per run instead of two shifts and a blend).  (Any 16 bytes whose two halves' fields
    sit delta bits apart: also Q4_K_R4's high bits of the mins.)"""
    v16 = _ld(b, p, off, 16)
    # the 16 bytes shifted, then both joined: the 32 bytes shifted and blended became a variable
    # shift per half (bytes widened to words, vpsllvw, packed back): IQ3_K_R4 356 against 241 us (README)
    return _cat(b, v16, b.lshr(v16, _c(delta, 16)))


# ----------------------------------------------------------------------------------------
# unpackers (byte offsets: quant.interleaved's _r_<type> builders)
# ----------------------------------------------------------------------------------------
# the level tables of quant.simd_blocks (16-entry pieces, +128, and the extra-bit shift)
_T_IQ2, _T_IQ3, _T_IQ4, _T_IQ5 = _blk._T_IQ2, _blk._T_IQ3, _blk._T_IQ4K, _blk._T_IQ5


def _lut(b: ir.IRBuilder, T, idx, hi=None, bias: int = 128):
    """Levels (+bias) of piece 0 of table T at idx (0..15), or of piece 1 where hi is non-zero
    (hi: a masked high bit, any power of two, so no shift is spent on it)."""
    def piece(k):
        t = _blk.rebias(T[0][k], bias)
        return _lookup(b, _cat(b, t, t), idx)
    r = piece(0)
    if hi is not None:
        r = b.select(b.icmp_unsigned("!=", hi, _c(0)), piece(1), r)
    return r


def _extra_off(b: ir.IRBuilder, T, p, s: int, bias: int):
    """bias - shift * extra bit of (h, k) for sub-block s (extra[8] at byte 8: bit s of byte 4h + k):
    quant.simd_blocks' offsets of the bits (a mask, no vector multiply)."""
    return _blk._extra_offs(b, T, _lane_fields(b, p, 8, s, 1), bias)


def _nib_scales(b: ir.IRBuilder, p, off: int, s: int):
    """4-bit per-16 fields (32 bytes at off): (h, k) of sub-block s -> byte 8 (s % 4) + 4h + k,
    bits 4 (s // 4)."""
    return _lane_fields(b, p, off + 8 * (s % 4), 4 * (s // 4), 15)


def _unpack_iq2_k_r4(b: ir.IRBuilder, p, bias: int = 128) -> R4Block:
    subs = []
    for s in range(8):
        runs = [(_lut(b, _T_IQ2, u, bias=bias), ao) for u, ao in _runs2(b, p, 48 + 32 * s)]
        sc = b.sub(_nib_scales(b, p, 16, s), _c(8, 8, _I32))
        subs.append(R4Sub(runs, sc, _extra_off(b, _T_IQ2, p, s, bias)))
    return R4Block(_d4(b, p, 0), subs)


def _unpack_iq3_k_r4(b: ir.IRBuilder, p, bias: int = 128) -> R4Block:
    subs = []
    for s in range(8):
        hb = _bitplanes(b, p, 312 + 16 * s, 4)

        def fix(u, t, hb=hb):
            return _lut(b, _T_IQ3, b.or_(u, _bit_to(b, hb, t, 2)), bias=bias)
        runs = _runs2(b, p, 56 + 32 * s, fix)
        ls = b.add(b.shl(_nib_scales(b, p, 24, s), _c(1, 8, _I32)), _c(1, 8, _I32))
        neg = b.icmp_unsigned("!=", _lane_fields(b, p, 16, s, 1), _c(0, 8, _I32))
        subs.append(R4Sub(runs, b.select(neg, b.neg(ls), ls), _extra_off(b, _T_IQ3, p, s, bias)))
    return R4Block(_d4(b, p, 0), subs)


def _ls6_r4(b: ir.IRBuilder, p, s: int):
    """IQ4_K_R4 / IQ5_K_R4 six-bit scales of sub-block s: scales_h crumbs at 16, scales_l
    nibbles at 32, minus 32."""
    hi = _lane_fields(b, p, 16 + 8 * (s % 2), 2 * (s // 2), 3)
    return b.sub(b.or_(_nib_scales(b, p, 32, s), b.shl(hi, _c(4, 8, _I32))), _c(32, 8, _I32))


def _unpack_iq4_k_r4(b: ir.IRBuilder, p, bias: int = 128) -> R4Block:
    subs = []
    for s in range(8):
        runs = [(_lut(b, _T_IQ4, u, bias=bias), ao) for u, ao in _runs4(b, p, 64 + 64 * s)]
        subs.append(R4Sub(runs, _ls6_r4(b, p, s), _extra_off(b, _T_IQ4, p, s, bias)))
    return R4Block(_d4(b, p, 0), subs)


_IQ5_BITS = ((0, 2), (1, 3), (4, 6), (5, 7))     # qh bit of each nibble run's m = 0 / 1 lanes (+2)


def _unpack_iq5_k_r4(b: ir.IRBuilder, p, bias: int = 128) -> R4Block:
    subs = []
    for s in range(8):
        hb = _bitplanes(b, p, 576 + 16 * s, 2)

        def fix(u, r, hb=hb):
            return _lut(b, _T_IQ5, u, b.and_(hb, _c(1 << _IQ5_BITS[r][0])), bias)
        subs.append(R4Sub(_runs4(b, p, 64 + 64 * s, fix), _ls6_r4(b, p, s), _extra_off(b, _T_IQ5, p, s, bias)))
    return R4Block(_d4(b, p, 0), subs)


def _unpack_iq4_ks_r4(b: ir.IRBuilder, p, bias: int = 128) -> R4Block:
    subs = []
    for s in range(8):
        v = _lane_fields(b, p, 4 * s, 0, None, dup=True)
        runs = [(_lut(b, _T_IQ4, u, bias=bias), ao) for u, ao in _runs4(b, p, 32 + 64 * s)]
        sc = b.sub(b.and_(v, _c(254, 8, _I32)), _c(127, 8, _I32))
        subs.append(R4Sub(runs, sc, _blk._extra_offs(b, _T_IQ4, b.and_(v, _c(1, 8, _I32)), bias)))
    return R4Block(ir.Constant(_vec(_F32, 4), [1.0] * 4), subs)


def _k4_r4_scales(b: ir.IRBuilder, p, s: int):
    """Q4_K_R4 / Q5_K_R4 scale lanes of sub-block s: scales_h (4 bits: scale >> 4 | min >> 4 << 2)
    at 16 + 4 (s % 4), bits 4 (s // 4); scales_l (scale & 15 | min << 4) at 32 + 4 s."""
    hi = _lane_fields(b, p, 16 + 4 * (s % 4), 4 * (s // 4), 15, dup=True)
    lo = _lane_fields(b, p, 32 + 4 * s, 0, None, dup=True)
    return b.or_(b.and_(lo, _c(15, 8, _I32)), b.shl(b.and_(hi, _c(3, 8, _I32)), _c(4, 8, _I32)))


def _k4_r4_mins(b: ir.IRBuilder, p):
    """Q4_K_R4 / Q5_K_R4 mins of all 8 sub-blocks in one byte vector, lane 4 s + k (sub-block s,
    row k): the same fields as _k4_r4_scales, read 32 lanes at a time."""
    hi = _bitplanes(b, p, 16, 4)
    lo = _ld(b, p, 32)
    return b.or_(b.and_(b.lshr(lo, _c(4)), _c(15)), b.shl(b.and_(b.lshr(hi, _c(2)), _c(3)), _c(4)))


def _unpack_q4_k_r4(b: ir.IRBuilder, p) -> R4Block:
    subs = []
    for s in range(8):
        subs.append(R4Sub(_runs4(b, p, 64 + 64 * s), _k4_r4_scales(b, p, s), 0))
    return R4Block(_d4(b, p, 0), subs, b.fneg(_d4(b, p, 8)), _k4_r4_mins(b, p))


_Q5_BITS = ((0, 4), (1, 5), (2, 6), (3, 7))      # ... for Q5_K_R4 (+4)


def _unpack_q5_k_r4(b: ir.IRBuilder, p) -> R4Block:
    subs = []
    for s in range(8):
        sc = _k4_r4_scales(b, p, s)

        hb = _bitplanes(b, p, 64 + 16 * s, 4)

        def fix(u, r, hb=hb):
            return b.or_(u, _bit_to(b, hb, _Q5_BITS[r][0], 4))
        subs.append(R4Sub(_runs4(b, p, 192 + 64 * s, fix), sc, 0))
    return R4Block(_d4(b, p, 0), subs, b.fneg(_d4(b, p, 8)), _k4_r4_mins(b, p))


def _unpack_q6_k_r4(b: ir.IRBuilder, p) -> R4Block:
    subs = []
    for s in range(8):
        qh = _ld(b, p, 72 + 32 * s)

        def fix(u, r, qh=qh):
            return b.or_(u, b.shl(b.and_(b.lshr(qh, _c(2 * r)), _c(3)), _c(4)))
        sc = _lane_fields(b, p, 8 + 8 * s, 0, None, signed=True)
        subs.append(R4Sub(_runs4(b, p, 328 + 64 * s, fix), sc, 32))
    return R4Block(_d4(b, p, 0), subs)


def _r4(name: str, unpack: Callable, row_scale: str = "", biased: bool = False) -> R4Dot:
    plain = _blk.BLOCK_DOTS[type_info(type_info(name).base).id]
    return R4Dot(name, 4 * plain.nbytes, unpack, row_scale, plain.off, plain.lmax, biased)


R4_DOTS: dict[int, R4Dot] = {type_info(r.name).id: r for r in (
    _r4("Q4_K_R4", _unpack_q4_k_r4),
    _r4("Q5_K_R4", _unpack_q5_k_r4),
    _r4("Q6_K_R4", _unpack_q6_k_r4),
    _r4("IQ2_K_R4", _unpack_iq2_k_r4, biased=True),
    _r4("IQ3_K_R4", _unpack_iq3_k_r4, biased=True),
    _r4("IQ4_K_R4", _unpack_iq4_k_r4, biased=True),
    _r4("IQ5_K_R4", _unpack_iq5_k_r4, biased=True),
    _r4("IQ4_KS_R4", _unpack_iq4_ks_r4, "f32", biased=True),
)}


# ----------------------------------------------------------------------------------------
# the group template
# ----------------------------------------------------------------------------------------
def _act_shuffle(b: ir.IRBuilder, a, ao):
    """Activation bytes for a run of the a.count / 32 sub-blocks in a: lane (p, m, k, i) =
    a[32 p + ao[m] + i]."""
    mask = [32 * p + ao[m] + i for p in range(a.type.count // 32) for m in range(2) for k in range(4)
            for i in range(4)]
    return b.shuffle_vector(a, a, ir.Constant(_vec(_I32, len(mask)), mask))


def _join(b: ir.IRBuilder, vals: list):
    """Equal lane vectors side by side (one: itself): the w sub-blocks of a vector (_width)."""
    return vals[0] if len(vals) == 1 else b.shuffle_vector(vals[0], vals[1], _cv(range(2 * vals[0].type.count)))


def _emit_group(b: ir.IRBuilder, fmt: R4Dot, grp, act, ntok, cols, vnni: bool):
    """The 4 rows of the group at grp dotted with ntok (<= TMAX) activation rows: an alloca of
    TMAX <4 x f32>, the first ntok filled."""
    meta = 16 if fmt.row_scale == "f32" else 0
    blocks = _gep(b, grp, meta)
    nb = b.udiv(cols, _const_i64(256))
    v4f = _vec(_F32, 4)
    zero32 = ir.Constant(_I32, 0)
    accs, maccs = token_accs(b, _vec(_F32, 8 * _blk._width(vnni)), _V8F)
    res = b.alloca(ir.ArrayType(v4f, TMAX))
    with cgutils.for_range(b, nb) as loop:
        ib = loop.index
        bp = b.gep(blocks, [b.mul(ib, _const_i64(fmt.nbytes))])
        prefetch(b, bp, PREFETCH_BYTES, fmt.nbytes)
        avx2 = None if vnni else _avx2_mode(fmt)
        blk = fmt.unpack(b, bp, avx2.bias if avx2 else 128) if fmt.biased else fmt.unpack(b, bp)
        d8 = _dup8(b, blk.d)
        # the mins: per pair of sub-blocks (2p, 2p + 1) a <8 x f32> over (sub-block, row) times
        # dm, so a token's min terms are 4 FMAs on its per-32 sums (per sub-block products of
        # the per-16 lanes measured a quarter of a Q4_K_R4 token)
        mins = None
        if blk.dm is not None:
            dm8 = _dup8(b, blk.dm)
            mins = [b.fmul(b.uitofp(b.zext(b.shuffle_vector(blk.mins, blk.mins, _cv(range(8 * q, 8 * q + 8))), _V8I),
                                    _V8F), dm8, flags=["fast"]) for q in range(4)]
        with cgutils.for_range(b, ntok) as tl:
            qp, sp, i16p, b16p = act.row(b, tl.index)
            _block_dot4(b, blk, mins, ib, qp, sp, i16p, b16p, d8, b.gep(accs, [zero32, tl.index]),
                        b.gep(maccs, [zero32, tl.index]), vnni, avx2)
    with cgutils.for_range(b, ntok) as tl:
        acc = b.load(b.gep(accs, [zero32, tl.index]))
        if _blk._width(vnni) == 2:      # the two sub-blocks' lanes of the 512-bit sums
            acc = b.fadd(b.shuffle_vector(acc, acc, _cv(range(8))), b.shuffle_vector(acc, acc, _cv(range(8, 16))),
                         flags=["fast"])
        r8 = b.fadd(acc, b.load(b.gep(maccs, [zero32, tl.index])), flags=["fast"])
        lo = b.shuffle_vector(r8, r8, ir.Constant(_vec(_I32, 4), [0, 1, 2, 3]))
        hi = b.shuffle_vector(r8, r8, ir.Constant(_vec(_I32, 4), [4, 5, 6, 7]))
        r = b.fadd(lo, hi, flags=["fast"])
        if fmt.row_scale == "f32":
            r = b.fmul(r, _ld(b, grp, 0, 4, _F32))
        b.store(r, b.gep(res, [zero32, tl.index]))
    return res


def _avx2_mode(fmt: R4Dot) -> _blk.Avx2Mode | None:
    """quant.simd_blocks.avx2_mode for the _R4 type (its plain type's off and lmax); None without
    AVX2.  k runs' int16 pair sums are added before their vpmaddwd."""
    if not HAS_AVX2:
        return None
    mode = _blk.avx2_mode(fmt.off, fmt.lmax, fmt.biased)
    assert fmt.biased or mode.mode == "direct", f"{fmt.name}: signed levels need a biased unpack"
    return mode


def _avx2_runs(b: ir.IRBuilder, pairs: list, mode: str, k: int):
    """<8 x i32> lane sums of the runs' products (pairs: (u, shuffled activations), 32 bytes
    each) with AVX2: `mode` and k as _avx2_mode."""
    total = None
    for g in range(0, len(pairs), k):
        p16 = None
        for u, a in pairs[g:g + k]:
            x = unsigned_pairs(b, u, a) if mode == "direct" else signed_pairs(b, u, a)
            p16 = x if p16 is None else b.add(p16, x)
        q = _quads(b, p16)
        total = q if total is None else b.add(total, q)
    return total


def _block_dot4(b: ir.IRBuilder, blk: R4Block, mins, ib, qp, sp, i16p, b16p, d8, accp, maccp, vnni: bool,
                avx2: _blk.Avx2Mode | None = None):
    """acc (lanes (h, k); with VNNI (sub-block parity, h, k)) += the unpacked block column ib
    times one activation row; macc += the
    min terms (mins: the min weights per sub-block pair, lanes (sub-block parity, k)).  The level
    offsets are taken off in the integer sums (i16p: the row's int per-16 sums; b16p: the same
    times their scales, f32).  avx2: _avx2_mode's choice for the generic form on an AVX2 CPU (the unpack took its bias)."""
    terms, oterms = [], []
    # the block's 16 activation sums in one load (per sub-block inserts measured slower)
    i16 = b.load(b.bitcast(b.gep(i16p, [b.mul(ib, _const_i64(16))]), _vec(_I32, 16).as_pointer()), align=4)
    w = _blk._width(vnni)
    for j in range(0, len(blk.subs), w):
        subs = blk.subs[j:j + w]
        k = b.add(b.mul(ib, _const_i64(8)), _const_i64(j))
        a = b.load(b.bitcast(b.gep(qp, [b.mul(k, _const_i64(32))]), _vec(_I8, 32 * w).as_pointer()), align=1)
        sv = b.load(b.bitcast(b.gep(sp, [k]), _vec(_F32, w).as_pointer()), align=4)
        sa = b.shuffle_vector(sv, sv, _cv([p for p in range(w) for _ in range(8)]))
        for r, (_, ao) in enumerate(subs[0].runs):
            assert all(sub.runs[r][1] == ao for sub in subs), "a run's activation offsets differ between sub-blocks"
        if all(isinstance(sub.off, int) and sub.off == 0 for sub in subs):
            isum = _c(0, 8 * w, _I32)
        else:
            off = _join(b, [_c(sub.off, 8, _I32) if isinstance(sub.off, int) else sub.off for sub in subs])
            isum = b.neg(b.mul(off, b.shuffle_vector(i16, i16, _cv([2 * j + q for q in range(2 * w) for _ in range(4)]))))
        if avx2:
            isum = b.add(isum, _avx2_runs(b, [(sub.runs[r][0], _act_shuffle(b, a, ao)) for r, (_, ao) in
                                              enumerate(subs[0].runs) for sub in subs], avx2.mode, avx2.k))
        else:
            for r, (_, ao) in enumerate(subs[0].runs):
                isum = dpbusd(b, isum, _join(b, [sub.runs[r][0] for sub in subs]), _act_shuffle(b, a, ao), vnni)
        terms.append(b.fmul(b.sitofp(b.mul(isum, _join(b, [sub.scale for sub in subs])), _vec(_F32, 8 * w)), sa,
                            flags=["fast"]))
    d = _join(b, [d8] * w)
    b.store(b.fadd(b.load(accp), b.fmul(tree_sum(b, terms), d, flags=["fast"]), flags=["fast"]), accp)
    if mins is not None:
        s16 = b.load(b.bitcast(b.gep(b16p, [b.mul(ib, _const_i64(16))]), _vec(_F32, 16).as_pointer()), align=4)
        a32 = b.fadd(b.shuffle_vector(s16, s16, _cv(range(0, 16, 2))), b.shuffle_vector(s16, s16, _cv(range(1, 16, 2))),
                     flags=["fast"])
        for q in range(4):
            oterms.append(b.fmul(mins[q], b.shuffle_vector(a32, a32, _cv([2 * q] * 4 + [2 * q + 1] * 4)),
                                 flags=["fast"]))
    if oterms:
        b.store(b.fadd(b.load(maccp), tree_sum(b, oterms), flags=["fast"]), maccp)


def _group_dot_intrinsic(vnni: bool):
    """group_dot(qtype, buf, gbase, gstride, n, q, s, bs, b16, cols, k0, ntok, out, r0) -> bool:
    out[k0 + t, r0 + 4 i + k] = row k of the 4-row group at byte gbase + i gstride dotted with
    activation row k0 + t, i < n, for the types of R4_DOTS (quant.simd_blocks.dot_intrinsic)."""
    return dot_intrinsic(R4_DOTS, _emit_group, 4, vnni, "r4")


group_dot_generic = _group_dot_intrinsic(False)
group_dot_vnni = _group_dot_intrinsic(True) if HAS_VNNI else None
group_dot = group_dot_vnni if HAS_VNNI else group_dot_generic
