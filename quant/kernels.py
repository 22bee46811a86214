"""Numba kernels for every compute type: row decoders, activation quantization, and the integer
matmul loops that call the row dots of quant.simd (Q8_0, Q4_0, _R8), quant.simd_blocks (the
other block types) and quant.simd_r4 (the _R4 layouts) for a few tokens, and from GEMM_MIN
tokens on quant.simd_gemm's integer GEMM on 32-row tiles (every simd_blocks / simd_r4 type,
Q8_0, Q4_0 and their _R8 forms; with AVX512-VNNI).

Calling convention shared by every weight kernel (quant.matmul builds these arguments):

    buf     read-only 1-D uint8 array (C layout) that starts at the first byte of row 0;
            row r starts at byte r * stride (of expert e: e * estride + r * stride).  Rows
            may be further apart than their length (a view into a memory map), so nothing
            here assumes stride == row bytes.
    qtype   GGML type id (ints below), branched on once per run of rows (quant.simd_blocks,
            simd_r4, simd_gemm) or per row (quant.simd), never per element.
    lut     F16_TO_F32: 65536-entry table that turns f16 bit patterns into f32 (block
            scales of the block types decoded by the other modules; decode_row reads them with
            the _half_to_f32 conversion instead).
    qk      the block size, 32.  It is an argument, not a constant, on purpose: with a
            constant trip count LLVM fully unrolls the 32-step block loops into scalar
            code; with a run-time count it vectorizes them (vpmaddwd for the int8 dots).

Activation side of the integer dot products: a row of f32 values is quantized once per
matmul into int8 values plus one scale per 32 (`quantize_act_q8`), with the rounding of the
Q8_2 blocks ik_llama.cpp uses for the same purpose (bf16 scale, round half to even); for the
GEMM of the types ik multiplies with Q8_K (quant.registry.ACT_Q8_256) one f32 scale per 256
values, written to each of its 32s (qk = 256).

The few-token kernels are one loop per type family: matvec_int (INT_DOT_TYPES) and
matvec_float (F16, BF16, F32), each serving plain matmuls, expert-indexed pairs (mul_mat_id)
and the fused SiLU gate/up product (see the section below).  The integer dots branch on the
type outside the block loops (quant.simd's per row; simd_blocks / simd_r4 once per run of
rows, where per row cost ~13 ns); for Q8_0 / Q4_0 that was measured
within 1-6 % of the former separate matvec_q8_0 / matvec_q4_0 (4096 x 4096, n = 1 and 4;
the float family within 1-6 % of the former matvec_float).
An earlier generic version (block dot inlined per block, or passed as a first-class
function) was 1.9-5x slower for Q4_0: the block loop stopped vectorizing.  What is called
through an address now is a whole run of 32 rows (run_address, quant.fnptr): matvec_int's
parallel loop compiles once for every type group, and each group's row dots and GEMM once, on
their own (a cold compile of the K-quants' products 43.7 -> 19.1 s, the IQK types' 54.9 ->
15.0 s, scripts/bench_compile.py; token times unchanged).

Inner loops index slices with the bare loop counter (`wv[j]`, not `buf[o + j]`): numba
must allow negative indices on `o + j`, and that wrap-around check blocks vectorization.

Everything is compiled lazily with cache=True; matmul passes the same argument types on
every call (read-only buf, int64 ints, C-contiguous arrays), so each kernel compiles once.
"""
from __future__ import annotations

import os

# Idle OpenMP threads of numba's pool sleep instead of spinning.  Must be set before numba
# starts the pool (its first parallel call), so it is done here, at import; an explicit
# setting in the environment wins.  Measured on a 2-core box shared with one busy process:
# a 2-thread Q8_0 4096x4096 matvec took 16 ms with the default spinning, 2 ms with PASSIVE;
# on an idle box PASSIVE costs ~5 % (1.00 -> 1.05 ms) and halves the many-token path's time
# (numba and OpenBLAS pools no longer spin against each other).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ... but a spin before sleeping: token generation runs ~10 small parallel kernels per layer
# back to back, and a parallel call after a 2 ms pause took min 26 / median 67 us (1.5 us while
# the pool spins).
# The spin used to be held at 1000 because a spinning numba worker took a core from OpenBLAS's
# threads in prompt processing (30000 spins: PP -50 %); since quant.gemm issues those GEMMs
# from inside numba's pool (OpenBLAS at one thread) nothing competes with it.  1B test model,
# 2 cores, Q4_0 (scripts/bench_spin.py): 1000 -> 30000 spins took TG from ~80 to ~93 t/s,
# PP512 unchanged (~250 t/s); 100000 measured the same as 30000.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

# numba's thread pool, started before any kernel runs: a cached kernel without parallel=True that
# calls a parallel one (matvec_act -> matvec_int) does not start it when loaded from the cache, and
# its first call then crashes (numba issue 8578; here a fresh process loading the Q8_0_R8 products
# from the cache died with SIGSEGV until this line)
numba.get_num_threads()

from . import fnptr as _fnptr, interleaved as _interleaved, registry as _reg, simd as _simd  # noqa: E402
from . import simd_blocks as _blocks  # noqa: E402  (integer row dots of the other block types)
from . import simd_r4 as _r4  # noqa: E402  (integer dots of the _R4 K-quant / IQK layouts)
from . import simd_gemm as _gemm  # noqa: E402  (integer GEMM of the simd_blocks types)
from .f32ops import f32_bits as _f32_bits  # noqa: E402
from .simd import amax32 as _amax32, isum16 as _isum16, q8_block32 as _q8_block32  # noqa: E402
from .iqk import decode_row_iqk  # noqa: E402
from .iquants import decode_row_iquants  # noqa: E402
from .ktquants import decode_row_kt, decode_row_kt_mm  # noqa: E402
from .kquants import decode_row_kquants  # noqa: E402
from .legacy import decode_row_legacy  # noqa: E402
from .numeric import F16_TO_F32, f16_at as _f16_at  # noqa: E402,F401
from .types import BY_ID as _BY_ID  # noqa: E402
from .typetag import QType, as_group, by_type, make_tag, qid  # noqa: E402

F32_ID, F16_ID, Q4_0_ID, Q8_0_ID, BF16_ID, Q6_0_ID = 0, 1, 2, 8, 30, 133
Q4_0_R8_ID, Q8_0_R8_ID = 202, 208   # ik_llama.cpp's 8-row interleaved forms (quant.simd)
# the types matvec_int multiplies (quant.registry: integer dots of quant.simd, simd_blocks, simd_r4)
INT_DOT_TYPES = _reg.INT_DOT_TYPES
_R4_KERNEL = _reg.id_table(lambda r: r.dot == _reg.DOT_R4, np.bool_, False)   # type id -> simd_r4 group dot
_GEMM_WEAVE = _reg.id_table(lambda r: r.gemm, np.int64, -1)      # type id -> simd_gemm's packing (-1: none)
_GEMM_SCALE32 = _reg.id_table(lambda r: r.id in _gemm.SCALE32, np.bool_, False)   # tile_gemm's per32 form
# tile_gemm's act256 form: the type's GEMM activations have one scale per 256 (quant.matmul._act)
_GEMM_ACT256 = _reg.id_table(lambda r: r.act == _reg.ACT_Q8_256, np.bool_, False)
_GEMM_MINS32 = _reg.id_table(lambda r: r.id in _gemm.MINS32, np.bool_, False)   # tile_gemm takes per-32 sums
_GEMM_SMALL = _reg.id_table(lambda r: r.id in _gemm.SMALL, np.bool_, False)     # tile_gemm's small form
# type id -> its row dot (simd_blocks, VNNI) reads the activations in PLANES_ORDER (row_dot_act)
_ROW_PLANES = _reg.id_table(lambda r: _simd.HAS_VNNI and r.id in _blocks.BLOCK_DOTS and _blocks.BLOCK_DOTS[r.id].planes,
                            np.bool_, False)
