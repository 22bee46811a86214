"""Quantizers for ik_llama.cpp's IQK types, byte for byte like its ggml_quantize_chunk.

Types: IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, IQ2_KS, without and with an importance
matrix (checked identical to ik's bytes on every super-block of the golden data).  IQ4_KSS is
not done yet (its search prunes quants to an even bit count and scrambles them).

The layouts are described in quant.iqk (which decodes them).  Each quantizer is a search:
per sub-block of 16 or 32 values it tries candidate scales against the non-linear level
table and its shifted twin (the "extra" bit), then fits 4-8 bit integer sub-block scales
under one f16 super-block scale (or one row scale for IQ4_KS / IQ4_KSS / IQ2_KS).

Bit-exactness with the C++ build: ik_llama.cpp is compiled with -O3 -march=native, so GCC
fuses a product into the following addition (one rounding, FMA) wherever the product is
used only by that addition.  The search decisions compare sums that are accumulated that way,
so the code here makes every fused multiply-add explicit (`_fma`, LLVM's llvm.fma.f32) and
every other operation a separate f32 operation, in the C++ order.  Which operations are
fused was read from the disassembly of ik_build's libggml.so (GCC 12, znver3 tuning):

* `s += a*b*c` in a loop: t = a*b rounded, then s = fma(t, c, s);
* `p1 + p2 + ...` (sums of products): the first product is fused with the second (rounded)
  product as addend, every later product is fused with the running sum; a product with the
  level 1 (IQ2_K's third level) is no product at all (x*1 folds to x);
* nearest_int(a*b) (the 1.5*2^23 rounding trick) fuses a*b with the magic constant;
* sums of squares that GCC vectorizes (sum of x^2 over a super-block) are not fused: the
  squares are rounded, then added in order;
* a weight qw*sqrtf(sigma2 + x*x) fuses x*x + sigma2;
* IQ2_KS's prefix sums of w*x are not fused (IQ2_K's are).
The best-index lookups use tables rebuilt from the level sets (equal to ik's iq3nl_index ..
iq6nl_index).  IQ3_K's iterative refinement after its refit is dead code in ik (its result is
never stored) and is left out.

f16 values are rounded to nearest even (the F16C instruction the build uses).

imatrix semantics follow ik's QHelper: per row, the importance of each column, except that a
block (16 or 32 columns) whose weights, values or weighted values are all ~0 gets weights 1e-9.

Numba kernels process one super-block at a time (scalar loops, f32 arithmetic); `quantize`
is the NumPy-level entry point.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import iqk
from .iqk import IQ2_K, IQ2_KS, IQ3_K, IQ4_K, IQ4_KS, IQ4_KSS, IQ5_K, IQ6_K, QK_K
from .types import type_info

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division (no exceptions), no fastmath
_inl = dict(_opts, inline="always")                          # small helpers: inlined by Numba
f32 = np.float32

# IQ2_K / IQ2_KS levels as integers (ggml-common.h iq2nl_values; plain, then shifted)
IQ2NL_I = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=np.int32)


# ----------------------------------------------------------------------------------------
# scalar primitives
# ----------------------------------------------------------------------------------------
@intrinsic
def _fma(typingctx, a, b, c):
    """a*b + c in f32 with one rounding (llvm.fma.f32: the hardware FMA where there is one)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        flt = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [flt], ir.FunctionType(flt, [flt, flt, flt]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _f16_bits(typingctx, x):
    """IEEE half bit pattern of f32 x, rounded to nearest even (as GGML_FP32_TO_FP16 / F16C)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(h, ir.IntType(16)), ir.IntType(32))
    return types.int32(types.float32), codegen


_MAGIC = f32(12582912.0)   # 1.5 * 2^23


@njit(**_inl)
def _nint_fma(a, b):
    """ik's nearest_int(a*b) with the product fused into the + 1.5*2^23: round half to even.
    (For |a*b| < 2^22; the sum then lies in [2^23, 2^24) where subtracting back is exact.)"""
    v = _fma(a, b, _MAGIC)
    return np.int32(v - _MAGIC)


@njit(**_opts)
def _put_u16(out, o, v):
    out[o] = np.uint8(v & 0xFF)
    out[o + 1] = np.uint8((v >> 8) & 0xFF)


def _nearest_level_table(levels: np.ndarray, ncell: int) -> np.ndarray:
    """ik's best_index lookup (iq3nl_index, iq4nl_index, ...) for n sorted levels, indexed by
    the integer part of x - levels[0]: k when every x of that cell (taken as (t-1, t+1) around
    t = index + levels[0], wide enough for C's truncation toward zero on both sides of 0) has
    level k as its nearest, n + k when the cell holds the midpoint of levels k and k+1 (ik
    then compares the two distances).  Equal to ik's tables for all four level sets."""
    v = levels.astype(np.float64)
    mids = (v[1:] + v[:-1]) / 2
    tab = np.empty(ncell, dtype=np.int32)
    for ix in range(ncell):
        t = ix + v[0]
        k_lo = int(np.searchsorted(mids, t - 1, side="right"))
        k_hi = int(np.searchsorted(mids, t + 1, side="left"))
        tab[ix] = k_lo if k_lo == k_hi else len(v) + k_lo
    return tab


# level sets as f32 (plain half, then the shifted half), their lookup tables (built from the
# plain half and used for both halves, as ik does) and ik's range limit on the lookup index
LV3, LV4, LV5 = iqk.IQ3NL, iqk.IQ4K, iqk.IQ5NL
LV6 = iqk.IQ6K_INT_LEVELS                     # ik's quantizer uses the integer IQ6_K levels
CELLS3, CELLS4 = _nearest_level_table(LV3[:8], 111), _nearest_level_table(LV4[:16], 241)
CELLS5, CELLS6 = _nearest_level_table(LV5[:32], 248), _nearest_level_table(LV6[:64], 249)


@njit(**_inl)
def _best_index(lv, off, n, cells, lim, rel, x):
    """ik's best_index_iq{3,4,5}nl / best_index_iq6nl: index k (0..n-1) of the level
    lv[off + k] nearest to x (ties to the upper one by ik's test x - v[k] < v[k+1] - x where
    the lookup cell is ambiguous).  The cell is (int)x - v[0] (rel=False) or (int)(x - v[0])
    (rel=True, IQ6_K); ik returns 0 below cell 0 (also for NaN and for x >= 2^31, which
    cvttss2si turns into INT_MIN) and n-1 from cell `lim` on.  The range tests are done on the
    float: cell < 0 <=> y <= v[0]-1 (y <= -1 for rel), cell >= lim <=> y >= v[0]+lim (lim)."""
    v0 = lv[off]
    if rel:
        y = x - v0
        lo = f32(-1.0)
        hi = f32(lim)
    else:
        y = x
        lo = v0 - f32(1.0)
        hi = v0 + f32(lim)
    if not (y > lo) or y >= f32(2147483648.0):
        return 0
    if y >= hi:
        return n - 1
    if rel:
        k = cells[np.int32(y)]
    else:
        k = cells[np.int32(y) - np.int32(v0)]
    if k < n:
        return k
    k -= n
    if x - lv[off + k] < lv[off + k + 1] - x:
        return k
    return k + 1


@njit(**_opts)
def _lset(lset):
    """(levels, n, cells, lim, rel) of level set lset (3: IQ3_K, 4: IQ4_K/KS, 5: IQ5_K, 6: IQ6_K)."""
    if lset == 4:
        return LV4, 16, CELLS4, 241, False
    if lset == 3:
        return LV3, 8, CELLS3, 111, False
    if lset == 5:
        return LV5, 32, CELLS5, 247, False
    return LV6, 64, CELLS6, 249, True


@njit(**_opts)
def _bi(lset, off, x):
    """_best_index on level set lset (a call: for the less hot loops)."""
    lv, n, cells, lim, rel = _lset(lset)
    return _best_index(lv, off, n, cells, lim, rel, x)


@njit(**_inl)
def _best_index_iq2nl(tab, off, x):
    if x < f32(tab[off + 1]):
        idx = 0
    elif x > f32(tab[off + 2]):
        idx = 2
    else:
        idx = 1
    if x - f32(tab[off + idx]) < f32(tab[off + idx + 1]) - x:
        return idx
    return idx + 1


# ----------------------------------------------------------------------------------------
# importance weights (ik's QHelper::row_weights)
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _row_weights(imat, xr, block, w):
    eps = f32(1e-9)
    eps2 = eps * eps
    thr = f32(block) * eps2
    for b in range(xr.shape[0] // block):
        sw2 = f32(0.0)
        sx2 = f32(0.0)
        swx = f32(0.0)
        for j in range(block):
            wj = imat[b * block + j]
            xj = xr[b * block + j]
            w[b * block + j] = wj
            sw2 = _fma(wj, wj, sw2)
            sx2 = _fma(xj, xj, sx2)
            swx = _fma(wj, abs(xj), swx)
        if sw2 > thr and sx2 > thr and swx > thr:
            continue
        for j in range(block):
            w[b * block + j] = eps


@njit(**_opts)
def _sum_sq(x):
    """Sum of squares, squares rounded then added in order (GCC's in-order vector reduction)."""
    s = f32(0.0)
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    return s


# ----------------------------------------------------------------------------------------
# IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS: scale search per sub-block against a level table
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _fit(bi, xb, w, off, idv):
    """Fit the sub-block xb at inverse scale idv to the levels lv[off:off+n] and (with -idv)
    to their mirror image: (sumqx_p, sumq2_p, sumqx_m, sumq2_m)."""
    sqx_p = f32(0.0)
    sq2_p = f32(0.0)
    sqx_m = f32(0.0)
    sq2_m = f32(0.0)
    lv, n, cells, lim, rel = _lset(bi)
    for j in range(xb.shape[0]):
        al = idv * xb[j]
        q = lv[off + _best_index(lv, off, n, cells, lim, rel, al)]
        t = w[j] * q
        sqx_p = _fma(t, xb[j], sqx_p)
        sq2_p = _fma(t, q, sq2_p)
        q = lv[off + _best_index(lv, off, n, cells, lim, rel, -al)]
        t = w[j] * q
        sqx_m = _fma(t, xb[j], sqx_m)
        sq2_m = _fma(t, q, sq2_m)
    return sqx_p, sq2_p, sqx_m, sq2_m


@njit(**_opts)
def _weights(xb, qw, has_qw, sigma2, plain_sq, w):
    """ik's per-value weights: qw*sqrt(sigma2 + x^2) with an imatrix, else x^2 (plain_sq)
    or sigma2/4 + x^2."""
    for j in range(xb.shape[0]):
        if has_qw:
            w[j] = qw[j] * f32(np.sqrt(_fma(xb[j], xb[j], sigma2)))
        elif plain_sq:
            w[j] = xb[j] * xb[j]
        else:
            w[j] = f32(0.25) * sigma2 + xb[j] * xb[j]


@njit(**_opts)
def _search(bi, xb, w, lv, n, ntry, step, first_checked, refit):
    """The scale search of quantize_row_iq{3,4,5,6}_k / iq4_ks for one sub-block (max|x| >=
    1e-16): a first fit at d = max/|v0|, then 2*ntry+1 inverse scales (itry*step + v0)/max,
    each with the plain and the shifted levels and both signs; optionally a final refit.
    Returns (d, shifted)."""
    amax = f32(0.0)
    mx = f32(0.0)
    for j in range(xb.shape[0]):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            mx = xb[j]
    d = (-mx) / lv[0]
    idv = f32(1.0) / d
    sqx_p, sq2_p, sqx_m, sq2_m = _fit(bi, xb, w, 0, idv)
    best = f32(0.0)
    if not first_checked or sq2_p > 0:
        d = sqx_p / sq2_p
        best = d * sqx_p
    if sq2_m > 0 and sqx_m * sqx_m > best * sq2_m:
        d = sqx_m / sq2_m
        best = d * sqx_m
    is_shifted = False
    for itry in range(-ntry, ntry + 1):
        for sh in range(2):
            off = n * sh
            idv = f32(step * itry + np.int32(lv[off])) / mx
            sqx_p, sq2_p, sqx_m, sq2_m = _fit(bi, xb, w, off, idv)
            if sq2_p > 0 and sqx_p * sqx_p > best * sq2_p:
                d = sqx_p / sq2_p
                best = d * sqx_p
                is_shifted = sh == 1
            if sq2_m > 0 and sqx_m * sqx_m > best * sq2_m:
                d = sqx_m / sq2_m
                best = d * sqx_m
                is_shifted = sh == 1
    if refit and d != 0:
        off = n if is_shifted else 0
        idv = f32(1.0) / d
        sumqx = f32(0.0)
        sumq2 = f32(0.0)
        for j in range(xb.shape[0]):
            q = lv[off + _bi(bi, off, idv * xb[j])]
            t = w[j] * q
            sumqx = _fma(t, xb[j], sumqx)
            sumq2 = _fma(t, q, sumq2)
        if sumq2 > 0:
            d = sumqx / sumq2
    return d, is_shifted


# per type: levels per half, ntry, step, first fit checked, refit, sigma2 factor, x^2 weights
@njit(**_opts)
def _quantize_kblock(qtype, x, qw, has_qw, out, o):
    """One super-block of IQ3_K / IQ4_K / IQ5_K / IQ6_K -> its bytes at out[o:]."""
    if qtype == IQ3_K:
        _kblock(3, qtype, LV3, 8, 3, 2, 110, x, qw, has_qw, out, o)
    elif qtype == IQ4_K:
        _kblock(4, qtype, LV4, 16, 7, 1, 144, x, qw, has_qw, out, o)
    elif qtype == IQ5_K:
        _kblock(5, qtype, LV5, 32, 5, 1, 176, x, qw, has_qw, out, o)
    else:
        _kblock(6, qtype, LV6, 64, 5, 1, 212, x, qw, has_qw, out, o)


@njit(**_opts)
def _kblock(bi, qtype, lv, n, ntry, step, bsize, x, qw, has_qw, out, o):
    for k in range(bsize):
        out[o + k] = 0
    sumx2 = _sum_sq(x)
    if qtype == IQ3_K:
        sigma2 = (f32(1.5) * sumx2) * f32(1.0 / 256)
    else:
        sigma2 = (f32(2.0) * sumx2) * f32(1.0 / 256)
    plain_sq = qtype == IQ4_K
    scales = np.empty(16, dtype=np.float32)
    w = np.empty(16, dtype=np.float32)
    extra = 0
    max_scale = f32(0.0)
    amax_scale = f32(0.0)
    for ib in range(16):
        xb = x[16 * ib:16 * ib + 16]
        _weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, plain_sq, w)
        amax = f32(0.0)
        for j in range(16):
            amax = max(amax, abs(xb[j]))
        if amax < f32(1e-16):
            scales[ib] = f32(0.0)
            continue
        d, shifted = _search(bi, xb, w, lv, n, ntry, step, qtype == IQ3_K, qtype != IQ4_K)
        if qtype == IQ3_K and d == 0:
            scales[ib] = f32(0.0)
            continue
        scales[ib] = d
        if shifted:
            extra |= 1 << ib
        if abs(d) > amax_scale:
            amax_scale = abs(d)
            max_scale = d
    if qtype != IQ4_K and amax_scale == 0:
        return
    _put_u16(out, o + 2, extra)
    if qtype == IQ3_K:
        d = amax_scale / f32(31.0)
        dout = f32(1.01)
    elif qtype == IQ6_K:
        d = (-max_scale) / f32(127.0)
        _put_u16(out, o, _f16_bits(d))
        dout = f32(1.0)
    else:
        d = (-max_scale) * f32(1.0 / 32)
        _put_u16(out, o, _f16_bits(d))
        dout = f32(1.0)
    idv = f32(1.0) / d if d != 0 else f32(0.0)
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ib in range(16):
        if qtype == IQ3_K:
            ls = _nint_fma(f32(0.5), _fma(idv, abs(scales[ib]), f32(-1.0)))
            ls = max(0, min(15, ls))
            out[o + 6 + ib // 2] |= np.uint8(ls << (4 * (ib % 2)))
            if scales[ib] < 0:
                out[o + 4 + ib // 8] |= np.uint8(1 << (ib % 8))
                ls = -(2 * ls + 1)
            else:
                ls = 2 * ls + 1
        elif qtype == IQ6_K:
            ls = max(-127, min(127, _nint_fma(idv, scales[ib])))
            out[o + 4 + ib] = np.uint8(ls & 255)
        else:
            ls = max(-32, min(31, _nint_fma(idv, scales[ib])))
            out[o + 8 + ib // 2] |= np.uint8(((ls + 32) & 15) << (4 * (ib % 2)))
            out[o + 4 + ib // 4] |= np.uint8(((ls + 32) >> 4) << (2 * (ib % 4)))
        dl = d * f32(ls)
        if dl == 0 and qtype != IQ4_K:
            continue
        off = n if (extra >> ib) & 1 else 0
        idl = f32(1.0) / dl if dl != 0 else f32(0.0)
        xb = x[16 * ib:16 * ib + 16]
        _weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, plain_sq, w)
        ib32 = ib // 2
        for j in range(16):
            k = _bi(bi, off, idl * xb[j])
            e = 16 * (ib % 2) + j                     # position in the 32 of sub-block pair ib32
            if qtype == IQ3_K:
                out[o + 14 + 32 * (ib32 // 4) + e] |= np.uint8((k & 3) << (2 * (ib32 % 4)))
                out[o + 78 + e] |= np.uint8((k >> 2) << ib32)
            elif qtype == IQ4_K:
                out[o + 16 + 16 * ib32 + (e % 16)] |= np.uint8(k << (4 * (e // 16)))
            elif qtype == IQ5_K:
                out[o + 16 + 32 * (ib32 // 2) + e] |= np.uint8((k & 15) << (4 * (ib32 % 2)))
                out[o + 144 + e] |= np.uint8((k >> 4) << ib32)
            else:
                out[o + 20 + 32 * (ib32 // 2) + e] |= np.uint8((k & 15) << (4 * (ib32 % 2)))
                out[o + 148 + 32 * (ib32 // 4) + e] |= np.uint8((k >> 4) << (2 * (ib32 % 4)))
            q = lv[off + k] * f32(ls)
            t = q * w[j]
            sumqx = _fma(t, xb[j], sumqx)
            sumq2 = _fma(t, q, sumq2)
    if qtype == IQ3_K:
        dd = sumqx / sumq2 if sumq2 > 0 else d
        _put_u16(out, o, _f16_bits(dout * dd))
    elif sumq2 > 0:
        _put_u16(out, o, _f16_bits(sumqx / sumq2))


# ----------------------------------------------------------------------------------------
# IQ4_KS: row scale (f32) + per block of 32 a 7-bit scale and the shift bit
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _quantize_iq4_ks_row(x, qw, has_qw, out):
    """One row -> f32 row scale + 136-byte blocks in out (the row's bytes)."""
    nb = x.shape[0] // QK_K
    lv, n = LV4, 16
    for k in range(out.shape[0]):
        out[k] = 0
    scales = np.empty(nb * 8, dtype=np.float32)
    w = np.empty(32, dtype=np.float32)
    amax_scale = f32(0.0)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = _sum_sq(xbl) * f32(2.0 / 256)
        o = 4 + 136 * ibl
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, True, w)
            amax = f32(0.0)
            for j in range(32):
                amax = max(amax, abs(xb[j]))
            if amax < f32(1e-16):
                scales[8 * ibl + ib] = f32(0.0)
                continue
            d, shifted = _search(4, xb, w, lv, n, 7, 1, False, False)
            if shifted:
                out[o + ib] = 1
            scales[8 * ibl + ib] = d
            amax_scale = max(amax_scale, abs(d))
    d = amax_scale / f32(127.0)
    _put_f32(out, 0, d)
    if d == 0:
        return
    idv = f32(1.0) / d
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = _sum_sq(xbl) * f32(2.0 / 256)
        o = 4 + 136 * ibl
        for ib in range(8):
            off = 16 if out[o + ib] & 1 else 0
            l = _nint_fma(f32(0.5), _fma(idv, scales[8 * ibl + ib], f32(127.0)))
            l = max(0, min(127, l)) << 1
            out[o + ib] |= np.uint8(l)
            l -= 127
            dl = d * f32(l)
            idl = f32(1.0) / dl if dl != 0 else f32(0.0)
            xb = xbl[32 * ib:32 * ib + 32]
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, True, w)
            for j in range(16):
                i1 = _bi(4, off, idl * xb[j])
                i2 = _bi(4, off, idl * xb[j + 16])
                out[o + 8 + 16 * ib + j] = np.uint8(i1 | (i2 << 4))
                q1 = lv[off + i1] * f32(l)
                q2 = lv[off + i2] * f32(l)
                t1 = q1 * w[j]
                t2 = q2 * w[j + 16]
                sumqx += _fma(t1, xb[j], t2 * xb[j + 16])
                sumq2 += _fma(t1, q1, t2 * q2)
    if sumq2 > 0:
        _put_f32(out, 0, sumqx / sumq2)


@njit(**_opts)
def _put_f32(out, o, v):
    b = np.empty(1, dtype=np.float32)
    b[0] = v
    u = b.view(np.uint32)[0]
    for k in range(4):
        out[o + k] = np.uint8((u >> np.uint32(8 * k)) & np.uint32(255))


# ----------------------------------------------------------------------------------------
# IQ2_K
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _make_qx_quants(x, qw, nmax, L):
    """ik's make_qx_quants(n, nmax, x, L, qw) (iqk_quantize.cpp): the best scale for the
    values x, trying 19 candidate inverse scales; L <- the integer scales + nmax of the best
    candidate.  Returns 0 (L zero) for an all-zero x."""
    n = x.shape[0]
    mx = f32(0.0)
    amax = f32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax == 0:
        for i in range(n):
            L[i] = 0
        return f32(0.0)
    fn = f32(nmax)
    iscale = f32(-nmax) / mx
    sumlx = f32(0.0)
    suml2 = f32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _nint_fma(iscale, x[i])))
        L[i] = l + nmax
        fl = f32(l)
        sumlx = _fma(qw[i] * x[i], fl, sumlx)
        suml2 = _fma(qw[i] * fl, fl, suml2)
    scale = sumlx / suml2 if suml2 != 0 else f32(0.0)
    best = scale * sumlx
    for it in range(-9, 10):
        if it == 0:
            continue
        iscale = -_fma(f32(0.1), f32(it), fn) / mx
        sumlx = f32(0.0)
        suml2 = f32(0.0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, _nint_fma(iscale, x[i])))
            fl = f32(l)
            sumlx = _fma(qw[i] * x[i], fl, sumlx)
            suml2 = _fma(qw[i] * fl, fl, suml2)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nint_fma(iscale, x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(**_opts)
def _sort_pairs(xb, idx):
    """idx <- 0..n-1 ordered by (xb value, index): std::sort of (value, index) pairs."""
    n = xb.shape[0]
    for j in range(n):
        idx[j] = j
    for j in range(1, n):
        k = idx[j]
        v = xb[k]
        i = j - 1
        while i >= 0 and (v < xb[idx[i]] or (not (xb[idx[i]] < v) and k < idx[i])):
            idx[i + 1] = idx[i]
            i -= 1
        idx[i + 1] = k


@njit(**_opts)
def _iq2k_weights(xb, qw, has_qw, sigma2, w):
    for j in range(xb.shape[0]):
        if has_qw:
            w[j] = qw[j] * f32(np.sqrt(_fma(xb[j], xb[j], sigma2)))
        else:
            w[j] = f32(0.25) * sigma2 + xb[j] * xb[j]


@njit(**_opts)
def _iq2k_search(xb, w, sumx, sumw, idx, max_i1, min_i3, fused_prefix):
    """Best (scale, shifted) for one sub-block (IQ2_K: 16 values, IQ2_KS: 32) over the splits
    i1 < max_i1 <= i2 <= i3 (i3 >= min_i3) of the sorted values into 4 runs (levels in order
    or reversed, plain or shifted table).  The sums are formed as GCC fuses them (module
    docstring; the prefix sums of w*x are fused in IQ2_K's build only)."""
    n = xb.shape[0]
    _sort_pairs(xb, idx)
    sumx[0] = f32(0.0)
    sumw[0] = f32(0.0)
    for j in range(n):
        jj = idx[j]
        sumw[j + 1] = sumw[j] + w[jj]
        if fused_prefix:
            sumx[j + 1] = _fma(w[jj], xb[jj], sumx[j])
        else:
            sumx[j + 1] = sumx[j] + w[jj] * xb[jj]
    best = f32(0.0)
    d = f32(0.0)
    shifted = False
    c31, c13, c17 = f32(-31.0), f32(-13.0), f32(17.0)
    c26, c8, c6, c22 = f32(-26.0), f32(-8.0), f32(6.0), f32(22.0)
    wt = sumw[n]
    xt = sumx[n]
    for i1 in range(max_i1):
        aw = sumw[i1] - sumw[0]
        ax = sumx[i1] - sumx[0]
        for i2 in range(i1, n):
            bw = sumw[i2] - sumw[i1]
            bx = sumx[i2] - sumx[i1]
            # first two terms of each of the four sums (loop invariant in i3)
            q2_1 = _fma(aw * c31, c31, (bw * c13) * c13)
            qx_1 = _fma(ax, c31, bx * c13)
            q2_2 = _fma(aw * c26, c26, (bw * c8) * c8)
            qx_2 = _fma(ax, c26, bx * c8)
            q2_3 = _fma(aw * c17, c17, bw)
            qx_3 = _fma(ax, c17, bx)
            q2_4 = _fma(aw * c22, c22, (bw * c6) * c6)
            qx_4 = _fma(ax, c22, bx * c6)
            for i3 in range(max(i2, min_i3), n):
                cw = sumw[i3] - sumw[i2]
                cx = sumx[i3] - sumx[i2]
                dw = wt - sumw[i3]
                dx = xt - sumx[i3]
                # levels -31 -13 1 17
                sumq2 = _fma(dw * c17, c17, q2_1 + cw)
                if sumq2 > 0:
                    sumqx = _fma(dx, c17, qx_1 + cx)
                    if sumqx * sumqx > best * sumq2:
                        d = sumqx / sumq2
                        best = d * sumqx
                        shifted = False
                # shifted -26 -8 6 22
                sumq2 = _fma(dw * c22, c22, _fma(cw * c6, c6, q2_2))
                if sumq2 > 0:
                    sumqx = _fma(dx, c22, _fma(cx, c6, qx_2))
                    if sumqx * sumqx > best * sumq2:
                        d = sumqx / sumq2
                        best = d * sumqx
                        shifted = True
                # reversed 17 1 -13 -31
                sumq2 = _fma(dw * c31, c31, _fma(cw * c13, c13, q2_3))
                if sumq2 > 0:
                    sumqx = _fma(dx, c31, _fma(cx, c13, qx_3))
                    if sumqx * sumqx > best * sumq2:
                        d = sumqx / sumq2
                        best = d * sumqx
                        shifted = False
                # reversed shifted 22 6 -8 -26
                sumq2 = _fma(dw * c26, c26, _fma(cw * c8, c8, q2_4))
                if sumq2 > 0:
                    sumqx = _fma(dx, c26, _fma(cx, c8, qx_4))
                    if sumqx * sumqx > best * sumq2:
                        d = sumqx / sumq2
                        best = d * sumqx
                        shifted = True
    return d, shifted


@njit(**_opts)
def _quantize_iq2_k_block(x, qw, has_qw, out, o):
    """One super-block of 256 values -> 76 bytes at out[o:]."""
    tab = IQ2NL_I
    for k in range(76):
        out[o + k] = 0
    sigma2 = (f32(1.5) * _sum_sq(x)) * f32(1.0 / 256)
    scales = np.empty(16, dtype=np.float32)
    sw = np.empty(16, dtype=np.float32)
    w = np.empty(16, dtype=np.float32)
    sumx = np.empty(17, dtype=np.float32)
    sumw = np.empty(17, dtype=np.float32)
    idx = np.empty(16, dtype=np.int64)
    extra = 0
    max_abs_scale = f32(0.0)
    for ib in range(16):
        xb = x[16 * ib:16 * ib + 16]
        _iq2k_weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, w)
        s = f32(0.0)
        amax = f32(0.0)
        for j in range(16):
            s += w[j]
            amax = max(amax, abs(xb[j]))
        sw[ib] = s
        if amax < f32(1e-16):
            scales[ib] = f32(0.0)
            continue
        d, shifted = _iq2k_search(xb, w, sumx, sumw, idx, 16, 0, True)
        scales[ib] = d
        if shifted:
            extra |= 1 << ib
        max_abs_scale = max(max_abs_scale, abs(d))
    if max_abs_scale == 0:
        return
    Ls = np.empty(16, dtype=np.int32)
    d = _make_qx_quants(scales, sw, 8, Ls)
    if d == 0:
        return
    _put_u16(out, o + 2, extra)
    idv = f32(1.0) / d
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ib in range(16):
        ls = max(-8, min(7, _nint_fma(idv, scales[ib])))
        out[o + 4 + ib // 2] |= np.uint8((ls + 8) << (4 * (ib % 2)))
        dl = d * f32(ls)
        if dl != 0:
            off = 4 if (extra >> ib) & 1 else 0
            xb = x[16 * ib:16 * ib + 16]
            _iq2k_weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, w)
            idl = f32(1.0) / dl
            ib32 = ib // 2
            qo = o + 12 + 32 * (ib32 // 4) + 16 * (ib % 2)
            sh = 2 * (ib32 % 4)
            for j in range(16):
                k = _best_index_iq2nl(tab, off, idl * xb[j])
                out[qo + j] |= np.uint8(k << sh)
                q = f32(tab[off + k] * ls)
                t = q * w[j]
                sumqx = _fma(t, xb[j], sumqx)
                sumq2 = _fma(t, q, sumq2)
    dd = sumqx / sumq2 if sumq2 > 0 else d
    _put_u16(out, o, _f16_bits(f32(1.030) * dd))


@njit(**_opts)
def _quantize_iq2_ks_row(x, qw, has_qw, out):
    """One row -> f16 row scale + 70-byte blocks (u16 extra | scales[4] | qs[64]) in out."""
    tab = IQ2NL_I
    nb = x.shape[0] // QK_K
    for k in range(out.shape[0]):
        out[k] = 0
    scales = np.zeros(nb * 8, dtype=np.float32)
    sw = np.zeros(nb * 8, dtype=np.float32)
    Ls = np.zeros(nb * 8, dtype=np.int32)
    w = np.empty(32, dtype=np.float32)
    sumx = np.empty(33, dtype=np.float32)
    sumw = np.empty(33, dtype=np.float32)
    idx = np.empty(32, dtype=np.int64)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = (f32(1.5) * _sum_sq(xbl)) * f32(1.0 / 256)
        extra = 0
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            _iq2k_weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, w)
            s = f32(0.0)
            amax = f32(0.0)
            for j in range(32):
                s += w[j]
                amax = max(amax, abs(xb[j]))
            sw[8 * ibl + ib] = s
            if amax < f32(1e-16):
                scales[8 * ibl + ib] = f32(0.0)
                continue
            d, shifted = _iq2k_search(xb, w, sumx, sumw, idx, 24, 8, False)
            scales[8 * ibl + ib] = d
            if shifted:
                extra |= 1 << ib
        _put_u16(out, 2 + 70 * ibl, extra)
    d = _make_qx_quants(scales, sw, 16, Ls)
    if d == 0:
        return
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = (f32(1.5) * _sum_sq(xbl)) * f32(1.0 / 256)
        o = 2 + 70 * ibl
        extra = np.int64(out[o]) | (np.int64(out[o + 1]) << 8)
        for ib in range(8):
            ls = Ls[8 * ibl + ib]
            out[o + 2 + ib // 2] |= np.uint8((ls & 15) << (4 * (ib % 2)))
            extra |= (ls >> 4) << (8 + ib)
            ls -= 16
            dl = d * f32(ls)
            if dl == 0:
                continue
            off = 4 if (extra >> ib) & 1 else 0
            xb = xbl[32 * ib:32 * ib + 32]
            _iq2k_weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, w)
            idl = f32(1.0) / dl
            qo = o + 6 + 32 * (ib // 4)
            sh = 2 * (ib % 4)
            for j in range(32):
                k = _best_index_iq2nl(tab, off, idl * xb[j])
                out[qo + j] |= np.uint8(k << sh)
                q = f32(tab[off + k] * ls)
                t = q * w[j]
                sumqx = _fma(t, xb[j], sumqx)
                sumq2 = _fma(t, q, sumq2)
        _put_u16(out, o, extra)
    dd = sumqx / sumq2 if sumq2 > 0 else d
    _put_u16(out, 0, _f16_bits(f32(1.030) * dd))


# ----------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _quantize_rows(x, qtype, imat, has_imat, out):
    """x (nrows, n) f32 -> out (nrows, row_bytes) uint8; imat: n column weights (has_imat)."""
    nrows, n = x.shape
    nb = n // QK_K
    w = np.zeros(n, dtype=np.float32)
    block = 32 if qtype == IQ4_KS or qtype == IQ4_KSS or qtype == IQ2_KS else 16
    bsize = (out.shape[1] - (4 if qtype == IQ4_KS or qtype == IQ4_KSS else 2 if qtype == IQ2_KS else 0)) // max(nb, 1)
    for r in range(nrows):
        xr = x[r]
        if has_imat:
            _row_weights(imat, xr, block, w)
        orow = out[r]
        if qtype == IQ4_KS:
            _quantize_iq4_ks_row(xr, w, has_imat, orow)
            continue
        if qtype == IQ2_KS:
            _quantize_iq2_ks_row(xr, w, has_imat, orow)
            continue
        for ibl in range(nb):
            xs = xr[QK_K * ibl:QK_K * ibl + QK_K]
            ws = w[QK_K * ibl:QK_K * ibl + QK_K]
            if qtype == IQ2_K:
                _quantize_iq2_k_block(xs, ws, has_imat, orow, bsize * ibl)
            else:
                _quantize_kblock(qtype, xs, ws, has_imat, orow, bsize * ibl)


QUANTIZE_TYPES = frozenset({IQ4_K, IQ2_K, IQ3_K, IQ5_K, IQ6_K, IQ4_KS, IQ2_KS})


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize f32 rows to the bytes ik_llama.cpp's ggml_quantize_chunk writes for IQK `qtype`.

    x: (nrows, n_per_row), or flat (one row; with an imatrix, rows of len(imatrix));
    imatrix: None or n_per_row f32 column importances.  Returns flat uint8 bytes,
    nrows * row_bytes(n_per_row).
    """
    ti = type_info(qtype)
    if ti.id not in QUANTIZE_TYPES:
        raise NotImplementedError(f"IQK quantize: type {ti.name} not supported")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        n = x.size if imatrix is None else np.asarray(imatrix).size
        if n == 0 or x.size % n:
            raise ValueError(f"{ti.name}: {x.size} values do not split into rows of {n}")
        x = x.reshape(-1, n)
    else:
        x = x.reshape(-1, x.shape[-1])
    x = np.ascontiguousarray(x)
    nrows, n = x.shape
    if n % QK_K:
        raise ValueError(f"{ti.name}: row length {n} is not a multiple of {QK_K}")
    if imatrix is None:
        im = np.zeros(1, dtype=np.float32)
    else:
        im = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if im.size != n:
            raise ValueError(f"{ti.name}: imatrix has {im.size} values for rows of {n}")
    out = np.zeros((nrows, ti.row_bytes(n)), dtype=np.uint8)
    _quantize_rows(x, ti.id, im, imatrix is not None, out)
    return out.reshape(-1)
