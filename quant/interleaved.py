"""ik_llama.cpp's row-interleaved CPU layouts (the _R4 / _R8 types), bit-exact with its files.

An _R4 / _R8 tensor stores its rows in groups of I = 4 or 8 (quant.types: TypeInfo.interleave).
Within a group, block column b (values [b*B, (b+1)*B) of every row) is one "R block" that holds
the I plain blocks of that column, rearranged so that SIMD code loads 4 consecutive values of
I rows at once.  A group is therefore

    [row meta of rows 0..I-1]  R block 0 | R block 1 | ...     (I * row_bytes bytes)

(row meta: only IQ4_KS_R4 and IQ5_KS_R4, the f32 row scales of their 4 rows).  Except for
Q8_K_R8 every R block is a bit permutation of the I plain blocks, up to the sign bytes below:
nothing is recomputed, so repacking and unpacking are exact inverses and ik's
dequantize_row_<type>_r4/_r8 gives the same f32 as the plain decoder of the unpacked rows
(tests/test_interleaved.py and tests/test_interleaved_iq.py, against ik's bytes), with two
exceptions in ik's decoders: Q5_0_R4 / Q6_0_R4 compute d*q - 16d (32d), which is +0 where the
plain (q - 16)*d is -0 (`dequantize` returns ik's +0; the engine's decoders keep the -0, the
same value), and ik's dequantize_row_mxfp4_r8 loops over 8x too many blocks (it overruns its
buffers: only the first row of a call is right), so MXFP4_R8 is checked row by row.

Scrambled signs (IQ2_XXS_R4, IQ2_XS_R4, IQ3_XXS_R4): where the plain block holds a group's 7
sign bits s (ksigns_iq2xs index: the 8th sign is their parity), the R block holds t, the prefix
XOR of s (t_j = s_0 ^ ... ^ s_j), in a byte (t << 1 | one other bit), so that SIMD code gets the
8 signs as t ^ (t << 1).  A bijection but not a bit permutation: the builders below write s,
repack then maps those bytes (_SCRAMBLE), and unpack takes s_j = t_j ^ t_(j-1), a second source
bit XOR-ed into the first (the tables' fields are XOR-ed, which is an OR for all other types).

How an R block is built from the I plain blocks (ik's repack_<type>), with L the per-value
integer levels of a row (0..2^bits-1), k the row in the group, e a value index:

* scales and other per-row fields are copied into arrays of I entries (d[k], or d[k] followed
  by dmin[k]);
* per-sub-block fields with index j (scale, min, extra bit, high scale bits) go to a packed
  array at position is = I*j + k: byte is % N, bits w*(is // N) (N bytes of w-bit fields);
* the levels of each 32-value sub-block s are "woven": byte 4*I*m + 4*k + i of the sub-block's
  part holds L[32*s + i + off] for the offsets `off` of group m (one per bit field of the byte),
  i = 0..3 -- e.g. the nibble pairs (0,8) (16,24) (4,12) (20,28) of the _R4 4-bit types.

Q8_K_R8 has no plain file type: ik quantizes f32 rows to Q8_K (f32 d per 256) and stores d as
f16.  `unpack` turns it into Q8_0 rows (every 32-block gets the super-block's f16 d): the
same values exactly, in a type ikcli already decodes.  `plain_type` says which type unpack
gives.

ik's other special forms (R_TYPES_SPECIAL, tests/test_special_types.py):
* BF16_R16: 16 rows of bf16, interleaved by pairs of values: the block column is 2 values, 4
  bytes per row, stored row after row (byte 64*c + 4*k + i).  ik's ggml_quantize_chunk
  (repack_f32_bf16_r16) truncates f32 to bf16 (top 16 bits), unlike its BF16, which rounds:
  `quantize` does the same.  Unpacks to BF16 rows.
* Q8_K_R16: Q8_K_R8's layout with 16 rows (f16 d[16], quant byte 64*j + 4*k + i = q[4*j + i]),
  but the quants stored as q ^ 0x80: ik's repack_q16_k flips them unconditionally in its AVX512
  builds (the machines these files come from; its dequantize_row_q8_k_r16 assumes it).  The gather
  tables carry a constant XOR for it.  Unpacks to Q8_0 rows like Q8_K_R8.
* Q8_KV_R8: Q8_KV rows (row meta f32 d + i32 sum of the quants, quant.legacy), the group
  header holding the 8 d only (row meta 4), the quants woven as Q8_0_R8's.  Unpacks to Q8_KV
  rows, the sums recomputed (ik's are those of the stored quants: they never saturate).

IQ1_S_R4 (219) and IQ1_M_R4 (229) are not repackings: ik
quantizes them itself (quantize_iq1_s_r4 / _iq1_m_r4), with an f16 scale per row (the 4 of a
group first, as row meta) and blocks of 32 values x 4 rows: IQ1_S_R4 24 bytes (qs[16], qh
u16[4]: IQ1_S's fields per 32 values, 3-bit ls, value d (2 ls + 1)(g +- 1/8)), IQ1_M_R4 28
(qs[16], qh[8], scales[4]: a 4-bit ls per 16 values, value d ls (g +- 1/8), not IQ1_M's
2 ls + 1).  dequantize_iq1_s_r4 / dequantize_iq1_m_r4 decode them (bit-exact with ik);
iq1_s_r4_to_iq1_s converts IQ1_S_R4 rows to IQ1_S with the same values (256 | n_per_row).
IQ1_M_R4's values have no ggml type (4-bit scales without IQ1_M's 2 ls + 1, one f16 scale per
row): iq1_m_r4_to_rows moves each row's bytes together into ikcli's own IQ1_M_ROWS layout
(quant.types, internal; quant.iquants decodes it, quant.simd_blocks has its integer dot).
unpack / unpack_fast give these forms (NOT_REPACKED); quant.iq1_r4_quantize writes both types.

The ik "online" repacking (+127 for Q8_0_R8 with AVX512, xor 0x88 on ARM, xor 0x80 for
Q8_K_R8) only exists in memory; files hold the plain-order bytes implemented here.

Public:
    repack(raw, qtype_plain, nrows, n_per_row, qtype_r=None)   plain rows -> R rows (bytes)
    unpack(raw_R, qtype_R, nrows, n_per_row)     R rows -> plain rows (bytes of plain_type)
    dequantize(raw_R, qtype_R, nrows, n_per_row, dequantize_plain)   R rows -> f32 (nrows, n_per_row)
    quantize(x, qtype_R, imatrix, quantize_plain)   f32 rows -> R bytes, as ggml_quantize_chunk
    unpack_group(buf, qtype, gbase, n_per_row, out)   Numba: one group -> plain rows
    dequantize_iq1_s_r4 / dequantize_iq1_m_r4 / iq1_s_r4_to_iq1_s   (NumPy, see above)
unpack_group is one table-driven loop for all 27 types: each plain byte is the XOR (in effect
an OR) of a few bit fields of R bytes (4 plain bytes at a time where the layout moves 4 values
together).  The tables come from the NumPy repack itself, run at import on bit-labelled probe
blocks (about 30 ms), so the reference and the Numba path cannot disagree on a layout.  Cost,
measured on the shared 2-core dev box (unpack_fast on one thread, 1024 x 4096, CPU time): 0.8
(IQ2_S_R4) to 4.8 (Q5_0_R4, IQ3_S_R4: their high / sign bits move one at a time) ns per value,
several times the plain decoders' 0.3-0.5 ns: fine for loading or converting, slow to redo for
every matvec.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from numba import njit, prange

from .numeric import fma32
from .types import type_info

# ids (quant.types)
Q8_0, Q8_K = 8, 15
Q4_0_R8, Q5_0_R4, Q8_0_R8, Q2_K_R4, Q3_K_R4, Q4_K_R4, Q5_K_R4, Q6_K_R4 = 202, 206, 208, 210, 211, 212, 213, 214
IQ2_XXS_R4, IQ2_XS_R4, IQ3_XXS_R4, IQ4_NL_R4, IQ3_S_R4, IQ2_S_R4, IQ4_XS_R8 = 216, 217, 218, 220, 221, 222, 223
Q6_0_R4, IQ2_K_R4, IQ3_K_R4, IQ4_K_R4, IQ5_K_R4, IQ4_KS_R4 = 233, 337, 338, 339, 340, 344
IQ5_KS_R4, MXFP4_R8, Q8_K_R8 = 352, 353, 399
BF16_R16, Q8_K_R16, Q8_KV_R8 = 230, 397, 398
BF16, Q8_KV = 30, 151
# ik's other 4-row forms of mainline i-quants, not a repacking of their plain type (see
# dequantize_iq1_s_r4 below); quant.types does not list them
IQ1_S_R4, IQ1_M_R4 = 219, 229

# the K-quant, IQK and legacy forms (tests/test_interleaved.py) and those of the mainline
# i-quants, MXFP4, Q5_0 / Q6_0 and IQ5_KS (tests/test_interleaved_iq.py)
R_TYPES = (Q4_0_R8, Q8_0_R8, Q2_K_R4, Q3_K_R4, Q4_K_R4, Q5_K_R4, Q6_K_R4, IQ4_NL_R4, IQ4_XS_R8,
           IQ2_K_R4, IQ3_K_R4, IQ4_K_R4, IQ5_K_R4, IQ4_KS_R4, Q8_K_R8)
R_TYPES_IQ = (Q5_0_R4, Q6_0_R4, MXFP4_R8, IQ2_XXS_R4, IQ2_XS_R4, IQ3_XXS_R4, IQ3_S_R4, IQ2_S_R4, IQ5_KS_R4)
# ik's remaining special forms (tests/test_special_types.py)
R_TYPES_SPECIAL = (BF16_R16, Q8_K_R16, Q8_KV_R8)
ALL_R_TYPES = R_TYPES + R_TYPES_IQ + R_TYPES_SPECIAL
# ik's own 4-row forms (not repackings): unpacked to IQ1_S / IQ1_M_ROWS rows by conversion
NOT_REPACKED = frozenset({IQ1_S_R4, IQ1_M_R4})
QK_K = 256
_Q8_K_BYTES = 296          # ik's block_q8_K: f32 d, f32 sum, int8 qs[256], int16 bsums[16]

# ik's quantize_<type>_r4/_r8 run the base quantizer through QHelper (per-row imatrix weights,
# degenerate blocks of this many values get weights 1e-9) for these types; the IQK _R4 types,
# Q5_0_R4 and IQ5_KS_R4 call the base quantizer directly
_QHELPER_BLOCK = {Q4_0_R8: 32, IQ4_NL_R4: 32, IQ4_XS_R8: 32, Q4_K_R4: 32, Q5_K_R4: 32,
                  Q6_K_R4: 16, Q3_K_R4: 16, Q2_K_R4: 16, Q6_0_R4: 32, IQ2_XXS_R4: 32, IQ3_XXS_R4: 32,
                  IQ2_XS_R4: 16, IQ2_S_R4: 16, IQ3_S_R4: 16}
# ik's dequantize_row_q5_0_r4 / _q6_0_r4 compute d*q + (-16 d) (-32 d), its plain decoders
# (q - 16)*d: the same exact values but +0 where the plain form gives -0 (d < 0)
# (dequantize_row_q8_k_r16: d*u + (-128 d) for the stored u = q ^ 0x80, the same)
_PLUS_ZERO = frozenset({Q5_0_R4, Q6_0_R4, Q8_K_R16})
# ik's quantize_mxfp4_r8 (like quantize_mxfp4) takes no importances, nor do the Q8_K / Q8_KV forms
_NO_IMATRIX = frozenset({MXFP4_R8, Q8_K_R8, Q8_K_R16, Q8_KV_R8})
# the Q8_K forms unpack to Q8_0 rows: (row k, 256-block) -> 8 blocks of 34 bytes
_Q8_K_FORMS = frozenset({Q8_K_R8, Q8_K_R16})


def is_interleaved(qtype: int | str) -> bool:
    return type_info(qtype).interleave > 0


def plain_type(qtype_r: int | str) -> int:
    """The type whose row bytes `unpack` / `unpack_group` produce for R type qtype_r."""
    ti = type_info(qtype_r)
    if not ti.interleave:
        raise ValueError(f"{ti.name} is not a row-interleaved (_R4/_R8) type")
    return Q8_0 if ti.id in _Q8_K_FORMS else type_info(ti.base).id


def _column(ti) -> tuple[int, int]:
    """(values, R bytes per row) of one block column of an R type.  A block column is the unit
    the layout interleaves: a plain block, except for BF16_R16 whose unit is a pair of values."""
    return (2, 4) if ti.id == BF16_R16 else (ti.block_size, ti.type_size)


def _plain_meta(qtype_r: int) -> int:
    """Row meta bytes of plain_type(qtype_r)'s rows: Q8_KV's 8 (f32 d, i32 sum) where the R
    form keeps only the 4 of d; otherwise the R type's own."""
    return type_info(Q8_KV).row_meta if qtype_r == Q8_KV_R8 else type_info(qtype_r).row_meta