_PLANES_ORDER = np.array(_blocks.PLANES_ORDER, np.int64)
# type id -> the family decoder _decode_plain_rows calls for it (after the types it decodes inline)
_DEC_LEGACY, _DEC_KQUANTS, _DEC_IQK, _DEC_IQUANTS, _DEC_KT = 1, 2, 3, 4, 5
_DECODER = _reg.id_table(lambda r: {"legacy": _DEC_LEGACY, "kquants": _DEC_KQUANTS, "iqk": _DEC_IQK,
                                    "iquants": _DEC_IQUANTS, "ktquants": _DEC_KT}.get(r.family, 0)
                         if r.decodes and not r.info.interleave else 0, np.int64, 0)
QK = 32            # weights per block (Q8_0, Q4_0, activation q8)


def _group_key(r: _reg.TypeTraits) -> str:
    """The kernel group of a type (quant.typetag): its family; _R4/_R8 layouts by their plain
    type's family; Q8_0 / Q4_0 and their _R8 forms (read in place) on their own."""
    if r.info.interleave:
        if r.id in (Q4_0_R8_ID, Q8_0_R8_ID):
            return "r8"
        base = _reg.TRAITS.get(_interleaved.plain_type(r.id))
        return f"r:{base.family if base else r.id}"
    if r.dot == _reg.DOT_Q8:          # Q8_0 / Q4_0 (quant.simd's dots): in nearly every model
        return "q8"
    return r.family or f"id{r.id}"


def _groups() -> dict[int, frozenset[int]]:
    by_key: dict[str, set[int]] = {}
    for t, r in _reg.TRAITS.items():
        by_key.setdefault(_group_key(r), set()).add(t)
    return {t: frozenset(ids) for ids in by_key.values() for t in ids}


_GROUPS = _groups()
_R8_IDS = frozenset((Q4_0_R8_ID, Q8_0_R8_ID))


_TAG_OF: dict[int, QType] = {}


def tag(qtype: int) -> QType:
    """qtype as the kernels' argument that compiles them for its group only (quant.typetag).
    One dict lookup after the first call: get_rows and the cache reads ask per call."""
    t = _TAG_OF.get(qtype)
    if t is None:
        t = _TAG_OF[int(qtype)] = make_tag(qtype, _GROUPS.get(int(qtype), (int(qtype),)))
    return t


def readonly(buf: np.ndarray) -> np.ndarray:
    """buf, or a read-only view of it: weight buffers are mapped files, so the kernels are
    compiled for read-only arrays, and a writable one would compile each of them again."""
    if buf.flags.writeable:
        buf = buf.view()
        buf.flags.writeable = False
    return buf


# the KV-cache types' group (flash attention's decoder): the float types, Q8_0 / Q4_0 and the rest
# of the legacy family
_CACHE_TAG = make_tag(F16_ID, _GROUPS[F16_ID] | _GROUPS[Q8_0_ID] | _GROUPS[Q6_0_ID])

_opts = dict(cache=True, fastmath=True, nogil=True)


