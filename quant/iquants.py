"""The mainline i-quant family: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (256-value
blocks whose 8- or 4-value groups are points of a lattice grid, with signs).

Layouts (ggml-common.h of ik_llama.cpp, the same as mainline; little-endian):

    IQ2_XXS  66 bytes  f16 d, qs u16[32]: per 32 values two u32: grid indices (4 bytes, 256-point
                       grid of 8 values), then 4 x 7 sign bits and the 4-bit scale ls (top bits)
    IQ2_XS   74 bytes  f16 d, qs u16[32] (9-bit index into a 512-point grid | 7 sign bits << 9),
                       scales[8]: a 4-bit ls per 16 values
    IQ2_S    82 bytes  f16 d, qs[32] low index bytes, signs[32] (one byte per 8 values),
                       qh[8] (2 high index bits per group), scales[8] as IQ2_XS (1024-point grid)
    IQ3_XXS  98 bytes  f16 d, qs[64] (indices into a 256-point grid of 4 values), then per 32
                       values a u32 of 4 x 7 sign bits and the 4-bit ls
    IQ3_S   110 bytes  f16 d, qs[64] low index bytes, qh[8] (the 9th index bit, one per group
                       of 4), signs[32], scales[4] (a 4-bit ls per 32 values)
    IQ1_S    50 bytes  f16 d, qs[32] low index bytes, qh u16[8]: per 32 values 4 x 3 high index
                       bits, a 3-bit ls (bits 12..14) and the delta sign (bit 15); 2048-point
                       grid of 8 values in {-1, 0, 1}
    IQ1_M    56 bytes  qs[32], qh[16] (per 8 values 3 high index bits and the delta sign),
                       scales u16[4]: 3-bit ls per 16 values; the top nibbles of the four
                       words are the f16 block scale
    IQ1_M_ROWS         ikcli's form of ik's IQ1_M_R4 rows (quant.interleaved.iq1_m_r4_to_rows):
                       per row an f16 d, then per 32 values 7 bytes: qs[4], qh[2] (as IQ1_M's),
                       one byte of two 4-bit ls (per 16 values; value d ls / 8 level, no 2 ls + 1)

Seven sign bits select 8 signs: the eighth is their parity (ksigns_iq2xs).  Values, with every
product exact in f32 (so any evaluation order gives ik's bits):

    IQ2_XXS / IQ2_XS / IQ2_S   d (2 ls + 1) / 8 * g * sign
    IQ3_XXS                    d (2 ls + 1) / 4 * g * sign
    IQ3_S                      d (2 ls + 1)     * g * sign
    IQ1_S / IQ1_M              d (2 ls + 1) / 8 * (8 g + (delta sign ? -1 : 1))

The grids are ggml's tables, kept as data in quant/data/iquant_grids.npz (scripts/
make_iquant_grids.py).  `dequantize` is the NumPy reference, `decode_row_iquants` the Numba
decoder (quant.kernels' calling convention, without its qk argument); `levels` gives the
integer form above (the integer dot kernels' contract, quant.simd_blocks).
"""
from __future__ import annotations

import os

import numpy as np
from numba import njit

from .numeric import raw_bytes
from .types import type_info

IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29
IQ1_M_ROWS = 4                  # internal (quant.types): IQ1_M_R4's rows
TYPES = frozenset({IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M, IQ1_M_ROWS})
QK_K = 256
# ggml_quantize_requires_imatrix: the quantizers of these refuse to run without importance data
REQUIRES_IMATRIX = frozenset({IQ2_XXS, IQ2_XS, IQ1_S})