# ----------------------------------------------------------------------------------------
# plain blocks -> fields (bit operations only: the repack must stay a bit permutation)
# ----------------------------------------------------------------------------------------
def _nib_halves(qs: np.ndarray) -> np.ndarray:
    """qs (..., 16*s): byte 16*t + j holds value 32*t + j (low nibble) and 32*t + 16 + j (high)."""
    q = qs.reshape(*qs.shape[:-1], -1, 16)
    return np.concatenate([q & 15, q >> 4], axis=-1).reshape(*qs.shape[:-1], -1)


def _nib_k4(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K/IQ5_K qs (..., 128): byte 32*h + j holds value 64*h + j (low), 64*h + 32 + j (high)."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.concatenate([q & 15, q >> 4], axis=-1).reshape(*qs.shape[:-1], 256)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit planes (..., 64): value 128*h + 32*s + j = bits 2s..2s+1 of byte 32*h + j."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(*qs.shape[:-1], 256)


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """(..., 32) bytes -> (..., 256): value e = bit e // 32 of byte e % 32."""
    return ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*qh.shape[:-1], 256)


def _u16_bits(b: np.ndarray, n: int) -> np.ndarray:
    """(..., 2) bytes of a little-endian u16 -> its low n bits (..., n), bit j at j."""
    v = b[..., 0].astype(np.uint16) | (b[..., 1].astype(np.uint16) << 8)
    return ((v[..., None] >> np.arange(n, dtype=np.uint16)) & 1).astype(np.uint8)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2n) nibbles, low nibble first."""
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def _crumbs_of(b: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 4n) 2-bit fields, lowest first."""
    return ((b[..., None] >> (2 * np.arange(4, dtype=np.uint8))) & 3).reshape(*b.shape[:-1], -1)


def _q3_k_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes -> 16 6-bit scales (low 4 bits from nibbles, high 2 from bytes 8..11)."""
    lo = np.concatenate([sc[..., 0:8] & 15, sc[..., 0:8] >> 4], axis=-1)       # scales 0..15
    hi = _crumbs_of(sc[..., 8:12])                                             # (.., 16): byte 8+i, crumb c
    hi = hi.reshape(*sc.shape[:-1], 4, 4).swapaxes(-1, -2).reshape(*sc.shape[:-1], 16)
    return lo | (hi << 4)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> (8 scales, 8 mins), 6 bits each."""
    a, b, c = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    ls = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    lm = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return ls, lm


# ----------------------------------------------------------------------------------------
# R block assembly helpers; P is (n, I, S): n block columns of I plain blocks
# ----------------------------------------------------------------------------------------
Q4_PAIRS = ((0, 8), (16, 24), (4, 12), (20, 28))      # nibble pairs of the _R4 4-bit types
CRUMBS = ((0, 4, 8, 12), (16, 20, 24, 28))           # 2-bit fields of the _R4 2/3-bit types