# ----------------------------------------------------------------------------------------
# scalar bit casts (numba has no float16 type; with these LLVM emits vcvtph2ps / plain moves
# and vectorizes the loops around them)
# ----------------------------------------------------------------------------------------
@intrinsic
def _half_to_f32(typingctx, h):
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _bits_to_f32(typingctx, u):
    """The f32 whose bit pattern is the low 32 bits of integer u."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        if u.bitwidth > 32:
            x = builder.trunc(x, ir.IntType(32))
        elif u.bitwidth < 32:
            x = builder.zext(x, ir.IntType(32))
        return builder.bitcast(x, ir.FloatType())
    return types.float32(u), codegen


# ----------------------------------------------------------------------------------------
# one row of weights -> f32
# ----------------------------------------------------------------------------------------
# _R4/_R8 types: R type id -> (interleave, plain type id, plain block size, plain block bytes,
# plain row meta); rows decode through quant.interleaved's unpack_group (a whole group at a
# time) and the plain type's decoder
def _r_table() -> np.ndarray:
    t = np.zeros((400, 5), np.int64)
    for ti in _BY_ID.values():
        if ti.interleave and ti.id < 400:
            pt = _BY_ID[_interleaved.plain_type(ti.id)]
            t[ti.id] = (ti.interleave, pt.id, pt.block_size, pt.type_size, pt.row_meta)
    return t


_R_TABLE = _r_table()


@njit(**_opts)
def _decode_interleaved_rows(buf, qtype, base, stride, n, cols, qk, lut, y, plain):
    """decode_rows_at for an _R4/_R8 type: row r (from the byte offset; repacked tensors are
    dense, so r = offset // row bytes) is row r % I of the group that starts at row r - r % I.
    Each group is unpacked once for all of its rows among the n, then decoded as the plain type
    (`plain`: its id, or its tag)."""
    qt = qtype
    il, pbs, pts, pmeta = _R_TABLE[qt, 0], _R_TABLE[qt, 2], _R_TABLE[qt, 3], _R_TABLE[qt, 4]
    prb = pmeta + cols // pbs * pts                   # plain row bytes (what unpack_group writes)
    rb = type_row_bytes(qt, cols)
    rows = np.empty((il, prb), np.uint8)
    flat = rows.reshape(-1)
    cur = -1
    for i in range(n):
        r = (base + i * stride) // rb
        k = r % il
        if r - k != cur:
            cur = r - k
            _interleaved.unpack_group(buf, qt, cur * rb, cols, rows)
        _decode_plain_rows(flat, plain, k * prb, 0, 1, cols, qk, lut, y[i:i + 1])


_ROW_BYTES = np.zeros((400, 3), np.int64)      # type id -> (block size, block bytes, row meta)
for _ti in _BY_ID.values():
    if _ti.id < 400:
        _ROW_BYTES[_ti.id] = (_ti.block_size, _ti.type_size, _ti.row_meta)


@njit(**_opts)
def type_row_bytes(qtype, cols):
    return _ROW_BYTES[qtype, 2] + cols // _ROW_BYTES[qtype, 0] * _ROW_BYTES[qtype, 1]


def _pick_rows_at(g: frozenset[int] | None):
    """decode_rows_at's body: for a tag, the path of its group (an _R8 pair, other _R4/_R8
    layouts, or plain rows); for an int, the branch over all three."""
    if g is not None and g <= _R8_IDS:
        def rows_r8(buf, qtype, base, stride, n, cols, qk, lut, y):
            _decode_r8_rows(buf, qid(qtype), base, stride, n, cols, qk, lut, y)
        return rows_r8
    if g is not None and all(t < 400 and _R_TABLE[t, 0] > 0 and t not in _R8_IDS for t in g):
        # a tag of every group the plain types belong to (Q8_K_R16 unpacks to Q8_0, its group's
        # others to K-quants): as_group types each member's plain id with it
        pids = sorted({int(_R_TABLE[t, 1]) for t in g})
        plain = make_tag(pids[0], frozenset().union(*(_GROUPS.get(p, frozenset((p,))) for p in pids)))

        def rows_r(buf, qtype, base, stride, n, cols, qk, lut, y):
            qt = qid(qtype)
            _decode_interleaved_rows(buf, qt, base, stride, n, cols, qk, lut, y, as_group(_R_TABLE[qt, 1], plain))
        return rows_r
    if g is not None and not any(t < 400 and _R_TABLE[t, 0] > 0 for t in g):
        def rows_plain(buf, qtype, base, stride, n, cols, qk, lut, y):
            _decode_plain_rows(buf, qtype, base, stride, n, cols, qk, lut, y)
        return rows_plain

    def rows_any(buf, qtype, base, stride, n, cols, qk, lut, y):
        qt = qid(qtype)
        if qt == Q8_0_R8_ID or qt == Q4_0_R8_ID:
            _decode_r8_rows(buf, qt, base, stride, n, cols, qk, lut, y)
        elif qt < 400 and _R_TABLE[qt, 0] > 0:                     # the other _R4/_R8 layouts
            _decode_interleaved_rows(buf, qt, base, stride, n, cols, qk, lut, y, _R_TABLE[qt, 1])
        else:
            _decode_plain_rows(buf, qt, base, stride, n, cols, qk, lut, y)
    return rows_any


_rows_at = by_type(1, _pick_rows_at)


@njit(**_opts)
def decode_rows_at(buf, qtype, base, stride, n, cols, qk, lut, y):
    """y[i, :cols] = the row at byte base + i * stride as f32, for i < n (qtype: an id, or a
    quant.typetag tag to compile for that type only).

    The one decoder of every type.  The type branch is taken once for all n rows: flash
    attention decodes blocks of short rows (8 cells of 192 values), where a call and a
    branch per row cost 2x its whole generation time for standard heads."""
    _rows_at(buf, qtype, base, stride, n, cols, qk, lut, y)


@njit(**_opts)
def _decode_r8_rows(buf, qtype, base, stride, n, cols, qk, lut, y):
    """decode_rows_at for Q8_0_R8 / Q4_0_R8, read in place: the tile path of -rtr models.
    Through unpack_group + the plain decoder these tiles took 2.7-3.3x longer (4096 x 4096,
    n = 512 matmul 2156 vs 792 ms for Q8_0_R8 vs Q8_0, one run on the loaded 2-core box)."""
    # row r of the tensor is row r % 8 of the group starting at row r - r % 8; rows are
    # contiguous (repacked tensors are always dense), so r follows from the byte offset
    q4 = qtype == Q4_0_R8_ID
    bs = 2 + (qk // 2 if q4 else qk)            # bytes per row per block
    rb = cols // qk * bs
    qs = buf.view(np.int8)
    for i in range(n):
        r = (base + i * stride) // rb
        k = r % 8
        g = (r - k) * rb
        for b in range(cols // qk):
            o = g + b * 8 * bs
            d = _f16_at(buf, o + 2 * k, lut)
            yv = y[i, b * qk:b * qk + qk]
            for l in range(qk // 8):
                for j in range(4):
                    if q4:
                        v = np.int32(buf[o + 16 + 32 * l + 4 * k + j])
                        yv[4 * l + j] = d * np.float32((v & 15) - 8)
                        yv[qk // 2 + 4 * l + j] = d * np.float32((v >> 4) - 8)
                    else:
                        yv[4 * l + j] = d * np.float32(qs[o + 16 + 32 * l + 4 * k + j])
                        yv[qk // 2 + 4 * l + j] = d * np.float32(qs[o + 16 + 128 + 32 * l + 4 * k + j])


@njit(**_opts)
def _rows_q8_0(buf, base, stride, n, cols, qk, lut, y):
    qs = buf.view(np.int8)
    hs = buf.view(np.uint16)        # block scales sit at even offsets (34-byte blocks)
    for i in range(n):
        for b in range(cols // qk):
            o = base + i * stride + b * (qk + 2)
            d = _half_to_f32(hs[o // 2])
            wv = qs[o + 2:o + 2 + qk]
            yv = y[i, b * qk:b * qk + qk]
            for j in range(qk):
                yv[j] = d * np.float32(wv[j])


@njit(**_opts)
def _rows_q4_0(buf, base, stride, n, cols, qk, lut, y):
    h = qk // 2
    hs = buf.view(np.uint16)        # 18-byte blocks: scales at even offsets
    for i in range(n):
        for b in range(cols // qk):
            o = base + i * stride + b * (h + 2)
            d = _half_to_f32(hs[o // 2])
            wv = buf[o + 2:o + 2 + h]
            lo = y[i, b * qk:b * qk + h]
            hi = y[i, b * qk + h:b * qk + qk]
            for j in range(h):
                v = np.int32(wv[j])
                lo[j] = d * np.float32((v & 15) - 8)
                hi[j] = d * np.float32((v >> 4) - 8)


@njit(**_opts)
def _rows_q6_0(buf, base, stride, n, cols, qk, lut, y):
    h = qk // 2
    e = qk // 4
    for i in range(n):
        for b in range(cols // qk):
            o = base + i * stride + b * (2 + e + h)
            d = _f16_at(buf, o, lut)
            hv = buf[o + 2:o + 2 + e]
            wv = buf[o + 2 + e:o + 2 + e + h]
            lo = y[i, b * qk:b * qk + h]
            hi = y[i, b * qk + h:b * qk + qk]
            for j in range(h):
                v = np.int32(wv[j])
                hb = np.int32(hv[j % e]) >> (4 * (j // e))
                lo[j] = d * np.float32(((v & 15) | ((hb << 4) & 0x30)) - 32)
                hi[j] = d * np.float32(((v >> 4) | ((hb << 2) & 0x30)) - 32)


@njit(**_opts)
def _rows_f16(buf, base, stride, n, cols, qk, lut, y):
    hv = buf.view(np.uint16)
    for i in range(n):
        o = (base + i * stride) // 2
        src = hv[o:o + cols]
        dst = y[i]
        for j in range(cols):
            dst[j] = _half_to_f32(src[j])


@njit(**_opts)
def _rows_bf16(buf, base, stride, n, cols, qk, lut, y):
    hv = buf.view(np.uint16)
    for i in range(n):
        o = (base + i * stride) // 2
        src = hv[o:o + cols]
        dst = y[i]
        for j in range(cols):      # bf16 bits are the top half of an f32
            dst[j] = _bits_to_f32(np.uint32(src[j]) << np.uint32(16))


@njit(**_opts)
def _rows_f32(buf, base, stride, n, cols, qk, lut, y):
    fv = buf.view(np.float32)
    for i in range(n):
        o = (base + i * stride) // 4
        src = fv[o:o + cols]
        dst = y[i]
        for j in range(cols):
            dst[j] = src[j]


# types decoded by their own loop above (the float types, and the legacy types of the KV cache)
_INLINE_ROWS = frozenset((Q8_0_ID, Q4_0_ID, Q6_0_ID, F16_ID, BF16_ID, F32_ID))
_FAMILY_ROW = frozenset((_DEC_LEGACY, _DEC_KQUANTS, _DEC_IQK, _DEC_IQUANTS, _DEC_KT))   # decode_row_<family>


@njit(**_opts)
def decode_cache_rows(buf, qtype, base, stride, n, cols, qk, lut, y):
    """decode_rows_at for the KV-cache types (the float types and the legacy 32-value blocks),
    qtype an int: kernels compiled once for every cache type (flash attention) hold only these
    decoders."""
    _decode_plain_rows(buf, as_group(qtype, _CACHE_TAG), base, stride, n, cols, qk, lut, y)


def _pick_plain(g: frozenset[int] | None):
    """_decode_plain_rows' body: the branches of the group's types only (closure constants:
    Numba prunes a branch on a False one before typing it), all of them for an int."""
    fams = {int(_DECODER[t]) for t in g if 0 <= t < 400} if g is not None else _FAMILY_ROW
    inline = _INLINE_ROWS if g is None else g & _INLINE_ROWS
    QS8, QS4, QS6, HF, BF, FF = (t in inline for t in (Q8_0_ID, Q4_0_ID, Q6_0_ID, F16_ID, BF16_ID, F32_ID))
    LG, KQ, IK, IQ, KT = (f in fams for f in (_DEC_LEGACY, _DEC_KQUANTS, _DEC_IQK, _DEC_IQUANTS, _DEC_KT))

    def plain_rows(buf, qtype, base, stride, n, cols, qk, lut, y):
        qt = qid(qtype)
        if QS8 and qt == Q8_0_ID:
            _rows_q8_0(buf, base, stride, n, cols, qk, lut, y)
        elif QS4 and qt == Q4_0_ID:
            _rows_q4_0(buf, base, stride, n, cols, qk, lut, y)
        elif QS6 and qt == Q6_0_ID:
            _rows_q6_0(buf, base, stride, n, cols, qk, lut, y)
        elif HF and qt == F16_ID:
            _rows_f16(buf, base, stride, n, cols, qk, lut, y)
        elif BF and qt == BF16_ID:
            _rows_bf16(buf, base, stride, n, cols, qk, lut, y)
        elif FF and qt == F32_ID:
            _rows_f32(buf, base, stride, n, cols, qk, lut, y)
        else:
            fam = _DECODER[qt] if 0 <= qt < 400 else 0
            if fam == 0:
                raise ValueError("decode_rows_at: unsupported type")
            for i in range(n):
                if LG and fam == _DEC_LEGACY:
                    decode_row_legacy(buf, qt, base + i * stride, cols, lut, y[i])
                elif KQ and fam == _DEC_KQUANTS:
                    decode_row_kquants(buf, qt, base + i * stride, cols, lut, y[i])
                elif IK and fam == _DEC_IQK:
                    decode_row_iqk(buf, qt, base + i * stride, cols, lut, y[i])
                elif IQ and fam == _DEC_IQUANTS:
                    decode_row_iquants(buf, qt, base + i * stride, cols, lut, y[i])
                elif KT and fam == _DEC_KT:
                    decode_row_kt_mm(buf, qt, base + i * stride, cols, lut, y[i])
                else:
                    raise ValueError("decode_rows_at: unsupported type")
    return plain_rows


_decode_plain_rows = by_type(1, _pick_plain)     # decode_rows_at for the plain (not row-interleaved) types


@njit(**_opts)
def decode_row(buf, qtype, base, cols, qk, lut, y):
    """Write the `cols` values of the row that starts at byte `base` into y[:cols]."""
    # np.int64, not the constants: a call with literals compiles a second decode_rows_at per group
    decode_rows_at(buf, qtype, base, np.int64(0), np.int64(1), cols, qk, lut, y[:cols].reshape(1, cols))


@njit(parallel=True, **_opts)
def _dequant_rows_switch(buf, qtype, stride, row_ids, cols, qk, lut, out):
    """dequant_rows compiled for qtype itself: an int compiles every type's decoder into it."""
    for i in prange(row_ids.shape[0]):
        decode_row(buf, qtype, row_ids[i] * stride, cols, qk, lut, out[i])


