"""Integer row dots for the block types beyond Q8_0 / Q4_0: K-quants, IQ4_XS, the IQK types and
the other legacy 32-value types, written in LLVM IR like quant.simd.

One template, one record per type.  Every type's block is read as

    d, and per 32-value sub-block j: 32 unsigned levels u (true level + OFF), an integer scale
    (one per 32 values, or two: one per 16), and optionally an integer min with its own f32 dm

so that the block's dot with activation sub-blocks (a_j int8, f32 scale s_j, int sums) is

    d * sum_j s_j * sum_16-halves h  sc_h * (sum_{k in h} u_k a_k - OFF * asum_h)
      + dm * sum_j s_j * sum_h min_h * asum_h

The inner sum is one vpdpbusd (AVX512-VNNI: unsigned bytes times signed bytes, 4 products per
int32 lane; per sub-block, lanes 0..3 hold values 0..15, lanes 4..7 values 16..31; with VNNI two
sub-blocks share one 512-bit vpdpbusd), the OFF correction taken off through the activation
sums, or in the generic IR (256-bit, one sub-block) the signed products summed in pairs twice
(LLVM selects vpmaddwd).  One unpack-and-add tree gathers the lanes of 4 vectors into one per
16-value half (_quad_sum), whose f32 scales are applied once per 4 vectors.  A type's record (`BlockDot`) only says how its bytes become (d, u, scales,
mins): the unpack functions below.  Non-linear level tables (IQ4_NL / IQ4_XS / IQK) are
in-register lookups: vpshufb on 16-entry tables (two per 32 lanes, one per 16-value half so
the per-16 "extra" bit can pick the shifted table), selects for 32 / 64-entry tables.

Activations are quant.kernels.quantize_act_q8's blocks of 32 (int8, f32 scale, int32 sum) plus
the int32 sum of every 16 values (block_sums16), shared with the Q8_0 / Q4_0 kernels: one
quantization per matmul whatever the weight types.

`row_dot(qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, ntok, out, r)` is one intrinsic
that switches on the type id (the switch is generated from BLOCK_DOTS) and runs that type's loop
over n rows
for up to TMAX activation rows at once: each weight block is unpacked once for all of them
(prompts and the experts' pairs: the unpacking is paid once per TMAX tokens).  IQ6_K uses the
integer levels ik's matmul kernels use (quant.iqk.IQ6K_INT_LEVELS).  IQ4_KSS has no record
here (rows are decoded to f32 by quant.kernels).

Development note (as quant.simd): after editing this module delete quant/__pycache__/*.nb*.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import iqk as _iqk
from . import iquants as _iq
from . import ktquants as _kt
from .legacy import KVALUES_MXFP4 as _KV_MXFP4
from .simd import _unpack_q4_0 as _simd_unpack_q4_0, _unpack_q8_0 as _simd_unpack_q8_0
from .typetag import group_of
from .simd import (HAS_AVX2, HAS_VNNI, PREFETCH_BYTES, cpu_features, prefetch, signed_quads, stack_scope, _F32, _I8, _I16,
                   _I32, _I64, _vec, _const_i64, _halves, _quads, _splat, dpbusd, unsigned_pairs)
_V64 = _vec(_I8, 64)
_V32 = _vec(_I8, 32)
_V16 = _vec(_I8, 16)


# ----------------------------------------------------------------------------------------
# small IR helpers
# ----------------------------------------------------------------------------------------
def _c(v: int, n: int = 32, t: ir.Type = _I8) -> ir.Constant:
    return ir.Constant(_vec(t, n), [v] * n)


def _gep(b: ir.IRBuilder, p, off):
    return b.gep(p, [off if isinstance(off, ir.Value) else _const_i64(off)])


def _ld(b: ir.IRBuilder, p, off, n: int = 32, t: ir.Type = _I8):
    return b.load(b.bitcast(_gep(b, p, off), _vec(t, n).as_pointer()), align=1)


def _u16(b: ir.IRBuilder, p, off):
    return b.zext(b.load(b.bitcast(_gep(b, p, off), _I16.as_pointer()), align=1), _I32)


def _f16(b: ir.IRBuilder, p, off):
    h = b.load(b.bitcast(_gep(b, p, off), _I16.as_pointer()), align=1)
    return b.fpext(b.bitcast(h, ir.HalfType()), _F32)


def _f32(b: ir.IRBuilder, p, off):
    return b.load(b.bitcast(_gep(b, p, off), _F32.as_pointer()), align=1)


def _bits(b: ir.IRBuilder, v, shift: int, mask: int):
    """(v >> shift) & mask for an i32 scalar."""
    if shift:
        v = b.lshr(v, ir.Constant(_I32, shift))
    return b.and_(v, ir.Constant(_I32, mask))


def _vshr(b: ir.IRBuilder, v, shift: int, mask: int, n: int = 32):
    """Per byte (v >> shift) & mask."""
    if shift:
        v = b.lshr(v, _c(shift, n))
    return b.and_(v, _c(mask, n)) if mask != 255 else v


def _bit_to(b: ir.IRBuilder, v, src: int, dst: int):
    """Bit src of every byte of v moved to bit dst (other bits cleared): one shift and one mask
    (x86 has no byte shifts: each one is a word shift plus a mask)."""
    if dst > src:
        v = b.shl(v, _c(dst - src))
    elif src > dst:
        v = b.lshr(v, _c(src - dst))
    return b.and_(v, _c(1 << dst))


def _cat(b: ir.IRBuilder, lo, hi):
    """Two vectors of n lanes -> one of 2n (lo first)."""
    n = 2 * lo.type.count
    return b.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, n), list(range(n))))


def _nib32(b: ir.IRBuilder, p, off):
    """16 bytes at p + off -> 32 levels: low nibbles (values 0..15), then high (16..31)."""
    v = _ld(b, p, off, 16)
    return _cat(b, _vshr(b, v, 0, 15, 16), _vshr(b, v, 4, 15, 16))


def _nib32_pairs(b: ir.IRBuilder, p, off, n: int) -> list:
    """_nib32 of the n consecutive 16-byte groups at p + off, two per 32-byte load: both nibble
    planes of a pair come from one and / shift / and, then each group's levels are one 128-bit
    lane permute (vperm2i128) instead of two half-width splits and an insert per group."""
    out = []
    for k in range(0, n, 2):
        v = _ld(b, p, off + 16 * k)
        lo, hi = _vshr(b, v, 0, 15), _vshr(b, v, 4, 15)
        out.append(b.shuffle_vector(lo, hi, _cv(list(range(16)) + list(range(32, 48)))))
        out.append(b.shuffle_vector(lo, hi, _cv(list(range(16, 32)) + list(range(48, 64)))))
    return out


def _nib64(b: ir.IRBuilder, p, off, group: int) -> list:
    """The 64 bytes at p + off as two vectors of 64 levels (BlockDot.wide): their low and high
    nibble planes (one and, one shift, one and), then per vector the planes' groups of `group`
    bytes interleaved, low first (one two-source permute).  group 32 (Q4_K / Q5_K: low nibbles
    one sub-block, high the next): sub-blocks 0, 1 and 2, 3 of the four the bytes hold (the
    16-byte groups of IQ4_XS / IQ4_K skip the permute: BlockDot.planes)."""
    v = _ld(b, p, off, 64)
    lo, hi = _vshr(b, v, 0, 15, 64), _vshr(b, v, 4, 15, 64)
    per = 32 // group                      # groups of each plane in one vector
    return [b.shuffle_vector(lo, hi, _cv([base + group * g + i for g in range(o * per, (o + 1) * per)
                                          for base in (0, 64) for i in range(group)]))
            for o in range(2)]


def _nibbles16(b: ir.IRBuilder, p, off: int, wide: bool) -> list:
    """The 128 bytes at p + off as 8 sub-blocks' levels (16 bytes each, low nibbles values 0..15):
    eight vectors of 32, or with `wide` the four nibble planes of 64 as they lie (BlockDot.planes:
    the first halves of sub-blocks 0..3, their second halves, the same of 4..7)."""
    if not wide:
        return _nib32_pairs(b, p, off, 8)
    out = []
    for o in (off, off + 64):
        v = _ld(b, p, o, 64)
        out += [_vshr(b, v, 0, 15, 64), _vshr(b, v, 4, 15, 64)]
    return out


def _halves_shr(b: ir.IRBuilder, v, k0: int, k1: int, mask: int):
    """32 bytes v twice as 64 (BlockDot.wide): the first copy's bytes >> k0, the second's >> k1,
    each & mask (16-bit lane shifts, vpsrlvw: x86 has no byte shifts; the mask drops the bits
    a byte takes from its neighbour)."""
    w = b.bitcast(_cat(b, v, v), _vec(_I16, 32))
    if k0 or k1:
        w = b.lshr(w, _cv([k0] * 16 + [k1] * 16, _I16))
    return b.and_(b.bitcast(w, _V64), _c(mask, 64))


def _bit_bytes(b: ir.IRBuilder, p, off, val: int):
    """Bit i of the 4 bytes at p + off (little-endian: byte i // 8, bit i % 8) as `val` or 0 in
    byte lane i of 32: each byte repeated 8 times (one byte shuffle), tested against its lane's
    bit.  Broadcasting the word to 32 i32 lanes, shifting, masking and narrowing cost ~8 instructions a
    block, this ~3 (vpshufb, vptestmb, a masked move): bench_row_dots.py, 2048 x 4096, one
    token, one thread, Q5_0 ~305 -> ~215 us."""
    v = _ld(b, p, off, 4)
    rep = b.shuffle_vector(v, v, _cv([i // 8 for i in range(32)]))
    hit = b.icmp_unsigned("!=", b.and_(rep, ir.Constant(_V32, [1 << (i % 8) for i in range(32)])), _c(0))
    return b.select(hit, _c(val), _c(0))


def _tab16(table: np.ndarray, off: int) -> ir.Constant:
    """A level table (<= 16 entries) plus OFF as 16 unsigned bytes."""
    t = [(int(v) + off) & 255 for v in table] + [0] * (16 - len(table))
    return ir.Constant(_V16, t)


def _lookup(b: ir.IRBuilder, tab32, idx):
    """Byte lane i of the result = tab32[16 * (i // 16) + idx[i]], idx in 0..15 (32 lanes, or 64
    with a 64-byte table): vpshufb on AVX2 / AVX-512; elsewhere a compare/select per table entry."""
    if idx.type.count == 64:        # two sub-blocks (BlockDot.wide: AVX-512 only)
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V64, [_V64, _V64]), "llvm.x86.avx512.pshuf.b.512")
        return b.call(fn, [tab32, idx])
    if HAS_AVX2:
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V32, [_V32, _V32]), "llvm.x86.avx2.pshuf.b")
        return b.call(fn, [tab32, idx])
    res = ir.Constant(_V32, [0] * 32)
    for e in range(16):
        cand = b.shuffle_vector(tab32, tab32, ir.Constant(_vec(_I32, 32), [e] * 16 + [16 + e] * 16))
        res = b.select(b.icmp_unsigned("==", idx, _c(e)), cand, res)
    return res


# ----------------------------------------------------------------------------------------
# the record
# ----------------------------------------------------------------------------------------
@dataclass
class Block:
    """What unpack gives for one block of nsub 32-value sub-blocks: d (f32); us = nsub vectors of
    32 unsigned levels (true level + off); per 16-value half h (2 * nsub lanes, i32 vectors):
    sc (the integer scales; types with one scale per 32 repeat it), off (an int for all, or a
    vector: IQK extra bits), and optionally mins with their f32 dm (value = d sc (u - off) +
    dm min)."""
    d: object
    us: list
    sc: object
    off: object = 0
    dm: object = None
    mins: object = None
    planes: bool = False     # us in BlockDot.planes order (the wide unpack of a planes record)


@dataclass(frozen=True)
class BlockDot:
    """One type's integer row dot: block size in values and bytes, the level offset OFF of its
    unsigned levels (the int in Block.off, or for information where it varies), the row scale
    stored before the blocks ("f32", "f16" or ""), and unpack (builder, block pointer) -> Block."""
    name: str
    values: int
    nbytes: int
    off: int
    unpack: Callable
    row_scale: str = ""
    tail: "BlockDot | None" = None     # for the rest of a row that is not whole blocks of this
    # both 16-value halves of every 32 values share d * scale and the activation-sum weight (one
    # scale per 32): quant.simd_gemm then converts once per 32 values instead of per 16
    scale32: bool = False
    # ik_llama.cpp's prompt GEMM multiplies it with Q8_K activations (one scale per 256 values;
    # per 32 for Q4_K / Q5_K / Q6_K, the 32-value types and the trellis ones): ikcli's GEMM
    # quantizes them so too (quant.matmul) and applies the activation scale once per 256; its
    # _R4 form (quant.simd_r4) takes the same activations (quant.registry)
    act256: bool = False
    # unpack(b, p, wide=True) gives the levels two sub-blocks to a vector (64 bytes: AVX-512),
    # which the VNNI row dots take as they are (else they join the 32-byte ones in pairs)
    wide: bool = False
    # with wide, unpack gives each 64 bytes' two nibble planes as they lie: one vector the first
    # 16-value halves of four sub-blocks, the next their second halves, and the VNNI row dot
    # reads activations stored in that order (PLANES_ORDER; quant.kernels.row_dot_act), instead
    # of a two-source permute per vector putting the levels in value order (bench_row_dots.py,
    # 2048 x 4096, one token, one thread: IQ4_XS 131 -> 115 us, IQ4_K 139 -> 121, IQ4_KS 111 -> 92)
    planes: bool = False
    # the row dots' unpack where it differs from the packing's (quant.simd_gemm): None for unpack
    dot_unpack: "Callable | None" = None
    # a bound on |level| (the level without OFF; for OFF 0, the stored level): quant.simd_gemm's
    # AVX2 GEMM adds more int16 products before widening when it is small (SMALL_LEVEL); a test
    # checks it against the packed levels of random blocks
    lmax: int = 128
    # unpack(b, p, bias=...) stores the levels plus any bias in 0..128 instead of OFF (lookup-table
    # types: the tables are constants either way), for avx2_mode
    biased: bool = False

    @property
    def meta(self) -> int:
        return {"": 0, "f16": 2, "f32": 4}[self.row_scale]


# ----------------------------------------------------------------------------------------
# lane-vector helpers for the per-half fields (computed once per block, not per sub-block:
# per sub-block scalar work measured up to a third of a Q6_K row dot)
# ----------------------------------------------------------------------------------------
def _u32(b: ir.IRBuilder, p, off):
    return b.load(b.bitcast(_gep(b, p, off), _I32.as_pointer()), align=1)


def _cv(vals, t: ir.Type = _I32) -> ir.Constant:
    return ir.Constant(_vec(t, len(vals)), list(vals))


def _bytes32(b: ir.IRBuilder, p, off: int, n: int, signed: bool = False):
    """n bytes at p + off as <n x i32>."""
    v = _ld(b, p, off, n)
    return b.sext(v, _vec(_I32, n)) if signed else b.zext(v, _vec(_I32, n))


def _gather(b: ir.IRBuilder, v, idx):
    """Lanes idx of vector v (a constant shuffle)."""
    return b.shuffle_vector(v, v, ir.Constant(_vec(_I32, len(idx)), list(idx)))


def _field(b: ir.IRBuilder, v, idx, shifts, mask: int):
    """Per lane i: (v[idx[i]] >> shifts[i]) & mask  (i32 lanes)."""
    g = _gather(b, v, idx)
    if any(shifts):
        g = b.lshr(g, _cv(shifts))
    return b.and_(g, _cv([mask] * len(idx)))


def _splat32(b: ir.IRBuilder, v, n: int):
    return _splat(b, v, _I32, n)


def _pairs(b: ir.IRBuilder, v8):
    """Per-32 lanes <8 x i32> -> per-16 <16 x i32> (each repeated)."""
    return _gather(b, v8, [j // 2 for j in range(16)])


def _bits16(b: ir.IRBuilder, word, first: int = 0, n: int = 16):
    """Bits first .. first + n - 1 of the i32 word as n lanes (0 / 1)."""
    return b.and_(b.lshr(_splat32(b, word, n), _cv(range(first, first + n))), _cv([1] * n))


# ----------------------------------------------------------------------------------------
# unpackers: K-quants and IQ4_XS (layouts: quant.kquants)
# ----------------------------------------------------------------------------------------
def _k4_scales_mins(b: ir.IRBuilder, p):
    """Q4_K / Q5_K: the 12 scale bytes at p + 4 -> (scales, mins) as per-16 lanes, the six-bit
    fields put together four at a time in 32-bit words (as ggml's scalar code does: the same
    with i32 lane gathers measured ~40 % of a Q4_K row dot)."""
    u0, u1, u2 = (_u32(b, p, o) for o in (4, 8, 12))
    k = lambda v: ir.Constant(_I32, v)   # noqa: E731
    lo6, lo4, lo2 = k(0x3F3F3F3F), k(0x0F0F0F0F), k(0x03030303)
    sc_hi = b.or_(b.and_(u2, lo4), b.shl(b.and_(b.lshr(u0, k(6)), lo2), k(4)))
    mn_hi = b.or_(b.and_(b.lshr(u2, k(4)), lo4), b.shl(b.and_(b.lshr(u1, k(6)), lo2), k(4)))

    def lanes(lo, hi):
        v = b.insert_element(b.insert_element(ir.Constant(_vec(_I32, 2), None), lo, k(0)), hi, k(1))
        return _pairs(b, b.zext(b.bitcast(v, _vec(_I8, 8)), _vec(_I32, 8)))
    return lanes(b.and_(u0, lo6), sc_hi), lanes(b.and_(u1, lo6), mn_hi)


def _unpack_q4_k(b: ir.IRBuilder, p, wide: bool = False) -> Block:
    sc, mn = _k4_scales_mins(b, p)
    if wide:
        us = _nib64(b, p, 16, 32) + _nib64(b, p, 80, 32)
    else:
        us = [_vshr(b, _ld(b, p, 16 + 32 * (s >> 1)), 4 * (s & 1), 15) for s in range(8)]
    return Block(_f16(b, p, 0), us, sc, 0, b.fneg(_f16(b, p, 2)), mn)


def _unpack_q5_k(b: ir.IRBuilder, p, wide: bool = False) -> Block:
    sc, mn = _k4_scales_mins(b, p)
    qh = _ld(b, p, 16)
    if wide:
        us = [b.or_(nib, b.shl(_halves_shr(b, qh, s, s + 1, 1), _c(4, 64)))
              for s, nib in zip(range(0, 8, 2), _nib64(b, p, 48, 32) + _nib64(b, p, 112, 32))]
    else:
        us = [b.or_(_vshr(b, _ld(b, p, 48 + 32 * (s >> 1)), 4 * (s & 1), 15), _bit_to(b, qh, s, 4))
              for s in range(8)]
    return Block(_f16(b, p, 0), us, sc, 0, b.fneg(_f16(b, p, 2)), mn)


def _unpack_q6_k(b: ir.IRBuilder, p, wide: bool = False) -> Block:
    us = []
    if wide:
        for n in range(2):      # ql: 64 bytes, low nibbles sub-blocks 4n, 4n + 1, high 4n + 2, 4n + 3
            ql, qh = _ld(b, p, 64 * n, 64), _ld(b, p, 128 + 32 * n)
            for half in range(2):
                hi = _halves_shr(b, qh, 4 * half, 4 * half + 2, 3)
                us.append(b.or_(_vshr(b, ql, 4 * half, 15, 64), b.shl(hi, _c(4, 64))))
        return Block(_f16(b, p, 208), us, _bytes32(b, p, 192, 16, signed=True), 32)
    for j in range(8):
        n, quarter = j >> 2, j & 3
        lo = _vshr(b, _ld(b, p, 64 * n + 32 * (quarter & 1)), 4 * (quarter >> 1), 15)
        hi = _vshr(b, _ld(b, p, 128 + 32 * n), 2 * quarter, 3)
        us.append(b.or_(lo, b.shl(hi, _c(4))))
    return Block(_f16(b, p, 208), us, _bytes32(b, p, 192, 16, signed=True), 32)


def _unpack_q3_k(b: ir.IRBuilder, p) -> Block:
    hm = _ld(b, p, 0)
    us = [b.or_(_vshr(b, _ld(b, p, 32 + 32 * (j >> 2)), 2 * (j & 3), 3), _bit_to(b, hm, j, 2))
          for j in range(8)]
    lo = _field(b, _bytes32(b, p, 96, 8), [s & 7 for s in range(16)], [4 * (s >> 3) for s in range(16)], 15)
    hi = _field(b, _bytes32(b, p, 104, 4), [s & 3 for s in range(16)], [2 * (s >> 2) for s in range(16)], 3)
    sc = b.sub(b.or_(lo, b.shl(hi, _cv([4] * 16))), _cv([32] * 16))
    return Block(_f16(b, p, 108), us, sc, 4)


def _unpack_q2_k(b: ir.IRBuilder, p) -> Block:
    us = [_vshr(b, _ld(b, p, 16 + 32 * (j >> 2)), 2 * (j & 3), 3) for j in range(8)]
    B = _bytes32(b, p, 0, 16)
    return Block(_f16(b, p, 80), us, b.and_(B, _cv([15] * 16)), 0, b.fneg(_f16(b, p, 82)),
                 b.lshr(B, _cv([4] * 16)))


_T_IQ4NL = _tab16(_iqk.IQ4K[:16], 128)   # kvalues_iq4nl: IQ4_K's first table


def _unpack_iq4_xs(b: ir.IRBuilder, p, wide: bool = False, bias: int = 128) -> Block:
    us = [_lookup_pieces(b, ([_T_IQ4NL], 0), nib, bias=bias) for nib in _nibbles16(b, p, 8, wide)]
    lo = _field(b, _bytes32(b, p, 4, 4), [ib >> 1 for ib in range(8)], [4 * (ib & 1) for ib in range(8)], 15)
    hi = b.and_(b.lshr(_splat32(b, _u16(b, p, 2), 8), _cv([2 * ib for ib in range(8)])), _cv([3] * 8))
    sc = b.sub(b.or_(lo, b.shl(hi, _cv([4] * 8))), _cv([32] * 8))
    return Block(_f16(b, p, 0), us, _pairs(b, sc), bias, planes=wide)


# ----------------------------------------------------------------------------------------
# unpackers: IQK (layouts: quant.iqk)
# ----------------------------------------------------------------------------------------
def _tables(levels: np.ndarray, n: int) -> tuple[list, int]:
    """The first level table (n entries) cut into 16-entry pieces (+128), and the shift of the
    second table: every IQK type's "extra" table is the first plus a constant, so an extra bit
    only moves the level offset of its half (Block.off) and the lookup tables stay constants
    (picking tables per sub-block with selects measured 3.2-3.7x slower: IQ4_K 2.07 vs 0.64 ms,
    IQ2_K 1.99 vs 0.54, 4096^2, one token, 2 threads)."""
    lv = np.asarray(levels).astype(np.int64)
    shift = {int(v) for v in lv[n:2 * n] - lv[:n]}
    assert len(shift) == 1, "the second table is not a shifted copy of the first"
    return [_tab16(lv[16 * k:16 * k + min(16, n)], 128) for k in range(max(1, n // 16))], shift.pop()


_T_IQ2 = _tables(_iqk.IQ2NL, 4)
_T_IQ3 = _tables(_iqk.IQ3NL, 8)
_T_IQ4K = _tables(_iqk.IQ4K, 16)
_T_IQ5 = _tables(_iqk.IQ5NL, 32)
_T_IQ6 = _tables(_iqk.IQ6K_INT_LEVELS, 64)


def rebias(piece: ir.Constant, bias: int) -> ir.Constant:
    """A 16-entry table piece (levels + 128) holding levels + bias instead.  A bias in 1..127 is
    avx2_mode's "direct": the levels must then land in 0..127 (-128: _tab16's padding)."""
    if bias == 128:
        return piece
    lv = [int(v.constant) - 128 for v in piece.constant]
    assert bias == 0 or all(0 <= v + bias <= 127 for v in lv if v != -128), "biased levels leave 0..127"
    return ir.Constant(piece.type, [(v + bias) & 255 for v in lv])


def _lookup_pieces(b: ir.IRBuilder, T, idx, hi=None, bias: int = 128):
    """Levels (+bias) of the first table for 32 (or 64: BlockDot.wide) lanes: idx (0..15) into
    piece `hi` (per-lane 0..3, or None: piece 0)."""
    res, n = None, idx.type.count
    for k, piece in enumerate(T[0]):
        tab = rebias(piece, bias)
        while tab.type.count < n:
            tab = _cat(b, tab, tab)
        r = _lookup(b, tab, idx)
        res = r if res is None else b.select(b.icmp_unsigned("==", hi, _c(k, n)), r, res)
    return res


def _extra_offs(b: ir.IRBuilder, T, bits, bias: int = 128):
    """Level offsets bias - shift * extra bit, per lane."""
    n = bits.type.count      # bits are 0 / 1: -bits & shift, no vector multiply
    return b.sub(_cv([bias] * n), b.and_(b.sub(_cv([0] * n), bits), _cv([T[1]] * n)))


_NIB16 = ([g >> 1 for g in range(16)], [4 * (g & 1) for g in range(16)])   # nibble g of 8 bytes


def _unpack_iq2_k(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    us = [_lookup_pieces(b, _T_IQ2, _vshr(b, _ld(b, p, 12 + 32 * (j >> 2)), 2 * (j & 3), 3), bias=bias) for j in range(8)]
    sc = b.sub(_field(b, _bytes32(b, p, 4, 8), *_NIB16, 15), _cv([8] * 16))
    return Block(_f16(b, p, 0), us, sc, _extra_offs(b, _T_IQ2, _bits16(b, _u16(b, p, 2)), bias))


def _unpack_iq3_k(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    qh = _ld(b, p, 78)
    us = []
    for j in range(8):
        idx = b.or_(_vshr(b, _ld(b, p, 14 + 32 * (j >> 2)), 2 * (j & 3), 3), _bit_to(b, qh, j, 2))
        us.append(_lookup_pieces(b, _T_IQ3, idx, bias=bias))
    v = b.add(b.shl(_field(b, _bytes32(b, p, 6, 8), *_NIB16, 15), _cv([1] * 16)), _cv([1] * 16))
    sign = _bits16(b, _u16(b, p, 4))
    sc = b.sub(v, b.mul(b.shl(sign, _cv([1] * 16)), v))           # v * (1 - 2 sign)
    return Block(_f16(b, p, 0), us, sc, _extra_offs(b, _T_IQ3, _bits16(b, _u16(b, p, 2)), bias))


def _ls6_16(b: ir.IRBuilder, p):
    """IQ4_K / IQ5_K: the 16 six-bit scales (nibbles of scales_l at 8 | crumbs of scales_h at 4),
    minus 32."""
    lo = _field(b, _bytes32(b, p, 8, 8), *_NIB16, 15)
    hi = _field(b, _bytes32(b, p, 4, 4), [g >> 2 for g in range(16)], [2 * (g & 3) for g in range(16)], 3)
    return b.sub(b.or_(lo, b.shl(hi, _cv([4] * 16))), _cv([32] * 16))


def _unpack_iq4_k(b: ir.IRBuilder, p, wide: bool = False, bias: int = 128) -> Block:
    us = [_lookup_pieces(b, _T_IQ4K, nib, bias=bias) for nib in _nibbles16(b, p, 16, wide)]
    return Block(_f16(b, p, 0), us, _ls6_16(b, p), _extra_offs(b, _T_IQ4K, _bits16(b, _u16(b, p, 2)), bias), planes=wide)


def _unpack_iq5_k(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    qh = _ld(b, p, 144)
    us = [_lookup_pieces(b, _T_IQ5, _vshr(b, _ld(b, p, 16 + 32 * (j >> 1)), 4 * (j & 1), 15), _vshr(b, qh, j, 1), bias)
          for j in range(8)]
    return Block(_f16(b, p, 0), us, _ls6_16(b, p), _extra_offs(b, _T_IQ5, _bits16(b, _u16(b, p, 2)), bias))


def _unpack_iq6_k(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    us = []
    for j in range(8):
        nib = _vshr(b, _ld(b, p, 20 + 32 * (j >> 1)), 4 * (j & 1), 15)
        hi = _vshr(b, _ld(b, p, 148 + 32 * (j >> 2)), 2 * (j & 3), 3)
        us.append(_lookup_pieces(b, _T_IQ6, nib, hi, bias))
    return Block(_f16(b, p, 0), us, _bytes32(b, p, 4, 16, signed=True),
                 _extra_offs(b, _T_IQ6, _bits16(b, _u16(b, p, 2)), bias))


def _unpack_iq4_ks(b: ir.IRBuilder, p, wide: bool = False, bias: int = 128) -> Block:
    us = [_lookup_pieces(b, _T_IQ4K, nib, bias=bias) for nib in _nibbles16(b, p, 8, wide)]
    B = _bytes32(b, p, 0, 8)
    sc = b.sub(b.and_(B, _cv([254] * 8)), _cv([127] * 8))
    return Block(ir.Constant(_F32, 1.0), us, _pairs(b, sc), _pairs(b, _extra_offs(b, _T_IQ4K, b.and_(B, _cv([1] * 8)), bias)),
                 planes=wide)


def _unpack_iq2_ks(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    us = [_lookup_pieces(b, _T_IQ2, _vshr(b, _ld(b, p, 6 + 32 * (g // 4)), 2 * (g % 4), 3), bias=bias) for g in range(8)]
    extra = _u16(b, p, 0)
    lo = _field(b, _bytes32(b, p, 2, 4), [g >> 1 for g in range(8)], [4 * (g & 1) for g in range(8)], 15)
    sc = b.sub(b.or_(lo, b.shl(_bits16(b, extra, 8, 8), _cv([4] * 8))), _cv([16] * 8))
    return Block(ir.Constant(_F32, 1.0), us, _pairs(b, sc), _pairs(b, _extra_offs(b, _T_IQ2, _bits16(b, extra, 0, 8), bias)))


def _unpack_iq3_ks(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    qh = _ld(b, p, 70)
    us = [_lookup_pieces(b, _T_IQ3, b.or_(_vshr(b, _ld(b, p, 6 + 32 * (g >> 2)), 2 * (g & 3), 3), _bit_to(b, qh, g, 2)), bias=bias)
          for g in range(8)]
    extra = _u16(b, p, 0)
    lo = _field(b, _bytes32(b, p, 2, 4), [g & 3 for g in range(8)], [4 * (g >> 2) for g in range(8)], 15)
    sc = b.sub(b.or_(lo, b.shl(_bits16(b, extra, 0, 8), _cv([4] * 8))), _cv([16] * 8))
    return Block(ir.Constant(_F32, 1.0), us, _pairs(b, sc), _pairs(b, _extra_offs(b, _T_IQ3, _bits16(b, extra, 8, 8), bias)))


def _unpack_iq5_ks(b: ir.IRBuilder, p, bias: int = 128) -> Block:
    qh = _ld(b, p, 136)
    us = [_lookup_pieces(b, _T_IQ5, _vshr(b, _ld(b, p, 8 + 32 * (g >> 1)), 4 * (g & 1), 15), _vshr(b, qh, g, 1), bias)
          for g in range(8)]
    B = _bytes32(b, p, 0, 8)
    sc = b.sub(b.and_(B, _cv([254] * 8)), _cv([127] * 8))
    return Block(ir.Constant(_F32, 1.0), us, _pairs(b, sc), _pairs(b, _extra_offs(b, _T_IQ5, b.and_(B, _cv([1] * 8)), bias)))


# IQ2_KL: a 5-bit index per pair of values; per 16-entry piece k of the pair table, bytes 0..15 hold
# the first levels (+128) and 16..31 the second, so one lookup gives both halves of 16 pairs
_KLP = _iqk.IQ2KL_PAIRS.astype(np.int64)
_T_IQ2KL = [ir.Constant(_V32, [(int(v) + 128) & 255 for v in np.concatenate([_KLP[16 * k:16 * k + 16, 0],
                                                                              _KLP[16 * k:16 * k + 16, 1]])])
            for k in range(2)]
_KL_INTERLEAVE = [(i >> 1) + 16 * (i & 1) for i in range(32)]


def _unpack_iq2_kl(b: ir.IRBuilder, p) -> Block:
    qh = _ld(b, p, 70, 16)
    us = []
    for g in range(8):
        nib = _vshr(b, _ld(b, p, 6 + 16 * (g >> 1), 16), 4 * (g & 1), 15, 16)
        top = _vshr(b, qh, g, 1, 16)
        idx, top = _cat(b, nib, nib), _cat(b, top, top)
        lv = b.select(b.icmp_unsigned("!=", top, _c(0)), _lookup(b, _T_IQ2KL[1], idx), _lookup(b, _T_IQ2KL[0], idx))
        us.append(_gather(b, lv, _KL_INTERLEAVE))
    lo = _field(b, _bytes32(b, p, 2, 4), [g & 3 for g in range(8)], [4 * (g >> 2) for g in range(8)], 15)
    hi = b.and_(b.lshr(_splat32(b, _u16(b, p, 0), 8), _cv([2 * g for g in range(8)])), _cv([3] * 8))
    sc = b.sub(b.or_(lo, b.shl(hi, _cv([4] * 8))), _cv([32] * 8))
    return Block(ir.Constant(_F32, 1.0), us, _pairs(b, sc), 128)


# ----------------------------------------------------------------------------------------
# unpackers: legacy 32-value blocks (layouts: quant.legacy; one sub-block per block)
# ----------------------------------------------------------------------------------------
_ONE2 = _cv([1, 1])


def _unpack_q4_1(b: ir.IRBuilder, p) -> Block:
    return Block(_f16(b, p, 0), [_nib32(b, p, 4)], _ONE2, 0, _f16(b, p, 2), _ONE2)


def _unpack_q5_0(b: ir.IRBuilder, p) -> Block:
    u = b.or_(_nib32(b, p, 6), _bit_bytes(b, p, 2, 16))
    return Block(_f16(b, p, 0), [u], _ONE2, 16)


def _unpack_q5_1(b: ir.IRBuilder, p) -> Block:
    u = b.or_(_nib32(b, p, 8), _bit_bytes(b, p, 4, 16))
    return Block(_f16(b, p, 0), [u], _ONE2, 0, _f16(b, p, 2), _ONE2)


def _unpack_q6_0(b: ir.IRBuilder, p) -> Block:
    # value j < 16 takes bits 4 (j // 8) .. +1 of qh[j % 8], value 16 + j the two above them, as
    # bits 4..5: each half of the lanes is shifted by a constant and the halves blended (a per-byte
    # variable shift has no x86 instruction)
    qh = _ld(b, p, 2, 8)
    t = b.shuffle_vector(qh, qh, _cv([j % 8 for j in range(32)]))
    m = _c(0x30, 32)
    up4, same = b.and_(b.shl(t, _c(4)), m), b.and_(t, m)
    up2, down2 = b.and_(b.shl(t, _c(2)), m), b.and_(b.lshr(t, _c(2)), m)
    lanes = list(range(8)) + list(range(40, 48)) + list(range(16, 24)) + list(range(56, 64))
    h = b.shuffle_vector(b.shuffle_vector(up4, up2, _cv(list(range(16)) + list(range(32, 48)))),
                         b.shuffle_vector(same, down2, _cv(list(range(16)) + list(range(32, 48)))), _cv(lanes))
    return Block(_f16(b, p, 0), [b.or_(_nib32(b, p, 10), h)], _ONE2, 32)


def _unpack_iq4_nl(b: ir.IRBuilder, p) -> Block:
    u = _lookup(b, _cat(b, _T_IQ4NL, _T_IQ4NL), _nib32(b, p, 2))
    return Block(_f16(b, p, 0), [u], _ONE2, 128)


_T_MXFP4 = _tab16(_KV_MXFP4, 128)


def _unpack_mxfp4(b: ir.IRBuilder, p) -> Block:
    """d = 2^(e - 128) from the E8M0 byte (e < 2: the subnormals 2^-128, 2^-127)."""
    e = b.zext(b.load(p), _I32)
    bits = b.select(b.icmp_unsigned(">=", e, ir.Constant(_I32, 2)), b.shl(b.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23)),
                    b.shl(ir.Constant(_I32, 0x00200000), e))
    u = _lookup(b, _cat(b, _T_MXFP4, _T_MXFP4), _nib32(b, p, 1))
    return Block(b.bitcast(bits, _F32), [u], _ONE2, 128)


# ----------------------------------------------------------------------------------------
# unpackers: mainline i-quants (layouts: quant.iquants).  Each group of 8 (4) values is one
# scalar load from the type's grid, kept as an internal constant array of i64 (i32) words in
# the module; signs are byte masks applied as (g ^ m) - m; every level is an integer (IQ1's
# delta folded in: 8 g +- 1), the fractions go into d.
# ----------------------------------------------------------------------------------------
_OFF_GRID, _OFF_IQ1 = 64, 16
# the sign bytes of the 7-bit sign indices (parity on top)
_KSIGNS = _iq.sign_byte(np.arange(128))


def _global(b: ir.IRBuilder, name: str, words: np.ndarray, bits: int):
    """An internal constant array of the integer words (made once per LLVM module)."""
    try:
        return b.module.get_global(name)
    except KeyError:
        et = ir.IntType(bits)
        ty = ir.ArrayType(et, len(words))
        gv = ir.GlobalVariable(b.module, ty, name=name)
        gv.linkage = "internal"
        gv.global_constant = True
        gv.initializer = ir.Constant(ty, [int(w) for w in words])
        return gv


def _grid_words(grid: np.ndarray, scale: int = 1, add: int = 0) -> tuple[np.ndarray, int]:
    """A grid (N, k) as N little-endian words of its k bytes (scale * value + add each)."""
    v = (grid.astype(np.int64) * scale + add).astype(np.uint8)
    k = grid.shape[1]
    return np.ascontiguousarray(v).view(f"<u{k}").reshape(-1).astype(np.uint64), 8 * k


_GRIDS = {name: _grid_words(g) for name, g in (("ikcli.iq2xxs", _iq.GRID_IQ2XXS), ("ikcli.iq2xs", _iq.GRID_IQ2XS),
                                                ("ikcli.iq2s", _iq.GRID_IQ2S), ("ikcli.iq3xxs", _iq.GRID_IQ3XXS),
                                                ("ikcli.iq3s", _iq.GRID_IQ3S))}
_GRIDS["ikcli.iq1s"] = _grid_words(_iq.GRID_IQ1S, 8, _OFF_IQ1)


def _grid_vec(b: ir.IRBuilder, name: str, idxs: list):
    """The 32 grid bytes of the entries idxs (i32 scalars; 4 of 8 bytes or 8 of 4) as <32 x i8>."""
    words, bits = _GRIDS[name]
    gv = _global(b, name, words, bits)
    v = ir.Constant(_vec(ir.IntType(bits), len(idxs)), None)
    zero = ir.Constant(_I32, 0)
    for i, ix in enumerate(idxs):
        v = b.insert_element(v, b.load(b.gep(gv, [zero, ix])), ir.Constant(_I32, i))
    return b.bitcast(v, _V32)


def _ksign_word(b: ir.IRBuilder, bits28):
    """Four 7-bit sign indices (bits 0..27 of an i32) -> the i32 of their four sign bytes, from a
    128-entry table (ksigns_iq2xs: parity on top).  The parity computed with scalar shifts and
    xors instead measured slower (IQ2_XXS 4096^2, one token, one thread: 1.34 vs 1.17 ms)."""
    gv = _global(b, "ikcli.ksigns", _KSIGNS, 8)
    zero = ir.Constant(_I32, 0)
    w = None
    for l in range(4):
        sb = b.zext(b.load(b.gep(gv, [zero, _bits(b, bits28, 7 * l, 127)])), _I32)
        sb = b.shl(sb, ir.Constant(_I32, 8 * l)) if l else sb
        w = sb if w is None else b.or_(w, sb)
    return w


_BITSEL = ir.Constant(_V32, [1 << (i % 8) for i in range(32)])


def _signed(b: ir.IRBuilder, g, word, off: int):
    """off + g * (bit i of the i32 word ? -1 : 1), per byte lane i."""
    w4 = b.bitcast(word, _vec(_I8, 4))
    w32 = b.shuffle_vector(w4, w4, ir.Constant(_vec(_I32, 32), [i // 8 for i in range(32)]))
    neg = b.icmp_unsigned("!=", b.and_(w32, _BITSEL), _c(0))
    return b.select(neg, b.sub(_c(off), g), b.add(_c(off), g))


def _odd_ls(b: ir.IRBuilder, v):
    """2 ls + 1 for the i32 lanes ls."""
    n = v.type.count
    return b.add(b.shl(v, _cv([1] * n)), _cv([1] * n))


def _scaled_d(b: ir.IRBuilder, d, div: int):
    return b.fmul(d, ir.Constant(_F32, 1.0 / div)) if div != 1 else d


def _i32(v: int):
    return ir.Constant(_I32, v)


def _byte(b: ir.IRBuilder, p, off):
    return b.zext(b.load(_gep(b, p, off)), _I32)


def _unpack_iq2_xxs(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        idx = [_byte(b, p, 2 + 8 * ib + l) for l in range(4)]
        us.append(_signed(b, _grid_vec(b, "ikcli.iq2xxs", idx), _ksign_word(b, _u32(b, p, 6 + 8 * ib)), _OFF_GRID))
    aux = _ld(b, p, 2, 16, _I32)
    sc = _odd_ls(b, b.lshr(_gather(b, aux, [2 * (h // 2) + 1 for h in range(16)]), _cv([28] * 16)))
    return Block(_scaled_d(b, _f16(b, p, 0), 8), us, sc, _OFF_GRID)


def _unpack_iq2_xs(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        q = [_u16(b, p, 2 + 8 * ib + 2 * l) for l in range(4)]
        signs = None
        for l in range(4):     # the four 7-bit sign indices as one word, then one table pass
            sl = b.shl(b.lshr(q[l], _i32(9)), _i32(7 * l)) if l else b.lshr(q[l], _i32(9))
            signs = sl if signs is None else b.or_(signs, sl)
        g = _grid_vec(b, "ikcli.iq2xs", [b.and_(x, _i32(511)) for x in q])
        us.append(_signed(b, g, _ksign_word(b, signs), _OFF_GRID))
    sc = _odd_ls(b, _field(b, _bytes32(b, p, 66, 8), *_NIB16, 15))
    return Block(_scaled_d(b, _f16(b, p, 0), 8), us, sc, _OFF_GRID)


def _unpack_iq2_s(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        qh = _byte(b, p, 66 + ib)
        idx = [b.or_(_byte(b, p, 2 + 4 * ib + l), b.shl(_bits(b, qh, 2 * l, 3), _i32(8))) for l in range(4)]
        us.append(_signed(b, _grid_vec(b, "ikcli.iq2s", idx), _u32(b, p, 34 + 4 * ib), _OFF_GRID))
    sc = _odd_ls(b, _field(b, _bytes32(b, p, 74, 8), *_NIB16, 15))
    return Block(_scaled_d(b, _f16(b, p, 0), 8), us, sc, _OFF_GRID)


def _unpack_iq3_xxs(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        idx = [_byte(b, p, 2 + 8 * ib + k) for k in range(8)]
        us.append(_signed(b, _grid_vec(b, "ikcli.iq3xxs", idx), _ksign_word(b, _u32(b, p, 66 + 4 * ib)), _OFF_GRID))
    sc = _odd_ls(b, _pairs(b, b.lshr(_ld(b, p, 66, 8, _I32), _cv([28] * 8))))
    return Block(_scaled_d(b, _f16(b, p, 0), 4), us, sc, _OFF_GRID)


def _unpack_iq3_s(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        qh = _byte(b, p, 66 + ib)
        idx = [b.or_(_byte(b, p, 2 + 8 * ib + k), b.shl(_bits(b, qh, k, 1), _i32(8))) for k in range(8)]
        us.append(_signed(b, _grid_vec(b, "ikcli.iq3s", idx), _u32(b, p, 74 + 4 * ib), _OFF_GRID))
    sc = _odd_ls(b, _field(b, _bytes32(b, p, 106, 4), [h // 4 for h in range(16)], [4 * ((h // 2) & 1) for h in range(16)], 15))
    return Block(_f16(b, p, 0), us, sc, _OFF_GRID)


def _iq1_levels(b: ir.IRBuilder, idx: list, neg: list):
    """The 32 IQ1 levels 8 g + 16 +- 1 of four grid entries, neg[l] (i32 0 / 1): group l's
    delta is negative."""
    g = _grid_vec(b, "ikcli.iq1s", idx)
    dv = ir.Constant(_vec(_I8, 4), None)
    for l, x in enumerate(neg):
        dv = b.insert_element(dv, b.trunc(b.sub(_i32(1), b.shl(x, _i32(1))), _I8), _i32(l))
    return b.add(g, b.shuffle_vector(dv, dv, ir.Constant(_vec(_I32, 32), [i // 8 for i in range(32)])))


def _unpack_iq1_s(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        qh = _u16(b, p, 34 + 2 * ib)
        idx = [b.or_(_byte(b, p, 2 + 4 * ib + l), b.shl(_bits(b, qh, 3 * l, 7), _i32(8))) for l in range(4)]
        us.append(_iq1_levels(b, idx, [_bits(b, qh, 15, 1)] * 4))
    sc = _odd_ls(b, _pairs(b, b.and_(b.lshr(b.zext(_ld(b, p, 34, 8, _I16), _vec(_I32, 8)), _cv([12] * 8)), _cv([7] * 8))))
    return Block(_scaled_d(b, _f16(b, p, 0), 8), us, sc, _OFF_IQ1)


def _unpack_iq1_m(b: ir.IRBuilder, p) -> Block:
    us = []
    for ib in range(8):
        h = [_bits(b, _byte(b, p, 32 + 2 * ib + (l >> 1)), 4 * (l & 1), 15) for l in range(4)]
        idx = [b.or_(_byte(b, p, 4 * ib + l), b.shl(b.and_(h[l], _i32(7)), _i32(8))) for l in range(4)]
        us.append(_iq1_levels(b, idx, [b.lshr(x, _i32(3)) for x in h]))
    sw = b.zext(_ld(b, p, 48, 4, _I16), _vec(_I32, 4))
    sc = _odd_ls(b, _field(b, sw, [h // 4 for h in range(16)], [6 * ((h // 2) & 1) + 3 * (h & 1) for h in range(16)], 7))
    top = [b.and_(b.lshr(b.extract_element(sw, _i32(k)), _i32(12)), _i32(15)) for k in range(4)]
    dbits = b.or_(b.or_(top[0], b.shl(top[1], _i32(4))), b.or_(b.shl(top[2], _i32(8)), b.shl(top[3], _i32(12))))
    d = b.fpext(b.bitcast(b.trunc(dbits, _I16), ir.HalfType()), _F32)
    return Block(_scaled_d(b, d, 8), us, sc, _OFF_IQ1)


def _unpack_iq1_m_rows(n: int) -> Callable:
    """IQ1_M_ROWS (quant.iquants): n blocks of 32 values (7 bytes: qs[4], qh[2], two 4-bit ls)
    as one block of the template; the row's f16 d is the record's row scale, levels 8 g +- 1."""
    def unpack(b: ir.IRBuilder, p) -> Block:
        us = []
        sc = ir.Constant(_vec(_I32, 2 * n), None)
        for ib in range(n):
            o = 7 * ib
            h = [_bits(b, _byte(b, p, o + 4 + (l >> 1)), 4 * (l & 1), 15) for l in range(4)]
            idx = [b.or_(_byte(b, p, o + l), b.shl(b.and_(h[l], _i32(7)), _i32(8))) for l in range(4)]
            us.append(_iq1_levels(b, idx, [b.lshr(x, _i32(3)) for x in h]))
            ls = _byte(b, p, o + 6)
            sc = b.insert_element(sc, b.and_(ls, _i32(15)), _i32(2 * ib))
            sc = b.insert_element(sc, b.lshr(ls, _i32(4)), _i32(2 * ib + 1))
        return Block(ir.Constant(_F32, 0.125), us, sc, _OFF_IQ1)
    return unpack


# ----------------------------------------------------------------------------------------
# unpackers: ik's trellis types (layouts: quant.ktquants).  A group's levels are generated, not
# stored: x = index + offset, value k = (the byte sum of KA^(k+1) x & 0x3f3f3f3f) - 126, so the
# unsigned level (+126) is one multiply by 0x01010101 and a shift (no byte overflows: 4 * 63).
# d is ik's matmul factor for the row scale (quant.ktquants.MATMUL_SCALE).
# ----------------------------------------------------------------------------------------
_OFF_KT = 126
_KA = 0xCBAC1FED


def _ka_powers(g: int) -> ir.Constant:
    """Lane g * j + k: KA^(k+1) mod 2^32 (as a signed i32 constant)."""
    pw, v = [], 1
    for _ in range(g):
        v = (v * _KA) & 0xFFFFFFFF
        pw.append(v - (1 << 32) if v >= 1 << 31 else v)
    return _cv(pw * (32 // g))


def _trellis_u(b: ir.IRBuilder, xs: list, g: int):
    """The 32 unsigned levels (level + 126, i32 lanes) of the groups with trellis seeds xs (i32)."""
    xv = ir.Constant(_vec(_I32, len(xs)), None)
    for i, x in enumerate(xs):
        xv = b.insert_element(xv, x, _i32(i))
    x32 = b.mul(_gather(b, xv, [i // g for i in range(32)]), _ka_powers(g))
    m = b.and_(x32, _cv([0x3F3F3F3F] * 32))
    return b.lshr(b.mul(m, _cv([0x01010101] * 32)), _cv([24] * 32))


_IQ4K_I32 = np.asarray(_iqk.IQ4K[:16]).astype(np.int64)


def _iq4k_scales(b: ir.IRBuilder, nibbles: list):
    """iq4k levels of 8 scale nibbles (i32 scalars) as per-16 lanes."""
    gv = _global(b, "ikcli.iq4k32", _IQ4K_I32 & 0xFFFFFFFF, 32)
    v = ir.Constant(_vec(_I32, 8), None)
    for i, nb in enumerate(nibbles):
        v = b.insert_element(v, b.load(b.gep(gv, [_i32(0), nb])), _i32(i))
    return _pairs(b, v)


def _kt_d(t: int):
    return ir.Constant(_F32, float(np.float32(_kt.MATMUL_SCALE[t])))


def _unpack_iq2_kt(b: ir.IRBuilder, p) -> Block:
    us = []
    for B in range(8):
        xs = [b.add(_u16(b, p, 4 + 8 * B + 2 * j), _i32(4096)) for j in range(4)]
        us.append(b.trunc(_trellis_u(b, xs, 8), _V32))
    sc = _iq4k_scales(b, [_bits(b, _byte(b, p, B % 4), 4 * (B // 4), 15) for B in range(8)])
    return Block(_kt_d(_kt.IQ2_KT), us, sc, _OFF_KT)


def _unpack_iq1_kt(b: ir.IRBuilder, p) -> Block:
    us, nibs = [], []
    for B in range(8):
        sh = _byte(b, p, B)
        nibs.append(b.and_(sh, _i32(15)))
        xs = []
        for j in range(4):
            hi = _bits(b, _byte(b, p, 40 + 4 * (B % 4) + j), 4 * (B // 4), 15)
            idx = b.or_(b.or_(_byte(b, p, 8 + 4 * B + j), b.shl(hi, _i32(8))), b.shl(_bits(b, sh, 4 + j, 1), _i32(12)))
            xs.append(b.add(idx, _i32(4096)))
        us.append(b.trunc(_trellis_u(b, xs, 8), _V32))
    return Block(_kt_d(_kt.IQ1_KT), us, _iq4k_scales(b, nibs), _OFF_KT)


def _unpack_iq3_kt(b: ir.IRBuilder, p) -> Block:
    qh = _ld(b, p, 68)
    us = []
    v32 = _vec(_I32, 32)
    for B in range(8):
        xs = [b.add(_u16(b, p, 4 + 8 * B + 2 * j), _i32(4096)) for j in range(4)]
        t = b.sub(_trellis_u(b, xs, 8), _cv([_OFF_KT] * 32))
        a = b.trunc(b.select(b.icmp_signed("<", t, ir.Constant(v32, [0] * 32)), b.neg(t), t), _V32)
        neg = b.icmp_unsigned("!=", _vshr(b, qh, B, 1), _c(0))
        us.append(b.select(neg, b.sub(_c(_OFF_KT), a), b.add(_c(_OFF_KT), a)))
    sc = _pairs(b, _field(b, _bytes32(b, p, 0, 4), [B % 4 for B in range(8)], [4 * (B // 4) for B in range(8)], 15))
    return Block(_kt_d(_kt.IQ3_KT), us, sc, _OFF_KT)


def _unpack_iq4_kt(b: ir.IRBuilder, p) -> Block:
    us = []
    for B in range(8):
        s = _u32(b, p, 4 * B)
        off = b.add(_i32(4096), b.shl(b.and_(s, _i32(1)), _i32(15)))
        xs = []
        for j in range(8):
            G = 8 * B + j
            hi = _bits(b, _byte(b, p, 96 + G % 32), 4 * (G // 32), 15)
            idx = b.or_(b.or_(_byte(b, p, 32 + G), b.shl(hi, _i32(8))), b.shl(_bits(b, s, 8 + 3 * j, 7), _i32(12)))
            xs.append(b.add(idx, off))
        us.append(b.trunc(_trellis_u(b, xs, 4), _V32))
    S = _ld(b, p, 0, 8, _I32)
    sc = _pairs(b, b.sub(b.lshr(b.and_(S, _cv([255] * 8)), _cv([1] * 8)), _cv([64] * 8)))
    return Block(_kt_d(_kt.IQ4_KT), us, sc, _OFF_KT)


def _from_simd(unpack: Callable, off: int) -> Callable:
    """A Block from one of quant.simd's Q8_0 / Q4_0 unpackers (their row dots are quant.simd's;
    these records only feed quant.simd_gemm): unsigned bytes (u8), level offset off."""
    def f(b: ir.IRBuilder, p) -> Block:
        d, parts = unpack(b, p, u8=True)
        u = parts[0][0] if len(parts) == 1 else _cat(b, parts[0][0], parts[1][0])
        return Block(d, [u], _ONE2, off)
    return f


_HAS_F16C = "+f16c" in cpu_features()


def _f16s(b: ir.IRBuilder, p, off: int, stride: int, n: int):
    """The f16 at p + off + i * stride, i < n <= 8, as <n x f32>: one vector conversion (vcvtph2ps,
    F16C) instead of n scalar ones and their inserts.  Through the x86 intrinsic, which keeps
    half-precision vectors out of the IR: while this was written as `fpext <n x half>`, a process
    loading numba's cached kernels crashed (a segmentation fault in quant.kernels.matvec_act's
    Q8_0_R8 products, after partial cache deletions; not reproduced after a full reset, so not
    pinned on that form; tests/test_kernel_cache.py runs cached products in a second process)."""
    h = ir.Constant(_vec(_I16, 8), [0] * 8)
    for i in range(n):
        x = b.load(b.bitcast(_gep(b, p, off + i * stride), _I16.as_pointer()), align=1)
        h = b.insert_element(h, x, ir.Constant(_I32, i))
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_vec(_F32, 8), [_vec(_I16, 8)]),
                                        "llvm.x86.vcvtph2ps.256")
    r = b.call(fn, [h])
    return r if n == 8 else b.shuffle_vector(r, r, _cv(list(range(n))))


def _grouped(one: BlockDot, n: int = 8, f16_d: tuple = ()) -> BlockDot:
    """n consecutive 32-value blocks as one block of the template, each with its own d (and dm):
    a block's fixed costs are paid once per 256 values instead of per 32 (measured at one
    block per pass: 2.5-6x Q8_0's time at one token); a row's last blocks go through groups of 4,
    then `one` (the 128-value rows of DeepSeek's per-head attn_k_b, where a type falls back to
    Q5_0 / IQ4_NL: 16 heads x 512 x 128 of Q5_0, one token, one thread, 162 -> 102 us; Q8_0 60)."""
    def unpack(b: ir.IRBuilder, p, vec_d: bool = False) -> Block:
        parts = [one.unpack(b, _gep(b, p, i * one.nbytes)) for i in range(n)]
        def vec(vals):
            v = ir.Constant(_vec(_F32, n), None)
            for i, x in enumerate(vals):
                v = b.insert_element(v, x, ir.Constant(_I32, i))
            return v
        ones = _cv([1] * (2 * n))
        mins = ones if parts[0].mins is not None else None
        d = _f16s(b, p, f16_d[0], one.nbytes, n) if vec_d else vec([q.d for q in parts])
        dm = None if mins is None else _f16s(b, p, f16_d[1], one.nbytes, n) if vec_d else vec([q.dm for q in parts])
        return Block(d, [q.us[0] for q in parts], ones, parts[0].off, dm, mins)
    # f16_d: the byte offsets of d (and dm) when the type stores them as f16.  The row dots then
    # convert the n of them as one vector (bench_row_dots.py, 2048 x 4096, one token, one thread:
    # Q4_1 203 -> 173 us, Q5_1 254 -> 227, Q5_0 214 -> 195, IQ4_NL 170 -> 162); the GEMM's
    # packing keeps the scalar conversions (with the vector one: Q4_1 0.142 -> 0.155 ms,
    # bench_tile_gemm.py --pack-only)
    dot = (lambda b, p: unpack(b, p, True)) if f16_d and _HAS_F16C else None
    return BlockDot(one.name, n * one.values, n * one.nbytes, one.off, unpack, one.row_scale,
                    tail=_grouped(one, n // 2, f16_d) if n > 4 else one, scale32=one.scale32, dot_unpack=dot,
                    lmax=one.lmax)


# type id -> record (ids: quant.types)
BLOCK_DOTS: dict[int, BlockDot] = {
    3: _grouped(BlockDot("Q4_1", 32, 20, 0, _unpack_q4_1, scale32=True, lmax=15), f16_d=(0, 2)),
    6: _grouped(BlockDot("Q5_0", 32, 22, 16, _unpack_q5_0, scale32=True, lmax=16), f16_d=(0,)),
    7: _grouped(BlockDot("Q5_1", 32, 24, 0, _unpack_q5_1, scale32=True, lmax=31), f16_d=(0, 2)),
    20: _grouped(BlockDot("IQ4_NL", 32, 18, 128, _unpack_iq4_nl, scale32=True), f16_d=(0,)),
    133: _grouped(BlockDot("Q6_0", 32, 26, 32, _unpack_q6_0, scale32=True, lmax=32), f16_d=(0,)),
    39: _grouped(BlockDot("MXFP4", 32, 17, 128, _unpack_mxfp4, scale32=True, lmax=12)),
    16: BlockDot("IQ2_XXS", 256, 66, _OFF_GRID, _unpack_iq2_xxs, scale32=True, act256=True),
    17: BlockDot("IQ2_XS", 256, 74, _OFF_GRID, _unpack_iq2_xs, act256=True),
    22: BlockDot("IQ2_S", 256, 82, _OFF_GRID, _unpack_iq2_s, act256=True),
    18: BlockDot("IQ3_XXS", 256, 98, _OFF_GRID, _unpack_iq3_xxs, scale32=True, act256=True),
    21: BlockDot("IQ3_S", 256, 110, _OFF_GRID, _unpack_iq3_s, scale32=True, act256=True),
    19: BlockDot("IQ1_S", 256, 50, _OFF_IQ1, _unpack_iq1_s, scale32=True, act256=True, lmax=9),
    29: BlockDot("IQ1_M", 256, 56, _OFF_IQ1, _unpack_iq1_m, act256=True, lmax=9),
    4: BlockDot("IQ1_M_ROWS", 256, 56, _OFF_IQ1, _unpack_iq1_m_rows(8), "f16", lmax=9,
                tail=BlockDot("IQ1_M_ROWS", 32, 7, _OFF_IQ1, _unpack_iq1_m_rows(1), "f16", lmax=9)),
    10: BlockDot("Q2_K", 256, 84, 0, _unpack_q2_k, act256=True, lmax=3),
    11: BlockDot("Q3_K", 256, 110, 4, _unpack_q3_k, act256=True, lmax=4),
    12: BlockDot("Q4_K", 256, 144, 0, _unpack_q4_k, scale32=True, wide=True, lmax=15),
    13: BlockDot("Q5_K", 256, 176, 0, _unpack_q5_k, scale32=True, wide=True, lmax=31),
    14: BlockDot("Q6_K", 256, 210, 32, _unpack_q6_k, wide=True, lmax=32),
    23: BlockDot("IQ4_XS", 256, 136, 128, _unpack_iq4_xs, scale32=True, act256=True, wide=True, planes=True, biased=True),
    137: BlockDot("IQ2_K", 256, 76, 128, _unpack_iq2_k, act256=True, lmax=31, biased=True),
    138: BlockDot("IQ3_K", 256, 110, 128, _unpack_iq3_k, act256=True, lmax=63, biased=True),
    139: BlockDot("IQ4_K", 256, 144, 128, _unpack_iq4_k, act256=True, wide=True, planes=True, biased=True),
    140: BlockDot("IQ5_K", 256, 176, 128, _unpack_iq5_k, act256=True, biased=True),
    141: BlockDot("IQ6_K", 256, 212, 128, _unpack_iq6_k, act256=True, biased=True),
    144: BlockDot("IQ4_KS", 256, 136, 128, _unpack_iq4_ks, "f32", scale32=True, act256=True, wide=True,
                  planes=True, biased=True),
    145: BlockDot("IQ2_KS", 256, 70, 128, _unpack_iq2_ks, "f16", scale32=True, act256=True, lmax=31, biased=True),
    152: BlockDot("IQ5_KS", 256, 168, 128, _unpack_iq5_ks, "f32", scale32=True, act256=True, biased=True),
    156: BlockDot("IQ3_KS", 256, 102, 128, _unpack_iq3_ks, "f16", scale32=True, act256=True, lmax=63, biased=True),
    157: BlockDot("IQ2_KL", 256, 86, 128, _unpack_iq2_kl, "f16", act256=True),
    158: BlockDot("IQ1_KT", 256, 56, _OFF_KT, _unpack_iq1_kt, "f32", scale32=True),
    153: BlockDot("IQ2_KT", 256, 68, _OFF_KT, _unpack_iq2_kt, "f32", scale32=True),
    154: BlockDot("IQ3_KT", 256, 100, _OFF_KT, _unpack_iq3_kt, "f32", scale32=True),
    155: BlockDot("IQ4_KT", 256, 128, _OFF_KT, _unpack_iq4_kt, "f32", scale32=True),
}


# Q8_0 / Q4_0 have row dots of their own (quant.simd); these records serve quant.simd_gemm
GEMM_ONLY: dict[int, BlockDot] = {
    8: _grouped(BlockDot("Q8_0", 32, 34, 128, _from_simd(_simd_unpack_q8_0, 128), scale32=True)),
    2: _grouped(BlockDot("Q4_0", 32, 18, 8, _from_simd(_simd_unpack_q4_0, 8), scale32=True, lmax=8)),
}


# ----------------------------------------------------------------------------------------
# the row template
# ----------------------------------------------------------------------------------------
class Avx2Mode(NamedTuple):
    """avx2_mode's choice for one type."""
    mode: str        # "direct" or "signed"
    k: int           # 32-byte products whose int16 pair sums are added before one vpmaddwd
    bias: int        # what the unpack adds to the levels (0 for a biased type's signed levels)

    @property
    def offset_in_sums(self) -> bool:
        """The level offset comes off the activation sums once per block, not off every byte:
        direct levels, and the signed levels a biased type stores."""
        return self.mode == "direct" or self.bias == 0


