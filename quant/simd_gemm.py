"""Integer GEMM for the block types of quant.simd_blocks: many activation rows (prompts, the
experts' shares of a prompt) times a tile of 32 weight rows.

A row dot unpacks every weight block once per TMAX tokens and pays per block and token for
its per-sub-block scales (about 46 vector ops per 256 products, quant.simd_blocks).  Here a
run of 32 weight rows is unpacked once into a woven tile of two sub-tiles of 16 rows (LANES),
one after the other:

    tu    the levels + LEVEL_OFF (128) as unsigned bytes, whatever the type's own offset; per
          16-value half h and quad j of it one 64-byte vector holding the quad's 4 levels of each
          of the sub-tile's 16 rows, so one vpdpbusd with the activation quad broadcast gives 16
          rows' partial sums in 16 lanes;
    tdsc  f32 d * scale of each row's half (row scale included);
    tws   for types with mins only (whose levels stay as stored): f32 weight of each half's
          activation sum (-d scale OFF + dm min).

and every token then costs per 32 values and 16 rows 8 vpdpbusd (512-bit) with the activation
quads broadcast once for both sub-tiles (the broadcast-from-memory pattern alone, 8 chains of 8,
ran at 6.7 G vpdpbusd/s on Zen 5 against 8.2 with each broadcast serving two vectors, 12 chains), each half's sum started at c16 (-128 * the half's sum of q: the
offset's term in integers, one broadcast), one or two converts and their d * scale, the activation
scale once, and for mins the activation-sum weights: no horizontal sums, no per-row work.  The
row dots' records (BLOCK_DOTS, plus GEMM_ONLY for Q8_0 / Q4_0) feed the packing, so every block type gets the
GEMM; the _R4 layouts are packed from simd_r4's records and Q8_0_R8 / Q4_0_R8 from their woven
runs (WEAVE says which packing a type takes).  Activations are quant.matmul's (q, s, bs, b16, c16)
with the f32 per-16 sums and c16 = -LEVEL_OFF * the int per-16 sums.

Without AVX512-VNNI, AVX2 CPUs get tile_gemm_avx2: the same tiles and loop, a sub-tile (two ymm
registers a line) at a time (a run-time loop: one body per form) for TOKENS_AVX2 activation rows,
each 32 bytes of a line taking vpsignb + vpmaddubsw (_avx2_pairs) where vpdpbusd takes one
instruction per 64, and a vpmaddwd + vpaddd per quad, or for types whose levels stay within
SMALL_LEVEL (SMALL: the K-quants, Q4_0, Q5_0, IQ2_K, ...) per half: its four quads' int16 pair sums
are added first.
Otherwise the generic IR form is compiled (LLVM lowers the 512-bit vectors to what the CPU has),
and quant.kernels keeps the GEMM off (HAS_GEMM).

Development note (as quant.simd): after editing this module delete quant/__pycache__/*.nb*.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (HAS_AVX2, HAS_VNNI, QK, _F32, _I8, _I32, _call, _const_i64, _halves, _quads, _splat,
                   _unpack_q4_0_r8, _unpack_q8_0_r8, _vec, dpbusd, signed_pairs, unsigned_pairs)
from .simd_blocks import (BLOCK_DOTS, GEMM_ONLY, BlockDot, _cv, _f16, _f32, _gep, _ld, _per_half, for_type,
                          prefetch, row_pieces, sum_weights, switch_value, type_switch)
from .simd_r4 import R4_DOTS, R4Dot, _dup8
from .types import type_info

LANES = 16         # weight rows per 512-bit vector (one lane each)
ROWS = 32          # weight rows per tile: two vectors of LANES, each activation quad's broadcast serving both
# the tile's levels are stored + LEVEL_OFF, whatever the type's own offset: the offset's term is then
# one integer per activation row and 16 values (c16, quant.kernels), started into each half's sum,
# instead of an f32 weight per half multiplied per token (types with mins keep that for the mins)
LEVEL_OFF = 128
# activation rows per pass over one sub-tile, over two (the tile's vectors are loaded once for them);
# 2-core Zen 5 (AVX-512 at full width), one thread, n = 512, 4096^2, one sub-tile: 4 -> 8 took Q4_K
# 41.9 -> 35.7 ms, Q6_K 41.5 -> 30.8, Q8_0 37.1 -> 32.2, IQ4_XS 35.2 -> 31.7; 6 and 12 were slower than
# 8 (12: register spills).  Two sub-tiles take 6 (2 x 6 sums and accumulators).  Types with mins
# (Q4_K, Q5_K, Q4_1, Q5_1, Q2_K) add their f32 term after the integer loop (mins_step): inside it, its
# weights and accumulators spilled the 16 tile vectors, and such tiles were done a sub-tile at a time
# (scripts/bench_tile_gemm.py, 1536 x 2048, one thread: Q4_K n = 48 0.62 -> 0.57 ms, n = 256 2.95 -> 2.58)
TOKENS = (8, 6)
# AVX2 (16 ymm registers, a sub-tile at a time): activation rows per pass
TOKENS_AVX2 = (4, 4)
_V16F = _vec(_F32, LANES)
_V16I = _vec(_I32, LANES)
_V64B = _vec(_I8, 64)


# ----------------------------------------------------------------------------------------
# packing: weight rows -> tile
# ----------------------------------------------------------------------------------------
def _subs(b: ir.IRBuilder, cols):
    """(elements of a sub-tile in tu as dwords, in tdsc / tws) for rows of cols values.  A tile is
    ROWS // LANES sub-tiles of LANES rows one after the other, each line of a sub-tile (a quad of tu,
    a half of tdsc / tws) one vector: the packing writes, and a pass over one sub-tile reads,
    contiguous memory (lines interleaved across the sub-tiles, 128 bytes apart, left half of L1's sets
    unused: Q4_K's per-vector passes, n = 256, ran 15 % slower than with 16-row tiles)."""
    return b.mul(b.udiv(cols, _const_i64(4)), _const_i64(LANES)), b.mul(b.udiv(cols, _const_i64(16)), _const_i64(LANES))


def _sub_tiles(b: ir.IRBuilder, nrows, cols, tu, tdsc, tws, unit: int):
    """Per sub-tile: (its first tile row, its rows or groups of `unit` rows of the nrows packed, 0
    .. LANES / unit, its tu, tdsc, tws pointers).  The callers emit the packing once per sub-tile:
    as one run-time loop over the sub-tiles it packed in 0.16-0.19 ms instead of 0.105 (1536 x 2048,
    IQ4_XS / Q4_K)."""
    subq, subh = _subs(b, cols)
    out = []
    for v in range(ROWS // LANES):
        left = b.sub(nrows, _const_i64(LANES * v // unit))
        n = b.select(b.icmp_signed("<", left, _const_i64(0)), _const_i64(0),
                     b.select(b.icmp_signed(">", left, _const_i64(LANES // unit)), _const_i64(LANES // unit), left))
        at = [b.gep(p, [b.mul(sub, _const_i64(v))]) for p, sub in ((tu, subq), (tdsc, subh), (tws, subh))]
        out.append((_const_i64(LANES * v), n, *at))
    return out


def _rebase(b: ir.IRBuilder, u32, off):
    """Levels stored as level + off (4 bytes a lane of <8 x i32>; off an int, or per lane an
    <8 x i32>) -> level + LEVEL_OFF, byte-wise (wrapping adds: the result fits when the level is
    an int8)."""
    if isinstance(off, int):
        if off == LEVEL_OFF:
            return u32
        rep = ir.Constant(_vec(_I32, 8), [((LEVEL_OFF - off) & 255) * 0x01010101] * 8)
    else:
        # each lane's low byte repeated through the lane: a byte shuffle, not a vector multiply
        low = b.bitcast(b.sub(_cv([LEVEL_OFF] * 8), off), _vec(_I8, 32))
        rep = b.bitcast(b.shuffle_vector(low, low, _cv([4 * (k // 4) for k in range(32)])), _vec(_I32, 8))
    v32 = _vec(_I8, 32)
    return b.bitcast(b.add(b.bitcast(u32, v32), b.bitcast(rep, v32)), _vec(_I32, 8))


def _row_fields(b: ir.IRBuilder, fmt: BlockDot, rows, i, boff, ib, nh: int):
    """Block ib of tile row i: (f32 d * scale per half, None and the levels + LEVEL_OFF as <8 x i32>
    per sub-block; for types with mins the f32 weight of each half's activation sum (-d sc off +
    dm min) and the levels as the type stores them)."""
    row, rs = rows(i)
    blk = fmt.unpack(b, b.gep(row, [b.add(_const_i64(boff) if isinstance(boff, int) else boff,
                                          b.mul(ib, _const_i64(fmt.nbytes)))]))
    dh = b.fmul(_per_half(b, blk.d, nh), _splat(b, rs, _F32, nh), flags=["fast"])
    dsc = b.fmul(b.sitofp(blk.sc, _vec(_F32, nh)), dh, flags=["fast"])
    dm = None if blk.mins is None else b.fmul(_per_half(b, blk.dm, nh), _splat(b, rs, _F32, nh), flags=["fast"])
    if blk.mins is not None:        # the mins' term is f32 per half anyway: the offset's joins it
        return dsc, sum_weights(b, blk.sc, blk.off, dh, blk.mins, dm), [b.bitcast(u, _vec(_I32, 8)) for u in blk.us]
    us = []
    for j, u in enumerate(blk.us):
        off = blk.off if isinstance(blk.off, int) else \
            b.shuffle_vector(blk.off, blk.off, _cv([2 * j] * 4 + [2 * j + 1] * 4))
        us.append(_rebase(b, b.bitcast(u, _vec(_I32, 8)), off))
    return dsc, None, us


def _transpose4(b: ir.IRBuilder, vs: list, n: int) -> list:
    """Four n-lane vectors -> n 4-lane vectors: result k = (vs[0][k], .., vs[3][k])."""
    a = b.shuffle_vector(vs[0], vs[1], _cv(range(2 * n)))
    c = b.shuffle_vector(vs[2], vs[3], _cv(range(2 * n)))
    return [b.shuffle_vector(a, c, _cv([k, n + k, 2 * n + k, 3 * n + k])) for k in range(n)]


def _pack_blocks(b: ir.IRBuilder, fmt: BlockDot, rows, nrows, boff, nb, h0, tu, tdsc, tws, ahead=None) -> bool:
    """Blocks 0 .. nb - 1 of fmt at byte boff of every row (rows(i) -> (row pointer, row scale))
    into the rows i < nrows (<= LANES) of a sub-tile, their first half being half h0 (ahead(i): row
    i's pointer, past the sub-tile's rows too).  Block-major: the 16 rows of
    one block write the same 4 KiB of tile (row-major packing measured 4.6 ms for a 4096^2
    Q4_K tile set, its stores missing L1).  Four rows at a time, transposed in registers: four
    consecutive rows' fields are 16 contiguous bytes of the tile (one store instead of four
    extracts and stores); the last nrows % 4 rows one by one."""
    nsub = fmt.values // 32
    nh = 2 * nsub
    has_mins = False
    p4 = lambda p: b.bitcast(p, _vec(p.type.pointee, 4).as_pointer())   # noqa: E731
    with cgutils.for_range(b, nb) as loop:
        ib = loop.index
        hb = b.add(h0, b.mul(ib, _const_i64(nh)))
        if ahead is not None:       # the same block of the next tile's rows, into L2
            with cgutils.for_range(b, _const_i64(LANES)) as pl:
                bo = b.add(_const_i64(boff) if isinstance(boff, int) else boff, b.mul(ib, _const_i64(fmt.nbytes)))
                prefetch(b, b.gep(ahead(b.add(pl.index, _const_i64(ROWS))), [bo]), 0, fmt.nbytes, locality=2)
        quads = [b.add(b.mul(b.add(hb, _const_i64(2 * j + m // 4)), _const_i64(4)), _const_i64(m % 4))
                 for j in range(nsub) for m in range(8)]
        with cgutils.for_range(b, b.udiv(nrows, _const_i64(4))) as rl:
            i0 = b.mul(rl.index, _const_i64(4))
            f = [_row_fields(b, fmt, rows, b.add(i0, _const_i64(k)), boff, ib, nh) for k in range(4)]
            for h, dv in enumerate(_transpose4(b, [x[0] for x in f], nh)):
                at = b.add(b.mul(b.add(hb, _const_i64(h)), _const_i64(LANES)), i0)
                b.store(dv, p4(b.gep(tdsc, [at])), align=4)
            if f[0][1] is not None:
                has_mins = True
                for h, wv in enumerate(_transpose4(b, [x[1] for x in f], nh)):
                    at = b.add(b.mul(b.add(hb, _const_i64(h)), _const_i64(LANES)), i0)
                    b.store(wv, p4(b.gep(tws, [at])), align=4)
            for j in range(nsub):
                for m, v in enumerate(_transpose4(b, [x[2][j] for x in f], 8)):
                    b.store(v, p4(b.gep(tu, [b.add(b.mul(quads[8 * j + m], _const_i64(LANES)), i0)])), align=4)
        with cgutils.for_range(b, b.urem(nrows, _const_i64(4))) as rl:
            i = b.add(b.mul(b.udiv(nrows, _const_i64(4)), _const_i64(4)), rl.index)
            dsc, ws, us = _row_fields(b, fmt, rows, i, boff, ib, nh)
            for h in range(nh):
                at = b.add(b.mul(b.add(hb, _const_i64(h)), _const_i64(LANES)), i)
                b.store(b.extract_element(dsc, ir.Constant(_I32, h)), b.gep(tdsc, [at]))
                if ws is not None:
                    b.store(b.extract_element(ws, ir.Constant(_I32, h)), b.gep(tws, [at]))
            for j, u32 in enumerate(us):
                for m in range(8):
                    b.store(b.extract_element(u32, ir.Constant(_I32, m)),
                            b.gep(tu, [b.add(b.mul(quads[8 * j + m], _const_i64(LANES)), i)]))
    return has_mins


def _pack_intrinsic(records: dict, label: str, case: Callable):
    """An intrinsic f(qtype, buf, base, stride, n, cols, tu, tdsc, tws) -> int that packs n rows
    (or groups) of a type in records: case(builder, record, row pointer at byte base + i
    stride of buf, n, cols, tu (i32 *), tdsc, tws) -> whether the type has mins, per type
    (quant.simd_blocks.type_switch).  Returns NOT_PACKED, PACKED or PACKED_MINS (tws written:
    the GEMM must add the mins' term)."""
    @intrinsic
    def pack(typingctx, qtype, buf, base, stride, n, cols, tu, tdsc, tws):
        if not all(isinstance(x, types.Array) for x in (buf, tu, tdsc, tws)):
            return None
        recs, qty = for_type(records, qtype)
        sig = types.int64(qty, buf, types.int64, types.int64, types.int64, types.int64, tu, tdsc, tws)

        def codegen(context, builder, sig, args):
            b = builder
            qt = switch_value(qtype, args[0])
            bufv, basev, stridev, nv, cols = args[1:6]
            wbuf = context.make_array(sig.args[1])(context, b, bufv)
            tu_p = b.bitcast(context.make_array(sig.args[6])(context, b, args[6]).data, _I32.as_pointer())
            tdsc_p = context.make_array(sig.args[7])(context, b, args[7]).data
            tws_p = context.make_array(sig.args[8])(context, b, args[8]).data

            def at(i):
                return b.gep(wbuf.data, [b.add(basev, b.mul(i, stridev))])
            code = cgutils.alloca_once_value(b, _const_i64(NOT_PACKED))

            def one(fmt):
                mins = case(b, fmt, at, nv, cols, tu_p, tdsc_p, tws_p)
                b.store(_const_i64(PACKED_MINS if mins else PACKED), code)
            type_switch(b, qt, recs, label, one)
            return b.load(code)
        return sig, codegen
    return pack


NOT_PACKED, PACKED, PACKED_MINS = 0, 1, 2


def _pack_plain(b: ir.IRBuilder, fmt: BlockDot, at, nrows, cols, tu, tdsc, tws) -> bool:
    def rows(i):
        row = at(i)
        rs = {"f32": lambda: _f32(b, row, 0), "f16": lambda: _f16(b, row, 0),
              "": lambda: ir.Constant(_F32, 1.0)}[fmt.row_scale]()
        return row, rs
    mins = None
    for r0, n, stu, stdsc, stws in _sub_tiles(b, nrows, cols, tu, tdsc, tws, 1):      # 16 rows' streams at a time
        rows_v = lambda i, r0=r0: rows(b.add(i, r0))       # noqa: E731
        # (the groups of 4 serve the short rows of generation: here they only cost compile time)
        for k, (rec, nb, v0, boff) in enumerate(row_pieces(b, fmt, cols, every_tail=False)):
            m = _pack_blocks(b, rec, rows_v, n, boff, nb, b.udiv(v0, _const_i64(16)), stu, stdsc, stws,
                             ahead=(lambda i, r0=r0: at(b.add(i, r0))) if k == 0 else None)
            assert mins is None or m == mins, fmt.name
            mins = m
    return mins


# tile_pack(qtype, buf, base, stride, nrows, cols, tu, tdsc, tws) -> NOT_PACKED / PACKED /
# PACKED_MINS: the rows at byte base + i stride of buf, i < nrows (<= ROWS), into tile rows i (tu:
# uint8 levels + LEVEL_OFF, ROWS * cols bytes; tdsc / tws: f32, cols // 16 * ROWS floats, tws only
# for PACKED_MINS; _subs gives the layout); each sub-tile's 16 rows packed before the next's (their
# 16 read streams: all 32 rows at once packed a 2048-column tile in 0.20-0.24 ms, 16 at a time in 0.105); rows nrows.. are left as they are.  NOT_PACKED (nothing written) for a
# type without a BLOCK_DOTS or GEMM_ONLY (Q8_0, Q4_0) record.
PLAIN_PACKS = {**BLOCK_DOTS, **GEMM_ONLY}
tile_pack = _pack_intrinsic(PLAIN_PACKS, "pack", _pack_plain)


def _pack_r4_blocks(b: ir.IRBuilder, fmt: R4Dot, groups, ngroups, nb, tu, tdsc, tws, ahead) -> bool:
    """The _R4 form: blocks 0 .. nb - 1 of every 4-row group g < ngroups (<= LANES / 4; groups(g) ->
    (block pointer, <4 x f32> row scales)) into rows 4 g .. 4 g + 3 of a sub-tile.  A run's dword lane (m, k)
    already holds row k's 4 levels at offset ao[m] of its sub-block, and the group's 4 rows are
    4 consecutive tile lanes: one 16-byte store per (run, m), no unpacking to the plain rows first (quant.interleaved's table-driven unpack measured
    slower than the _R4 row dots it would feed)."""
    v8f = _vec(_F32, 8)
    p4 = lambda p: b.bitcast(p, _vec(p.type.pointee, 4).as_pointer())   # noqa: E731
    with cgutils.for_range(b, nb) as loop:
        ib = loop.index
        hb = b.mul(ib, _const_i64(16))
        with cgutils.for_range(b, _const_i64(LANES // 4)) as pl:      # the next tile's block, into L2
            prefetch(b, b.gep(ahead(b.add(pl.index, _const_i64(ROWS // 4))), [b.mul(ib, _const_i64(fmt.nbytes))]), 0,
                     fmt.nbytes, locality=2)
        with cgutils.for_range(b, ngroups) as gl:
            g = gl.index
            bp, rs4 = groups(g)
            blk = fmt.unpack(b, b.gep(bp, [b.mul(ib, _const_i64(fmt.nbytes))]))
            d8 = _dup8(b, b.fmul(blk.d, rs4, flags=["fast"]))
            dm8 = None if blk.dm is None else _dup8(b, b.fmul(blk.dm, rs4, flags=["fast"]))
            for si, sub in enumerate(blk.subs):
                dsc = b.fmul(b.sitofp(sub.scale, v8f), d8, flags=["fast"])
                mn = None if dm8 is None else \
                    b.zext(b.shuffle_vector(blk.mins, blk.mins, _cv([4 * si + k for k in range(4)] * 2)), _vec(_I32, 8))
                ws = None if mn is None else sum_weights(b, sub.scale, sub.off, d8, mn, dm8)
                # lanes (h or m, k): the group's 4 rows are 4 consecutive tile lanes, one 16-byte store
                g4 = b.mul(g, _const_i64(4))
                for h in range(2):
                    at = b.add(b.mul(b.add(hb, _const_i64(2 * si + h)), _const_i64(LANES)), g4)
                    lanes = _cv(range(4 * h, 4 * h + 4))
                    b.store(b.shuffle_vector(dsc, dsc, lanes), p4(b.gep(tdsc, [at])), align=4)
                    if ws is not None:
                        b.store(b.shuffle_vector(ws, ws, lanes), p4(b.gep(tws, [at])), align=4)
                for u, ao in sub.runs:
                    u32 = b.bitcast(u, _vec(_I32, 8))
                    if mn is None:
                        off = sub.off if isinstance(sub.off, int) else b.shuffle_vector(
                            sub.off, sub.off, _cv([ao[m] // 16 * 4 + k for m in range(2) for k in range(4)]))
                        u32 = _rebase(b, u32, off)
                    for m in range(2):
                        half, quad = 2 * si + ao[m] // 16, (ao[m] % 16) // 4
                        line = b.add(b.mul(b.add(hb, _const_i64(half)), _const_i64(4)), _const_i64(quad))
                        at = b.add(b.mul(line, _const_i64(LANES)), g4)
                        b.store(b.shuffle_vector(u32, u32, _cv(range(4 * m, 4 * m + 4))), p4(b.gep(tu, [at])), align=4)
            has_mins = blk.dm is not None
    return has_mins


def _pack_r4(b: ir.IRBuilder, fmt: R4Dot, at, ngroups, cols, tu, tdsc, tws) -> bool:
    def blocks(g):          # the group's first block (no load: also used past the last group)
        return _gep(b, at(g), 16) if fmt.row_scale == "f32" else at(g)

    def groups(g):
        if fmt.row_scale == "f32":
            return blocks(g), _ld(b, at(g), 0, 4, _F32)
        return blocks(g), ir.Constant(_vec(_F32, 4), [1.0] * 4)
    mins = None
    for r0, n, stu, stdsc, stws in _sub_tiles(b, ngroups, cols, tu, tdsc, tws, 4):
        g0 = b.udiv(r0, _const_i64(4))
        mins = _pack_r4_blocks(b, fmt, lambda g: groups(b.add(g, g0)), n, b.udiv(cols, _const_i64(256)), stu, stdsc,
                               stws, lambda g: blocks(b.add(g, g0)))
    return mins


# tile_pack_r4(qtype, buf, base, gstride, ngroups, cols, tu, tdsc, tws) -> int: tile_pack for the
# _R4 types of quant.simd_r4 (R4_DOTS): the 4-row groups at byte base + g gstride, g < ngroups
# (<= ROWS / 4), into tile rows 4 g .. 4 g + 3.
tile_pack_r4 = _pack_intrinsic(R4_DOTS, "packr4", _pack_r4)


@dataclass(frozen=True)
class R8Pack:
    """Q8_0_R8 / Q4_0_R8 (quant.simd's layouts and unpackers): per 32-value block of 8 rows, 8 f16
    d then woven runs of 32 bytes, each a quad of values of the 8 rows (quant.simd._unpack_*_r8
    give them as unsigned bytes with their activation offsets)."""
    name: str
    nbytes: int
    unpack: Callable
    off: int                # level offset of the unsigned bytes (128: int8 + 128; 8: nibbles)
    lmax: int               # bound on |level| (BlockDot.lmax)


def _pack_r8(b: ir.IRBuilder, fmt: R8Pack, at, ngroups, cols, tu, tdsc, tws) -> bool:
    """Blocks of every 8-row group g < ngroups into tile rows 8 g .. 8 g + 7: the woven 32-byte
    runs are the tile's layout already (8 rows' quad), so each is one store."""
    p8 = lambda p: b.bitcast(p, _vec(p.type.pointee, 8).as_pointer())   # noqa: E731
    for r0, n, tu, tdsc, tws in _sub_tiles(b, ngroups, cols, tu, tdsc, tws, 8):
        g0 = b.udiv(r0, _const_i64(8))
        with cgutils.for_range(b, b.udiv(cols, _const_i64(32))) as loop:
            ib = loop.index
            with cgutils.for_range(b, _const_i64(LANES // 8)) as pl:      # the next tile's block, into L2
                prefetch(b, b.gep(at(b.add(b.add(pl.index, g0), _const_i64(ROWS // 8))),
                                  [b.mul(ib, _const_i64(fmt.nbytes))]), 0, fmt.nbytes, locality=2)
            with cgutils.for_range(b, n) as gl:
                bp = b.gep(at(b.add(gl.index, g0)), [b.mul(ib, _const_i64(fmt.nbytes))])
                r8 = b.mul(gl.index, _const_i64(8))
                d, runs = fmt.unpack(b, bp, u8=True)
                for h in range(2):
                    at_h = b.add(b.mul(b.add(b.mul(ib, _const_i64(2)), _const_i64(h)), _const_i64(LANES)), r8)
                    b.store(d, p8(b.gep(tdsc, [at_h])), align=4)
                for v, ao in runs:               # activation offset ao: quad ao // 4 of the block's 8
                    quad = b.add(b.mul(ib, _const_i64(8)), _const_i64(ao // 4))
                    b.store(_rebase(b, b.bitcast(v, _vec(_I32, 8)), fmt.off),
                            p8(b.gep(tu, [b.add(b.mul(quad, _const_i64(LANES)), r8)])), align=4)
    return False


# tile_pack_r8(qtype, buf, base, gstride, ngroups, cols, tu, tdsc, tws) -> int: tile_pack for
# Q8_0_R8 / Q4_0_R8: the 8-row groups at byte base + g gstride, g < ngroups (<= ROWS / 8).
R8_PACKS = {208: R8Pack("Q8_0_R8", 16 + 8 * QK, _unpack_q8_0_r8, 128, 128),
            202: R8Pack("Q4_0_R8", 16 + 4 * QK, _unpack_q4_0_r8, 8, 8)}
tile_pack_r8 = _pack_intrinsic(R8_PACKS, "packr8", _pack_r8)

# type id -> the packing quant.kernels calls for it: 0 tile_pack (rows), 4 tile_pack_r4, 8 tile_pack_r8
WEAVE: dict[int, int] = {**{t: 0 for t in PLAIN_PACKS}, **{t: 4 for t in R4_DOTS}, **{t: 8 for t in R8_PACKS}}
# the types whose tiles hold one d * scale and activation-sum weight per 32 values (both halves
# alike: BlockDot.scale32; the _R8 packs write one per block of 32): tile_gemm's per32 form multiplies them
SCALE32: frozenset[int] = frozenset([t for t, r in PLAIN_PACKS.items() if r.scale32] + list(R8_PACKS))
# the SCALE32 types packed PACKED_MINS (levels as stored, offset 0, a min per sub-block: Q4_1, Q5_1,
# Q4_K, Q5_K; a test checks this against the packing): tile_gemm takes their activation sums per 32
# values (b16's pairs added once a call, quant.kernels) instead of adding the pair per tile and
# token: Q4_K / Q5_K 1536 x 2048, n = 48, pack + GEMM, one thread: +4-7 %
MINS32: frozenset[int] = frozenset(t for t, r in PLAIN_PACKS.items() if r.scale32 and r.off == 0)


def _lmax(t: int) -> int:
    """The bound on a WEAVE type's tile levels (BlockDot.lmax: |level| after LEVEL_OFF, or for
    levels stored with offset 0 the level); an _R4 type packs as its plain type."""
    if t in R8_PACKS:
        return R8_PACKS[t].lmax
    return BLOCK_DOTS[type_info(type_info(t).base).id].lmax if t in R4_DOTS else PLAIN_PACKS[t].lmax


# the WEAVE types whose levels stay within SMALL_LEVEL: the AVX2 GEMM adds a half's four int16 pair
# sums before one vpmaddwd (8 products a lane: 8 * 32 * 127 = 32512 < 2**15) instead of one
# vpmaddwd per quad
SMALL_LEVEL = 32
SMALL: frozenset[int] = frozenset(t for t in WEAVE if _lmax(t) <= SMALL_LEVEL)


def _form_of(t: int) -> tuple[bool, bool, bool, bool]:
    """(per32, mins, act256, small): the tile_gemm form a WEAVE type takes, from its record (the
    packing reports mins exactly for levels stored with offset 0; an _R4 type packs as its plain
    type)."""
    small = t in SMALL
    if t in R8_PACKS:
        return True, False, False, small
    if t in R4_DOTS:
        plain = BLOCK_DOTS[type_info(type_info(t).base).id]
        return False, plain.off == 0, plain.act256, small
    r = PLAIN_PACKS[t]
    return r.scale32, r.off == 0, r.act256, small


# type id -> its tile_gemm form: a call with a tag (quant.typetag) compiles only its group's forms
# (each form is a large unrolled body compiled into every caller; a first cold Q4_K + Q8_0 matmul
# compiled in 53-55 s with all eight, 38 s with its group's: 16-row tiles with all eight took
# 38.6); tests check it against quant.kernels' flags and the packing's codes
FORMS: dict[int, tuple[bool, bool, bool]] = {t: _form_of(t) for t in WEAVE}


# ----------------------------------------------------------------------------------------
# the GEMM: tile x activation rows
# ----------------------------------------------------------------------------------------
def _avx2_pairs(b: ir.IRBuilder, w, a, mins: bool):
    """The int16 pair sums (<32 x i16>) of the tile line w (64 bytes) times the activation quad a
    broadcast (64 bytes), with AVX2 (no VNNI): for mins tiles (levels as stored, 0..SMALL_LEVEL)
    one vpmaddubsw per 32 bytes; else w is (signed level, |level|), made once for every token of
    a chunk, and the level's sign moves onto the activations (quant.simd.signed_pairs): the true
    levels' sum, so that sum starts at 0, not c16."""
    if mins:
        return _halves(b, (w, a), lambda x, y: unsigned_pairs(b, x, y))
    lev, mag = w
    return _halves(b, (lev, mag, a), lambda x, m, y: signed_pairs(b, x, y, m))


def _gemm_body(context, b: ir.IRBuilder, sig, args, vnni: bool, per32: bool, mins: bool, act256: bool,
               nv: int, v0, avx2: bool = False, small: bool = False) -> None:
    """One form of the GEMM over nv (1 or 2) of the tile's row vectors of LANES rows, from vector v0
    (an i64: 0 or 1).  per32:
    the tile's two halves of every 32 values share their d * scale and activation-sum weight
    (SCALE32): their integer sums are added, then converted and scaled once.  mins: a PACKED_MINS
    tile (levels as the type stores them, tws the f32 weights of the activation sums: mins and
    offset); else the levels carry + LEVEL_OFF and c16 starts each half's sum.  act256: the
    activations have one scale per 256 values (ik's Q8_K rule, each of its 8 entries of s alike;
    cols a multiple of 256): it is applied once per 256.  small (avx2 only): the tile's levels are
    within SMALL_LEVEL (SMALL), and a half's int16 pair sums are added before their vpmaddwd."""
    tu_p = context.make_array(sig.args[0])(context, b, args[0]).data
    tdsc_p = context.make_array(sig.args[1])(context, b, args[1]).data
    tws_p = context.make_array(sig.args[2])(context, b, args[2]).data
    nh = args[3]
    arrs = []
    for k in (4, 5, 6, 7, 10):    # q, s, b16, c16, out: data pointer and row stride in elements
        a = context.make_array(sig.args[k])(context, b, args[k])
        st = b.sdiv(b.extract_value(a.strides, 0), _const_i64(sig.args[k].dtype.bitwidth // 8))
        arrs.append((a.data, st))
    (qd, qst), (sd, sst), (fd, fst), (cd, cst), (od, ost) = arrs
    k0, ntok, r0, nrows = args[8], args[9], args[11], args[12]
    zf = ir.Constant(_V16F, [0.0] * LANES)
    vr = range(nv)
    lane0 = b.mul(v0, _const_i64(LANES))
    subq, subh = _subs(b, b.mul(nh, _const_i64(16)))

    def vec(p, line, sub, vt):
        """Line `line` of the nv sub-tiles from v0 on (p: elements of tu or tdsc / tws, sub: a sub-tile's), as vt."""
        return [b.load(b.bitcast(b.gep(p, [b.add(b.mul(line, _const_i64(LANES)), b.mul(b.add(v0, _const_i64(v)), sub))]),
                                 vt.as_pointer()), align=4) for v in vr]

    def chunk(t0, nt: int):
        """Tokens t0 .. t0 + nt - 1 (nt constant) over the whole tile."""
        tok = [b.add(k0, b.add(t0, _const_i64(t))) for t in range(nt)]
        qp = [b.gep(qd, [b.mul(t, qst)]) for t in tok]
        sp = [b.gep(sd, [b.mul(t, sst)]) for t in tok]
        fp = [b.gep(fd, [b.mul(t, fst)]) for t in tok]
        cp = [b.gep(cd, [b.mul(t, cst)]) for t in tok]
        accs = [[cgutils.alloca_once_value(b, zf) for _ in vr] for _ in range(nt)]
        for a in sum(accs, []):
            b.store(zf, a)
        baccs = [[cgutils.alloca_once_value(b, zf) for _ in vr] for _ in range(nt if act256 else 0)]

        def step(si):
            """The 32 values si: the two halves' products with their d * scale, then (per 32) the
            activation scale once, a 32 fewer than per half; act256: into baccs, scaled per 256."""
            hs = [b.add(b.mul(si, _const_i64(2)), _const_i64(k)) for k in range(2)]
            tu32 = b.bitcast(tu_p, _I32.as_pointer())        # a quad of LANES rows: LANES dwords
            ws = [[vec(tu32, b.add(b.mul(h, _const_i64(4)), _const_i64(j)), subq, _V64B) for j in range(4)] for h in hs]
            dsc = [vec(tdsc_p, h, subh, _V16F) for h in hs]
            if avx2 and not mins:       # (signed level, |level|) of each line, for all the chunk's tokens
                top = ir.Constant(_V64B, [-128] * 64)
                lv = [[[b.xor(x, top) for x in wv] for wv in wh] for wh in ws]
                ws = [[[(x, _call(b, "llvm.abs.v64i8", _V64B, x, ir.Constant(ir.IntType(1), 0))) for x in wv]
                       for wv in wh] for wh in lv]
            for t in range(nt):
                # one integer sum per half, or per32 one for both (8 dpbusd in one chain: the halves'
                # vpaddd and one of their two start broadcasts saved, ~8 % of the IQ4_XS GEMM).  The
                # levels carry + LEVEL_OFF: a sum starts at -LEVEL_OFF * (its values' sum of q); the
                # activation quad's broadcast serves the nv row vectors
                isums = []
                for hgroup in ([hs] if per32 else [[h] for h in hs]):
                    if mins or avx2:
                        isum = [ir.Constant(_V16I, [0] * LANES)] * nv
                    else:
                        c = b.load(b.gep(cp[t], [hgroup[0]]))
                        for h in hgroup[1:]:
                            c = b.add(c, b.load(b.gep(cp[t], [h])))
                        isum = [_splat(b, c, _I32, LANES)] * nv
                    for h in hgroup:
                        k = hs.index(h)
                        q16 = b.bitcast(b.gep(qp[t], [b.mul(h, _const_i64(16))]), _I32.as_pointer())
                        acts = [b.bitcast(_splat(b, b.load(b.gep(q16, [_const_i64(j)]), align=1), _I32, LANES), _V64B)
                                for j in range(4)]
                        if not avx2:
                            for j in range(4):
                                isum = [dpbusd(b, isum[v], ws[k][j][v], acts[j], vnni) for v in vr]
                            continue
                        # AVX2: the int16 pair sums of `run` quads added before one vpmaddwd (small
                        # levels: 4 quads, 8 products a lane, within 8 * SMALL_LEVEL * 127 < 2**15)
                        run = 4 if small else 1
                        for j0 in range(0, 4, run):
                            p16 = None
                            for j in range(j0, j0 + run):
                                x = [_avx2_pairs(b, ws[k][j][v], acts[j], mins) for v in vr]
                                p16 = x if p16 is None else [b.add(p16[v], x[v]) for v in vr]
                            isum = [b.add(isum[v], _halves(b, (p16[v],), lambda y: _quads(b, y))) for v in vr]
                    isums.append(isum)
                for v in vr:
                    if act256:      # each product straight into the 256's sum (an FMA each)
                        acc = b.load(baccs[t][v])
                        for isum, d in zip(isums, dsc):
                            acc = b.fadd(acc, b.fmul(b.sitofp(isum[v], _V16F), d[v], flags=["fast"]), flags=["fast"])
                        b.store(acc, baccs[t][v])
                    else:
                        part = None
                        for isum, d in zip(isums, dsc):
                            x = b.fmul(b.sitofp(isum[v], _V16F), d[v], flags=["fast"])
                            part = x if part is None else b.fadd(part, x, flags=["fast"])
                        sv = _splat(b, b.load(b.gep(sp[t], [si])), _F32, LANES)
                        b.store(b.fadd(b.load(accs[t][v]), b.fmul(part, sv, flags=["fast"]), flags=["fast"]),
                                accs[t][v])

        def mins_step(i):
            """The mins' (and offset's) f32 term of weight line i: its activation-sum weight times
            the tokens' activation sums (b16: per 32 for per32 tiles, MINS32, else per 16), after
            the integer loop, whose 16 live tile vectors leave no registers for it."""
            w = vec(tws_p, b.mul(i, _const_i64(2)) if per32 else i, subh, _V16F)
            for t in range(nt):
                fv = _splat(b, b.load(b.gep(fp[t], [i])), _F32, LANES)
                for v in vr:
                    b.store(b.fadd(b.load(accs[t][v]), b.fmul(w[v], fv, flags=["fast"]), flags=["fast"]), accs[t][v])

        if act256:      # 8 steps of 32 under one activation scale (its 8 entries of s are equal)
            with cgutils.for_range(b, b.udiv(nh, _const_i64(16))) as bl:
                for a in sum(baccs, []):
                    b.store(zf, a)
                with cgutils.for_range(b, _const_i64(8)) as il:
                    step(b.add(b.mul(bl.index, _const_i64(8)), il.index))
                for t in range(nt):
                    sv = _splat(b, b.load(b.gep(sp[t], [b.mul(bl.index, _const_i64(8))])), _F32, LANES)
                    for v in vr:
                        b.store(b.fadd(b.load(accs[t][v]), b.fmul(b.load(baccs[t][v]), sv, flags=["fast"]),
                                       flags=["fast"]), accs[t][v])
        else:
            with cgutils.for_range(b, b.udiv(nh, _const_i64(2))) as sl:
                step(sl.index)
        if mins:
            with cgutils.for_range(b, b.udiv(nh, _const_i64(2)) if per32 else nh) as ml:
                mins_step(ml.index)
        for t in range(nt):
            for v in vr:
                res = b.load(accs[t][v])
                first = b.add(lane0, _const_i64(LANES * v))     # the vector's first tile row
                dst = b.gep(od, [b.add(b.mul(tok[t], ost), b.add(r0, first))])
                left = b.sub(nrows, first)      # rows of this vector to store (1 .. LANES)
                with b.if_else(b.icmp_signed(">=", left, _const_i64(LANES))) as (then, otherwise):
                    with then:
                        b.store(res, b.bitcast(dst, _V16F.as_pointer()), align=4)
                    with otherwise:
                        with cgutils.for_range(b, left) as il:
                            b.store(b.extract_element(res, b.trunc(il.index, _I32)), b.gep(dst, [il.index]))

    # chunks of TOKENS[nv], then one of half that if that many are left, then single tokens (an
    # expert's share of a prompt is often a few dozen rows: its remainder is not done one by one)
    full = (TOKENS_AVX2 if avx2 else TOKENS)[nv - 1]
    nfull = b.udiv(ntok, _const_i64(full))
    with cgutils.for_range(b, nfull) as cl:
        chunk(b.mul(cl.index, _const_i64(full)), full)
    done = b.mul(nfull, _const_i64(full))
    half = full // 2
    with b.if_then(b.icmp_unsigned(">=", b.sub(ntok, done), _const_i64(half))):
        chunk(done, half)
    done = b.add(done, b.mul(b.udiv(b.sub(ntok, done), _const_i64(half)), _const_i64(half)))
    with cgutils.for_range(b, b.sub(ntok, done)) as rl:
        chunk(b.add(done, rl.index), 1)


def _gemm_intrinsic(vnni: bool, avx2: bool = False):
    """tile_gemm(tu, tdsc, tws, nh, q, s, b16, c16, k0, ntok, out, r0, nrows, per32, mins, act256, small,
    qtype): out[k0 + t, r0 + i] = tile row i dotted with activation row k0 + t (q int8, s f32 per
    32, b16 f32 per 16 sums, per 32 for per32 mins tiles (MINS32), c16 int32 -LEVEL_OFF * the
    per-16 sums of q), t < ntok, i < nrows (<= ROWS; one sub-tile's form up to LANES); nh = cols /
    16.  per32: for tiles of SCALE32 types; mins: for tiles packed PACKED_MINS; act256: s has one
    value per 256; small: levels within SMALL_LEVEL (SMALL types; only the AVX2 form uses it).
    The forms are branches of one kernel (constant flags leave LLVM one); qtype, an id or a tag: a
    tag's call holds only its group's forms (FORMS)."""
    @intrinsic
    def tile_gemm(typingctx, tu, tdsc, tws, nh, q, s, b16, c16, k0, ntok, out, r0, nrows, per32, mins, act256,
                  small, qtype):
        if not all(isinstance(x, types.Array) for x in (tu, tdsc, tws, q, s, b16, c16, out)):
            return None
        i64, bl = types.int64, types.boolean
        recs, qty = for_type(FORMS, qtype)
        # (an int qtype: all types' forms; without AVX2 the small flag makes no other body)
        forms = {f if avx2 else f[:3] + (False,) for f in recs.values()}
        sig = types.void(tu, tdsc, tws, i64, q, s, b16, c16, i64, i64, out, i64, i64, bl, bl, bl, bl, qty)

        def codegen(context, b, sig, args):
            for p32, m, k, sm in sorted(forms):
                flags = [(args[13], p32), (args[14], m), (args[15], k)] + ([(args[16], sm)] if avx2 else [])
                form = None
                for v, want in flags:
                    c = v if want else b.not_(v)
                    form = c if form is None else b.and_(form, c)
                # one body per form (each is compiled into every caller: a second one per form
                # doubled the kernels' cold compile time)
                with b.if_then(form):
                    if avx2:    # 16 ymm registers: one sub-tile at a time, a run-time loop over them
                        nsub = b.udiv(b.add(args[12], _const_i64(LANES - 1)), _const_i64(LANES))
                        with cgutils.for_range(b, nsub) as sl:
                            _gemm_body(context, b, sig, args, vnni, p32, m, k, 1, sl.index, avx2, sm)
                    else:       # both sub-tiles at once, whatever nrows (a second vector past nrows
                        # is computed, never stored)
                        _gemm_body(context, b, sig, args, vnni, p32, m, k, 2, _const_i64(0))
            return context.get_dummy_value()
        return sig, codegen
    return tile_gemm


# VNNI where the CPU has it, else the generic IR (LLVM lowers it to what the CPU has), which
# tile_gemm_generic always is (tests).  Per 32 values, one thread, n = 512, 4096^2, 2-core Zen 5:
# Q4_K 35.7 -> 33.5 ms, Q8_0 32.2 -> 29.9, IQ4_XS 31.7 -> 30.9
tile_gemm_generic = _gemm_intrinsic(False)
tile_gemm_avx2 = _gemm_intrinsic(False, True) if HAS_AVX2 else None
tile_gemm = _gemm_intrinsic(True) if HAS_VNNI else tile_gemm_avx2 or tile_gemm_generic