def dequant_rows(buf, qtype, stride, row_ids, cols, qk, lut, out) -> None:
    """out[i, :] = row row_ids[i] as f32, in parallel over i.  out: (len(row_ids), cols).  A tag
    (quant.typetag) decodes through its group's row kernel, called by address (rows_address):
    the loop compiles once for every group; an int through the decoder of every type."""
    if isinstance(qtype, QType):
        _dequant_by_address(qtype, False, buf, stride, row_ids, cols, qk, lut, out)
    else:
        _dequant_rows_switch(buf, qtype, stride, row_ids, cols, qk, lut, out)


def _pick_unscaled(g: frozenset[int] | None):
    """A row without the trellis types' matmul factor: their dequantize_row, else decode_row."""
    KT = g is None or any(0 <= t < 400 and _DECODER[t] == _DEC_KT for t in g)
    OTHER = g is None or any(not (0 <= t < 400 and _DECODER[t] == _DEC_KT) for t in g)

    def row(buf, qtype, base, cols, qk, lut, y):
        qt = qid(qtype)
        if KT and qt < 400 and _DECODER[qt] == _DEC_KT:
            decode_row_kt(buf, qt, base, cols, lut, y)
        elif OTHER:
            decode_row(buf, qtype, base, cols, qk, lut, y)
    return row


_row_unscaled = by_type(1, _pick_unscaled)


def dequant_rows_unscaled(buf, qtype, stride, row_ids, cols, qk, lut, out) -> None:
    """dequant_rows as ik's dequantize_row gives the rows (its get_rows): without the matmul
    factor the trellis types' decoders carry (quant.registry.TypeTraits.matmul_scale)."""
    _dequant_by_address(qtype if isinstance(qtype, QType) else tag(int(qtype)), True, buf, stride, row_ids, cols,
                        qk, lut, out)


def _dequant_by_address(qtype: QType, unscaled: bool, buf, stride, row_ids, cols, qk, lut, out) -> None:
    rows = np.ascontiguousarray(row_ids, dtype=np.int64)
    dst = out if out.flags.c_contiguous and out.dtype == np.float32 else np.empty(out.shape, np.float32)
    _dequant_rows_at(int(qtype), rows_address(qtype, buf, lut, unscaled), buf, stride, rows, cols, qk, lut, dst)
    if dst is not out:
        out[...] = dst


@njit(parallel=True, **_opts)
def _dequant_rows_at(qt, rows, buf, stride, row_ids, cols, qk, lut, out):
    """dequant_rows' loop: qt a plain type id, rows the address of its group's row kernel."""
    for i in prange(row_ids.shape[0]):
        # the arguments' types are the kernel's signature (rows_address): scalars made int64 here
        _fnptr.call_at(rows, (np.int64(qt), buf, np.int64(row_ids[i] * stride), np.int64(0), np.int64(1),
                              np.int64(cols), np.int64(qk), lut, out[i].reshape(1, cols)))


def _make_rows_kernel(proto: QType, unscaled: bool):
    """decode_rows_at (unscaled: ik's get_rows values, _row_unscaled) for proto's type group,
    called by its address with the type id as a plain int: the parallel loops around it
    (dequant_rows, quant.gemm's tiles) compile once for every group, and the group's decoders
    once, here, instead of once in each loop, its parfor gufunc and their wrappers."""
    if unscaled:
        @njit(**_opts)
        def rows_unscaled(qt, buf, base, stride, n, cols, qk, lut, y):
            t = as_group(qt, proto)
            for i in range(n):
                _row_unscaled(buf, t, base + i * stride, cols, qk, lut, y[i])
        return rows_unscaled

    @njit(**_opts)
    def rows(qt, buf, base, stride, n, cols, qk, lut, y):
        decode_rows_at(buf, as_group(qt, proto), base, stride, n, cols, qk, lut, y)
    return rows


_ROWS_KERNELS: dict = {}      # (group's Numba type, unscaled, buf's and lut's kinds) -> (kernel, its address)