def avx2_mode(off: int, lmax: int, biased: bool) -> Avx2Mode:
    """How an AVX2 CPU (no VNNI) multiplies a type's levels (level offset off, |level| <= lmax):
    (mode, k, bias).  "direct": the stored levels u lie in 0..127 and go into vpmaddubsw as they
    are, no sign trick: off +- lmax (0..lmax for off 0) within 0..127 (the K-quants, Q4_1, Q5_0,
    IQ1_S ...), or a biased type stored as level + lmax when 2 lmax < 128 (IQ2_K, IQ3_K ...).
    Otherwise "signed": vpsignb's trick on the signed levels (a biased type stores them with
    bias 0).  k: how many 32-byte products' int16 pair sums may be added before their vpmaddwd
    (k * 2 * bound * 127 < 2**15)."""
    if biased and 2 * lmax <= 127:
        return Avx2Mode("direct", max(1, 32767 // (254 * 2 * lmax)), lmax)
    lo, hi = (0, lmax) if off == 0 else (off - lmax, off + lmax)      # u's range (off 0: as stored)
    if not biased and 0 <= lo and hi <= 127:
        return Avx2Mode("direct", max(1, 32767 // (254 * max(hi, 1))), off)
    return Avx2Mode("signed", max(1, 32767 // (254 * min(lmax, 128))), 0 if biased else off)


def _sub_isum(b: ir.IRBuilder, u, a, off8, vnni: bool, direct: bool = False):
    """Per-lane integer sums of 32 products (VNNI: or 64, two sub-blocks): <8 x i32> (<16 x i32>),
    lane i = values 4i..4i+3.  vnni or direct (AVX2: avx2_mode): of the unsigned levels u (the
    block removes off * activation sums once, in lane vectors); else: of the signed levels u - off
    (off8: None for 0, else the 32 byte offsets)."""
    if vnni:                       # 32 or 64 levels (two sub-blocks: _width)
        n = u.type.count // 4
        return dpbusd(b, ir.Constant(_vec(_I32, n), [0] * n), u, a)
    if direct:
        return _halves(b, (u, a), lambda x, y: _quads(b, unsigned_pairs(b, x, y)))
    w = b.sub(u, off8) if off8 is not None else u
    return signed_quads(b, w, a)


TMAX = 8   # activation rows per call: every weight block is unpacked once for all of them


@dataclass
class Act:
    """Pointers to activation row 0 of a token tile (q int8, s f32 per 32, bs i32 per 32, b16 i32
    per 16) and their row strides in elements; `row(t)` gives row t's pointers."""
    q: object
    s: object
    bs: object
    b16: object
    strides: tuple

    def row(self, b: ir.IRBuilder, t):
        return tuple(b.gep(p, [b.mul(t, st)]) for p, st in zip((self.q, self.s, self.bs, self.b16), self.strides))


def act_arrays(context, builder, sig_args, args, k0):
    """Act for the activation arrays (q, s, bs, b16: 2-D, one row per token) from row k0 on."""
    ptrs, strides = [], []
    for ty, val in zip(sig_args, args):
        a = context.make_array(ty)(context, builder, val)
        st = builder.sdiv(builder.extract_value(a.strides, 0), _const_i64(ty.dtype.bitwidth // 8))
        ptrs.append(builder.gep(a.data, [builder.mul(k0, st)]))
        strides.append(st)
    return Act(*ptrs, tuple(strides))


def token_accs(b: ir.IRBuilder, *elems: ir.Type) -> list:
    """For each element type, TMAX zeroed accumulators (one per activation row).  Allocated
    where they are used, inside the row loops, on purpose: hoisted to the entry block
    (cgutils.alloca_once) one token measured 10-15 % slower (one thread, 4096^2: Q4_K 0.49 ->
    0.54-0.56 ms, Q4_K_R4 0.34 -> 0.39-0.40, IQ2_K_R4 0.39 -> 0.44-0.46, alternating runs).
    dot_intrinsic gives them back after each row (stack_scope), so long loops do not grow the stack."""
    out = []
    for t in elems:
        a = b.alloca(ir.ArrayType(t, TMAX))
        for i in range(TMAX):
            b.store(ir.Constant(t, None), b.gep(a, [ir.Constant(_I32, 0), ir.Constant(_I32, i)]))
        out.append(a)
    return out


def _emit_row(b: ir.IRBuilder, fmt: BlockDot, row, act: Act, ntok, cols, vnni: bool):
    """The dots of one row of type fmt at pointer row with ntok (<= TMAX) activation rows:
    returns an alloca of TMAX f32, the first ntok filled.  A record with a `tail` (the legacy
    types' groups of 8 blocks) finishes a row that is not a whole number of groups with its tails
    (row_pieces: groups of 4, then single blocks)."""
    parts = [_blocks_loop(b, rec, b.gep(row, [boff]), b.udiv(v0, _const_i64(32)), nb, act, ntok, vnni)
             for rec, nb, v0, boff in row_pieces(b, fmt, cols)]
    res = b.alloca(ir.ArrayType(_F32, TMAX))
    zero32 = ir.Constant(_I32, 0)
    with cgutils.for_range(b, ntok) as tl:
        # the pieces' product sums share a width: added before one reduction (a row of 128 Q5_0
        # values is all tail, and its reductions were a third of its time)
        vals = [tree_sum(b, [b.load(b.gep(accs, [zero32, tl.index])) for accs, _ in parts])]
        vals += [b.load(b.gep(saccs, [zero32, tl.index])) for _, saccs in parts]
        r = None
        for v in vals:
            red = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32, [_F32, v.type]),
                                                 f"llvm.vector.reduce.fadd.v{v.type.count}f32")
            x = b.call(red, [ir.Constant(_F32, 0.0), v])
            x.fastmath.add("reassoc")
            r = x if r is None else b.fadd(r, x)
        if fmt.row_scale == "f32":
            r = b.fmul(r, _f32(b, row, 0))
        elif fmt.row_scale == "f16":
            r = b.fmul(r, _f16(b, row, 0))
        b.store(r, b.gep(res, [zero32, tl.index]))
    return res


def row_pieces(b: ir.IRBuilder, fmt: BlockDot, cols, every_tail: bool = True) -> list:
    """A row of cols values as runs of whole blocks: of fmt, then of its tail, its tail's tail...
    (record, blocks, first value, first byte: after the row's meta bytes), i64 values.  Without
    every_tail only fmt and its last tail (each record's loop is compiled into every caller)."""
    chain = [fmt]
    while chain[-1].tail is not None:
        chain.append(chain[-1].tail)
    if not every_tail:
        chain = chain[:1] + chain[1:][-1:]
    out, v0, boff, rest = [], _const_i64(0), _const_i64(fmt.meta), cols
    for rec in chain:
        nb = b.udiv(rest, _const_i64(rec.values))
        out.append((rec, nb, v0, boff))
        v0 = b.add(v0, b.mul(nb, _const_i64(rec.values)))
        boff = b.add(boff, b.mul(nb, _const_i64(rec.nbytes)))
        rest = b.urem(rest, _const_i64(rec.values))
    return out


def _blocks_loop(b: ir.IRBuilder, fmt: BlockDot, blocks, sub0, nb, act: Act, ntok, vnni: bool):
    """nb blocks of fmt from pointer blocks on, whose first sub-block is activation sub-block
    sub0, times the ntok activation rows: (accs, saccs), TMAX accumulators each."""
    nsub = fmt.values // 32
    avx2 = None if vnni or not HAS_AVX2 else avx2_mode(fmt.off, fmt.lmax, fmt.biased)
    accs, saccs = token_accs(b, _vec(_F32, 8 * _width(vnni)), _vec(_F32, 2 * nsub))
    zero32 = ir.Constant(_I32, 0)
    with cgutils.for_range(b, nb) as loop:
        ib = loop.index
        bp = b.gep(blocks, [b.mul(ib, _const_i64(fmt.nbytes))])
        prefetch(b, bp, PREFETCH_BYTES, fmt.nbytes)
        if vnni:
            blk = fmt.unpack(b, bp, wide=True) if fmt.wide else (fmt.dot_unpack or fmt.unpack)(b, bp)
        elif fmt.biased and avx2:
            blk = fmt.unpack(b, bp, bias=avx2.bias)
        else:
            blk = (fmt.dot_unpack or fmt.unpack)(b, bp)
        prep = _block_prep(b, blk, nsub, vnni, avx2)
        k0 = b.add(sub0, b.mul(ib, _const_i64(nsub)))
        with cgutils.for_range(b, ntok) as tl:
            qp, sp, _, b16p = act.row(b, tl.index)
            _block_dot(b, blk, prep, k0, nsub, qp, sp, b16p, b.gep(accs, [zero32, tl.index]),
                       b.gep(saccs, [zero32, tl.index]), vnni)
    return accs, saccs


def _per_half(b: ir.IRBuilder, v, nh: int):
    """A block scale (f32) or per-sub-block scales (<nsub x f32>) as nh = 2 nsub half lanes."""
    if isinstance(v.type, ir.VectorType):
        return _gather(b, v, [h // 2 for h in range(nh)])
    return _splat(b, v, _F32, nh)


def _width(vnni: bool) -> int:
    """Sub-blocks per dot product: two with VNNI (a 512-bit vpdpbusd over 64 values: half the dot
    and reduction instructions of a block), one in the generic IR (256-bit)."""
    return 2 if vnni else 1


def _lane_half(lane: int, w: int, planes: bool) -> int:
    """The half (relative to its group of 4w sub-blocks; sub-block j's halves are 2j, 2j + 1) that
    lane 4m + i of _quad_sum's result sums: group m of product vector i, which covers sub-blocks
    wi .. wi + w - 1 (value order), or with planes (BlockDot.planes, w == 2) half (i & 1) of
    sub-block 4 (i >> 1) + m."""
    m, i = divmod(lane, 4)
    if planes:
        return 2 * (4 * (i >> 1) + m) + (i & 1)
    return 2 * (w * i + (m >> 1)) + (m & 1)


def _quad_lanes(g: int, nsub: int, nh: int, w: int, planes: bool = False) -> list:
    """Lanes of the per-half vectors (natural order) in the order of _quad_sum's result for group
    g (sub-blocks 4wg .. 4wg + 4w - 1, those below nsub; index nh: a zero lane)."""
    out = []
    for lane in range(8 * w):
        h = 8 * w * g + _lane_half(lane, w, planes)
        out.append(h if h < 2 * nsub else nh)
    return out


# the activations' order for a planes record, per 128 values: their 16-value halves 0, 2, 4, 6, 1, 3, 5, 7
PLANES_ORDER = tuple(_lane_half(4 * m + i, 2, True) for i in range(2) for m in range(4))


def _quad_sum(b: ir.IRBuilder, ps: list):
    """Four <8w x i32> product vectors (each 4-lane group: the products of 16 values) -> one
    <8w x i32>: lane 4m + i = the sum of group m of ps[i].  Two levels of unpack-and-add
    (vpunpck{l,h}{dq,qdq}, within 128-bit lanes) instead of a horizontal sum per sub-block: the
    f32 scales are then applied with one convert and one FMA per 4w sub-blocks, as
    ik_llama.cpp's K-quant kernels do."""
    n = ps[0].type.count

    def level(x, y, lo, hi):
        return b.add(b.shuffle_vector(x, y, _cv(lo)), b.shuffle_vector(x, y, _cv(hi)))

    lo1 = [v for m in range(n // 4) for v in (4 * m, n + 4 * m, 4 * m + 1, n + 4 * m + 1)]
    hi1 = [v for m in range(n // 4) for v in (4 * m + 2, n + 4 * m + 2, 4 * m + 3, n + 4 * m + 3)]
    lo2 = [v for m in range(n // 4) for v in (4 * m, 4 * m + 1, n + 4 * m, n + 4 * m + 1)]
    hi2 = [v for m in range(n // 4) for v in (4 * m + 2, 4 * m + 3, n + 4 * m + 2, n + 4 * m + 3)]
    x = level(ps[0], ps[1], lo1, hi1)
    y = level(ps[2], ps[3], lo1, hi1)
    return level(x, y, lo2, hi2)


def sum_weights(b: ir.IRBuilder, sc, off, d, mins=None, dm=None):
    """The f32 weight of each lane's activation sum, -d sc off + dm min, or None when both terms
    vanish: sc, off (a vector or a plain int) and mins are i32 lane vectors, d and dm f32 lane
    vectors of the same count.  One formula for the row dots (quant.simd_blocks) and the GEMM's
    packings (quant.simd_gemm, plain, _R4 and _R8 lanes)."""
    n = sc.type.count
    w = None
    if not (isinstance(off, int) and off == 0):
        offv = _cv([off] * n) if isinstance(off, int) else off
        w = b.fmul(b.sitofp(b.mul(sc, offv), _vec(_F32, n)), b.fneg(d), flags=["fast"])
    if mins is not None:
        m = b.fmul(b.sitofp(mins, _vec(_F32, n)), dm, flags=["fast"])
        w = m if w is None else b.fadd(w, m, flags=["fast"])
    return w


def _block_prep(b: ir.IRBuilder, blk: Block, nsub: int, vnni: bool, avx2: Avx2Mode | None = None):
    """What the activation rows share of a block: per group of 4w sub-blocks (_width) the f32
    lanes d * sc in _quad_sum's order, the per-half weights of the activation sums
    (-d sc off + dm min, f32, natural order), the levels w sub-blocks to a vector and, for the
    generic IR, the per-byte level offsets.  avx2: avx2_mode's choice (the unpack took its bias)."""
    nh, w = 2 * nsub, _width(vnni)
    # the groups' lanes are picked from the integer scales (one shuffle) before the convert
    scz = b.shuffle_vector(blk.sc, ir.Constant(_vec(_I32, nh), [0] * nh), _cv(range(nh + 1)))
    dh = _per_half(b, blk.d, nh)
    dz = b.shuffle_vector(dh, ir.Constant(_vec(_F32, nh), [0.0] * nh), _cv(range(nh + 1)))
    dsc = []
    for g in range(-(-nsub // (4 * w))):
        lanes = _quad_lanes(g, nsub, nh, w, blk.planes)
        dsc.append(b.fmul(b.sitofp(_gather(b, scz, lanes), _vec(_F32, 8 * w)), _gather(b, dz, lanes), flags=["fast"]))
    us = blk.us
    if w == 2 and us[0].type.count == 32:
        zero = ir.Constant(_V32, [0] * 32)
        us = [b.shuffle_vector(us[j], us[j + 1] if j + 1 < nsub else zero, _cv(range(64)))
              for j in range(0, nsub, 2)]
    # VNNI and AVX2's direct levels take the offsets off the sums (so do the signed levels of a
    # biased type: no per-byte subtraction), the rest off the levels themselves (off8)
    off = blk.off
    in_sums = vnni or (avx2 is not None and avx2.offset_in_sums)
    wsum = sum_weights(b, blk.sc, off if in_sums else 0, dh, blk.mins,
                       None if blk.mins is None else _per_half(b, blk.dm, nh))
    off8 = None
    if not in_sums and not (isinstance(off, int) and off == 0):
        if isinstance(off, int):
            off8 = [_c(off)] * nsub
        else:
            o8 = b.trunc(off, _vec(_I8, nh))
            off8 = [_gather(b, o8, [2 * j] * 16 + [2 * j + 1] * 16) for j in range(nsub)]
    return dsc, wsum, off8, us, avx2 is not None and avx2.mode == "direct"


def _block_dot(b: ir.IRBuilder, blk: Block, prep, k0, nsub: int, qp, sp, b16p, accp, saccp, vnni: bool):
    """acc += the unpacked block whose first sub-block is activation sub-block k0, times one
    activation row (the activation-sum terms: sacc; b16 holds each half's sum times its
    sub-block's activation scale, f32)."""
    dsc, wsum, off8, us, direct = prep
    w = _width(vnni)
    vf = _vec(_F32, 8 * w)
    zero = ir.Constant(_vec(_I32, 8 * w), [0] * (8 * w))
    acc = b.load(accp)
    for g, coef in enumerate(dsc):
        ps = []
        for i in range(4):
            j = 4 * w * g + w * i          # the vector's first sub-block
            if j >= nsub:
                ps.append(zero)
                continue
            k = b.add(k0, _const_i64(j))
            n = 32 * min(w, nsub - j)      # an odd last sub-block: 32 bytes (the row may end there)
            a = b.load(b.bitcast(b.gep(qp, [b.mul(k, _const_i64(32))]), _vec(_I8, n).as_pointer()), align=1)
            if n < 32 * w:                 # ... its zero levels meet zero bytes
                a = b.shuffle_vector(a, ir.Constant(_V32, [0] * 32), _cv(range(64)))
            ps.append(_sub_isum(b, us[j // w], a, None if off8 is None else off8[j], vnni, direct))
        # the activation scale of each lane's sub-block
        kg = b.add(k0, _const_i64(4 * w * g))
        m = min(4 * w, nsub - 4 * w * g)
        if m == 4 * w:
            sv = b.load(b.bitcast(b.gep(sp, [kg]), _vec(_F32, 4 * w).as_pointer()), align=4)
        else:
            sv = ir.Constant(_vec(_F32, 4 * w), [0.0] * (4 * w))
            for i in range(m):
                sv = b.insert_element(sv, b.load(b.gep(sp, [b.add(kg, _const_i64(i))])), ir.Constant(_I32, i))
        sl = b.shuffle_vector(sv, sv, _cv([_lane_half(lane, w, blk.planes) >> 1 for lane in range(8 * w)]))
        t = b.fmul(b.sitofp(_quad_sum(b, ps), vf), b.fmul(coef, sl, flags=["fast"]), flags=["fast"])
        acc = b.fadd(acc, t, flags=["fast"])
    b.store(acc, accp)
    if wsum is not None:
        nh = 2 * nsub
        f16 = b.load(b.bitcast(b.gep(b16p, [b.mul(k0, _const_i64(2))]), _vec(_F32, nh).as_pointer()), align=4)
        b.store(b.fadd(b.load(saccp), b.fmul(f16, wsum, flags=["fast"]), flags=["fast"]), saccp)


def tree_sum(b: ir.IRBuilder, vals: list):
    """Pairwise f32 sum: log2(n) levels instead of a chain of n dependent adds (the sub-blocks of
    a block); Q4_K_R4, one token, paired runs: 0.26-0.29 -> 0.20-0.21 ms (plain types: within
    the noise)."""
    while len(vals) > 1:
        vals = [b.fadd(vals[i], vals[i + 1], flags=["fast"]) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]


def _one_or_many(b: ir.IRBuilder, ntok, emit) -> None:
    """emit(ntok) twice: for the constant 1 (token generation: LLVM then keeps the accumulators in
    registers; through the TMAX-row path one token measured Q6_K 0.97 against ~0.5 ms before, in
    unpaired runs on a noisy machine) and for the rest."""
    one = b.icmp_unsigned("==", ntok, _const_i64(1))
    with b.if_else(one) as (then, otherwise):
        with then:
            emit(_const_i64(1))
        with otherwise:
            emit(ntok)


def dot_intrinsic(records: dict, emit_rows: Callable, width: int, vnni: bool, label: str):
    """An intrinsic f(qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, ntok, out, r) -> bool:
    for i < n, the weight rows r + i width .. r + i width + width - 1 at byte base + i stride of
    buf (one row, or a width-row interleaved group) dotted with activation rows k0 + t of
    (q, s, bs, b16), t < ntok (<= TMAX), written to out[k0 + t, r + i width:...], for every type
    in `records` (others: False, out untouched).  A switch on qtype around each type's loop over
    the n rows (one dispatch per run of rows: per row it measured ~13 ns, a fifth of a 2048-wide
    Q4_K row): emit_rows(builder, record, weight pointer, Act, ntok, cols, vnni) -> alloca of
    TMAX results (f32, or <width x f32>)."""

    @intrinsic
    def dot(typingctx, qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, ntok, out, r):
        if not all(isinstance(x, types.Array) for x in (buf, q, s, bs, b16, out)):
            return None
        recs, qty = for_type(records, qtype)
        sig = types.boolean(qty, buf, types.int64, types.int64, types.int64, q, s, bs, b16, types.int64,
                            types.int64, types.int64, out, types.int64)

        def codegen(context, builder, sig, args):
            qt = switch_value(qtype, args[0])
            bufv, basev, stridev, nv, cols, k0v, ntokv, rv = (args[i] for i in (1, 2, 3, 4, 9, 10, 11, 13))
            wbuf = context.make_array(sig.args[1])(context, builder, bufv)
            act = act_arrays(context, builder, sig.args[5:9], args[5:9], k0v)
            oa = context.make_array(sig.args[12])(context, builder, args[12])
            ost = builder.sdiv(builder.extract_value(oa.strides, 0), _const_i64(4))
            def case(fmt):
                def emit(ntok, fmt=fmt):
                    with cgutils.for_range(builder, nv) as rl, stack_scope(builder):   # per-row allocas
                        wp = builder.gep(wbuf.data, [builder.add(basev, builder.mul(rl.index, stridev))])
                        col = builder.add(rv, builder.mul(rl.index, _const_i64(width)))
                        obase = builder.gep(oa.data, [builder.add(builder.mul(k0v, ost), col)])
                        res = emit_rows(builder, fmt, wp, act, ntok, cols, vnni)
                        with cgutils.for_range(builder, ntok) as tl:
                            v = builder.load(builder.gep(res, [ir.Constant(_I32, 0), tl.index]))
                            dst = builder.gep(obase, [builder.mul(tl.index, ost)])
                            if width > 1:
                                dst = builder.bitcast(dst, _vec(_F32, width).as_pointer())
                            builder.store(v, dst, align=4)
                _one_or_many(builder, ntokv, emit)
            return type_switch(builder, qt, recs, label, case)
        return sig, codegen
    return dot


def for_type(records: dict, qtype: types.Type) -> tuple[dict, types.Type]:
    """A switch intrinsic's records and qtype argument type: all of them for an int qtype, only
    the group's (quant.typetag) for a tag, so that a per-group kernel holds only those cases."""
    g = group_of(qtype)
    if g is None:
        return records, types.int64
    return {t: r for t, r in records.items() if t in g}, qtype


def switch_value(qtype: types.Type, arg):
    """The value type_switch branches on: the argument (an int, or a tag's id), or the id of a
    one-type group as a constant."""
    g = group_of(qtype)
    return _const_i64(next(iter(g))) if g is not None and len(g) == 1 else arg


def type_switch(b: ir.IRBuilder, qtype, records: dict, label: str, case: Callable):
    """A switch on the type id qtype over records (id -> record): case(record) emits that type's
    code; returns an i1, true when qtype had a record."""
    okp = cgutils.alloca_once_value(b, ir.Constant(ir.IntType(1), 0))
    end = b.append_basic_block(f"{label}.end")
    sw = b.switch(qtype, end)
    for tid, fmt in records.items():
        bb = b.append_basic_block(f"{label}.{fmt.name}")
        sw.add_case(ir.Constant(_I64, tid), bb)
        b.position_at_end(bb)
        case(fmt)
        b.store(ir.Constant(ir.IntType(1), 1), okp)
        b.branch(end)
    b.position_at_end(end)
    return b.load(okp)


def _row_dot_intrinsic(vnni: bool):
    """row_dot(qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, ntok, out, r) -> bool:
    out[k0 + t, r + i] = the row at byte base + i stride of buf dotted with activation row k0 + t,
    i < n, for the types of BLOCK_DOTS (dot_intrinsic; each block is unpacked once for the ntok
    rows)."""
    return dot_intrinsic(BLOCK_DOTS, _emit_row, 1, vnni, "rowdot")


row_dot_generic = _row_dot_intrinsic(False)
row_dot_vnni = _row_dot_intrinsic(True) if HAS_VNNI else None
row_dot = row_dot_vnni if HAS_VNNI else row_dot_generic
