"""Quantizers for ik_llama.cpp's 4-row 1-bit i-quants IQ1_S_R4 (219) and IQ1_M_R4 (229), byte
for byte like its ggml_quantize_chunk (quantize_iq1_s_r4 / quantize_iq1_m_r4).  Checked
identical to ik's bytes on every block and row scale of the golden data
(tests/test_iq1_r4_quantize.py), of 4096 x 4096 Gaussian rows and of 1792 rows of 2048 from
seven distributions (zero / tiny blocks and halves, ties, sparse rows, scales 1e-9 .. 1e3),
without an imatrix and with two (one of them zero on many columns and blocks).

These are not repackings of IQ1_S / IQ1_M: ik quantizes them on their own, per 32 values of one
row, under one f16 scale per row (no super-blocks).  Layout of a group of 4 rows (row bytes
2 + n_per_row / 32 * 6 (IQ1_S_R4) or 7 (IQ1_M_R4); quant.interleaved decodes both):
* 8 bytes: the 4 rows' f16 scales d = 1.0625 max / 15 (max: the row's largest block scale);
* per 32 values, one block of the 4 rows:
  IQ1_S_R4 (24 bytes): qs[16] (byte 4 i + k: low 8 bits of row k's grid index of values
  8i..8i+7), qh u16[4] (row k: bits 3i..3i+2 the index's high 3 bits, 12..14 the block scale
  ls (value d (2 ls + 1)), 15 set for the shift -1/8);
  IQ1_M_R4 (28 bytes): qs[16] as above, qh[8] (byte 4 h + k: high bits of row k's groups
  2h / 2h+1 in bits 0..2 / 4..6, their shift -1/8 in bits 3 / 7), scales[4] (row k: a 4-bit
  ls per 16 values, low nibble first; value d ls, not IQ1_M's 2 ls + 1).

Per block (ggml-quants.c, the same out-of-line functions ik's IQ1_S / IQ1_M call, reused
from quant.iq12_quantize): IQ1_S_R4 runs iq1s_process_1block on the 32 values
(iq12_quantize._iq1s_block), IQ1_M_R4 iq1m_process_1block on each half of 16
(iq12_quantize._iq1m_block).  Weights: sigma2 = 1.5 sum(x^2) / 32 over the 32 values,
w = imatrix * sqrt(sigma2 + x^2) (without an imatrix, the square root alone).  A block whose
sum of squares is below 1e-14 is stored as grid index 1029 (all zeros) with scale 0; IQ1_M_R4
does the same per half.  With an imatrix, a block (IQ1_M_R4: a half) whose sum of w |x| is
below 1e-14 falls back to the weights without imatrix (ik prints a message for IQ1_S_R4).

Importance matrix: optional for both.  ggml_quantize_requires_imatrix lists only IQ2_XXS,
IQ2_XS and IQ1_S, so ik (and this module) quantizes IQ1_S_R4 / IQ1_M_R4 with or without one.
ik's imatrix is per column (the same for all rows).

Bit-exactness (disassembly of ik_build's libggml.so, GCC -O3 -march=native; the block
functions' own rules are in quant.iq12_quantize's docstring):
* the sums of squares are rounded squares added in order (IQ1_M_R4: the two halves apart,
  then low + high); sigma2 = (1.5 sum) * (1/32);
* sqrt(sigma2 + x*x) fuses x*x into the add, except IQ1_M_R4's imatrix fallback, which reuses
  the rounded squares of the sum above (sigma2 + round(x*x); read from the disassembly: the
  test data cannot tell it from the fused form, the weights differ by an ulp at most);
* sum w |x| (the imatrix check) fuses each product into the running sum; IQ1_M_R4 compares
  the second half's sum in double against 1e-14 (the first half, and IQ1_S_R4, in f32);
* d = (1.0625 max) / 15 rounded to f16 (nearest even); the block scales use inv = 15 / max
  (0 when max is 0): IQ1_S_R4 ls = nearest_int(0.5 (s inv - 1)) as fma(fma(inv, s, -1), 0.5,
  1.5 2^23), IQ1_M_R4 ls = nearest_int(s inv) as fma(s, inv, 1.5 2^23), clamped to 0..7 / 0..15.
Behaviour kept from ik: IQ1_M_R4 leaves the shift of a half whose 16 values are all ~0 to be
that of the last half processed at the same position (ik's shift1 / shift2 live across blocks,
rows and row groups).  Their first values are uninitialized in ik, so when the very first
block's half is skipped ik reads masks[] with a garbage index (arbitrary bits or a crash); 0 here.

Speed: one Numba kernel per type (f32 arithmetic, nogil, no fastmath) runs all row groups;
`quantize` is the NumPy-level entry point.  One thread, 4096 x 4096 Gaussian rows (thread CPU
time, shared 2-core box): IQ1_S_R4 2.0 s (ik 2.3-2.5 s), IQ1_M_R4 2.7 s (ik 2.7 s), with or
without an imatrix.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .f32ops import f16_bits, fma_f32
from .iq12_quantize import (_XM, _XP, _grid_tables, _iq1m_block, _iq1s_block, _level_tables, _ni_fma, _ni_half,
                            _put_u16, _sum_sq)
from .iquants import IQ1_S

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division, no fastmath
f32 = np.float32

IQ1_S_R4, IQ1_M_R4 = 219, 229
QUANTIZE_TYPES = (IQ1_S_R4, IQ1_M_R4)
_BLOCK_BYTES = {IQ1_S_R4: 24, IQ1_M_R4: 28}   # per 32 values of the 4 rows of a group
_NAMES = {IQ1_S_R4: "IQ1_S_R4", IQ1_M_R4: "IQ1_M_R4"}
_ZERO_INDEX = 1029                             # the grid point with all coordinates 0
_EPS = f32(1e-14)
_MASKS = np.array([0x00, 0x80, 0x08, 0x88], dtype=np.int64)   # IQ1_M shift pair -> qh bits


def row_bytes(qtype: int, n_per_row: int) -> int:
    """Bytes of one row of `qtype` (IQ1_S_R4 / IQ1_M_R4) with n_per_row values."""
    return 2 + n_per_row // 32 * _BLOCK_BYTES[qtype] // 4


@njit(**_opts)
def _finish_scale(out, base, k, mx):
    """Store row k's f16 scale (1.0625 mx / 15) in the group header; returns 15 / mx (0 for 0)."""
    _put_u16(out, base + 2 * k, f16_bits((f32(1.0625) * mx) / f32(15.0)))
    return f32(15.0) / mx if mx != 0 else f32(0.0)