def rows_address(qtype, buf: np.ndarray, lut: np.ndarray, unscaled: bool = False) -> int:
    """The address of the row decoder of qtype's group for these kinds of buf and lut: a
    function (qt, buf, base, stride, n, cols, qk, lut, y) with int64 scalars and y a C-contiguous
    (n, cols) f32 array, as decode_rows_at (compiled, or loaded from the cache, on first use)."""
    gty = (qtype if isinstance(qtype, QType) else tag(int(qtype)))._numba_type_

    def make():
        # buf typed read-only whether it is or not (the kernel only reads it; both kinds share
        # one data model): weights and quantized caches then share one compiled decoder
        bty = numba.typeof(buf)
        return (_make_rows_kernel(make_tag(min(gty.group), gty.group), unscaled),
                (_I64, bty.copy(readonly=True), _I64, _I64, _I64, _I64, _I64, numba.typeof(lut),
                 types.Array(types.float32, 2, "C")))
    # buf's writability left out of the key, as out of the kernel's type
    return _fnptr.cached_address(_ROWS_KERNELS, (gty, unscaled, _fnptr.arrays_key(buf, writability=False),
                                                 _fnptr.arrays_key(lut)), make)


@njit(cache=True, nogil=True, error_model="numpy")
def int8_levels(vals, d, q) -> bool:
    """q[i, j, k] = vals[i, j, k] / d[i, j] where every value is d times an int8 level exactly
    (d 0: the values must be 0, levels 0); False, q partly written, where one is not (a
    non-finite or corrupt scale).  One pass for quant.matmul's exact Q8_0 form of short rows
    (a NumPy form took 145-235 ms for DeepSeek-V3's 65536 x 128 attn_k_b, the whole conversion
    with this one ~25 ms)."""
    for i in range(vals.shape[0]):
        for j in range(vals.shape[1]):
            dj = d[i, j]
            for k in range(vals.shape[2]):
                v = vals[i, j, k]
                lev = np.rint(v / dj) if dj != 0 else np.float32(0.0)
                if not (-127.0 <= lev <= 127.0) or lev * dj != v:
                    return False
                q[i, j, k] = np.int8(lev)
    return True