_G = np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "iquant_grids.npz"))
GRID_IQ1S = np.ascontiguousarray(_G["IQ1_S"])      # (2048, 8) in {-1, 0, 1}
GRID_IQ2XXS = np.ascontiguousarray(_G["IQ2_XXS"])  # (256, 8)
GRID_IQ2XS = np.ascontiguousarray(_G["IQ2_XS"])    # (512, 8)
GRID_IQ2S = np.ascontiguousarray(_G["IQ2_S"])      # (1024, 8)
GRID_IQ3XXS = np.ascontiguousarray(_G["IQ3_XXS"])  # (256, 4)
GRID_IQ3S = np.ascontiguousarray(_G["IQ3_S"])      # (512, 4)

# the block-scale divisor of each type: value = d * (2 ls + 1) / DIV * integer level
DIV = {IQ2_XXS: 8, IQ2_XS: 8, IQ2_S: 8, IQ3_XXS: 4, IQ3_S: 1, IQ1_S: 8, IQ1_M: 8}


def sign_byte(bits7: np.ndarray) -> np.ndarray:
    """7 sign bits -> the 8-bit mask with the parity bit on top (ksigns_iq2xs)."""
    b = np.asarray(bits7).astype(np.uint32) & 127
    par = np.zeros_like(b)
    for k in range(7):
        par ^= (b >> k) & 1
    return (b | (par << 7)).astype(np.uint8)


def _sign_values(sbytes: np.ndarray) -> np.ndarray:
    """(..., G) sign bytes -> (..., 8 G) factors +1 / -1 (bit j of a byte: its group's value j)."""
    bits = np.unpackbits(sbytes[..., None].astype(np.uint8), axis=-1, bitorder="little")
    return (1 - 2 * bits.astype(np.int32)).reshape(*sbytes.shape[:-1], -1)


