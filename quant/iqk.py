"""Decoding of ik_llama.cpp's IQK weight types, bit for bit like its dequantize_row_<type>.

Types (ids from quant.types): IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K (super-blocks of 256, each
with its own f16 scale d), and IQ4_KS, IQ4_KSS, IQ2_KS, IQ5_KS, IQ3_KS, IQ2_KL (super-blocks
of 256 without a d; one row scale d is stored in the first bytes of every row: an f32 for
IQ4_KS / IQ4_KSS / IQ5_KS, an f16 for IQ2_KS / IQ3_KS / IQ2_KL).

Every type splits a super-block into sub-blocks of 16 or 32 values.  A sub-block has an
integer scale ls and one "extra" bit that picks one of two non-linear level tables (the
second one is the first shifted by a small amount); a value is

    y = (d * ls) * level[extra][q]          (two f32 roundings, in that order)

with q a 2..6-bit index (IQ2_KL: a 5-bit index of a pair of levels, see below).  Byte
layouts, for element e of a super-block (0..255):

IQ2_K  (76 B)  f16 d | u16 extra | scales[8] | qs[64]
               sub-block g = e//16: ls = nibble g of scales (low nibble first) - 8,
               extra bit g;  q = qs[32*(e//128) + e%32] >> 2*((e//32)%4) & 3 -> IQ2NL.
IQ3_K (110 B)  f16 d | u16 extra | u16 sign bits | scales[8] | qs[64] | qh[32]
               g = e//16: ls = (2*nibble g + 1), negated when sign bit g is set; extra bit g;
               q = 2 bits as IQ2_K | bit e//32 of qh[e%32] << 2 -> IQ3NL.
IQ4_K (144 B)  f16 d | u16 extra | scales_h[4] | scales_l[8] | qs[128]
               g = e//16: ls = (nibble g of scales_l | 2 bits g of scales_h << 4) - 32;
               q = qs[16*(e//32) + e%16] >> 4*((e%32)//16) & 15 -> IQ4K.
IQ5_K (176 B)  f16 d | u16 extra | scales_h[4] | scales_l[8] | qs[128] | qh[32]
               scales as IQ4_K; q = qs[32*(e//64) + e%32] >> 4*((e%64)//32) & 15
               | bit e//32 of qh[e%32] << 4 -> IQ5NL.
IQ6_K (212 B)  f16 d | u16 extra | int8 scales[16] | qs[128] | qh[64]
               g = e//16: ls = scales[g]; q = 4 bits as IQ5_K
               | qh[32*(e//128) + e%32] >> 2*((e//32)%4) & 3 << 4 -> IQ6K level (below).
IQ4_KS         row: f32 d, then blocks (136 B): scales[8] | qs[128]
               g = e//32: ls = (scales[g] & 254) - 127, extra = scales[g] & 1; q as IQ4_K.
IQ4_KSS        row: f32 d, then blocks (128 B) of 64 little-endian u16 words w, 8 per
               sub-block of 32: bit 0 of word k is bit k of the sub-block's byte s
               (ls = (s & 254) - 127, extra = s & 1); the 4 nibbles of the word
               a = (w & 0xfffe) ^ ((w & 0xfffe) >> 1) are q of elements 2k, 16+2k, 2k+1, 17+2k.
IQ2_KS         row: f16 d, then blocks (70 B): u16 extra | scales[4] | qs[64]
               g = e//32: ls = (nibble g of scales | bit 8+g of extra << 4) - 16,
               extra bit g (bits 0..7); q as IQ2_K.
IQ5_KS         row: f32 d, then blocks (168 B): scales[8] | qs[128] | qh[32]
               g = e//32: ls, extra as IQ4_KS; q as IQ5_K (nibbles in pairs of 32, qh bit e//32).
IQ3_KS         row: f16 d, then blocks (102 B): u16 extra | scales[4] | qs[64] | qh[32]
               g = e//32: ls = (nibble g//4 of scales[g%4] | bit g of extra << 4) - 16,
               extra bit 8+g picks the shifted table; q as IQ3_K -> IQ3NL.
IQ2_KL         row: f16 d, then blocks (86 B): u16 scales_h | scales_l[4] | qs[64] | qh[16]
               g = e//32: ls = (nibble g//4 of scales_l[g%4] | 2 bits 2g of scales_h << 4) - 32;
               no extra bits.  Values come in pairs: pair p = e//2 (j = p%16 within its
               sub-block) has the 5-bit index k = nibble g%2 of qs[16*(g//2) + j]
               | bit g of qh[j] << 4, and its two values are the levels IQ2KL_PAIRS[k]
               (ggml-common.h iq2kl_values: 32 pairs of IQ3NL's first-table levels).

IQ6_K levels: dequantize_row_iq6_k computes them with a cubic in f32,
    level(q) = A + q*(B + q*(-C + q*D)) + m      (m = 1 when the extra bit is set),
which GCC contracts into three fused multiply-adds when it targets FMA (-march=native on any
current x86-64, and aarch64 by default); without FMA 34 of the 64 levels differ in the last
bit.  IQ6K_LEVELS reproduces the FMA build (checked against ik_build's libggml.so).  ik's own
matmul kernels, CUDA dequantizer and quantizer use instead the integer table iq6nl_values
(the cubic rounded to integers, IQ6K_INT_LEVELS here): up to 0.5 level apart from what
dequantize_row_iq6_k gives.  decode_row_iqk follows dequantize_row_iq6_k;
decode_row_iqk_int6 is the same decoder with the integer IQ6_K levels.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .types import type_info

IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K = 137, 138, 139, 140, 141
IQ4_KS, IQ2_KS, IQ4_KSS = 144, 145, 146
IQ5_KS, IQ3_KS, IQ2_KL = 152, 156, 157
TYPES = IQK_TYPES = frozenset({IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, IQ2_KS, IQ4_KSS,
                               IQ5_KS, IQ3_KS, IQ2_KL})
QK_K = 256

# ---------------------------------------------------------------------------------------
# level tables (ggml-common.h): the second half of each is the one picked by an extra bit
# ---------------------------------------------------------------------------------------
_f32 = np.float32
IQ2NL = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=_f32)
IQ3NL = np.array([-63, -40, -23, -10, 1, 13, 28, 47,
                  -59, -36, -19, -6, 5, 17, 32, 51], dtype=_f32)
IQ4K = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                 -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117], dtype=_f32)
IQ5NL = np.array([-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
                  -1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121,
                  -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
                  1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123], dtype=_f32)
IQ6NL_INT = np.array([
    -127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
    -51, -47, -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5,
    -2, 0, 3, 6, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 40, 44,
    47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115, 121,
    -126, -120, -114, -108, -103, -97, -92, -87, -83, -78, -73, -69, -65, -61, -57, -53,
    -50, -46, -43, -39, -36, -33, -30, -27, -24, -21, -18, -15, -12, -10, -7, -4,
    -1, 1, 4, 7, 10, 13, 15, 18, 21, 24, 28, 31, 34, 37, 41, 45,
    48, 52, 56, 60, 64, 69, 73, 78, 83, 88, 93, 99, 104, 110, 116, 122], dtype=_f32)

# IQ2_KL: ggml-common.h's iq2kl_values, 32 u16 words = two int8 levels each (low byte first)
_IQ2KL_WORDS = np.array([
    0xe9c1, 0x0dc1, 0xc1d8, 0xf6d8, 0x0dd8, 0x2fd8, 0xd8e9, 0xe9e9, 0x01e9, 0x0de9, 0x1ce9, 0xc1f6,
    0x01f6, 0x0df6, 0x2ff6, 0xe901, 0xf601, 0x0101, 0x0d01, 0x1c01, 0xd80d, 0xe90d, 0xf60d, 0x010d,
    0x0d0d, 0xc11c, 0xe91c, 0x011c, 0x1c1c, 0x2f1c, 0xe92f, 0x0d2f], dtype="<u2")
IQ2KL_PAIRS = _IQ2KL_WORDS.view(np.int8).reshape(32, 2).astype(_f32)     # (32, 2) levels
IQ2KL_FLAT = np.ascontiguousarray(IQ2KL_PAIRS.reshape(-1))                # pair k at 2k, 2k+1

# IQ6_K's cubic (iqk_quantize.cpp: A_IQ6K .. S_IQ6K), all f32
_A6, _B6, _C6, _D6, _S6 = _f32(-127.0), _f32(6.2568), _f32(0.11218), _f32(0.0011972), _f32(1.0)


def _fma_f32(a: np.ndarray, b, c) -> np.ndarray:
    """Fused a*b + c in f32 (one rounding).  Exact here: |a| <= 63 has 6 significant bits,
    so a*b + c fits the 53 bits of a double before the single rounding to f32."""
    return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)


def _iq6k_levels(fma: bool = True) -> np.ndarray:
    q = np.arange(64, dtype=np.float32)
    if fma:
        t = _fma_f32(q, _D6, -_C6)
        t = _fma_f32(q, t, _B6)
        v = _fma_f32(q, t, _A6)
    else:
        v = _A6 + q * (_B6 + q * (-_C6 + q * _D6))
    return np.concatenate([v + _f32(0.0), v + _S6]).astype(np.float32)


IQ6K_LEVELS = _iq6k_levels(fma=True)        # what dequantize_row_iq6_k computes (FMA build)
IQ6K_LEVELS_NOFMA = _iq6k_levels(fma=False)  # the same without FMA contraction
IQ6K_INT_LEVELS = IQ6NL_INT                  # what ik's matmul / CUDA / quantizer use

# ---------------------------------------------------------------------------------------
# NumPy reference
# ---------------------------------------------------------------------------------------
_E = np.arange(QK_K)
_G16, _G32 = _E // 16, _E // 32
_Q2_BYTE, _Q2_SHIFT = 32 * (_E // 128) + _E % 32, 2 * ((_E // 32) % 4)   # 2-bit fields (also IQ6_K qh)
_Q4_BYTE, _Q4_SHIFT = 16 * (_E // 32) + _E % 16, 4 * ((_E % 32) // 16)  # nibbles, pairs of 16
_Q4W_BYTE, _Q4W_SHIFT = 32 * (_E // 64) + _E % 32, 4 * ((_E % 64) // 32)  # nibbles, pairs of 32
_QH_BYTE, _QH_SHIFT = _E % 32, _E // 32                                  # 1 bit per element


def _f16s(b: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> f32 value of the little-endian f16."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _u16s(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2")[..., 0].astype(np.int64)


def _bits(v: np.ndarray, shift, width: int) -> np.ndarray:
    return (v.astype(np.int64) >> shift) & ((1 << width) - 1)


def _nibbles(s: np.ndarray, n: int) -> np.ndarray:
    """(nb, n/2) bytes -> (nb, n): nibble g of the array (low nibble of byte g//2 first)."""
    g = np.arange(n)
    return _bits(s[:, g // 2], 4 * (g % 2), 4)


def _extra_bits(extra: np.ndarray, n: int) -> np.ndarray:
    return (extra[:, None] >> np.arange(n)) & 1


def _scaled(d: np.ndarray, ls: np.ndarray, group: int, levels: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(d * ls) * levels[idx] in f32, with ls per sub-block of `group` values."""
    dl = d[:, None].astype(np.float32) * ls.astype(np.float32)        # (nb, 256/group)
    g = _G16 if group == 16 else _G32
    return dl[:, g] * levels[idx]


def _ref_iq2_k(b, meta):
    d, extra, sc, qs = _f16s(b[:, 0:2]), _u16s(b[:, 2:4]), b[:, 4:12], b[:, 12:76]
    ls = _nibbles(sc, 16) - 8
    q = _bits(qs[:, _Q2_BYTE], _Q2_SHIFT, 2)
    return _scaled(d, ls, 16, IQ2NL, q + 4 * _extra_bits(extra, 16)[:, _G16])


def _ref_iq3_k(b, meta):
    d, extra, sign = _f16s(b[:, 0:2]), _u16s(b[:, 2:4]), _u16s(b[:, 4:6])
    sc, qs, qh = b[:, 6:14], b[:, 14:78], b[:, 78:110]
    ls = (2 * _nibbles(sc, 16) + 1) * (1 - 2 * _extra_bits(sign, 16))
    q = _bits(qs[:, _Q2_BYTE], _Q2_SHIFT, 2) | _bits(qh[:, _QH_BYTE], _QH_SHIFT, 1) << 2
    return _scaled(d, ls, 16, IQ3NL, q + 8 * _extra_bits(extra, 16)[:, _G16])


def _scales_6bit(sh: np.ndarray, sl: np.ndarray) -> np.ndarray:
    """IQ4_K / IQ5_K: 16 six-bit scales = nibble g of sl | 2-bit field g of sh << 4, minus 32."""
    g = np.arange(16)
    return (_nibbles(sl, 16) | _bits(sh[:, g // 4], 2 * (g % 4), 2) << 4) - 32


def _ref_iq4_k(b, meta):
    d, extra, sh, sl, qs = _f16s(b[:, 0:2]), _u16s(b[:, 2:4]), b[:, 4:8], b[:, 8:16], b[:, 16:144]
    q = _bits(qs[:, _Q4_BYTE], _Q4_SHIFT, 4)
    return _scaled(d, _scales_6bit(sh, sl), 16, IQ4K, q + 16 * _extra_bits(extra, 16)[:, _G16])


def _ref_iq5_k(b, meta):
    d, extra, sh, sl = _f16s(b[:, 0:2]), _u16s(b[:, 2:4]), b[:, 4:8], b[:, 8:16]
    qs, qh = b[:, 16:144], b[:, 144:176]
    q = _bits(qs[:, _Q4W_BYTE], _Q4W_SHIFT, 4) | _bits(qh[:, _QH_BYTE], _QH_SHIFT, 1) << 4
    return _scaled(d, _scales_6bit(sh, sl), 16, IQ5NL, q + 32 * _extra_bits(extra, 16)[:, _G16])


def _ref_iq6_k(b, meta, levels=IQ6K_LEVELS):
    d, extra, ls = _f16s(b[:, 0:2]), _u16s(b[:, 2:4]), b[:, 4:20].view(np.int8)
    qs, qh = b[:, 20:148], b[:, 148:212]
    q = _bits(qs[:, _Q4W_BYTE], _Q4W_SHIFT, 4) | _bits(qh[:, _Q2_BYTE], _Q2_SHIFT, 2) << 4
    return _scaled(d, ls, 16, levels, q + 64 * _extra_bits(extra, 16)[:, _G16])


def _ref_iq4_ks(b, meta):
    d = np.full(b.shape[0], meta.view("<f4")[0], dtype=np.float32)
    sc, qs = b[:, 0:8].astype(np.int64), b[:, 8:136]
    q = _bits(qs[:, _Q4_BYTE], _Q4_SHIFT, 4)
    return _scaled(d, (sc & 254) - 127, 32, IQ4K, q + 16 * (sc & 1)[:, _G32])


def _ref_iq4_kss(b, meta):
    d = np.full(b.shape[0], meta.view("<f4")[0], dtype=np.float32)
    w = np.ascontiguousarray(b).view("<u2").astype(np.int64).reshape(-1, 8, 8)  # (nb, sub-block, word)
    s = ((w & 1) << np.arange(8)).sum(axis=2)                                     # (nb, 8) scale bytes
    a = w & 0xFFFE
    a ^= a >> 1
    nib = (a[..., None] >> np.array([0, 4, 8, 12])) & 15                           # (nb, 8, 8 words, 4)
    q = np.empty((b.shape[0], 8, 32), dtype=np.int64)
    q[:, :, 0:16:2], q[:, :, 16:32:2] = nib[..., 0], nib[..., 1]   # byte 2k of the sub-block
    q[:, :, 1:16:2], q[:, :, 17:32:2] = nib[..., 2], nib[..., 3]   # byte 2k+1
    q = q.reshape(-1, QK_K)
    return _scaled(d, (s & 254) - 127, 32, IQ4K, q + 16 * (s & 1)[:, _G32])


def _ref_iq2_ks(b, meta):
    d = np.full(b.shape[0], _f16s(meta[None, 0:2])[0], dtype=np.float32)
    extra, sc, qs = _u16s(b[:, 0:2]), b[:, 2:6], b[:, 6:70]
    ls = (_nibbles(sc, 8) | (_extra_bits(extra >> 8, 8) << 4)) - 16
    q = _bits(qs[:, _Q2_BYTE], _Q2_SHIFT, 2)
    return _scaled(d, ls, 32, IQ2NL, q + 4 * _extra_bits(extra, 8)[:, _G32])


def _ref_iq5_ks(b, meta):
    d = np.full(b.shape[0], meta.view("<f4")[0], dtype=np.float32)
    sc, qs, qh = b[:, 0:8].astype(np.int64), b[:, 8:136], b[:, 136:168]
    q = _bits(qs[:, _Q4W_BYTE], _Q4W_SHIFT, 4) | _bits(qh[:, _QH_BYTE], _QH_SHIFT, 1) << 4
    return _scaled(d, (sc & 254) - 127, 32, IQ5NL, q + 32 * (sc & 1)[:, _G32])


_NIB8_BYTE, _NIB8_SHIFT = np.arange(8) % 4, 4 * (np.arange(8) // 4)   # nibble g//4 of byte g%4


def _ref_iq3_ks(b, meta):
    d = np.full(b.shape[0], _f16s(meta[None, 0:2])[0], dtype=np.float32)
    extra, sc, qs, qh = _u16s(b[:, 0:2]), b[:, 2:6], b[:, 6:70], b[:, 70:102]
    ls = (_bits(sc[:, _NIB8_BYTE], _NIB8_SHIFT, 4) | (_extra_bits(extra, 8) << 4)) - 16
    q = _bits(qs[:, _Q2_BYTE], _Q2_SHIFT, 2) | _bits(qh[:, _QH_BYTE], _QH_SHIFT, 1) << 2
    return _scaled(d, ls, 32, IQ3NL, q + 8 * _extra_bits(extra >> 8, 8)[:, _G32])


_P = np.arange(QK_K // 2)                                   # pairs of a super-block
_PG, _PJ = _P // 16, _P % 16                                # sub-block, pair within it


def _ref_iq2_kl(b, meta):
    d = np.full(b.shape[0], _f16s(meta[None, 0:2])[0], dtype=np.float32)
    sh, sl, qs, qh = _u16s(b[:, 0:2]), b[:, 2:6], b[:, 6:70], b[:, 70:86]
    g = np.arange(8)
    ls = (_bits(sl[:, _NIB8_BYTE], _NIB8_SHIFT, 4) | (sh[:, None] >> (2 * g) & 3) << 4) - 32
    k = _bits(qs[:, 16 * (_PG // 2) + _PJ], 4 * (_PG % 2), 4) | _bits(qh[:, _PJ], _PG, 1) << 4
    idx = (2 * k[:, :, None] + np.arange(2)).reshape(b.shape[0], QK_K)    # level entry of each value
    return _scaled(d, ls, 32, IQ2KL_FLAT, idx)


_REF = {IQ2_K: _ref_iq2_k, IQ3_K: _ref_iq3_k, IQ4_K: _ref_iq4_k, IQ5_K: _ref_iq5_k, IQ6_K: _ref_iq6_k,
        IQ4_KS: _ref_iq4_ks, IQ4_KSS: _ref_iq4_kss, IQ2_KS: _ref_iq2_ks,
        IQ5_KS: _ref_iq5_ks, IQ3_KS: _ref_iq3_ks, IQ2_KL: _ref_iq2_kl}


def dequant_rows(raw: np.ndarray, ti, n: int, n_per_row: int | None):
    """The checks of a super-block type's dequantize (also quant.ktquants'): returns raw as
    flat uint8, n_per_row (default n), the row's bytes and the number of rows holding n values."""
    n_per_row = n if n_per_row is None else n_per_row
    if n_per_row % QK_K:
        raise ValueError(f"{ti.name}: row length {n_per_row} is not a multiple of {QK_K}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    rb = ti.row_bytes(n_per_row)
    nrows = -(-n // n_per_row)
    if raw.size < nrows * rb:
        raise ValueError(f"{ti.name}: {n} values need {nrows * rb} bytes, got {raw.size}")
    return raw, n_per_row, rb, nrows


def dequantize(raw: np.ndarray, qtype: int, n: int, n_per_row: int | None = None,
               iq6k_levels: np.ndarray | None = None) -> np.ndarray:
    """Flat f32 values of the first n weights stored in `raw`, the bytes of whole rows of
    n_per_row weights each (default: one row of n).  iq6k_levels: the 128 IQ6_K levels to use
    (default IQ6K_LEVELS, i.e. dequantize_row_iq6_k; IQ6K_INT_LEVELS for ik's matmul values)."""
    ti = type_info(qtype)
    if ti.id not in _REF:
        raise ValueError(f"quant.iqk.dequantize: {ti.name} is not an IQK type")
    raw, n_per_row, rb, nrows = dequant_rows(raw, ti, n, n_per_row)
    fn = _REF[ti.id]
    out = np.empty((nrows, n_per_row), dtype=np.float32)
    for r in range(nrows):
        row = raw[r * rb:(r + 1) * rb]
        meta, blocks = row[:ti.row_meta], row[ti.row_meta:].reshape(-1, ti.type_size)
        if ti.id == IQ6_K and iq6k_levels is not None:
            out[r] = _ref_iq6_k(blocks, meta, np.asarray(iq6k_levels, dtype=np.float32)).reshape(-1)
        else:
            out[r] = fn(blocks, meta).reshape(-1)
    return out.reshape(-1)[:n]


# ---------------------------------------------------------------------------------------
# Numba decoder (calling convention of quant.kernels.decode_row, without qk)
# ---------------------------------------------------------------------------------------
_opts = dict(cache=True, fastmath=True, nogil=True)


@njit(**_opts)
def _f16_at(buf, o, lut):
    return lut[np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)]


@njit(**_opts)
def _u16_at(buf, o):
    return np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)


@njit(**_opts)
def _f32_at(buf, o):
    """f32 stored little-endian at byte offset o (any alignment; no allocation)."""
    u = np.uint32(np.uint32(buf[o]) | (np.uint32(buf[o + 1]) << np.uint32(8)) |
                  (np.uint32(buf[o + 2]) << np.uint32(16)) | (np.uint32(buf[o + 3]) << np.uint32(24)))
    return u.view(np.float32)


_inl = dict(_opts, inline="always")


@njit(**_inl)
def _ls6(buf, o, g):
    """IQ4_K / IQ5_K: six-bit scale g of the block at o (nibble g of scales_l at o+8 | 2-bit
    field g of scales_h at o+4 << 4), minus 32."""
    return (((np.int32(buf[o + 8 + g // 2]) >> (4 * (g % 2))) & 15) |
            (((np.int32(buf[o + 4 + g // 4]) >> (2 * (g % 4))) & 3) << 4)) - 32


@njit(**_inl)
def _put_lo(yv, n, dl, tv, qv, sh, lmask):
    """yv[j] = dl * tv[qv[j] >> sh & lmask] for j < n (n: a constant at every call)."""
    for j in range(n):
        yv[j] = dl * tv[(np.uint32(qv[j]) >> sh) & lmask]


@njit(**_inl)
def _put_lohi(yv, dl, tv, qv, sh, lmask, hv, hs, hmask, hshift):
    """16 values with a high part: q = qv[j] >> sh & lmask | (hv[j] >> hs & hmask) << hshift."""
    for j in range(16):
        k = ((np.uint32(qv[j]) >> sh) & lmask) | (((np.uint32(hv[j]) >> hs) & hmask) << hshift)
        yv[j] = dl * tv[k]


@njit(**_inl)
def _put32_lohi(yv, dl, tv, buf, qo, sh, lmask, ho, hs, hshift):
    """32 values as two _put_lohi halves: low bits in buf[qo:], one high bit (hs) in buf[ho:]."""
    for h in range(2):
        _put_lohi(yv[16 * h:16 * h + 16], dl, tv, buf[qo + 16 * h:], sh, lmask, buf[ho + 16 * h:], hs,
                  np.uint32(1), hshift)


@njit(**_opts)
def _decode_iqk(buf, qtype, base, cols, lut, y, tab):
    """Body of decode_row_iqk; tab: the level table of qtype (f32).

    The inner loops are table lookups (gathers), so unlike quant.kernels' arithmetic
    decoders they gain nothing from a run-time trip count: with the constant 16 / 32 LLVM
    unrolls them, measured 8-12 % faster than with a run-time count (AVX-512 host)."""
    nb = cols // 256
    if qtype == IQ2_K:
        for b in range(nb):
            o = base + b * 76
            yb = y[b * 256:b * 256 + 256]
            d = _f16_at(buf, o, lut)
            extra = _u16_at(buf, o + 2)
            for g in range(16):                                   # sub-blocks of 16
                ib = g // 2
                dl = d * np.float32(((np.int32(buf[o + 4 + ib]) >> (4 * (g % 2))) & 15) - 8)
                tv = tab[4 * ((extra >> g) & 1):]
                qv = buf[o + 12 + 32 * (ib // 4) + 16 * (g % 2):]
                sh = np.uint32(2 * (ib % 4))
                _put_lo(yb[16 * g:16 * g + 16], 16, dl, tv, qv, sh, np.uint32(3))
    elif qtype == IQ3_K:
        for b in range(nb):
            o = base + b * 110
            yb = y[b * 256:b * 256 + 256]
            d = _f16_at(buf, o, lut)
            extra = _u16_at(buf, o + 2)
            sign = _u16_at(buf, o + 4)
            for g in range(16):
                ib = g // 2
                s = (np.int32(buf[o + 6 + ib]) >> (4 * (g % 2))) & 15
                dl = d * np.float32((2 * s + 1) * (1 - 2 * ((sign >> g) & 1)))
                tv = tab[8 * ((extra >> g) & 1):]
                qv = buf[o + 14 + 32 * (ib // 4) + 16 * (g % 2):]
                hv = buf[o + 78 + 16 * (g % 2):]
                sh = np.uint32(2 * (ib % 4))
                hs = np.uint32(ib)
                _put_lohi(yb[16 * g:16 * g + 16], dl, tv, qv, sh, np.uint32(3), hv, hs, np.uint32(1), np.uint32(2))
    elif qtype == IQ4_K:
        for b in range(nb):
            o = base + b * 144
            yb = y[b * 256:b * 256 + 256]
            d = _f16_at(buf, o, lut)
            extra = _u16_at(buf, o + 2)
            for g in range(16):
                dl = d * np.float32(_ls6(buf, o, g))
                tv = tab[16 * ((extra >> g) & 1):]
                qv = buf[o + 16 + 16 * (g // 2):]
                sh = np.uint32(4 * (g % 2))
                _put_lo(yb[16 * g:16 * g + 16], 16, dl, tv, qv, sh, np.uint32(15))
    elif qtype == IQ5_K:
        for b in range(nb):
            o = base + b * 176
            yb = y[b * 256:b * 256 + 256]
            d = _f16_at(buf, o, lut)
            extra = _u16_at(buf, o + 2)
            for g in range(16):
                dl = d * np.float32(_ls6(buf, o, g))
                tv = tab[32 * ((extra >> g) & 1):]
                # chunks of 64 values: 32 bytes of nibbles (low nibbles first), qh bit e//32
                qv = buf[o + 16 + 32 * (g // 4) + 16 * (g % 2):]
                hv = buf[o + 144 + 16 * (g % 2):]
                sh = np.uint32(4 * ((g % 4) // 2))
                hs = np.uint32(g // 2)
                _put_lohi(yb[16 * g:16 * g + 16], dl, tv, qv, sh, np.uint32(15), hv, hs, np.uint32(1), np.uint32(4))
    elif qtype == IQ6_K:
        sc = buf.view(np.int8)
        for b in range(nb):
            o = base + b * 212
            yb = y[b * 256:b * 256 + 256]
            d = _f16_at(buf, o, lut)
            extra = _u16_at(buf, o + 2)
            for g in range(16):
                dl = d * np.float32(sc[o + 4 + g])
                tv = tab[64 * ((extra >> g) & 1):]
                qv = buf[o + 20 + 32 * (g // 4) + 16 * (g % 2):]
                hv = buf[o + 148 + 32 * (g // 8) + 16 * (g % 2):]
                sh = np.uint32(4 * ((g % 4) // 2))
                hs = np.uint32(2 * ((g // 2) % 4))
                _put_lohi(yb[16 * g:16 * g + 16], dl, tv, qv, sh, np.uint32(15), hv, hs, np.uint32(3), np.uint32(4))
    elif qtype == IQ4_KS:
        d = _f32_at(buf, base)
        for b in range(nb):
            o = base + 4 + b * 136
            yb = y[b * 256:b * 256 + 256]
            for g in range(8):                                    # sub-blocks of 32
                s = np.int32(buf[o + g])
                dl = d * np.float32((s & 254) - 127)
                tv = tab[16 * (s & 1):]
                qv = buf[o + 8 + 16 * g:]
                lo = yb[32 * g:32 * g + 16]
                hi = yb[32 * g + 16:32 * g + 32]
                for j in range(16):
                    v = np.uint32(qv[j])
                    lo[j] = dl * tv[v & np.uint32(15)]
                    hi[j] = dl * tv[v >> np.uint32(4)]
    elif qtype == IQ4_KSS:
        d = _f32_at(buf, base)
        for b in range(nb):
            o = base + 4 + b * 128
            yb = y[b * 256:b * 256 + 256]
            for g in range(8):
                wv = buf[o + 16 * g:]                             # 8 little-endian u16 words
                s = 0
                for k in range(8):
                    s |= (np.int32(wv[2 * k]) & 1) << k
                dl = d * np.float32((s & 254) - 127)
                tv = tab[16 * (s & 1):]
                lo = yb[32 * g:32 * g + 16]
                hi = yb[32 * g + 16:32 * g + 32]
                for k in range(8):
                    w = (np.uint32(wv[2 * k]) | (np.uint32(wv[2 * k + 1]) << np.uint32(8))) & np.uint32(0xFFFE)
                    a = w ^ (w >> np.uint32(1))
                    lo[2 * k] = dl * tv[a & np.uint32(15)]
                    hi[2 * k] = dl * tv[(a >> np.uint32(4)) & np.uint32(15)]
                    lo[2 * k + 1] = dl * tv[(a >> np.uint32(8)) & np.uint32(15)]
                    hi[2 * k + 1] = dl * tv[a >> np.uint32(12)]
    elif qtype == IQ2_KS:
        d = _f16_at(buf, base, lut)
        for b in range(nb):
            o = base + 2 + b * 70
            yb = y[b * 256:b * 256 + 256]
            extra = _u16_at(buf, o)
            for g in range(8):
                s = ((np.int32(buf[o + 2 + g // 2]) >> (4 * (g % 2))) & 15) | (((extra >> (8 + g)) & 1) << 4)
                dl = d * np.float32(s - 16)
                tv = tab[4 * ((extra >> g) & 1):]
                qv = buf[o + 6 + 32 * (g // 4):]
                sh = np.uint32(2 * (g % 4))
                _put_lo(yb[32 * g:32 * g + 32], 32, dl, tv, qv, sh, np.uint32(3))
    elif qtype == IQ5_KS:
        d = _f32_at(buf, base)
        for b in range(nb):
            o = base + 4 + b * 168
            yb = y[b * 256:b * 256 + 256]
            for g in range(8):
                s = np.int32(buf[o + g])
                dl = d * np.float32((s & 254) - 127)
                tv = tab[32 * (s & 1):]
                _put32_lohi(yb[32 * g:32 * g + 32], dl, tv, buf, o + 8 + 32 * (g // 2), np.uint32(4 * (g % 2)),
                            np.uint32(15), o + 136, np.uint32(g), np.uint32(4))
    elif qtype == IQ3_KS:
        d = _f16_at(buf, base, lut)
        for b in range(nb):
            o = base + 2 + b * 102
            yb = y[b * 256:b * 256 + 256]
            extra = _u16_at(buf, o)
            for g in range(8):
                s = ((np.int32(buf[o + 2 + g % 4]) >> (4 * (g // 4))) & 15) | (((extra >> g) & 1) << 4)
                dl = d * np.float32(s - 16)
                tv = tab[8 * ((extra >> (8 + g)) & 1):]
                _put32_lohi(yb[32 * g:32 * g + 32], dl, tv, buf, o + 6 + 32 * (g // 4), np.uint32(2 * (g % 4)),
                            np.uint32(3), o + 70, np.uint32(g), np.uint32(2))
    elif qtype == IQ2_KL:
        d = _f16_at(buf, base, lut)
        for b in range(nb):
            o = base + 2 + b * 86
            yb = y[b * 256:b * 256 + 256]
            sc_h = _u16_at(buf, o)
            for g in range(8):
                s = ((np.int32(buf[o + 2 + g % 4]) >> (4 * (g // 4))) & 15) | (((sc_h >> (2 * g)) & 3) << 4)
                dl = d * np.float32(s - 32)
                qv = buf[o + 6 + 16 * (g // 2):]
                hv = buf[o + 70:]
                sh = np.uint32(4 * (g % 2))
                hs = np.uint32(g)
                for j in range(16):
                    k = (((np.uint32(qv[j]) >> sh) & np.uint32(15))
                         | (((np.uint32(hv[j]) >> hs) & np.uint32(1)) << np.uint32(4)))
                    yb[32 * g + 2 * j] = dl * tab[2 * k]
                    yb[32 * g + 2 * j + 1] = dl * tab[2 * k + 1]
    else:
        raise ValueError("decode_row_iqk: not an IQK type")


@njit(**_opts)
def _table(qtype, iq6):
    if qtype == IQ2_K or qtype == IQ2_KS:
        return IQ2NL
    if qtype == IQ3_K or qtype == IQ3_KS:
        return IQ3NL
    if qtype == IQ5_K or qtype == IQ5_KS:
        return IQ5NL
    if qtype == IQ2_KL:
        return IQ2KL_FLAT
    if qtype == IQ6_K:
        return iq6
    return IQ4K


@njit(**_opts)
def decode_row_iqk(buf, qtype, base, cols, lut, y):
    """Write the `cols` values of the IQK row that starts (with its row-scale bytes, if the
    type has them) at byte `base` of buf into y[:cols]; as ik's dequantize_row_<type>."""
    _decode_iqk(buf, qtype, base, cols, lut, y, _table(qtype, IQ6K_LEVELS))


@njit(**_opts)
def decode_row_iqk_int6(buf, qtype, base, cols, lut, y):
    """decode_row_iqk, but IQ6_K with the integer levels iq6nl_values that ik's matmul
    kernels (and its CUDA dequantizer) use instead of dequantize_row_iq6_k's cubic."""
    _decode_iqk(buf, qtype, base, cols, lut, y, _table(qtype, IQ6K_INT_LEVELS))


@njit(**_opts)
def is_iqk(qtype):
    """True for the type ids decode_row_iqk handles (usable inside other njit code)."""
    return (qtype == IQ2_K or qtype == IQ3_K or qtype == IQ4_K or qtype == IQ5_K or qtype == IQ6_K
            or qtype == IQ4_KS or qtype == IQ2_KS or qtype == IQ4_KSS
            or qtype == IQ5_KS or qtype == IQ3_KS or qtype == IQ2_KL)