# ----------------------------------------------------------------------------------------
# activations -> int8 + f32 scale per block
# ----------------------------------------------------------------------------------------
_qopts = dict(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz"})


@njit(**_qopts)
def _quantize_row_q8(xr, qk, qr, sr, br):
    """One row: the rule of the Q8_2 activation blocks ik_llama.cpp multiplies Q8_0 / Q4_0
    weights with: d = amax/127 rounded to bfloat16 (nearest even), q = x/d rounded to nearest
    even and saturated to -127..127 (never binding).  Matching it keeps perplexities within noise of the C++ tool.
    br: each block's sum of q (the VNNI kernels' offset correction, quant.simd).  qk must be QK:
    the loops use the constant, f32 bounds and the bf16 rounding on the bits (9216 values, one
    call: 14.8 -> 7.8 us); the block's max and rounding are quant.simd's 32-lane vector intrinsics."""
    for b in range(xr.shape[0] // QK):
        o = b * QK
        amax = _amax32(xr, o)
        d = amax / np.float32(127.0)
        if d > 0:       # to bf16, nearest even, on the bits (ggml's fp32 -> bf16; frexp / ldexp cost ~20 ns)
            u = _f32_bits(d)
            d = _bits_to_f32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        sr[b] = d
        br[b] = _q8_block32(xr, o, inv, qr)


@njit(**_qopts)
def _quantize_row_q8_k(xr, qr, sr, br):
    """One row by the rule of ik_llama.cpp's Q8_K activations (what its GEMM multiplies the IQ,
    IQK, Q2_K / Q3_K and IQK _R4 types with): per 256 values d = amax/127 in f32, q = x * (127/amax)
    rounded to nearest even.  The layout stays per 32: d is written to the 8 scales of its 256
    values (every kernel reads them as it reads Q8_2's), br the int32 sums of q per 32."""
    for b in range(xr.shape[0] // 256):
        o = b * 256
        amax = np.float32(0.0)
        for k in range(8):
            amax = max(amax, _amax32(xr, o + 32 * k))
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        for k in range(8):       # |x * inv| <= 127 (the saturation never binds)
            sr[8 * b + k] = d
            br[8 * b + k] = _q8_block32(xr, o + 32 * k, inv, qr)


@njit(**_qopts)
def _quantize_row(xr, qk, qr, sr, br):
    """One row: qk == QK the Q8_2 rule (_quantize_row_q8), qk == 256 the Q8_K rule
    (_quantize_row_q8_k; the row is whole 256s)."""
    if qk == 256:
        _quantize_row_q8_k(xr, qr, sr, br)
    else:
        _quantize_row_q8(xr, QK, qr, sr, br)


@njit(parallel=True, **_qopts)
def quantize_act_q8(x, qk, q, s, bs):
    """x (n, cols) f32 -> q (n, cols) int8, s (n, cols//32) f32 with x ~= q * s (per 32 values;
    qk 256: one scale per 256 values, written to its 8 entries), bs (n, cols//32) int32 block
    sums of q, in parallel over rows."""
    for t in prange(x.shape[0]):
        _quantize_row(x[t], qk, q[t], s[t], bs[t])


@njit(cache=True, nogil=True)
def block_sums16(q, s, i16, f16, c16):
    """i16[t, i] = the sum of q[t, 16 i:16 i + 16] (int32) and f16[t, i] = the same times the
    activation scale of its 32-block, s[t, i // 2] (f32, exact: an 11-bit sum times a bfloat16
    scale): the per-16 activation sums of the block types with 16-value sub-scales, level
    offsets or mins (quant.simd_blocks takes the f32 ones, quant.simd_r4 both; an i16 of
    another width is not written: Q8_0 / Q4_0 keep their per-32 sums there for quant.simd and
    take the f32 ones into quant.simd_gemm); c16 (when as wide as f16) = -LEVEL_OFF * i16, the
    start of the GEMM's per-16 sums (quant.simd_gemm)."""
    for t in range(q.shape[0]):
        _row_sums16(q[t], s[t], i16[t], f16[t], c16[t])


@njit(cache=True, nogil=True)
def _row_sums16(qr, sr, ir, fr, cr):
    """block_sums16 of one row."""
    ints = ir.shape[0] == fr.shape[0]      # else ir holds other sums (per 32): left alone
    tile = cr.shape[0] == fr.shape[0]
    for i in range(fr.shape[0]):
        acc = _isum16(qr, 16 * i)
        if ints:
            ir[i] = acc
        if tile:
            cr[i] = np.int32(-_gemm.LEVEL_OFF) * acc
        fr[i] = np.float32(acc) * sr[i // 2]


@njit(parallel=True, cache=True, nogil=True)
def quantize_act_q8_sums(x, qk, q, s, bs, b16, c16):
    """quantize_act_q8 then block_sums16 in the same parallel pass over rows (a prompt's block
    sums were a serial second pass: ~6 ms of a 512-token batch of the 2B test model)."""
    for t in prange(x.shape[0]):
        _quantize_row(x[t], qk, q[t], s[t], bs[t])
        _row_sums16(q[t], s[t], bs[t], b16[t], c16[t])


@njit(**_qopts)
def quantize_act_q8_serial(x, qk, q, s, bs, b16, c16):
    """quantize_act_q8 then block_sums16 (when b16 has columns) on the calling thread, in one
    call: for a few rows, waking the pool costs more (tens of microseconds with
    OMP_WAIT_POLICY=PASSIVE) than the work, and a second dispatch a few more."""
    for t in range(x.shape[0]):
        _quantize_row(x[t], qk, q[t], s[t], bs[t])
    if b16.shape[1]:
        block_sums16(q, s, bs, b16, c16)


@njit(parallel=True, cache=True, nogil=True)
def gather_rows(a, rows, out):
    """out[i] = a[rows[i]] in parallel over i (a prompt's pairs: NumPy's fancy indexing is one thread)."""
    for i in prange(rows.shape[0]):
        out[i, :] = a[rows[i], :]


@njit(parallel=True, cache=True, nogil=True)
def scatter_rows(src, rows, out):
    """out[rows[i]] = src[i] in parallel over i (rows distinct)."""
    for i in prange(rows.shape[0]):
        out[rows[i], :] = src[i, :]


# ----------------------------------------------------------------------------------------
# few-token matmuls: out[k, r] = dot(W_e[r], x[k]) for (expert e, activation row k) pairs
# ----------------------------------------------------------------------------------------
# Both kernel families take the pairs sorted by expert, in groups: pairs gb[g]:gb[g+1] use
# expert ge[g]; pair k's activation row is row k of x (or of q, s), and its result goes to
# out[k].  (quant.matmul gathers the activations into this order and scatters the results
# back.  Indexing through pair -> row maps instead measured 3-10 % slower for F16 / BF16.)
# The parallel loop runs over (group, run of ROW_RUN weight rows) items, so a weight row is
# read once for all pairs of its expert.  A plain matmul is one group: expert 0, pairs =
# tokens.  Expert e, row r of tensor a starts at byte e * esa + r * sa.
#
# fused=True adds a second tensor b ("up", same type and shape) and stores
# silu(a_row . x) * (b_row . x) in out (outb: scratch of out's shape): the gate/up
# projection of a SiLU MLP in one call over activations quantized once.  A work item takes
# FUSED_RUNS runs of rows: a's, then the same rows of b, then SiLU*mul on them.  a's and b's
# runs in turn (16 rows of each) measured ~10 % below two separate products (Q4_K, 16384 x 2048
# each, one token, 1 and 2 threads: 15.9 / 32 against 17.7 / 35 GB/s).
ROW_RUN = 32
assert ROW_RUN == _gemm.ROWS
FUSED_RUNS = 4      # runs per work item of the fused kernels (128 rows of a, then of b)
# From this many pairs on, a run of rows of a type quant.simd_gemm packs (WEAVE: the simd_blocks
# and simd_r4 types, Q8_0, Q4_0 and their _R8 forms) is packed into a tile and multiplied
# by quant.simd_gemm (with AVX512-VNNI): one thread, 4096^2, n = 8 /
# 64 / 512: Q4_K 3.7 / 11.1 / 71 ms against the row dots' 3.3 / 23 / (tiles + BLAS) 137 (16-row
# tiles).  Runs are a tile's 32 rows: 1536 x 2048, n = 48, pack + GEMM, one thread, 16 -> 32 rows:
# IQ4_XS 0.52 -> 0.44 ms, Q6_K 0.69 -> 0.52, Q4_K 0.64 -> 0.55, Q8_0 0.57 -> 0.49.
# Without VNNI, AVX2's form of the GEMM (quant.simd_gemm.tile_gemm_avx2): Zen 3, one thread, 4096^2,
# n = 512, against the f32 tiles + BLAS it replaces: see the README (AVX2)
HAS_GEMM = _simd.HAS_VNNI or _simd.HAS_AVX2
GEMM_MIN = 12 if HAS_GEMM else 1 << 62
HAS_SHORT_R8 = _simd.HAS_VNNI      # quant.matmul's short rows in _R8 form: measured with VNNI only


@njit(cache=True, nogil=True)
def group_pairs(ids, x_rows, n_expert, n_x, many):
    """Plan of a mul_mat_id over P (expert ids[p], activation row x_rows[p]) pairs, one pass
    in compiled code (in NumPy it took ~30 us a call, a third of a token's MoE time at T=1).

    Returns (order, counts, few, ge, gb, rows_identity, order_identity):
      order  (P,) pair indices grouped by expert (stable counting sort), experts ascending;
      counts (n_expert,) pairs per expert;
      few    number of leading entries of `order` that belong to experts with fewer than
             `many` pairs (the few-pair kernels' pairs; the rest go expert by expert to tiles);
      ge, gb the few-pair groups: pairs gb[g]:gb[g+1] of order[:few] use expert ge[g];
      rows_identity  x_rows[order[:few]] == 0..few-1 (no activation gather needed);
      order_identity order[:few] == 0..few-1 (results need no scatter).
    Raises IndexError on an expert id or row out of range."""
    P = ids.shape[0]
    counts = np.zeros(n_expert, np.int64)
    for p in range(P):
        e = ids[p]
        if e < 0 or e >= n_expert:
            raise IndexError("expert id out of range")
        if x_rows[p] < 0 or x_rows[p] >= n_x:
            raise IndexError("activation row out of range")
        counts[e] += 1
    # few-pair experts first, then the others, each part in expert order
    start = np.empty(n_expert, np.int64)
    pos = 0
    ng = 0
    for e in range(n_expert):
        if counts[e] > 0 and counts[e] < many:
            start[e] = pos
            pos += counts[e]
            ng += 1
    few = pos
    for e in range(n_expert):
        if counts[e] >= many:
            start[e] = pos
            pos += counts[e]
    ge = np.empty(ng, np.int64)
    gb = np.empty(ng + 1, np.int64)
    g = 0
    gb[0] = 0
    for e in range(n_expert):
        if counts[e] > 0 and counts[e] < many:
            ge[g] = e
            gb[g + 1] = start[e] + counts[e]
            g += 1
    order = np.empty(P, np.int64)
    fill = start.copy()
    for p in range(P):
        e = ids[p]
        order[fill[e]] = p
        fill[e] += 1
    rows_identity = True
    order_identity = True
    for i in range(few):
        rows_identity = rows_identity and x_rows[order[i]] == i
        order_identity = order_identity and order[i] == i
    return order, counts, few, ge, gb, rows_identity, order_identity


@njit(cache=True, nogil=True, inline="always")
def exp_f32(x):
    """e^x in f32 without a libm call, so that the loops around it vectorize: x clamped to
    [-87.3, 88], x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its degree-7 Taylor
    polynomial (relative error below 1e-8 there), times 2^n built on the exponent bits.  Within
    2 ulp of float64 exp (tests/test_kernels_exp.py).  silu at g < -88: g / (1 + e^88), ~1e-36
    in magnitude where libm's inf gave -0."""
    x = x if x > np.float32(-87.33) else np.float32(-87.33)     # selects (min / max branch on NaN)
    x = x if x < np.float32(88.0) else np.float32(88.0)
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = (x - n * np.float32(0.693145751953125)) - n * np.float32(1.4286068203094172e-06)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _bits_to_f32((np.int32(n) + np.int32(127)) * np.int32(8388608))     # (n + 127) << 23


@njit(cache=True, nogil=True, inline="always")
def _silu_mul(g, u):
    """silu(g) * u in f32 (exp_f32: the fused expert loops vectorize; libm's expf kept them scalar,
    10.6 ms for 3072 x 1536 values on one thread)."""
    return g / (np.float32(1.0) + exp_f32(-g)) * u


# The integer kernels are compiled without fastmath: numba's fastmath flags on the loops around
# quant.simd's row dots made LLVM restructure them and halved the Q8_0 matvec's speed
# (4096 x 4096, 2 threads: 12.6 vs 23 GB/s, measured); the IR sets its own fast flags.
_iopts = dict(cache=True, nogil=True)


@njit(inline="always", **_iopts)      # into run (_make_run_kernel): one library holds the group's code
def _gemm_rows(qtype, weave, buf, ebase, stride, r0, r1, k0, k1, cols, q, s, b16, c16, out):
    """out[k, r] for rows r0:r1 (<= 16; weave 4 / 8: an _R4 / _R8 layout, whole groups; 0:
    plain rows) and pairs k0:k1 through quant.simd_gemm (False: the type has no record there,
    nothing written)."""
    tu = np.empty(_gemm.ROWS * cols, np.uint8)
    tdsc = np.empty(cols // 16 * _gemm.ROWS, np.float32)
    tws = np.empty(cols // 16 * _gemm.ROWS, np.float32)
    if weave == 4:
        code = _gemm.tile_pack_r4(qtype, buf, ebase + r0 * stride, 4 * stride, (r1 - r0) // 4, cols, tu, tdsc, tws)
    elif weave == 8:
        code = _gemm.tile_pack_r8(qtype, buf, ebase + r0 * stride, 8 * stride, (r1 - r0) // 8, cols, tu, tdsc, tws)
    else:
        code = _gemm.tile_pack(qtype, buf, ebase + r0 * stride, stride, r1 - r0, cols, tu, tdsc, tws)
    if code == _gemm.NOT_PACKED:
        return False
    _gemm.tile_gemm(tu, tdsc, tws, cols // 16, q, s, b16, c16, k0, k1 - k0, out, r0, r1 - r0,
                    _GEMM_SCALE32[qid(qtype)], code == _gemm.PACKED_MINS, _GEMM_ACT256[qid(qtype)],
                    _GEMM_SMALL[qid(qtype)], qtype)
    return True


@njit(**_iopts)
def _sums32(b16):
    """Per-32 activation sums from per-16 ones (the f32 add the GEMM made per tile before)."""
    b32 = np.empty((b16.shape[0], b16.shape[1] // 2), np.float32)
    for t in range(b16.shape[0]):
        for i in range(b32.shape[1]):
            b32[t, i] = b16[t, 2 * i] + b16[t, 2 * i + 1]
    return b32


@njit(**_iopts)
def _takes_gemm(qt, n, cols, b16, c16):
    """True when _int_run gives n pairs of type id qt to quant.simd_gemm."""
    return n >= GEMM_MIN and qt < 400 and _GEMM_WEAVE[qt] >= 0 and b16.shape[1] * 16 == cols and \
        c16.shape[1] * 16 == cols


@njit(**_iopts)
def _planes_rows(q, k0, k1, qr):
    """Activation rows k0:k1 of q into qr in PLANES_ORDER: each 128 values' 16-value halves reordered."""
    for k in range(k0, k1):
        for c in range(0, q.shape[1], 128):
            for p in range(8):
                h = c + 16 * _PLANES_ORDER[p]
                qr[k, c + 16 * p:c + 16 * p + 16] = q[k, h:h + 16]


@njit(**_iopts)
def row_dot_act(qtype, q):
    """The int8 activations q (rows) as quant.simd_blocks.row_dot reads them for this type: q
    itself, or for a planes record with VNNI a copy in PLANES_ORDER."""
    qt = qid(qtype)
    if not (qt < 400 and _ROW_PLANES[qt]):
        return q
    qr = np.empty_like(q)
    _planes_rows(q, 0, q.shape[0], qr)
    return qr


@njit(**_iopts)
def _row_dot_act_pairs(qtype, q, gb, cols, b16, c16):
    """row_dot_act for the pair groups gb that go to the row dots (those that take the GEMM keep q's
    order and leave their rows of the copy unwritten)."""
    qt = qid(qtype)
    if not (qt < 400 and _ROW_PLANES[qt]):
        return q
    dots = False        # a prompt's products all take the GEMM: no copy then
    for g in range(gb.shape[0] - 1):
        dots = dots or not _takes_gemm(qt, gb[g + 1] - gb[g], cols, b16, c16)
    if not dots:
        return q
    qr = np.empty_like(q)
    for g in range(gb.shape[0] - 1):
        if not _takes_gemm(qt, gb[g + 1] - gb[g], cols, b16, c16):
            _planes_rows(q, gb[g], gb[g + 1], qr)
    return qr


@njit(inline="always", **_iopts)      # into run (_make_run_kernel): one library holds the group's code
def _int_run(qtype, buf, ebase, stride, r0, r1, k0, k1, nb, qk, lut, q, s, bs, b16, c16, b32, out, qr):
    """out[k, r] = row r . activation k for rows r0:r1 (from byte ebase on), pairs k0:k1.
    Interleaved types go 4 or 8 rows at a time (r0, r1 are multiples of that for them).
    From GEMM_MIN pairs every type quant.simd_gemm packs (WEAVE) goes through its GEMM; below,
    quant.simd_blocks / simd_r4 take TMAX activation rows a call (a weight block unpacked once
    for all of them; the tile of TMAX rows stays in L1 while the run's weight rows pass).
    qr: q as simd_blocks' row dots read it (_row_dot_act_pairs)."""
    cols = nb * qk
    qt = qid(qtype)      # a constant when qtype is a tag: LLVM drops the other types' branches
    # b16 is empty for Q8_0 / Q4_0 activations made for the row dots only (quant.matmul._act)
    if _takes_gemm(qt, k1 - k0, cols, b16, c16) and \
            _gemm_rows(qtype, _GEMM_WEAVE[qt], buf, ebase, stride, r0, r1, k0, k1, cols, q, s,
                       b32 if _GEMM_MINS32[qt] else b16, c16, out):
        return
    if qt < 400 and _R4_KERNEL[qt]:
        for kt in range(k0, k1, _blocks.TMAX):
            nt = min(_blocks.TMAX, k1 - kt)
            _r4.group_dot(qtype, buf, ebase + r0 * stride, 4 * stride, (r1 - r0) // 4, q, s, bs, b16, cols, kt, nt,
                          out, r0)
        return
    if qt == Q8_0_R8_ID or qt == Q4_0_R8_ID:
        for r in range(r0, r1, 8):
            gbase = ebase + r * stride
            for k in range(k0, k1):
                if qt == Q8_0_R8_ID:
                    _simd.group_dot_q8_0_r8(buf, gbase, q[k], s[k], bs[k], nb, out[k], r)
                else:
                    _simd.group_dot_q4_0_r8(buf, gbase, q[k], s[k], bs[k], nb, out[k], r)
        return
    if qt == Q8_0_ID or qt == Q4_0_ID:
        for r in range(r0, r1):
            base = ebase + r * stride
            for k in range(k0, k1):
                if qt == Q8_0_ID:
                    out[k, r] = _simd.row_dot_q8_0(buf, base, q[k], s[k], bs[k], nb)
                else:
                    out[k, r] = _simd.row_dot_q4_0(buf, base, q[k], s[k], bs[k], nb)
        return
    for kt in range(k0, k1, _blocks.TMAX):
        nt = min(_blocks.TMAX, k1 - kt)
        _blocks.row_dot(qtype, buf, ebase + r0 * stride, stride, r1 - r0, qr, s, bs, b16, cols, kt, nt, out, r0)


@njit(**_opts)
def _f32_run(qtype, buf, ebase, stride, r0, r1, k0, k1, cols, qk, lut, x, y, out):
    """The same for any type: each row decoded once into the f32 scratch y, then f32 dots."""
    for r in range(r0, r1):
        decode_row(buf, qtype, ebase + r * stride, cols, qk, lut, y)
        for k in range(k0, k1):
            xv = x[k]
            acc = np.float32(0.0)
            for j in range(cols):
                acc += y[j] * xv[j]
            out[k, r] = acc


# not fastmath (it would fold exp_f32's two-part ln2); numpy's error model (a division by zero
# unchecked) and row slices indexed from 0 (no wraparound selects): both kept the loop scalar
@njit(cache=True, nogil=True, error_model="numpy")
def _silu_mul_run(r0, r1, k0, k1, out, outb):
    for k in range(k0, k1):
        o = out[k, r0:r1]
        ob = outb[k, r0:r1]
        for r in range(o.shape[0]):
            o[r] = _silu_mul(o[r], ob[r])


def _make_run_kernel(proto: QType):
    """_int_run for proto's type group, called by its address (quant.fnptr) with the type id as
    a plain int: the drivers below then compile once for every group, and the group's code is
    compiled once, here (the K-quants' group, a cold few-token product: 43.7 -> 19.1 s)."""
    @njit(**_iopts)
    def run(qt, buf, ebase, stride, r0, r1, k0, k1, nb, qk, lut, q, s, bs, b16, c16, b32, out, qr):
        _int_run(as_group(qt, proto), buf, ebase, stride, r0, r1, k0, k1, nb, qk, lut, q, s, bs, b16, c16, b32,
                 out, qr)
    return run


# (group's Numba type, buffer's kind) -> (run kernel, its address)
_RUN_KERNELS: dict = {}
_I64 = types.int64


def run_address(qtype, buf: np.ndarray) -> int:
    """The address of _int_run compiled for qtype's group and buf's kind of array (compiled, or
    loaded from the cache, on first use)."""
    gty = (qtype if isinstance(qtype, QType) else tag(int(qtype)))._numba_type_

    def make():
        # the group's smallest id as the closure's tag: the same cache entry whichever type asks first
        i8, f32, i32 = (types.Array(dt, 2, "C") for dt in (types.int8, types.float32, types.int32))
        return (_make_run_kernel(make_tag(min(gty.group), gty.group)),
                (_I64, numba.typeof(buf), _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                 types.Array(types.float32, 1, "C"), i8, f32, i32, f32, i32, f32, f32, i8))
    return _fnptr.cached_address(_RUN_KERNELS, (gty,) + _fnptr.arrays_key(buf), make)


@njit(parallel=True, **_iopts)
def _matvec_rows(qt, run, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut, q, s, bs, b16, c16, ge, gb,
                 out, outb):
    """matvec_int's loop: qt a plain type id, run the address of its group's _int_run."""
    nb = cols // qk
    nrun = (nrows + ROW_RUN - 1) // ROW_RUN
    nch = (nrun + FUSED_RUNS - 1) // FUSED_RUNS if fused else nrun
    b32 = _sums32(b16) if qt < 400 and _GEMM_MINS32[qt] and c16.shape[1] else b16    # c16: some expert tiles
    qr = _row_dot_act_pairs(qt, q, gb, cols, b16, c16)
    per = FUSED_RUNS * ROW_RUN if fused else ROW_RUN
    for i in prange(ge.shape[0] * nch):
        g = i // nch
        c0 = (i - g * nch) * per
        c1 = min(nrows, c0 + per)
        nr = (c1 - c0 + ROW_RUN - 1) // ROW_RUN
        for j in range(2 * nr if fused else nr):      # a's runs, then (fused) b's
            b = j >= nr
            r0 = c0 + (j - nr if b else j) * ROW_RUN
            # the arguments' types are run's signature (run_address): scalars made int64 here
            _fnptr.call_at(run, (np.int64(qt), bufb if b else bufa, np.int64(ge[g] * (esb if b else esa)),
                                 np.int64(sb if b else sa), np.int64(r0), np.int64(min(c1, r0 + ROW_RUN)),
                                 np.int64(gb[g]), np.int64(gb[g + 1]), np.int64(nb), np.int64(qk), lut, q, s, bs,
                                 b16, c16, b32, outb if b else out, qr))
        if fused:
            _silu_mul_run(c0, c1, gb[g], gb[g + 1], out, outb)


def matvec_int(qtype, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut, q, s, bs, b16, c16, ge, gb, out,
               outb) -> None:
    """INT_DOT_TYPES weights . int8 activations (q, s, bs from quantize_act_q8, b16 and c16 from
    block_sums16, one row per pair), integer block sums.  out, outb: (n_pairs, nrows)."""
    _matvec_rows(int(qtype), run_address(qtype, bufa), bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut,
                 q, s, bs, b16, c16, ge, gb, out, outb)


@njit(**_iopts)
def _matvec_act(qt, run, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut, x, sums16, rows, ge, gb,
                out, outb):
    n = x.shape[0]
    q = np.empty((n, cols), np.int8)
    s = np.empty((n, cols // QK), np.float32)
    bs = np.empty((n, cols // 16 if sums16 else cols // QK), np.int32)
    b16 = np.empty((n, cols // 16 if sums16 else 0), np.float32)
    c16 = np.empty((n, 0), np.int32)
    quantize_act_q8_serial(x, QK, q, s, bs, b16, c16)
    if rows.shape[0]:
        q, s, bs, b16 = q[rows], s[rows], bs[rows], b16[rows]
    _matvec_rows(qt, run, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut, q, s, bs, b16, c16, ge, gb,
                 out, outb)


def matvec_act(qtype, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut, x, sums16, rows, ge, gb,
               out, outb) -> None:
    """matvec_int for a few activation rows x (f32, x.size small): x quantized here (as
    quantize_act_q8_serial; per-16 sums when sums16) and row rows[k] of it given to pair k (rows
    empty: pair k = row k).  One compiled call for a generated token's product instead of
    quant.matmul's activation arrays, quantizer call and matvec call: in generation the glue
    runs with caches emptied by the weights streaming past (~30 us a product, measured)."""
    _matvec_act(int(qtype), run_address(qtype, bufa), bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut,
                x, sums16, rows, ge, gb, out, outb)


@njit(parallel=True, **_opts)
def matvec_float(qtype, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, qk, lut, x, ge, gb, out, outb):
    """Any type . f32 activations (one row per pair), rows decoded to f32 one at a time."""
    nrun = (nrows + ROW_RUN - 1) // ROW_RUN
    nch = (nrun + FUSED_RUNS - 1) // FUSED_RUNS if fused else nrun
    for i in prange(ge.shape[0] * nch):
        g = i // nch
        c = i - g * nch
        y = np.empty(cols, dtype=np.float32)
        if not fused:
            r0 = c * ROW_RUN
            _f32_run(qtype, bufa, ge[g] * esa, sa, r0, min(nrows, r0 + ROW_RUN), gb[g], gb[g + 1], cols, qk, lut,
                     x, y, out)
            continue
        c0 = c * FUSED_RUNS * ROW_RUN
        c1 = min(nrows, c0 + FUSED_RUNS * ROW_RUN)
        _f32_run(qtype, bufa, ge[g] * esa, sa, c0, c1, gb[g], gb[g + 1], cols, qk, lut, x, y, out)
        _f32_run(qtype, bufb, ge[g] * esb, sb, c0, c1, gb[g], gb[g + 1], cols, qk, lut, x, y, outb)
        _silu_mul_run(c0, c1, gb[g], gb[g + 1], out, outb)