@njit(**_opts)
def _groups_iq1_s_r4(x, qw, has_qw, out, kmap, nbrs, gqp, gqm, gl):
    """All row groups of x (nrows, n) into out (flat uint8), as ik's quantize_iq1_s_r4."""
    nrows, n = x.shape
    nblock = n // 32
    gbytes = 8 + 24 * nblock
    weight = np.empty(32, dtype=np.float32)
    L = np.zeros(32, dtype=np.int32)
    index = np.zeros(4, dtype=np.int64)
    idx = np.zeros(32, dtype=np.int64)
    sumx = np.zeros(33, dtype=np.float32)
    sumw = np.zeros(33, dtype=np.float32)
    scales = np.zeros((nblock, 4), dtype=np.float32)
    mx = np.zeros(4, dtype=np.float32)
    inv = np.zeros(4, dtype=np.float32)
    for g in range(nrows // 4):
        base = g * gbytes
        mx[:] = 0
        for ibl in range(nblock):
            bo = base + 8 + 24 * ibl
            xo = 32 * ibl
            for k in range(4):
                xb = x[4 * g + k, xo:xo + 32]
                s2 = _sum_sq(xb, 0, 32)
                if s2 < _EPS:
                    scales[ibl, k] = 0
                    for i in range(4):
                        out[bo + 4 * i + k] = np.uint8(_ZERO_INDEX & 255)
                    _put_u16(out, bo + 16 + 2 * k, 0x924)         # high bits 4 in each of 4 groups
                    continue
                sigma2 = (f32(1.5) * s2) * f32(1.0 / 32)
                use_qw = has_qw
                if has_qw:
                    sumwx = f32(0.0)
                    for j in range(32):
                        weight[j] = qw[xo + j] * np.sqrt(fma_f32(xb[j], xb[j], sigma2))
                        sumwx = fma_f32(weight[j], abs(xb[j]), sumwx)
                    if sumwx < _EPS:       # importances zero where x is not: ignore them
                        use_qw = False
                if not use_qw:
                    for j in range(32):
                        weight[j] = np.sqrt(fma_f32(xb[j], xb[j], sigma2))
                scale, shift = _iq1s_block(xb, weight, L, index, idx, sumx, sumw, kmap, nbrs, gqp, gqm, gl)
                scales[ibl, k] = scale
                mx[k] = scale if scale > mx[k] else mx[k]
                h = 0
                for i in range(4):
                    out[bo + 4 * i + k] = np.uint8(index[i] & 255)
                    h |= (index[i] >> 8) << (3 * i)
                if shift < 0:
                    h |= 0x8000
                _put_u16(out, bo + 16 + 2 * k, h)
        for k in range(4):
            inv[k] = _finish_scale(out, base, k, mx[k])
        for ibl in range(nblock):
            bo = base + 8 + 24 * ibl
            for k in range(4):
                ls = max(0, min(7, _ni_half(inv[k], scales[ibl, k])))
                out[bo + 17 + 2 * k] |= np.uint8(ls << 4)          # bits 12..14 of qh[k]


@njit(**_opts)
def _groups_iq1_m_r4(x, qw, has_qw, out, kmap, nbrs, gqp, gqm, gl):
    """All row groups of x (nrows, n) into out (flat uint8), as ik's quantize_iq1_m_r4."""
    nrows, n = x.shape
    nblock = n // 32
    gbytes = 8 + 28 * nblock
    weight = np.empty(32, dtype=np.float32)
    L = np.zeros(16, dtype=np.int32)
    index = np.zeros(4, dtype=np.int64)
    ihalf = np.zeros(2, dtype=np.int64)
    idx = np.zeros(16, dtype=np.int64)
    scratch = np.zeros((6, 17), dtype=np.float32)
    scales = np.zeros((nblock, 4, 2), dtype=np.float32)
    mx = np.zeros(4, dtype=np.float32)
    inv = np.zeros(4, dtype=np.float32)
    shift = np.zeros(2, dtype=np.int64)        # ik's shift1 / shift2: kept when a half is skipped
    for g in range(nrows // 4):
        base = g * gbytes
        mx[:] = 0
        for ibl in range(nblock):
            bo = base + 8 + 28 * ibl
            xo = 32 * ibl
            for k in range(4):
                xb = x[4 * g + k, xo:xo + 32]
                s2l = _sum_sq(xb, 0, 16)
                s2h = _sum_sq(xb, 16, 16)
                s2 = s2l + s2h
                if s2 < _EPS:
                    scales[ibl, k, 0] = 0
                    scales[ibl, k, 1] = 0
                    for i in range(4):
                        out[bo + 4 * i + k] = np.uint8(_ZERO_INDEX & 255)
                    for h in range(2):
                        out[bo + 16 + 4 * h + k] = np.uint8(0x44)  # high bits 4 and 4, shift +
                    continue
                sigma2 = (f32(1.5) * s2) * f32(1.0 / 32)
                if has_qw:
                    for j in range(32):
                        weight[j] = qw[xo + j] * np.sqrt(fma_f32(xb[j], xb[j], sigma2))
                    for h in range(2):
                        sumwx = f32(0.0)
                        for j in range(16 * h, 16 * h + 16):
                            sumwx = fma_f32(weight[j], abs(xb[j]), sumwx)
                        # ik: the first half compares in f32, the second in double (1e-14 literal)
                        low = sumwx < _EPS if h == 0 else np.float64(sumwx) < 1e-14
                        if low:
                            for j in range(16 * h, 16 * h + 16):
                                weight[j] = np.sqrt(sigma2 + xb[j] * xb[j])   # rounded square
                else:
                    for j in range(32):
                        weight[j] = np.sqrt(fma_f32(xb[j], xb[j], sigma2))
                for h in range(2):
                    if (s2l if h == 0 else s2h) > _EPS:
                        o = 16 * h
                        sc, sh = _iq1m_block(xb[o:o + 16], weight[o:o + 16], L, ihalf, idx, kmap, nbrs,
                                             gqp, gqm, gl, scratch)
                        shift[h] = sh
                        index[2 * h] = ihalf[0]
                        index[2 * h + 1] = ihalf[1]
                    else:
                        sc = f32(0.0)
                        index[2 * h] = _ZERO_INDEX
                        index[2 * h + 1] = _ZERO_INDEX
                    scales[ibl, k, h] = sc
                    mx[k] = sc if sc > mx[k] else mx[k]
                for i in range(4):
                    out[bo + 4 * i + k] = np.uint8(index[i] & 255)
                for h in range(2):
                    qh = (index[2 * h] >> 8) | ((index[2 * h + 1] >> 8) << 4) | _MASKS[shift[h]]
                    out[bo + 16 + 4 * h + k] = np.uint8(qh)
        for k in range(4):
            inv[k] = _finish_scale(out, base, k, mx[k])
        for ibl in range(nblock):
            bo = base + 8 + 28 * ibl
            for k in range(4):
                ls1 = max(0, min(15, _ni_fma(scales[ibl, k, 0], inv[k])))
                ls2 = max(0, min(15, _ni_fma(scales[ibl, k, 1], inv[k])))
                out[bo + 24 + k] = np.uint8(ls1 | (ls2 << 4))


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize f32 rows to the bytes ik_llama.cpp's ggml_quantize_chunk writes for IQ1_S_R4
    (qtype 219) or IQ1_M_R4 (229).

    x: (nrows, n_per_row) with nrows a multiple of 4 and n_per_row a multiple of 32;
    imatrix: None or n_per_row f32 column importances (optional for both types, as in ik).
    Returns (nrows, row_bytes) uint8, row_bytes = 2 + n_per_row / 32 * (6 or 7); each group
    of 4 rows is one interleaved unit (the rows' bytes are not separable).
    """
    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"iq1_r4_quantize: type {qtype} is not IQ1_S_R4 (219) or IQ1_M_R4 (229)")
    name = _NAMES[qtype]
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be 2-D (nrows, n_per_row), got shape {x.shape}")
    nrows, n = x.shape
    if nrows % 4:
        raise ValueError(f"{name}: {nrows} rows is not a multiple of 4 (rows are quantized in groups of 4)")
    if n % 32 or n == 0:
        raise ValueError(f"{name}: row length {n} is not a positive multiple of 32")
    x = np.ascontiguousarray(x)
    has = imatrix is not None
    if has:
        im = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if im.size != n:
            raise ValueError(f"{name}: imatrix has {im.size} values for rows of {n}")
    else:
        im = np.zeros(1, dtype=np.float32)
    rb = row_bytes(qtype, n)
    out = np.zeros(nrows * rb, dtype=np.uint8)
    if nrows:
        _, kmap, nbrs = _grid_tables(IQ1_S)
        gl, _ = _level_tables(IQ1_S)
        gqp, gqm = _XP[gl], _XM[gl]
        kern = _groups_iq1_s_r4 if qtype == IQ1_S_R4 else _groups_iq1_m_r4
        kern(x, im, has, out, kmap, nbrs, gqp, gqm, gl)
    return out.reshape(nrows, rb)