def _u16s(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2").astype(np.int64)


def _u32s(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4").astype(np.int64)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def levels(raw: np.ndarray, qtype: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The integer form of n values: (d (nb,) f32 block scales, scale (nb, 16) odd integers 2 ls + 1
    per 16 values, level (nb, 256) int32), value = d / DIV * scale * level."""
    ti = type_info(qtype)
    if ti.id not in TYPES or ti.id == IQ1_M_ROWS:
        raise ValueError(f"{ti.name} is not a mainline i-quant")
    b = raw_bytes(raw, qtype, n).reshape(-1, ti.type_size)
    nb = b.shape[0]
    t = ti.id
    if t == IQ2_XXS:
        d = _f16(b[:, 0:2])[:, 0]
        w = _u32s(b[:, 2:66]).reshape(nb, 8, 2)
        idx = (w[:, :, 0:1] >> (8 * np.arange(4))) & 255                      # (nb, 8, 4)
        sg = sign_byte(w[:, :, 1:2] >> (7 * np.arange(4)))                   # (nb, 8, 4)
        lv = GRID_IQ2XXS[idx].astype(np.int32).reshape(nb, 8, 32) * _sign_values(sg)
        ls = (w[:, :, 1] >> 28)
        sc = np.repeat(ls, 2, axis=1)
    elif t == IQ2_XS:
        d = _f16(b[:, 0:2])[:, 0]
        q = _u16s(b[:, 2:66]).reshape(nb, 32)
        lv = GRID_IQ2XS[q & 511].astype(np.int32).reshape(nb, 256) * _sign_values(sign_byte(q >> 9))
        s = b[:, 66:74].astype(np.int64)
        sc = np.stack([s & 15, s >> 4], axis=2).reshape(nb, 16)
    elif t == IQ2_S:
        d = _f16(b[:, 0:2])[:, 0]
        qs, signs, qh = b[:, 2:34].astype(np.int64), b[:, 34:66], b[:, 66:74].astype(np.int64)
        hi = (np.repeat(qh, 4, axis=1) >> (2 * np.tile(np.arange(4), 8))) & 3
        lv = GRID_IQ2S[qs | (hi << 8)].astype(np.int32).reshape(nb, 256) * _sign_values(signs)
        s = b[:, 74:82].astype(np.int64)
        sc = np.stack([s & 15, s >> 4], axis=2).reshape(nb, 16)
    elif t == IQ3_XXS:
        d = _f16(b[:, 0:2])[:, 0]
        qs = b[:, 2:66].astype(np.int64)
        w = _u32s(b[:, 66:98])                                               # (nb, 8)
        sg = sign_byte(w[:, :, None] >> (7 * np.arange(4))).reshape(nb, 32)
        lv = GRID_IQ3XXS[qs].astype(np.int32).reshape(nb, 256) * _sign_values(sg)
        sc = np.repeat(w >> 28, 2, axis=1)
    elif t == IQ3_S:
        d = _f16(b[:, 0:2])[:, 0]
        qs, qh, signs = b[:, 2:66].astype(np.int64), b[:, 66:74].astype(np.int64), b[:, 74:106]
        hi = (np.repeat(qh, 8, axis=1) >> np.tile(np.arange(8), 8)) & 1
        lv = GRID_IQ3S[qs | (hi << 8)].astype(np.int32).reshape(nb, 256) * _sign_values(signs)
        s = b[:, 106:110].astype(np.int64)
        sc = np.repeat(np.stack([s & 15, s >> 4], axis=2).reshape(nb, 8), 2, axis=1)
    elif t == IQ1_S:
        d = _f16(b[:, 0:2])[:, 0]
        qs = b[:, 2:34].astype(np.int64).reshape(nb, 8, 4)
        qh = _u16s(b[:, 34:50])                                              # (nb, 8)
        idx = qs | (((qh[:, :, None] >> (3 * np.arange(4))) & 7) << 8)
        g = GRID_IQ1S[idx].astype(np.int32).reshape(nb, 8, 32)
        delta = 1 - 2 * ((qh >> 15) & 1)
        lv = 8 * g + delta[:, :, None]
        sc = np.repeat((qh >> 12) & 7, 2, axis=1)
    else:  # IQ1_M
        qs = b[:, 0:32].astype(np.int64).reshape(nb, 8, 4)
        qh = b[:, 32:48].astype(np.int64).reshape(nb, 8, 2)
        sw = _u16s(b[:, 48:56])                                              # (nb, 4)
        dbits = (sw[:, 0] >> 12) | ((sw[:, 1] >> 8) & 0xF0) | ((sw[:, 2] >> 4) & 0xF00) | (sw[:, 3] & 0xF000)
        d = dbits.astype(np.uint16).view(np.float16).astype(np.float32)
        qhg = np.stack([qh[:, :, 0] & 15, qh[:, :, 0] >> 4, qh[:, :, 1] & 15, qh[:, :, 1] >> 4], axis=2)
        idx = qs | ((qhg & 7) << 8)
        g = GRID_IQ1S[idx].astype(np.int32)                                  # (nb, 8, 4, 8)
        delta = 1 - 2 * ((qhg >> 3) & 1)
        lv = (8 * g + delta[..., None]).reshape(nb, 256)
        sc = (np.repeat(sw, 4, axis=1) >> (3 * np.tile(np.arange(4), 4))) & 7
    return d.astype(np.float32), (2 * sc + 1).astype(np.int32).reshape(nb, 16), lv.reshape(nb, 256).astype(np.int32)


def _dequantize_iq1_m_rows(raw: np.ndarray, n: int, n_per_row: int) -> np.ndarray:
    ti = type_info(IQ1_M_ROWS)
    nrows = n // n_per_row
    rows = np.ascontiguousarray(np.asarray(raw).reshape(-1).view(np.uint8)[:nrows * ti.row_bytes(n_per_row)])
    rows = rows.reshape(nrows, -1)
    d = _f16(rows[:, :2]).reshape(nrows, 1, 1)
    B = rows[:, 2:].reshape(nrows, n_per_row // 32, 7).astype(np.int64)
    qh = np.stack([B[..., 4] & 15, B[..., 4] >> 4, B[..., 5] & 15, B[..., 5] >> 4], axis=2)   # per group of 8
    g = GRID_IQ1S[B[..., :4] | ((qh & 7) << 8)].astype(np.int32)                             # (r, b, 4, 8)
    lv = 8 * g + (1 - 2 * ((qh >> 3) & 1))[..., None]
    ls = np.stack([B[..., 6] & 15, B[..., 6] >> 4], axis=2).astype(np.float32)               # (r, b, 2)
    dl = (d * ls) * np.float32(0.125)
    return (np.repeat(dl, 16, axis=2) * lv.reshape(nrows, -1, 32).astype(np.float32)).reshape(-1)


def dequantize(raw: np.ndarray, qtype: int, n: int, n_per_row: int | None = None) -> np.ndarray:
    """The first n values (a multiple of 256) of the flat bytes raw of an i-quant, as f32
    (IQ1_M_ROWS: rows of n_per_row values, default one row)."""
    if type_info(qtype).id == IQ1_M_ROWS:
        return _dequantize_iq1_m_rows(raw, n, n if n_per_row is None else n_per_row).astype(np.float32)
    d, sc, lv = levels(raw, qtype, n)
    dl = (d[:, None] * sc.astype(np.float32)) * np.float32(1.0 / DIV[type_info(qtype).id])
    return (np.repeat(dl, 16, axis=1) * lv.astype(np.float32)).astype(np.float32).reshape(-1)


# ----------------------------------------------------------------------------------------
# Numba decoder
# ----------------------------------------------------------------------------------------
_opts = dict(cache=True, fastmath=True, nogil=True)
_SIGNS = sign_byte(np.arange(128))
_BLOCK_BYTES = np.zeros(32, np.int64)        # type id -> block bytes (quant.types), 0: not in the family
for _t in TYPES - {IQ1_M_ROWS}:
    _BLOCK_BYTES[_t] = type_info(_t).type_size


@njit(**_opts)
def _u16_at(buf, o):
    return np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)


@njit(**_opts)
def _u32_at(buf, o):
    return _u16_at(buf, o) | (_u16_at(buf, o + 2) << 16)


@njit(**_opts)
def _put8(y, o, dl, grid, gi, signs):
    for j in range(8):
        v = np.float32(grid[gi, j])
        y[o + j] = dl * (-v if (signs >> j) & 1 else v)


@njit(**_opts)
def _put1(y, o, dl, gi, dsign):
    for j in range(8):
        y[o + j] = dl * np.float32(8 * np.int32(GRID_IQ1S[gi, j]) + (1 - 2 * dsign))


@njit(**_opts)
def decode_row_iquants(buf, qtype, base, cols, lut, y):
    """y[:cols] = the row at byte base of buf (cols a multiple of 256; IQ1_M_ROWS: of 32); lut:
    F16_TO_F32."""
    if qtype == IQ1_M_ROWS:
        d = lut[_u16_at(buf, base)]
        for ib in range(cols // 32):
            o = base + 2 + 7 * ib
            sc = np.int64(buf[o + 6])
            for h in range(2):
                dl = d * np.float32((sc >> (4 * h)) & 15) * np.float32(0.125)
                qh = np.int64(buf[o + 4 + h])
                for q in range(2):
                    hb = (qh >> (4 * q)) & 15
                    _put1(y, 32 * ib + 16 * h + 8 * q, dl, np.int64(buf[o + 2 * h + q]) | ((hb & 7) << 8), hb >> 3)
        return
    tb = _BLOCK_BYTES[qtype] if 0 <= qtype < _BLOCK_BYTES.size else 0
    if tb == 0:
        raise ValueError("decode_row_iquants: not an i-quant")
    for blk in range(cols // QK_K):
        o = base + blk * tb
        yo = blk * QK_K
        if qtype == IQ1_M:
            w0, w1, w2, w3 = _u16_at(buf, o + 48), _u16_at(buf, o + 50), _u16_at(buf, o + 52), _u16_at(buf, o + 54)
            d = lut[(w0 >> 12) | ((w1 >> 8) & 0xF0) | ((w2 >> 4) & 0xF00) | (w3 & 0xF000)]
        else:
            d = lut[_u16_at(buf, o)]
        for ib in range(8):
            yb = yo + 32 * ib
            if qtype == IQ2_XXS:
                g = _u32_at(buf, o + 2 + 8 * ib)
                s = _u32_at(buf, o + 6 + 8 * ib)
                dl = d * np.float32(2 * (s >> 28) + 1) * np.float32(0.125)
                for l in range(4):
                    _put8(y, yb + 8 * l, dl, GRID_IQ2XXS, (g >> (8 * l)) & 255, np.int64(_SIGNS[(s >> (7 * l)) & 127]))
            elif qtype == IQ2_XS or qtype == IQ2_S:
                sb = np.int64(buf[o + (66 if qtype == IQ2_XS else 74) + ib])
                for l in range(4):
                    dl = d * np.float32(2 * ((sb >> (4 * (l >> 1))) & 15) + 1) * np.float32(0.125)
                    if qtype == IQ2_XS:
                        q = _u16_at(buf, o + 2 + 8 * ib + 2 * l)
                        _put8(y, yb + 8 * l, dl, GRID_IQ2XS, q & 511, np.int64(_SIGNS[q >> 9]))
                    else:
                        gi = np.int64(buf[o + 2 + 4 * ib + l]) | (((np.int64(buf[o + 66 + ib]) >> (2 * l)) & 3) << 8)
                        _put8(y, yb + 8 * l, dl, GRID_IQ2S, gi, np.int64(buf[o + 34 + 4 * ib + l]))
            elif qtype == IQ3_XXS or qtype == IQ3_S:
                if qtype == IQ3_XXS:
                    s = _u32_at(buf, o + 66 + 4 * ib)
                    dl = d * np.float32(2 * (s >> 28) + 1) * np.float32(0.25)
                else:
                    ls = (np.int64(buf[o + 106 + (ib >> 1)]) >> (4 * (ib & 1))) & 15
                    dl = d * np.float32(2 * ls + 1)
                for l in range(8):
                    if qtype == IQ3_XXS:
                        gi = np.int64(buf[o + 2 + 8 * ib + l])
                        signs = np.int64(_SIGNS[(s >> (7 * (l >> 1))) & 127]) >> (4 * (l & 1))
                        grid = GRID_IQ3XXS
                    else:
                        gi = np.int64(buf[o + 2 + 8 * ib + l]) | (((np.int64(buf[o + 66 + ib]) >> l) & 1) << 8)
                        signs = np.int64(buf[o + 74 + 4 * ib + (l >> 1)]) >> (4 * (l & 1))
                        grid = GRID_IQ3S
                    for j in range(4):
                        v = np.float32(grid[gi, j])
                        y[yb + 4 * l + j] = dl * (-v if (signs >> j) & 1 else v)
            elif qtype == IQ1_S:
                qh = _u16_at(buf, o + 34 + 2 * ib)
                dl = d * np.float32(2 * ((qh >> 12) & 7) + 1) * np.float32(0.125)
                for l in range(4):
                    gi = np.int64(buf[o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                    _put1(y, yb + 8 * l, dl, gi, (qh >> 15) & 1)
            else:  # IQ1_M
                sw = _u16_at(buf, o + 48 + 2 * (ib >> 1))
                for l in range(4):
                    h = (np.int64(buf[o + 32 + 2 * ib + (l >> 1)]) >> (4 * (l & 1))) & 15
                    ls = (sw >> (6 * (ib & 1) + 3 * (l >> 1))) & 7
                    dl = d * np.float32(2 * ls + 1) * np.float32(0.125)
                    _put1(y, yb + 8 * l, dl, np.int64(buf[o + 4 * ib + l]) | ((h & 7) << 8), h >> 3)