def _weave(L: np.ndarray, groups, width: int) -> np.ndarray:
    """L (n, I, V) levels -> (n, V // 32 * len(groups) * I * 4) bytes: for 32-value sub-block s,
    group m, row k, i < 4, the byte holds the fields L[k, 32*s + i + off] for off in groups[m],
    `width` bits each, first offset lowest."""
    n, nrow, nv = L.shape
    lb = L.reshape(n, nrow, nv // 32, 32)
    i = np.arange(4)
    out = np.zeros((n, nv // 32, len(groups), nrow, 4), dtype=np.uint8)
    mask = (1 << width) - 1
    for m, offs in enumerate(groups):
        acc = np.zeros((n, nrow, nv // 32, 4), dtype=np.uint8)
        for t, off in enumerate(offs):
            acc |= (lb[..., off + i] & mask) << (width * t)
        out[:, :, m] = acc.transpose(0, 2, 1, 3)
    return out.reshape(n, -1)


def _place(v: np.ndarray, nbytes: int, width: int) -> np.ndarray:
    """Per-row fields v (n, I, J) -> packed (n, nbytes): field (k, j) has index is = I*j + k and
    sits in byte is % nbytes at bit width * (is // nbytes)."""
    n, nrow, nj = v.shape
    flat = v.transpose(0, 2, 1).reshape(n, nj * nrow)
    out = np.zeros((n, nbytes), dtype=np.uint8)
    for s in range(flat.shape[1] // nbytes):
        out |= flat[:, s * nbytes:(s + 1) * nbytes] << (width * s)
    return out


def _rows_of(P: np.ndarray, a: int, b: int) -> np.ndarray:
    """Bytes [a, b) of every row's block, concatenated over the rows: (n, I * (b - a))."""
    return P[:, :, a:b].reshape(P.shape[0], -1)


def _extra_bits(P: np.ndarray, o: int) -> np.ndarray:
    """The 16 extra bits (u16 at byte o) of the IQK blocks, (n, I, 16)."""
    return _u16_bits(P[:, :, o:o + 2], 16)


def _r_q4_0(P):      # Q4_0 -> Q4_0_R8: d[8], qs copied in runs of 4 bytes
    return np.concatenate([_rows_of(P, 0, 2), _weave(_nib_halves(P[:, :, 2:18]),
                                                     ((0, 16), (4, 20), (8, 24), (12, 28)), 4)], axis=1)


def _r_iq4_nl(P):    # IQ4_NL -> IQ4_NL_R4
    return np.concatenate([_rows_of(P, 0, 2), _weave(_nib_halves(P[:, :, 2:18]), Q4_PAIRS, 4)], axis=1)


def _r_q8_0(P):      # Q8_0 -> Q8_0_R8
    return np.concatenate([_rows_of(P, 0, 2), _weave(P[:, :, 2:34], [(4 * m,) for m in range(8)], 8)], axis=1)


def _r_iq4_xs(P):    # IQ4_XS -> IQ4_XS_R8: d[8] | scales_h[16] | scales_l[32] | qs[1024]
    sl = _nibbles(P[:, :, 4:8])
    sh = _u16_bits(P[:, :, 2:4], 16).reshape(*P.shape[:2], 8, 2)
    sh = sh[..., 0] | (sh[..., 1] << 1)
    qs = _weave(_nib_halves(P[:, :, 8:136]), ((0, 4), (8, 12), (16, 20), (24, 28)), 4)
    return np.concatenate([_rows_of(P, 0, 2), _place(sh, 16, 2), _place(sl, 32, 4), qs], axis=1)


def _r_iq4_ks(P):    # IQ4_KS -> IQ4_KS_R4 (block part; the row scales go to the group header)
    return np.concatenate([_place(P[:, :, 0:8], 32, 8), _weave(_nib_halves(P[:, :, 8:136]), Q4_PAIRS, 4)], axis=1)


def _iqk_scales(P, o_h, o_l):
    """IQ4_K/IQ5_K 6-bit sub-scale fields -> (scales_h[16], scales_l[32]) of the _R4 block."""
    sl = _nibbles(P[:, :, o_l:o_l + 8])                      # scale j: nibble j
    sh = _crumbs_of(P[:, :, o_h:o_h + 4])                    # scale j: crumb j
    return _place(sh, 16, 2), _place(sl, 32, 4)


def _r_iq4_k(P):     # IQ4_K -> IQ4_K_R4: d[4] | extra[8] | scales_h[16] | scales_l[32] | qs[512]
    sh, sl = _iqk_scales(P, 4, 8)
    qs = _weave(_nib_halves(P[:, :, 16:144]), Q4_PAIRS, 4)
    return np.concatenate([_rows_of(P, 0, 2), _place(_extra_bits(P, 2), 8, 1), sh, sl, qs], axis=1)


def _r_iq5_k(P):     # IQ5_K -> IQ5_K_R4: d[4] | extra[8] | scales_h[16] | scales_l[32] | qs[512] | qh[128]
    sh, sl = _iqk_scales(P, 4, 8)
    L = _nib_k4(P[:, :, 16:144]) | (_bit_planes(P[:, :, 144:176]) << 4)
    qs = _weave(L & 15, Q4_PAIRS, 4)
    qh = _weave(L >> 4, [(0, 8, 16, 24, 4, 12, 20, 28)], 1)
    return np.concatenate([_rows_of(P, 0, 2), _place(_extra_bits(P, 2), 8, 1), sh, sl, qs, qh], axis=1)


def _r_iq2_k(P):     # IQ2_K -> IQ2_K_R4: d[4] | extra[8] | scales[32] | qs[256]
    qs = _weave(_crumbs(P[:, :, 12:76]), CRUMBS, 2)
    return np.concatenate([_rows_of(P, 0, 2), _place(_extra_bits(P, 2), 8, 1),
                           _place(_nibbles(P[:, :, 4:12]), 32, 4), qs], axis=1)


def _r_iq3_k(P):     # IQ3_K -> IQ3_K_R4: d[4] | extra[8] | scales_h[8] | scales_l[32] | qs[256] | qh[128]
    L = _crumbs(P[:, :, 14:78]) | (_bit_planes(P[:, :, 78:110]) << 2)
    sh = _place(_u16_bits(P[:, :, 4:6], 16), 8, 1)
    sl = _place(_nibbles(P[:, :, 6:14]), 32, 4)
    qs = _weave(L & 3, CRUMBS, 2)
    qh = _weave(L >> 2, [(0, 4, 8, 12, 16, 20, 24, 28)], 1)
    return np.concatenate([_rows_of(P, 0, 2), _place(_extra_bits(P, 2), 8, 1), sh, sl, qs, qh], axis=1)


def _r_q2_k(P):      # Q2_K -> Q2_K_R4: d[4] dmin[4] | scales[64] | qs[256]
    qs = _weave(_crumbs(P[:, :, 16:80]), CRUMBS, 2)
    return np.concatenate([_rows_of(P, 80, 82), _rows_of(P, 82, 84), _place(P[:, :, 0:16], 64, 8), qs], axis=1)


def _r_q3_k(P):      # Q3_K -> Q3_K_R4: d[4] | scales_h[16] | scales_l[32] | qh[128] | qs[256]
    L = _crumbs(P[:, :, 32:96]) | (_bit_planes(P[:, :, 0:32]) << 2)
    ls = _q3_k_scales(P[:, :, 96:108])
    qh = _weave(L >> 2, [(0, 4, 8, 12, 16, 20, 24, 28)], 1)
    qs = _weave(L & 3, CRUMBS, 2)
    return np.concatenate([_rows_of(P, 108, 110), _place(ls >> 4, 16, 2), _place(ls & 15, 32, 4), qh, qs], axis=1)


def _k4_scale_fields(P):
    ls, lm = _k4_scales(P[:, :, 4:16])
    return _place((ls >> 4) | ((lm >> 4) << 2), 16, 4), _place((ls & 15) | ((lm & 15) << 4), 32, 8)


def _r_q4_k(P):      # Q4_K -> Q4_K_R4: d[4] dmin[4] | scales_h[16] | scales_l[32] | qs[512]
    sh, sl = _k4_scale_fields(P)
    qs = _weave(_nib_k4(P[:, :, 16:144]), Q4_PAIRS, 4)
    return np.concatenate([_rows_of(P, 0, 2), _rows_of(P, 2, 4), sh, sl, qs], axis=1)


def _r_q5_k(P):      # Q5_K -> Q5_K_R4: d[4] dmin[4] | scales_h[16] | scales_l[32] | qh[128] | qs[512]
    sh, sl = _k4_scale_fields(P)
    L = _nib_k4(P[:, :, 48:176]) | (_bit_planes(P[:, :, 16:48]) << 4)
    qh = _weave(L >> 4, [(0, 8, 4, 12, 16, 24, 20, 28)], 1)
    qs = _weave(L & 15, Q4_PAIRS, 4)
    return np.concatenate([_rows_of(P, 0, 2), _rows_of(P, 2, 4), sh, sl, qh, qs], axis=1)


def _r_q6_k(P):      # Q6_K -> Q6_K_R4: d[4] | scales[64] | qh[256] | ql[512]
    ql = P[:, :, 0:128].reshape(*P.shape[:2], 2, 2, 32)            # (half, 32-byte part, j)
    qh = P[:, :, 128:192].reshape(*P.shape[:2], 2, 1, 32)
    low = np.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], axis=3)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    L = (low | (high << 4)).reshape(*P.shape[:2], 256)
    qh_r = _weave(L >> 4, ((0, 8, 4, 12), (16, 24, 20, 28)), 2)
    ql_r = _weave(L & 15, Q4_PAIRS, 4)
    return np.concatenate([_rows_of(P, 208, 210), _place(P[:, :, 192:208], 64, 8), qh_r, ql_r], axis=1)


def _r_q8_k(P):      # ik's Q8_K blocks -> Q8_K_R8: d[8] as f16 | qs[2048]  (d rounded: not a permutation)
    d = np.ascontiguousarray(P[:, :, 0:4]).view(np.float32)[..., 0].astype(np.float16)
    qs = _weave(P[:, :, 8:264], [(4 * m,) for m in range(8)], 8)
    return np.concatenate([d.view(np.uint8).reshape(P.shape[0], -1), qs], axis=1)


def _r_q8_k_16(P):   # ik's Q8_K blocks -> Q8_K_R16: d[16] as f16 | qs[4096] as q ^ 0x80 (ik's AVX512
    # build flips them when it repacks, and its dequantize_row_q8_k_r16 reads them as u - 128)
    d = np.ascontiguousarray(P[:, :, 0:4]).view(np.float32)[..., 0].astype(np.float16)
    qs = _weave(P[:, :, 8:264], [(4 * m,) for m in range(8)], 8) ^ np.uint8(0x80)
    return np.concatenate([d.view(np.uint8).reshape(P.shape[0], -1), qs], axis=1)


def _r_q8_kv(P):     # Q8_KV quants -> Q8_KV_R8 (the d of the 8 rows go to the group header)
    return _weave(P, [(4 * m,) for m in range(8)], 8)


def _r_bf16(P):      # BF16 value pairs -> BF16_R16: the 16 rows' pairs one after the other
    return P.reshape(P.shape[0], -1)


def _r_q5_0(P):      # Q5_0 -> Q5_0_R4: d[4] | qh[16] | qs[64]
    hi = np.unpackbits(P[:, :, 2:6], axis=-1, bitorder="little")      # value e: bit e of the u32
    L = _nib_halves(P[:, :, 6:22]) | (hi << 4)
    return np.concatenate([_rows_of(P, 0, 2), _weave(L >> 4, [(0, 16, 4, 20, 8, 24, 12, 28)], 1),
                           _weave(L & 15, Q4_PAIRS, 4)], axis=1)


# Q6_0: the two high bits of value e sit in byte e % 8 of qh, crumb 2 * ((e % 16) // 8) + e // 16
_Q6_0_CRUMB = 4 * (np.arange(32) % 8) + 2 * ((np.arange(32) % 16) // 8) + np.arange(32) // 16


def _r_q6_0(P):      # Q6_0 -> Q6_0_R4: d[4] | qh[32] | qs[64]
    L = _nib_halves(P[:, :, 10:26]) | (_crumbs_of(P[:, :, 2:10])[..., _Q6_0_CRUMB] << 4)
    return np.concatenate([_rows_of(P, 0, 2), _weave(L >> 4, CRUMBS, 2), _weave(L & 15, Q4_PAIRS, 4)], axis=1)


def _r_mxfp4(P):     # MXFP4 -> MXFP4_R8: e[8] | qs[128], bytes moved in runs of 4
    return np.concatenate([_rows_of(P, 0, 1), _weave(_nib_halves(P[:, :, 1:17]),
                                                     ((0, 16), (4, 20), (8, 24), (12, 28)), 4)], axis=1)


def _r_iq5_ks(P):    # IQ5_KS -> IQ5_KS_R4: scales[32] | qs[512] | qh[128] (row scales: group header)
    L = _nib_k4(P[:, :, 8:136]) | (_bit_planes(P[:, :, 136:168]) << 4)
    return np.concatenate([_place(P[:, :, 0:8], 32, 8), _weave(L & 15, Q4_PAIRS, 4),
                           _weave(L >> 4, [(0, 8, 16, 24, 4, 12, 20, 28)], 1)], axis=1)


def _by_sub(P, a: int, b: int, per: int) -> np.ndarray:
    """Bytes [a, b) of every row's block in runs of `per` bytes per 32 values, ordered (sub-block,
    row, byte): byte per*I*s + per*k + i = row k's byte a + per*s + i."""
    n, nrow = P.shape[:2]
    return P[:, :, a:b].reshape(n, nrow, -1, per).transpose(0, 2, 1, 3).reshape(n, -1)


def _sas(w: np.ndarray) -> np.ndarray:
    """IQ2_XXS / IQ3_XXS sign-and-scale words (n, I, 32: a u32 per 32 values, 4 x 7 sign bits and
    the 4-bit scale on top) -> the _R4 sas bytes before the sign scrambling: byte 16*s + 4*k + i
    holds bit i of row k's scale (bit 0) and its sign group i (bits 1..7)."""
    n, nrow = w.shape[:2]
    b = np.unpackbits(w, axis=-1, bitorder="little").reshape(n, nrow, 8, 32)
    b = np.concatenate([b[..., 28:32, None], b[..., 0:28].reshape(n, nrow, 8, 4, 7)], axis=-1)
    return np.packbits(b.transpose(0, 2, 1, 3, 4), axis=-1, bitorder="little").reshape(n, -1)


def _r_iq2_xxs(P):   # IQ2_XXS -> IQ2_XXS_R4: d[4] | sas[128] | qs[128]
    q = P[:, :, 2:66].reshape(*P.shape[:2], 8, 2, 4)          # per 32 values: 4 index bytes, a u32
    grid, words = q[:, :, :, 0].reshape(*P.shape[:2], 32), q[:, :, :, 1].reshape(*P.shape[:2], 32)
    return np.concatenate([_rows_of(P, 0, 2), _sas(words), _by_sub(grid, 0, 32, 4)], axis=1)


def _r_iq3_xxs(P):   # IQ3_XXS -> IQ3_XXS_R4: d[4] | sas[128] | qs[256]
    return np.concatenate([_rows_of(P, 0, 2), _sas(P[:, :, 66:98]), _by_sub(P, 2, 66, 8)], axis=1)


def _r_iq2_xs(P):    # IQ2_XS -> IQ2_XS_R4: d[4] | qs u16[128] | scales[32]
    return np.concatenate([_rows_of(P, 0, 2), _by_sub(P, 2, 66, 8), _place(P[:, :, 66:74], 32, 8)], axis=1)


def _r_iq2_s(P):     # IQ2_S -> IQ2_S_R4: d[4] | qs[128] | qh[32] | signs[128] | scales[32]
    return np.concatenate([_rows_of(P, 0, 2), _by_sub(P, 2, 34, 4), _place(P[:, :, 66:74], 32, 8),
                           _by_sub(P, 34, 66, 4), _place(P[:, :, 74:82], 32, 8)], axis=1)


def _r_iq3_s(P):     # IQ3_S -> IQ3_S_R4: d[4] | qs[256] | qh[32] | signs[128] | scales[16]
    n, nrow = P.shape[:2]
    # qs: byte 32*s + 8*i + 4*h + k = row k's index byte 8*s + 4*h + i
    qs = P[:, :, 2:66].reshape(n, nrow, 8, 2, 4).transpose(0, 2, 4, 3, 1).reshape(n, -1)
    # signs: bit 2*m + h of byte 16*s + 4*k + i = bit 4*h + i of row k's sign byte 4*s + m
    sb = np.unpackbits(P[:, :, 74:106], axis=-1, bitorder="little").reshape(n, nrow, 8, 4, 2, 4)
    signs = np.packbits(sb.transpose(0, 2, 1, 5, 3, 4).reshape(n, -1), axis=-1, bitorder="little")
    return np.concatenate([_rows_of(P, 0, 2), qs, _place(P[:, :, 66:74], 32, 8), signs,
                           _place(_nibbles(P[:, :, 106:110]), 16, 4)], axis=1)


_BUILD = {Q4_0_R8: _r_q4_0, Q8_0_R8: _r_q8_0, IQ4_NL_R4: _r_iq4_nl, IQ4_XS_R8: _r_iq4_xs,
          IQ4_KS_R4: _r_iq4_ks, IQ4_K_R4: _r_iq4_k, IQ5_K_R4: _r_iq5_k, IQ2_K_R4: _r_iq2_k,
          IQ3_K_R4: _r_iq3_k, Q2_K_R4: _r_q2_k, Q3_K_R4: _r_q3_k, Q4_K_R4: _r_q4_k,
          Q5_K_R4: _r_q5_k, Q6_K_R4: _r_q6_k, Q8_K_R8: _r_q8_k, Q5_0_R4: _r_q5_0, Q6_0_R4: _r_q6_0,
          MXFP4_R8: _r_mxfp4, IQ5_KS_R4: _r_iq5_ks, IQ2_XXS_R4: _r_iq2_xxs, IQ2_XS_R4: _r_iq2_xs,
          IQ3_XXS_R4: _r_iq3_xxs, IQ2_S_R4: _r_iq2_s, IQ3_S_R4: _r_iq3_s,
          BF16_R16: _r_bf16, Q8_K_R16: _r_q8_k_16, Q8_KV_R8: _r_q8_kv}


# ----------------------------------------------------------------------------------------
# the scrambled signs of IQ2_XXS_R4 / IQ2_XS_R4 / IQ3_XXS_R4
# ----------------------------------------------------------------------------------------
def _prefix_xor7(s: np.ndarray) -> np.ndarray:
    """Bit j of the result = XOR of bits 0..j of s (7 bits)."""
    t = s.astype(np.int64)
    for sh in (1, 2, 4):
        t ^= t << sh
    return t & 127


# a sign byte (7 sign bits << 1 | one other bit): the builders above write the plain sign bits s,
# ik stores t = prefix XOR of s, so that its SIMD code gets the 8 signs as t ^ (t << 1)
# (parity on top) with two shifts and no table: a bijection, but not a bit permutation
_SCRAMBLE = ((_prefix_xor7(np.arange(256) >> 1) << 1) | (np.arange(256) & 1)).astype(np.uint8)
_UNSCRAMBLE = np.argsort(_SCRAMBLE).astype(np.uint8)
# R block bytes holding scrambled sign bytes (the probes and the gather tables see the plain s)
_SIGN_BYTES = {IQ2_XXS_R4: np.arange(8, 136), IQ3_XXS_R4: np.arange(8, 136),
               IQ2_XS_R4: 9 + 2 * np.arange(128)}                    # the high byte of each u16


# ----------------------------------------------------------------------------------------
# the unpack map: plain bit p of a block column comes from R bit G[p]
# ----------------------------------------------------------------------------------------
def _bits(b: np.ndarray) -> np.ndarray:
    return np.unpackbits(b, axis=-1, bitorder="little")


def _probe_permutation(qtype_r: int) -> np.ndarray:
    """G for a bit-permuting R type, found by repacking bit-labelled plain blocks: probe t sets
    plain bit p iff bit t of p is set, so R bit r reads back the index of its source bit."""
    ti = type_info(qtype_r)
    nrow, s = ti.interleave, _column(ti)[1]
    nbits = nrow * s * 8
    nprobe = int(nbits - 1).bit_length()
    labels = np.arange(nbits)
    probes = ((labels[None, :] >> np.arange(nprobe)[:, None]) & 1).astype(np.uint8)      # (nprobe, nbits)
    probes = np.concatenate([probes, np.ones((1, nbits), np.uint8)])                     # + all ones
    P = np.packbits(probes, axis=-1, bitorder="little").reshape(-1, nrow, s)
    R = _bits(_BUILD[ti.id](P))
    if R.shape[1] != nbits or not R[-1].all():
        raise AssertionError(f"{ti.name}: repack is not a bit permutation")
    F = (R[:-1].astype(np.int64) << np.arange(nprobe)[:, None]).sum(axis=0)             # R bit r <- plain bit F[r]
    if not np.array_equal(np.sort(F), labels):
        raise AssertionError(f"{ti.name}: repack is not a bit permutation")
    G = np.empty(nbits, dtype=np.int64)
    G[F] = np.arange(nbits)
    return G


def _q8_k_r8_gather(nrow: int = 8) -> np.ndarray:
    """G for Q8_K_R8 (nrow 8) / Q8_K_R16 (16) -> Q8_0 rows: row k's 8 blocks of 34 bytes per 256
    values take the f16 d[k] (R bytes 2k, 2k+1) and value 32*t + c from R qs byte
    2*nrow + 4*nrow*(8*t + c // 4) + 4*k + c % 4."""
    k = np.arange(nrow)[:, None, None]
    t = np.arange(8)[None, :, None]
    c = np.arange(32)[None, None, :]
    src = np.empty((nrow, 8, 34), dtype=np.int64)
    src[:, :, 0:2] = 2 * k + np.arange(2)
    src[:, :, 2:] = 2 * nrow + 4 * nrow * (8 * t + c // 4) + 4 * k + c % 4
    byte = src.reshape(-1)
    return (8 * byte[:, None] + np.arange(8)).reshape(-1)


def _gather_map(qtype_r: int) -> np.ndarray:
    if qtype_r in _Q8_K_FORMS:
        return _q8_k_r8_gather(type_info(qtype_r).interleave)
    return _probe_permutation(qtype_r)


def _flip_map(qtype_r: int) -> np.ndarray | None:
    """Plain bits that are the complement of their R bit (None: none): Q8_K_R16's quants are
    stored ^ 0x80, so bit 7 of every plain quant byte is flipped back."""
    if qtype_r != Q8_K_R16:
        return None
    f = np.zeros((16, 8, 34, 8), dtype=np.uint8)
    f[:, :, 2:, 7] = 1
    return f.reshape(-1)


def _xor_map(qtype_r: int, G: np.ndarray) -> np.ndarray | None:
    """The second source of each plain bit (-1: none) for the types with scrambled sign bytes:
    sign bit j >= 1 of a plain group is t_j ^ t_(j-1), the R bit G[p] and the one below it."""
    if qtype_r not in _SIGN_BYTES:
        return None
    scrambled = np.zeros(G.size // 8, dtype=bool)
    scrambled[_SIGN_BYTES[qtype_r]] = True
    return np.where(scrambled[G // 8] & (G % 8 >= 2), G - 1, -1)


def _plain_block_bytes(qtype_r: int) -> int:
    """Bytes per row of one block column in the unpacked (plain_type) form."""
    if qtype_r in _Q8_K_FORMS:
        return 8 * 34
    return 4 if qtype_r == BF16_R16 else type_info(qtype_r).type_size


def _runs(p: np.ndarray, g: np.ndarray, flip: np.ndarray | None = None) -> list[tuple[int, ...]]:
    """Plain bits p (ascending) taken from R bits g as runs that stay within one byte of each:
    (plain byte, R byte, R shift, plain shift, mask, xor): xor (within the mask) holds the
    run's bits that flip[p] says are complemented."""
    start = np.ones(p.size, dtype=bool)
    start[1:] = (p[1:] % 8 == 0) | (p[1:] != p[:-1] + 1) | (g[1:] != g[:-1] + 1) | (g[1:] % 8 == 0)
    first = np.flatnonzero(start)
    length = np.diff(np.append(first, p.size))
    fl = np.zeros(p.size, np.int64) if flip is None else flip[p].astype(np.int64)
    xor = np.zeros(first.size, np.int64)
    for j in range(8):                      # bit j of a run: element first + j where the run is that long
        has = length > j
        xor[has] |= fl[first[has] + j] << j
    return [(int(a), int(b), int(c), int(d), int(m), int(x)) for a, b, c, d, m, x in
            zip(p[first] // 8, g[first] // 8, g[first] % 8, p[first] % 8, (1 << length) - 1, xor)]


def _gather_tables(G: np.ndarray, X: np.ndarray | None, sp: int,
                   flip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """G (and the XOR sources X) as (entries, fields) for unpack_group.  A field (src byte, src
    shift, dst shift, mask, xor) is one bit run that lies within one R byte and one plain byte.
    An entry (dst row, dst byte, count, first field, end field) writes `count` plain bytes: byte
    dst + j is the XOR of its fields (((R[src + j] >> src shift) & mask) ^ xor) << dst shift (an
    OR but for the scrambled signs: the fields of G never overlap; xor is 0 but for the flipped
    bits of flip).  count is 4 where 4 consecutive
    plain bytes take the same fields from 4 consecutive R bytes (the woven layouts move 4 values
    at a time), else 1."""
    per_byte: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(G.size // 8)]
    p = np.arange(G.size)
    runs = _runs(p, G, flip)
    if X is not None:
        runs += _runs(p[X >= 0], X[X >= 0])
    for pb, rb, ss, ds, m, x in runs:
        per_byte[pb].append((rb, ss, ds, m, x))
    ents, fields, b = [], [], 0
    while b < len(per_byte):
        fl = per_byte[b]
        cnt = 4 if b % sp + 4 <= sp and all(
            [(f[0] + j,) + f[1:] for f in fl] == per_byte[b + j] for j in range(1, 4)) else 1
        ents.append((b // sp, b % sp, cnt, len(fields), len(fields) + len(fl)))
        fields.extend(fl)
        b += cnt
    return np.array(ents, dtype=np.int32), np.array(fields, dtype=np.int32)


def _build_tables():
    slot = np.full(400, -1, dtype=np.int32)
    # per type: interleave, R bytes and plain bytes per row per block column, R row meta, values per
    # block column, entries [start, end), plain row meta (Q8_KV_R8: 8, its rows' i32 sum recomputed)
    info = np.zeros((len(ALL_R_TYPES), 8), dtype=np.int32)
    ents, fields, gathers, ne, nf = [], [], {}, 0, 0
    for s, t in enumerate(ALL_R_TYPES):
        ti = type_info(t)
        G = _gather_map(t)
        X = _xor_map(t, G)
        F = _flip_map(t)
        e, f = _gather_tables(G, X, _plain_block_bytes(t), F)
        e[:, 3:] += nf
        gathers[t] = (G, X, F)
        slot[t] = s
        vals, sr = _column(ti)
        info[s] = (ti.interleave, sr, _plain_block_bytes(t), ti.row_meta, vals, ne, ne + len(e), _plain_meta(t))
        ents.append(e)
        fields.append(f)
        ne, nf = ne + len(e), nf + len(f)
    return slot, info, np.concatenate(ents), np.concatenate(fields), gathers


_SLOT, _INFO, _ENTS, _FIELDS, _GATHER = _build_tables()
# one contiguous array per column: plain 1-d loads in the loop
_E_ROW, _E_DST, _E_CNT, _E_F0, _E_F1 = (np.ascontiguousarray(c) for c in _ENTS.T)
_F_SRC, _F_SSH, _F_DSH, _F_MASK, _F_XOR = (np.ascontiguousarray(c) for c in _FIELDS.T)


# ----------------------------------------------------------------------------------------
# NumPy reference API
# ----------------------------------------------------------------------------------------
def _check_rows(ti, nrows: int, n_per_row: int) -> None:
    if nrows % ti.interleave:
        raise ValueError(f"{ti.name} needs a multiple of {ti.interleave} rows; the tensor is "
                         f"{nrows} x {n_per_row}")
    vals = _column(ti)[0] if ti.interleave else ti.block_size
    if n_per_row % vals:
        raise ValueError(f"{ti.name}: rows of {n_per_row} values are not a multiple of {vals}; "
                         f"the tensor is {nrows} x {n_per_row}")


def _as_rows(raw: np.ndarray, nrows: int, row_bytes: int, name: str) -> np.ndarray:
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size < nrows * row_bytes:
        raise ValueError(f"{name}: {nrows} rows need {nrows * row_bytes} bytes, got {raw.size}")
    return raw[:nrows * row_bytes].reshape(nrows, row_bytes)


def _r_type_of_plain(qtype_plain: int | str, qtype_r: int | str | None = None):
    """-> (plain TypeInfo, R TypeInfo, plain bytes per row per block column)."""
    ti = type_info(qtype_plain)
    if qtype_r is not None:
        tr = type_info(qtype_r)
        if tr.id not in ALL_R_TYPES or tr.base != ti.name:
            raise ValueError(f"{tr.name} is not a row-interleaved form of {ti.name}")
    elif ti.id == Q8_K:
        tr = type_info(Q8_K_R8)
    else:
        tr = next((type_info(t) for t in ALL_R_TYPES if type_info(t).base == ti.name), None)
        if tr is None:
            raise ValueError(f"{ti.name} has no row-interleaved form")
    s = _Q8_K_BYTES if ti.id == Q8_K else _column(tr)[0] * ti.type_size // ti.block_size
    return ti, tr, s


def repack(raw: np.ndarray, qtype_plain: int | str, nrows: int, n_per_row: int,
           qtype_r: int | str | None = None) -> np.ndarray:
    """Plain rows (nrows, row_bytes) of qtype_plain -> the bytes of its _R4/_R8 form qtype_r
    (default: its first, that of quant.types.interleaved_form), (nrows, row_bytes of the R
    type), as ik's repack_<type> (offline form).  Q8_K: ik's block_q8_K (296 bytes per 256) ->
    Q8_K_R8 (or Q8_K_R16).  Q8_KV -> Q8_KV_R8 drops the rows' quant sums."""
    ti, tr, s = _r_type_of_plain(qtype_plain, qtype_r)
    _check_rows(tr, nrows, n_per_row)
    nb, nrow, meta = n_per_row // _column(tr)[0], tr.interleave, tr.row_meta
    pmeta = ti.row_meta if ti.id != Q8_K else 0
    rows = _as_rows(raw, nrows, pmeta + nb * s, ti.name)
    ng = nrows // nrow
    P = rows[:, pmeta:].reshape(ng, nrow, nb, s).transpose(0, 2, 1, 3).reshape(ng * nb, nrow, s)
    R = _BUILD[tr.id](np.ascontiguousarray(P))
    if tr.id in _SIGN_BYTES:
        pos = _SIGN_BYTES[tr.id]
        R[:, pos] = _SCRAMBLE[R[:, pos]]
    R = R.reshape(ng, -1)
    head = rows[:, :meta].reshape(ng, nrow * meta)
    return np.concatenate([head, R], axis=1).reshape(nrows, tr.row_bytes(n_per_row))


def unpack(raw_r: np.ndarray, qtype_r: int | str, nrows: int, n_per_row: int) -> np.ndarray:
    """R rows -> rows of plain_type(qtype_r), (nrows, plain row_bytes): the exact inverse of
    repack (Q8_K_R8 / Q8_K_R16: Q8_0 rows holding the same values; Q8_KV_R8: Q8_KV rows, their
    i32 quant sums, which the R form drops, recomputed)."""
    tr = type_info(qtype_r)
    if not tr.interleave:
        raise ValueError(f"{tr.name} is not a row-interleaved (_R4/_R8) type")
    if tr.id in NOT_REPACKED:
        return _NOT_REPACKED_ROWS[tr.id](raw_r, nrows, n_per_row)
    _check_rows(tr, nrows, n_per_row)
    vals, s = _column(tr)
    nb, nrow, meta = n_per_row // vals, tr.interleave, tr.row_meta
    sp = _plain_block_bytes(tr.id)
    rows = _as_rows(raw_r, nrows, tr.row_bytes(n_per_row), tr.name)
    ng = nrows // nrow
    groups = rows.reshape(ng, nrow * tr.row_bytes(n_per_row))
    head = groups[:, :nrow * meta].reshape(ng, nrow, meta)
    R = groups[:, nrow * meta:].reshape(ng * nb, nrow * s)
    G, X, F = _GATHER[tr.id]
    P = np.empty((ng * nb, nrow * sp), dtype=np.uint8)
    for c in range(0, ng * nb, 1024):            # bounded memory: 8 bytes per bit in flight
        b = _bits(R[c:c + 1024])
        pb = b[:, G]
        if X is not None:
            pb[:, X >= 0] ^= b[:, X[X >= 0]]
        if F is not None:
            pb ^= F
        P[c:c + 1024] = np.packbits(pb, axis=-1, bitorder="little")
    P = P.reshape(ng, nb, nrow, sp).transpose(0, 2, 1, 3).reshape(ng, nrow, nb * sp)
    if tr.id == Q8_KV_R8:                        # Q8_KV's row meta: d, then the i32 sum of the quants
        tot = P.view(np.int8).sum(axis=2, dtype=np.int32)
        head = np.concatenate([head, tot.reshape(ng, nrow, 1).view(np.uint8)], axis=2)
    return np.concatenate([head, P], axis=2).reshape(nrows, head.shape[2] + nb * sp)


def dequantize(raw_r: np.ndarray, qtype_r: int | str, nrows: int, n_per_row: int,
               dequantize_plain: Callable[[np.ndarray, int, int], np.ndarray]) -> np.ndarray:
    """R rows -> f32 (nrows, n_per_row), the values of ik's dequantize_row_<type>_r4/_r8.
    dequantize_plain(raw, qtype, n): the reference decoder of plain_type(qtype_r) (quant.registry
    passes it: this module does not know the other families)."""
    if type_info(qtype_r).id in NOT_REPACKED:
        return (dequantize_iq1_s_r4 if type_info(qtype_r).id == IQ1_S_R4 else dequantize_iq1_m_r4)(
            raw_r, nrows, n_per_row)
    plain = unpack(raw_r, qtype_r, nrows, n_per_row)
    pt = plain_type(qtype_r)
    y = np.stack([dequantize_plain(plain[r], pt, n_per_row) for r in range(nrows)]) if nrows else \
        np.zeros((0, n_per_row), np.float32)
    if type_info(qtype_r).id in _PLUS_ZERO:
        y += np.float32(0)                       # -0 -> +0, nothing else changes
    return y


# ----------------------------------------------------------------------------------------
# quantization (ggml_quantize_chunk for the R types)
# ----------------------------------------------------------------------------------------
def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """f32 rows (nrows, n) -> ik's block_q8_K bytes (nrows, n/256*296) as its AVX2 build's
    quantize_row_q8_K32 computes d and qs: d = amax/127, q = round-half-even(x * (127/amax)).
    (sum and bsums, which only the dot products read, are d*sum(q) and int16 sums of 16.)"""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nrows, n = x.shape
    b = x.reshape(nrows, n // QK_K, QK_K)
    amax = np.abs(b).max(axis=2, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(b * inv), -128, 127).astype(np.int8)
    out = np.zeros((nrows, n // QK_K, _Q8_K_BYTES), dtype=np.uint8)
    out[..., 0:4] = d.view(np.uint8)
    tot = q.astype(np.int32).sum(axis=2, keepdims=True)
    out[..., 4:8] = (d * tot.astype(np.float32)).astype(np.float32).view(np.uint8)
    out[..., 8:264] = q.view(np.uint8)
    out[..., 264:296] = q.reshape(nrows, -1, 16, 16).astype(np.int16).sum(axis=3).astype(np.int16).view(np.uint8)
    return out.reshape(nrows, -1)


def _qhelper_groups(x: np.ndarray, imatrix: np.ndarray, block: int):
    """ik's QHelper: per row, blocks where the weights, the values or their product are all ~0
    get weights 1e-9 instead of the imatrix.  Yields (row indices, weights) batches."""
    nrows, n = x.shape
    eps = np.float32(1e-9)
    thr = np.float32(block) * (eps * eps)
    w = imatrix.reshape(n // block, block)
    xb = x.reshape(nrows, n // block, block)
    sw2 = np.zeros(n // block, np.float32)
    sx2 = np.zeros((nrows, n // block), np.float32)
    swx = np.zeros((nrows, n // block), np.float32)
    for j in range(block):                     # C's order (and its fused multiply-adds)
        sw2 = fma32(w[:, j], w[:, j], sw2)
        sx2 = fma32(xb[:, :, j], xb[:, :, j], sx2)
        swx = fma32(w[:, j], np.abs(xb[:, :, j]), swx)
    keep = (sw2 > thr) & (sx2 > thr) & (swx > thr)
    plain = keep.all(axis=1)
    if plain.any():
        yield np.flatnonzero(plain), imatrix
    for r in np.flatnonzero(~plain):
        wr = np.where(keep[r][:, None], w, eps).astype(np.float32).reshape(-1)
        yield np.array([r]), wr


def quantize(x: np.ndarray, qtype_r: int | str, imatrix: np.ndarray | None,
             quantize_plain: Callable[[np.ndarray, int, np.ndarray | None], np.ndarray]) -> np.ndarray:
    """f32 rows (nrows, n_per_row) -> the flat bytes ik's ggml_quantize_chunk writes for the R type:
    the base type's quantizer (with QHelper's imatrix handling where ik uses it), then repack.
    Q8_K_R8, Q8_K_R16, Q8_KV_R8 and MXFP4_R8 ignore the imatrix, as ik does.  BF16_R16 truncates
    the f32 values to bf16 (ik's repack_f32_bf16_r16 keeps their top 16 bits: no rounding, unlike
    its BF16).  quantize_plain(rows, qtype, imatrix): the base type's ggml_quantize_chunk
    (quant.registry passes it)."""
    tr = type_info(qtype_r)
    if tr.id in NOT_REPACKED:
        raise NotImplementedError(f"quantize: {tr.name} is not a repacking (quant.iq1_r4_quantize writes it)")
    x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)
    nrows, n = x.shape
    _check_rows(tr, nrows, n)
    if tr.id in _Q8_K_FORMS:
        return repack(quantize_q8_k(x), Q8_K, nrows, n, tr.id).reshape(-1)
    if tr.id == BF16_R16:
        bits = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        return repack(bits.view(np.uint8), BF16, nrows, n, tr.id).reshape(-1)
    base = type_info(tr.base).id
    rb = type_info(base).row_bytes(n)
    if tr.id in _NO_IMATRIX:
        imatrix = None
    if imatrix is None or tr.id not in _QHELPER_BLOCK:
        plain = quantize_plain(x, base, imatrix).reshape(nrows, rb)
    else:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if imatrix.size != n:
            raise ValueError(f"imatrix has {imatrix.size} values but the rows have {n} columns")
        plain = np.empty((nrows, rb), dtype=np.uint8)
        for rows, w in _qhelper_groups(x, imatrix, _QHELPER_BLOCK[tr.id]):
            plain[rows] = quantize_plain(x[rows], base, w).reshape(len(rows), rb)
    return repack(plain, base, nrows, n).reshape(-1)


# ----------------------------------------------------------------------------------------
# IQ1_S_R4 / IQ1_M_R4: ik's own 4-row i-quants (not repackings: see the module docstring)
# ----------------------------------------------------------------------------------------
IQ1_ROW_META = 2                       # f16 row scale; a group starts with the 4 of its rows
IQ1_BYTES = {IQ1_S_R4: 6, IQ1_M_R4: 7}  # bytes per row per 32 values (R blocks of 24 / 28 bytes)
IQ1_DELTA = np.float32(0.125)          # IQ1S_DELTA = IQ1M_DELTA


def iq1_r4_row_bytes(qtype_r: int, n_per_row: int) -> int:
    if n_per_row % 32:
        raise ValueError(f"IQ1_S_R4 / IQ1_M_R4 rows of {n_per_row} values are not a multiple of 32")
    return IQ1_ROW_META + n_per_row // 32 * IQ1_BYTES[qtype_r]


def _iq1_r4_groups(raw: np.ndarray, qtype_r: int, nrows: int, n_per_row: int):
    """-> (d (ngroups, 4) f32 row scales, R blocks (ngroups, n_per_row / 32, 4 * bytes per 32))."""
    if nrows % 4:
        raise ValueError(f"{nrows} rows are not whole groups of 4 rows")
    rb = iq1_r4_row_bytes(qtype_r, n_per_row)
    g = _as_rows(raw, nrows, rb, "IQ1_R4").reshape(nrows // 4, 4 * rb)
    d = np.ascontiguousarray(g[:, :8]).view(np.float16).astype(np.float32)
    return d, g[:, 8:].reshape(nrows // 4, n_per_row // 32, 4 * IQ1_BYTES[qtype_r])


def _iq1_grid() -> np.ndarray:
    from .iquants import GRID_IQ1S       # the data table only (quant.iquants is the IQ1_S family)
    return GRID_IQ1S.astype(np.float32)


def dequantize_iq1_s_r4(raw: np.ndarray, nrows: int, n_per_row: int) -> np.ndarray:
    """IQ1_S_R4 rows -> f32 (nrows, n_per_row), the values of ik's dequantize_row_iq1_s_r4.
    R block (per 32 values of 4 rows): qs[16] (byte 4*i + k: low index byte of row k's group i
    of 8), qh u16[4] (row k: bits 3i..3i+2 high index bits, 12..14 ls, 15 the delta sign).
    Value d[k] (2 ls + 1) (grid + delta), every product exact in f32."""
    d, B = _iq1_r4_groups(raw, IQ1_S_R4, nrows, n_per_row)
    qs = B[..., 0:16].reshape(*B.shape[:2], 4, 4).astype(np.int64)                 # (g, b, i, k)
    qh = np.ascontiguousarray(B[..., 16:24]).view("<u2").astype(np.int64)        # (g, b, k)
    idx = qs | (((qh[:, :, None, :] >> (3 * np.arange(4))[:, None]) & 7) << 8)
    dl = d[:, None, :] * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)           # (g, b, k)
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)
    v = _iq1_grid()[idx.transpose(0, 3, 1, 2)] + delta.transpose(0, 2, 1)[..., None, None]
    y = (dl.transpose(0, 2, 1)[..., None, None] * v).astype(np.float32)           # (g, k, b, i, 8)
    return y.reshape(nrows, n_per_row)


def dequantize_iq1_m_r4(raw: np.ndarray, nrows: int, n_per_row: int) -> np.ndarray:
    """IQ1_M_R4 rows -> f32 (nrows, n_per_row), the values of ik's dequantize_row_iq1_m_r4.
    R block: qs[16] (byte 8*h + 4*q + k: low index byte of row k's group 2h + q of 8 in half h of
    16), qh[8] (byte 4*h + k: high index bits of groups 2h / 2h+1 in bits 0..2 / 4..6, their delta
    signs in bits 3 / 7), scales[4] (row k: ls of half 0 / 1 in the low / high nibble).
    Value d[k] ls (grid + delta): a 4-bit ls without the 2 ls + 1 of IQ1_M."""
    d, B = _iq1_r4_groups(raw, IQ1_M_R4, nrows, n_per_row)
    qs = B[..., 0:16].reshape(*B.shape[:2], 2, 2, 4).astype(np.int64)            # (g, b, h, q, k)
    qh = B[..., 16:24].reshape(*B.shape[:2], 2, 1, 4).astype(np.int64)           # (g, b, h, 1, k)
    sh = 4 * np.arange(2)[:, None]                                               # group q: nibble q
    idx = qs | (((qh >> sh) & 7) << 8)
    delta = np.where((qh >> sh) & 8, -IQ1_DELTA, IQ1_DELTA)                       # (g, b, h, q, k)
    sc = B[..., 24:28].astype(np.int64)                                          # (g, b, k)
    ls = np.stack([sc & 15, sc >> 4], axis=2).astype(np.float32)                 # (g, b, h, k)
    dl = d[:, None, None, :] * ls
    v = _iq1_grid()[idx] + delta[..., None]                                      # (g, b, h, q, k, 8)
    y = (dl[:, :, :, None, :, None] * v).astype(np.float32)
    return y.transpose(0, 4, 1, 2, 3, 5).reshape(nrows, n_per_row)


def iq1_s_r4_to_iq1_s(raw: np.ndarray, nrows: int, n_per_row: int) -> np.ndarray:
    """IQ1_S_R4 rows -> IQ1_S rows (nrows, n_per_row / 256 * 50) with the same values: every
    IQ1_S super-block takes its row's f16 scale as d; qs and qh move unchanged (IQ1_S's qh word
    per 32 values has the same fields).  Needs n_per_row % 256 == 0."""
    if n_per_row % QK_K:
        raise ValueError(f"IQ1_S rows of {n_per_row} values are not a multiple of 256")
    _, B = _iq1_r4_groups(raw, IQ1_S_R4, nrows, n_per_row)
    ng, nsb = nrows // 4, n_per_row // QK_K
    head = _as_rows(raw, nrows, iq1_r4_row_bytes(IQ1_S_R4, n_per_row), "IQ1_S_R4").reshape(ng, -1)[:, :8]
    out = np.empty((ng, 4, nsb, 50), dtype=np.uint8)
    out[..., 0:2] = head.reshape(ng, 4, 1, 2)                 # the f16 bits, unchanged
    B = B.reshape(ng, nsb, 8, 24)                                                # (g, sb, b, bytes)
    qs = B[..., 0:16].reshape(ng, nsb, 8, 4, 4).transpose(0, 4, 1, 2, 3)         # (g, k, sb, b, i)
    out[..., 2:34] = qs.reshape(ng, 4, nsb, 32)
    qh = B[..., 16:24].reshape(ng, nsb, 8, 4, 2).transpose(0, 3, 1, 2, 4)        # (g, k, sb, b, 2)
    out[..., 34:50] = qh.reshape(ng, 4, nsb, 16)
    return out.reshape(nrows, nsb * 50)


# byte k + 4 j of a 28-byte IQ1_M_R4 block (j < 7) is byte j of row k's 7 (qs[4], qh[2], scales)
_IQ1M_ROW_BYTES = np.array([[k + 4 * j for j in range(7)] for k in range(4)])


def iq1_m_r4_to_rows(raw: np.ndarray, nrows: int, n_per_row: int) -> np.ndarray:
    """IQ1_M_R4 rows -> IQ1_M_ROWS rows (the same row bytes, each row's own bytes together): per
    row its f16 scale, then per 32 values qs[4] (groups 2h + q: byte 2h + q), qh[2] (byte h:
    groups 2h / 2h+1 in nibbles, bit 3 of a nibble the delta sign), one byte of two 4-bit ls
    (half 0 low).  Values as dequantize_iq1_m_r4."""
    _, B = _iq1_r4_groups(raw, IQ1_M_R4, nrows, n_per_row)
    ng, nb = nrows // 4, n_per_row // 32
    head = _as_rows(raw, nrows, iq1_r4_row_bytes(IQ1_M_R4, n_per_row), "IQ1_M_R4").reshape(ng, -1)[:, :8]
    out = np.empty((ng, 4, 2 + nb * 7), dtype=np.uint8)     # written in place: one temporary, not three
    out[:, :, :2] = head.reshape(ng, 4, 2)
    out[:, :, 2:].reshape(ng, 4, nb, 7)[...] = B[:, :, _IQ1M_ROW_BYTES].transpose(0, 2, 1, 3)
    return out.reshape(nrows, 2 + nb * 7)


_NOT_REPACKED_ROWS = {IQ1_S_R4: iq1_s_r4_to_iq1_s, IQ1_M_R4: iq1_m_r4_to_rows}


# ----------------------------------------------------------------------------------------
# Numba: one group -> plain rows
# ----------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def unpack_group(buf, qtype, gbase, n_per_row, out):
    """Unpack the group of interleaved rows of R type `qtype` that starts at byte gbase of the
    uint8 array buf into out (uint8, (interleave, plain row bytes)): the row bytes of
    plain_type(qtype), ready for the plain decoders (quant.kernels.decode_rows_at).

    One loop for every type, driven by the tables above.  4-byte entries work on 4 bytes at
    once in a u32 (a field never crosses its byte lane: the mask drops what the shift brings
    in from the next byte); measured 1.3-1.9x faster than byte-wise OR-ing into zeroed rows."""
    if qtype < 0 or qtype >= _SLOT.size or _SLOT[qtype] < 0:
        raise ValueError("unpack_group: not a row-interleaved (_R4/_R8) type")
    s = _SLOT[qtype]
    nrow = _INFO[s, 0]
    sr = _INFO[s, 1]
    sp = _INFO[s, 2]
    meta = _INFO[s, 3]
    nb = n_per_row // _INFO[s, 4]
    e0 = _INFO[s, 5]
    e1 = _INFO[s, 6]
    pmeta = _INFO[s, 7]
    if out.shape[0] < nrow or out.shape[1] < pmeta + nb * sp or gbase + nrow * (meta + nb * sr) > buf.size:
        raise ValueError("unpack_group: out too small or group past the end of buf")
    for k in range(nrow):                      # the group header holds the rows' meta in order
        for t in range(meta):
            out[k, t] = buf[gbase + k * meta + t]
    for ib in range(nb):
        src = gbase + nrow * meta + ib * nrow * sr
        dst = pmeta + ib * sp
        for e in range(e0, e1):
            r = _E_ROW[e]
            d = dst + _E_DST[e]
            acc = np.uint32(0)
            if _E_CNT[e] == 4:
                for f in range(_E_F0[e], _E_F1[e]):
                    a = src + _F_SRC[f]
                    w = (np.uint32(buf[a]) | (np.uint32(buf[a + 1]) << 8) | (np.uint32(buf[a + 2]) << 16)
                         | (np.uint32(buf[a + 3]) << 24))
                    acc ^= (((w >> _F_SSH[f]) & (np.uint32(_F_MASK[f]) * np.uint32(0x01010101)))
                            ^ (np.uint32(_F_XOR[f]) * np.uint32(0x01010101))) << _F_DSH[f]
                out[r, d] = acc & 255
                out[r, d + 1] = (acc >> 8) & 255
                out[r, d + 2] = (acc >> 16) & 255
                out[r, d + 3] = acc >> 24
            else:
                for f in range(_E_F0[e], _E_F1[e]):
                    acc ^= (((np.uint32(buf[src + _F_SRC[f]]) >> _F_SSH[f]) & _F_MASK[f]) ^ _F_XOR[f]) << _F_DSH[f]
                out[r, d] = acc
    if pmeta > meta:                           # Q8_KV_R8 -> Q8_KV: the i32 sum of each row's quants
        for k in range(nrow):
            tot = np.int32(0)
            for j in range(nb * sp):
                tot += np.int32(np.int8(out[k, pmeta + j]))
            for t in range(4):
                out[k, meta + t] = (tot >> (8 * t)) & 255


@njit(parallel=True, cache=True, nogil=True)
def _unpack_groups(buf, qtype, ngroups, group_bytes, n_per_row, il, out):
    for g in prange(ngroups):
        unpack_group(buf, qtype, g * group_bytes, n_per_row, out[g * il:(g + 1) * il])


def unpack_fast(raw_r: np.ndarray, qtype_r: int | str, nrows: int, n_per_row: int) -> np.ndarray:
    """unpack in compiled code, groups in parallel: the same bytes (tests/test_interleaved.py).
    For converting a whole model's tensors at load (the NumPy unpack handles ~10 MB/s)."""
    tr = type_info(qtype_r)
    if not tr.interleave:
        raise ValueError(f"{tr.name} is not a row-interleaved (_R4/_R8) type")
    if tr.id in NOT_REPACKED:
        return _NOT_REPACKED_ROWS[tr.id](raw_r, nrows, n_per_row)
    _check_rows(tr, nrows, n_per_row)
    rb = tr.row_bytes(n_per_row)
    buf = _as_rows(raw_r, nrows, rb, tr.name).reshape(-1)
    prb = _plain_meta(tr.id) + n_per_row // _column(tr)[0] * _plain_block_bytes(tr.id)
    out = np.empty((nrows, prb), dtype=np.uint8)
    _unpack_groups(buf, tr.id, nrows // tr.interleave, tr.interleave * rb, n_per_row, tr.interleave, out)
    return out
