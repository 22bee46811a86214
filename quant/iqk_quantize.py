"""Quantizers for ik_llama.cpp's IQK types, byte for byte like its ggml_quantize_chunk.

Types: IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, IQ4_KSS, IQ2_KS, IQ3_KS, IQ5_KS, IQ2_KL,
without and with an importance matrix (checked identical to ik's bytes on every super-block of
the golden data, and on 1024 random rows of 2048 per type, except one IQ2_KS row: its
row-scale fit (make_qx_quants) has a candidate that wins by one ulp, so some f32 rounding
still differs; IQ3_KS / IQ5_KS / IQ2_KL: 2560 rows of 2048 from five distributions, each
without and with an imatrix, all identical).  IQ4_KSS is IQ4_KS whose every group of four
quants is pruned to an even number of set bits, then stored as 15 scrambled bits.  IQ3_KS and
IQ5_KS are IQ3_K's / IQ5_K's scale search on sub-blocks of 32 under one row scale (IQ5_KS
stores its scales as IQ4_KS does).  IQ2_KL quantizes pairs of values to 32 pairs of IQ3_K
levels: the nearest level of each value, and when that pair is not one of the 32, the best of
eight listed neighbour pairs by weighted squared error.

The layouts are described in quant.iqk (which decodes them).  Each quantizer is a search:
per sub-block of 16 or 32 values it tries candidate scales against the non-linear level
table and its shifted twin (the "extra" bit), then fits 4-8 bit integer sub-block scales
under one f16 super-block scale (or one row scale for the _KS / _KSS / _KL types).

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
* IQ2_KS's prefix sums of w*x are not fused (IQ2_K's are);
* IQ4_KSS (the same rules; confirmed by the identical bytes): prune_iq4ks's errors
  dl*v - x are fma(dl, v, -x) and its score w*(e1*e1 - e0*e0) is w * fma(e1, e1, -(e0*e0));
  the final mse's x - dl*q is fma(-dl, q, x).
* IQ2_KL (the same rules, confirmed by the identical bytes): a pair's score
  w1*e1*e1 + w2*e2*e2 is fma(w1*e1, e1, (w2*e2)*e2), its errors dl*g - x are fma(dl, g, -x),
  and a pair's sums w1*q1*x1 + w2*q2*x2 are fma(w1*q1, x1, (w2*q2)*x2), added (unfused) to
  the running sum.  IQ3_KS stores the row scale -0 (f16 0x8000) for an all-zero row: ik
  writes -max_scale/16 before testing it.
The best-index lookups use tables rebuilt from the level sets (equal to ik's iq3nl_index ..
iq6nl_index).  IQ3_K's iterative refinement after its refit is dead code in ik (its result is
never stored) and is left out.

f16 values are rounded to nearest even (the F16C instruction the build uses).

imatrix semantics follow ik's QHelper: per row, the importance of each column, except that a
block (16 or 32 columns) whose weights, values or weighted values are all ~0 gets weights 1e-9.

Speed: the searches evaluate every candidate scale of a sub-block at once.  ik's nearest-level
lookup (table cell, then a compare) is replaced by the equal "count the thresholds x is at or
above" form (see _thresholds), so the level picks of all (value, candidate) pairs are
compares and selects in long loops that LLVM vectorizes (_pick_lanes); the per-candidate sums
then run in ik's order, and the candidates are compared in ik's order (IQ2_KL: the level
picks of its 24 candidates as lanes, then the pair lookups per lane).  IQ2_K / IQ2_KS's
split search first finds, vectorized over i3, the first split of an (i1, i2) row that beats
the current best, and scans the row in order from there only (usually there is none).
Numba compiles a callee once per distinct constant argument, so the per-type parameters are
passed as run-time values (_kparams) to keep the cold compile short.  Single-thread
throughput against ik: scripts/bench_quantize_kernels.py.

Numba kernels process one row or super-block per call (f32 arithmetic, nogil, no fastmath);
`quantize` is the NumPy-level entry point.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import iqk
from .f32ops import MAGIC, f16_bits, fma_f32, nint_fma, quantizer_rows
from .iqk import IQ2_K, IQ2_KL, IQ2_KS, IQ3_K, IQ3_KS, IQ4_K, IQ4_KS, IQ4_KSS, IQ5_K, IQ5_KS, IQ6_K, QK_K
from .types import type_info

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division (no exceptions), no fastmath
_inl = dict(_opts, inline="always")                          # small helpers: inlined by Numba
f32 = np.float32

# IQ2_K / IQ2_KS levels as integers (ggml-common.h iq2nl_values; plain, then shifted)
IQ2NL_I = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=np.int32)


# ----------------------------------------------------------------------------------------
# scalar primitives (quant.f32ops)
# ----------------------------------------------------------------------------------------
_fma, _f16_bits, _nint_fma, _MAGIC = fma_f32, f16_bits, nint_fma, MAGIC


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


# The search loops use another form of the same function: _best_index is non-decreasing in x
# below a cut-off X_big (2^31, or where x - v0 reaches 2^31 for IQ6_K) and 0 from there on,
# so the level it picks is levels[#{i : x >= T[i]}] (or levels[0] from X_big on), with T[i]
# the least f32 where it exceeds i.  That is compares and selects only, which LLVM vectorizes
# across the candidate scales.  (Checked against _best_index on every f32 of both signs up to
# +inf, for every level set and half; tests/test_quantize_iqk.py checks samples around each T.)
def _ord_key(x: np.ndarray) -> np.ndarray:
    """f32 -> int64 keys in the order of the floats (-0 and +0 adjacent, not equal)."""
    b = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(b >= 0, b, -(b & 0x7FFFFFFF) - 1)


def _from_key(k: np.ndarray) -> np.ndarray:
    b = np.where(k >= 0, k, (-(k + 1)) | 0x80000000)
    return b.astype(np.uint32).view(np.float32)


def _first_true(pred, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Least f32 x in [lo, hi] with pred(x) (elementwise; pred monotone, true at hi)."""
    a, b = _ord_key(lo), _ord_key(hi)
    while (a < b).any():
        m = (a + b) // 2
        t = pred(_from_key(m))
        b = np.where(t, m, b)
        a = np.where(t, a, m + 1)
    return _from_key(a)


def _best_index_np(half: np.ndarray, cells: np.ndarray, lim: int, rel: bool, x: np.ndarray) -> np.ndarray:
    """_best_index (ik's best_index_iq*nl) for an array x on one half of a level set."""
    n = half.size
    v0 = half[0]
    y = (x - v0).astype(np.float32) if rel else x
    with np.errstate(invalid="ignore"):
        ok = (y > -2147483649.0) & (y < 2147483648.0)
        ix = np.where(ok, np.trunc(np.where(ok, y, 0)), -1).astype(np.int64)
    if not rel:
        ix = np.where(ok, ix - np.int64(v0), -1)
    k = cells[np.clip(ix, 0, lim - 1)].astype(np.int64)
    amb = k >= n
    kl = np.where(amb, k - n, k)
    lo_v, hi_v = half[np.minimum(kl, n - 1)], half[np.minimum(kl + 1, n - 1)]
    up = amb & ~((x - lo_v).astype(np.float32) < (hi_v - x).astype(np.float32))
    k = kl + up
    return np.where(ix < 0, 0, np.where(ix >= lim, n - 1, k))


def _thresholds(levels: np.ndarray, n: int, cells: np.ndarray, lim: int, rel: bool):
    """(T, X_big): T = both halves' n-1 thresholds (flat f32), X_big per half."""
    ts, big = [], []
    for half in (levels[:n], levels[n:2 * n]):
        half = half.astype(np.float32)
        i = np.arange(n - 1)
        lo = np.full(n - 1, half[0] - 4, dtype=np.float32)
        hi = np.full(n - 1, half[0] + lim + 4, dtype=np.float32)
        ts.append(_first_true(lambda x: _best_index_np(half, cells, lim, rel, x) > i, lo, hi))
        if rel:
            c = np.float32(2.0 ** 31)
            big.append(_first_true(lambda x: (x - half[0]).astype(np.float32) >= c,
                                   np.array([c - 1024], np.float32), np.array([c + 1024], np.float32))[0])
        else:
            big.append(np.float32(2.0 ** 31))
    return np.concatenate(ts).astype(np.float32), np.array(big, dtype=np.float32)


def _padded(levels: np.ndarray, n: int, thr: np.ndarray):
    """Per half, thresholds padded with +inf to n (a multiple of 8: _fit_lanes takes 8 at a
    time; +inf only selects for x = +inf, which X_big overrides) and the level each selects."""
    tp = np.full((2, n), np.inf, dtype=np.float32)
    lp = np.empty((2, n), dtype=np.float32)
    for h in range(2):
        tp[h, :n - 1] = thr[h * (n - 1):(h + 1) * (n - 1)]
        lp[h] = levels[h * n + 1:(h + 1) * n + 1] if h == 0 else np.append(levels[n + 1:2 * n], levels[2 * n - 1])
    return tp.reshape(-1), lp.reshape(-1)


THR3, XBIG3 = _thresholds(LV3, 8, CELLS3, 111, False)
THR4, XBIG4 = _thresholds(LV4, 16, CELLS4, 241, False)
THR5, XBIG5 = _thresholds(LV5, 32, CELLS5, 247, False)
THR6, XBIG6 = _thresholds(LV6, 64, CELLS6, 249, True)
TP3, LP3 = _padded(LV3, 8, THR3)
TP4, LP4 = _padded(LV4, 16, THR4)
TP5, LP5 = _padded(LV5, 32, THR5)
TP6, LP6 = _padded(LV6, 64, THR6)


@njit(**_opts)
def _lthr(lset):
    """(padded thresholds, the levels they select, X_big) of level set lset."""
    if lset == 4:
        return TP4, LP4, XBIG4
    if lset == 3:
        return TP3, LP3, XBIG3
    if lset == 5:
        return TP5, LP5, XBIG5
    return TP6, LP6, XBIG6


@njit(**_opts)
def _pick_lanes(xb, h, n, tp, vals, v0, big, sidv, al, q):
    """q[j*nl + c] <- vals-entry of the level that ik's best index picks for sidv[c] * xb[j]
    on half h of a level set (thresholds tp, X_big big; v0: the entry of level 0).  All
    (value, lane) pairs at once, eight thresholds per pass: long independent loops with
    loop-invariant operands, which LLVM vectorizes."""
    nl = sidv.shape[0]
    nv = xb.shape[0]
    m = nv * nl
    for j in range(nv):
        xj = xb[j]
        for c in range(nl):
            al[j * nl + c] = sidv[c] * xj
    for k in range(m):
        q[k] = v0
    for i in range(h * n, h * n + n, 8):
        t0, t1, t2, t3 = tp[i], tp[i + 1], tp[i + 2], tp[i + 3]
        t4, t5, t6, t7 = tp[i + 4], tp[i + 5], tp[i + 6], tp[i + 7]
        u0, u1, u2, u3 = vals[i], vals[i + 1], vals[i + 2], vals[i + 3]
        u4, u5, u6, u7 = vals[i + 4], vals[i + 5], vals[i + 6], vals[i + 7]
        for k in range(m):
            a = al[k]
            r = q[k]
            r = u0 if a >= t0 else r
            r = u1 if a >= t1 else r
            r = u2 if a >= t2 else r
            r = u3 if a >= t3 else r
            r = u4 if a >= t4 else r
            r = u5 if a >= t5 else r
            r = u6 if a >= t6 else r
            r = u7 if a >= t7 else r
            q[k] = v0 if a >= big else r


@njit(**_opts)
def _fit_lanes(xb, w, lv, off, n, tp, lp, xbig, sidv, al, q, sqx, sq2):
    """_fit for many inverse scales sidv[c] at once, on levels lv[off:off+n] (one lane per c):
    sqx[c] = sum w*q*x, sq2[c] = sum w*q*q, each summed in j order as ik does."""
    nl = sidv.shape[0]
    h = off // n
    _pick_lanes(xb, h, n, tp, lp, lv[off], xbig[h], sidv, al, q)
    for c in range(nl):
        sqx[c] = f32(0.0)
        sq2[c] = f32(0.0)
    for j in range(xb.shape[0]):
        xj = xb[j]
        wj = w[j]
        for c in range(nl):
            qc = q[j * nl + c]
            t = wj * qc
            sqx[c] = _fma(t, xj, sqx[c])
            sq2[c] = _fma(t, qc, sq2[c])


def _lane_scratch() -> np.ndarray:
    """Scratch for _search: rows sidv, sqx, sq2 (2 halves x 32 lanes), then al, q
    (32 values x 32 lanes)."""
    return np.zeros((5, 1024), dtype=np.float32)


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
# _weights' rule without an imatrix: sigma2/4 + x^2, x^2, |x|
W_SIGMA, W_SQ, W_ABS = 0, 1, 2


@njit(**_opts)
def _weights(xb, qw, has_qw, sigma2, kind, w):
    """ik's per-value weights: qw*sqrt(sigma2 + x^2) with an imatrix, else by `kind`:
    sigma2/4 + x^2 (W_SIGMA: IQ2_K/KS, IQ3_K, IQ5_K, IQ6_K), x^2 (W_SQ: IQ4_K and the
    32-value types but IQ2_KS / IQ2_KL), |x| (W_ABS: IQ2_KL)."""
    for j in range(xb.shape[0]):
        if has_qw:
            w[j] = qw[j] * f32(np.sqrt(_fma(xb[j], xb[j], sigma2)))
        elif kind == W_SQ:
            w[j] = xb[j] * xb[j]
        elif kind == W_ABS:
            w[j] = abs(xb[j])
        else:
            w[j] = f32(0.25) * sigma2 + xb[j] * xb[j]


@njit(**_inl)
def _amax_mx(xb):
    """(max |x|, the first x of that magnitude)."""
    amax = f32(0.0)
    mx = f32(0.0)
    for j in range(xb.shape[0]):
        ax = abs(xb[j])
        if ax > amax:            # (= max(amax, ax) as Numba lowers it, NaN included)
            amax = ax
            mx = xb[j]
    return amax, mx


@njit(**_opts)
def _put_quants(bi, off, idl, fl, xb, w, out, qo, lbits, sh, ho, hsh, sumqx, sumq2):
    """Quantize xb at inverse scale idl to the nearest levels of level set bi (half at off):
    index k's low lbits bits go to out[qo + j] << sh, the rest (ho >= 0) to out[ho + j] << hsh.
    Returns sumqx, sumq2 plus sum w*q*x and w*q*q (q = level * fl, fused as ik's)."""
    lv, n, cells, lim, rel = _lset(bi)
    lmask = (1 << lbits) - 1
    for j in range(xb.shape[0]):
        k = _best_index(lv, off, n, cells, lim, rel, idl * xb[j])
        out[qo + j] |= np.uint8((k & lmask) << sh)
        if ho >= 0:
            out[ho + j] |= np.uint8((k >> lbits) << hsh)
        q = lv[off + k] * fl
        t = q * w[j]
        sumqx = _fma(t, xb[j], sumqx)
        sumq2 = _fma(t, q, sumq2)
    return sumqx, sumq2


@njit(**_opts)
def _search(bi, xb, w, lv, n, ntry, step, first_checked, refit, lanes):
    """The scale search of quantize_row_iq{3,4,5,6}_k / iq4_ks for one sub-block (max|x| >=
    1e-16): a first fit at d = max/|v0|, then 2*ntry+1 inverse scales (itry*step + v0)/max,
    each with the plain and the shifted levels and both signs; optionally a final refit.
    All fits are computed first, one lane each (_fit_lanes; lanes: _lane_scratch()), then
    compared in ik's order.  Returns (d, shifted)."""
    mx = _amax_mx(xb)[1]
    d0 = (-mx) / lv[0]
    # lanes of the plain half: the first fit (+, -), then per itry (+, -); shifted: per itry
    nt = 2 * ntry + 1
    nl = 16 * ((2 * nt + 2 + 15) // 16)
    sidv = lanes[0]
    sqx = lanes[1]
    sq2 = lanes[2]
    idv = f32(1.0) / d0
    sidv[0] = idv
    sidv[1] = -idv
    for t in range(nt):
        idv = f32(step * (t - ntry) + np.int32(lv[0])) / mx
        sidv[2 + 2 * t] = idv
        sidv[3 + 2 * t] = -idv
        idv = f32(step * (t - ntry) + np.int32(lv[n])) / mx
        sidv[nl + 2 * t] = idv
        sidv[nl + 2 * t + 1] = -idv
    for c in range(2 * nt + 2, nl):
        sidv[c] = f32(0.0)
    for c in range(nl + 2 * nt, 2 * nl):
        sidv[c] = f32(0.0)
    tp, lp, xbig = _lthr(bi)
    al = lanes[3, :nl * xb.shape[0]]
    q = lanes[4, :nl * xb.shape[0]]
    for h in range(2):
        a, b = h * nl, h * nl + nl
        _fit_lanes(xb, w, lv, h * n, n, tp, lp, xbig, sidv[a:b], al, q, sqx[a:b], sq2[a:b])
    d = d0
    best = f32(0.0)
    if not first_checked or sq2[0] > 0:
        d = sqx[0] / sq2[0]
        best = d * sqx[0]
    if sq2[1] > 0 and sqx[1] * sqx[1] > best * sq2[1]:
        d = sqx[1] / sq2[1]
        best = d * sqx[1]
    is_shifted = False
    for t in range(nt):
        for c in (2 + 2 * t, 3 + 2 * t, nl + 2 * t, nl + 2 * t + 1):
            if sq2[c] > 0 and sqx[c] * sqx[c] > best * sq2[c]:
                d = sqx[c] / sq2[c]
                best = d * sqx[c]
                is_shifted = c >= nl
    if refit and d != 0:
        blv, bn, bcells, blim, brel = _lset(bi)
        off = n if is_shifted else 0
        idv = f32(1.0) / d
        sumqx = f32(0.0)
        sumq2 = f32(0.0)
        for j in range(xb.shape[0]):
            q = lv[off + _best_index(blv, off, bn, bcells, blim, brel, idv * xb[j])]
            t = w[j] * q
            sumqx = _fma(t, xb[j], sumqx)
            sumq2 = _fma(t, q, sumq2)
        if sumq2 > 0:
            d = sumqx / sumq2
    return d, is_shifted


# per type: levels per half, ntry, step, first fit checked, refit, sigma2 factor, x^2 weights
@njit(**_opts)
def _kparams(qtype):
    """(level set, levels, levels per half, ntry, step, block bytes) of a type.  Returned by
    a call, not passed as constants: numba would compile a callee per constant argument."""
    if qtype == IQ3_K:
        return 3, LV3, 8, 3, 2, 110
    if qtype == IQ5_K:
        return 5, LV5, 32, 5, 1, 176
    if qtype == IQ6_K:
        return 6, LV6, 64, 5, 1, 212
    return 4, LV4, 16, 7, 1, 144                 # IQ4_K, IQ4_KS, IQ4_KSS


@njit(**_opts)
def _quantize_kblock(qtype, x, qw, has_qw, out, o, lanes):
    """One super-block of IQ3_K / IQ4_K / IQ5_K / IQ6_K -> its bytes at out[o:]."""
    bi, lv, n, ntry, step, bsize = _kparams(qtype)
    _kblock(bi, qtype, lv, n, ntry, step, bsize, x, qw, has_qw, out, o, lanes)


@njit(**_opts)
def _kblock(bi, qtype, lv, n, ntry, step, bsize, x, qw, has_qw, out, o, lanes):
    for k in range(bsize):
        out[o + k] = 0
    sumx2 = _sum_sq(x)
    if qtype == IQ3_K:
        sigma2 = (f32(1.5) * sumx2) * f32(1.0 / 256)
    else:
        sigma2 = (f32(2.0) * sumx2) * f32(1.0 / 256)
    wkind = W_SQ if qtype == IQ4_K else W_SIGMA
    scales = np.empty(16, dtype=np.float32)
    w = np.empty(16, dtype=np.float32)
    extra = 0
    max_scale = f32(0.0)
    amax_scale = f32(0.0)
    for ib in range(16):
        xb = x[16 * ib:16 * ib + 16]
        _weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, wkind, w)
        if _amax_mx(xb)[0] < f32(1e-16):
            scales[ib] = f32(0.0)
            continue
        d, shifted = _search(bi, xb, w, lv, n, ntry, step, qtype == IQ3_K, qtype != IQ4_K, lanes)
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
        _weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, wkind, w)
        ib32 = ib // 2
        e = 16 * (ib % 2)                         # position in the 32 of sub-block pair ib32
        if qtype == IQ3_K:
            qo, lbits, sh, ho, hsh = o + 14 + 32 * (ib32 // 4) + e, 2, 2 * (ib32 % 4), o + 78 + e, ib32
        elif qtype == IQ4_K:
            qo, lbits, sh, ho, hsh = o + 16 + 16 * ib32, 4, 4 * (ib % 2), -1, 0
        elif qtype == IQ5_K:
            qo, lbits, sh, ho, hsh = o + 16 + 32 * (ib32 // 2) + e, 4, 4 * (ib32 % 2), o + 144 + e, ib32
        else:
            qo, lbits, sh, ho, hsh = (o + 20 + 32 * (ib32 // 2) + e, 4, 4 * (ib32 % 2),
                                      o + 148 + 32 * (ib32 // 4) + e, 2 * (ib32 % 4))
        sumqx, sumq2 = _put_quants(bi, off, idl, f32(ls), xb, w, out, qo, lbits, sh, ho, hsh, sumqx, sumq2)
    if qtype == IQ3_K:
        dd = sumqx / sumq2 if sumq2 > 0 else d
        _put_u16(out, o, _f16_bits(dout * dd))
    elif sumq2 > 0:
        _put_u16(out, o, _f16_bits(sumqx / sumq2))


# ----------------------------------------------------------------------------------------
# The types with a row scale and sub-blocks of 32: IQ4_KS (f32 row scale, per block of 32 a
# 7-bit scale and the shift bit), IQ5_KS (the same scales, 5-bit quants), IQ3_KS (f16 row
# scale, 5-bit scales), IQ4_KSS and IQ2_KL (their own searches, below).  IQ3_KS / IQ5_KS are
# IQ3_K's / IQ5_K's scale search on sub-blocks of 32.
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _ks_params(qtype):
    """(level set, levels, levels per half, ntry, step, first fit checked, refit) of IQ4_KS
    (also returned for IQ4_KSS / IQ2_KL, which do not use them), IQ3_KS, IQ5_KS.  Typed
    values, not literals: numba would compile a callee per literal argument (see _kparams),
    and equal literals in both branches stay literals."""
    no = np.bool_(False)
    if qtype == IQ3_KS:
        return np.int64(3), LV3, np.int64(8), np.int64(5), np.int64(1), np.bool_(True), no
    if qtype == IQ5_KS:
        return np.int64(5), LV5, np.int64(32), np.int64(5), np.int64(1), no, no
    return np.int64(4), LV4, np.int64(16), np.int64(7), np.int64(1), no, no


@njit(**_opts)
def _row_scales32(qtype, x, qw, has_qw, lanes, scales, shifts):
    """First pass of IQ4_KS / IQ4_KSS / IQ3_KS / IQ5_KS / IQ2_KL over a row: the scale of
    every sub-block of 32 (0 where max|x| < 1e-16) into scales, its table half (0 / 1) into
    shifts.  Returns (max |scale|, the first scale of that magnitude)."""
    nb = x.shape[0] // QK_K
    bi, lv, n, ntry, step, first_checked, refit = _ks_params(qtype)
    kl = qtype == IQ2_KL
    wkind = W_ABS if kl else W_SQ
    w = np.empty(32, dtype=np.float32)
    xp = np.empty(32, dtype=np.float32)
    wp = np.empty(32, dtype=np.float32)
    amax_scale = f32(0.0)
    max_scale = f32(0.0)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = _sum_sq(xbl) * (f32(2.25 / 256) if kl else f32(2.0 / 256))
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, wkind, w)
            amax, mx = _amax_mx(xb)
            shifts[8 * ibl + ib] = 0
            if amax < f32(1e-16):
                scales[8 * ibl + ib] = f32(0.0)
                continue
            if qtype == IQ4_KSS:
                _kss_gather(xb, w, xp, wp)
                d = _kss_search(xp, wp, mx, lanes)
            elif kl:
                d = _kl_search(xb, w, mx, lanes)
            else:
                d, shifted = _search(bi, xb, w, lv, n, ntry, step, first_checked, refit, lanes)
                shifts[8 * ibl + ib] = 1 if shifted else 0
            scales[8 * ibl + ib] = d
            if abs(d) > amax_scale:
                amax_scale = abs(d)
                max_scale = d
    return amax_scale, max_scale


@njit(**_inl)
def _ks_scale(idv, s):
    """IQ4_KS / IQ5_KS / IQ4_KSS: the stored 7-bit scale of sub-block scale s, times 2."""
    l = _nint_fma(f32(0.5), _fma(idv, s, f32(127.0)))
    return max(0, min(127, l)) << 1


@njit(**_opts)
def _quantize_ks_row(qtype, x, qw, has_qw, out, lanes):
    """One row of IQ4_KS (f32 row scale + 136-byte blocks: scales[8] | qs[128]), IQ5_KS (f32
    row scale + 168-byte blocks: scales[8] | qs[128] | qh[32]) or IQ3_KS (f16 row scale +
    102-byte blocks: u16 extra | scales[4] | qs[64] | qh[32]) -> out (the row's bytes)."""
    nb = x.shape[0] // QK_K
    bi, lv, n, ntry, step, first_checked, refit = _ks_params(qtype)
    blv, bn, bcells, blim, brel = _lset(bi)
    is3 = qtype == IQ3_KS
    meta = 2 if is3 else 4
    bs = 102 if is3 else (168 if qtype == IQ5_KS else 136)
    for k in range(out.shape[0]):
        out[k] = 0
    scales = np.empty(nb * 8, dtype=np.float32)
    shifts = np.empty(nb * 8, dtype=np.int64)
    w = np.empty(32, dtype=np.float32)
    amax_scale, max_scale = _row_scales32(qtype, x, qw, has_qw, lanes, scales, shifts)
    for ibl in range(nb):                       # the shift bits (IQ3_KS: extra bits 8 + ib)
        o = meta + bs * ibl
        for ib in range(8):
            if is3:
                out[o + 1] |= np.uint8(shifts[8 * ibl + ib] << ib)
            else:
                out[o + ib] = np.uint8(shifts[8 * ibl + ib])
    if is3:
        d = (-max_scale) * f32(1.0 / 16)
        _put_u16(out, 0, _f16_bits(d))      # an all-zero row stores -0 (0x8000), as ik does
    else:
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
        o = meta + bs * ibl
        for ib in range(8):
            off = n if shifts[8 * ibl + ib] else 0
            if is3:
                l = max(-16, min(15, _nint_fma(idv, scales[8 * ibl + ib])))
                ul = l + 16
                out[o + 2 + ib % 4] |= np.uint8((ul & 15) << (4 * (ib // 4)))
                out[o] |= np.uint8((ul >> 4) << ib)                     # extra bit ib
            else:
                l = _ks_scale(idv, scales[8 * ibl + ib])
                out[o + ib] |= np.uint8(l)
                l -= 127
            dl = d * f32(l)       # (never 0 for the odd l of IQ4_KS / IQ5_KS)
            idl = f32(1.0) / dl if dl != 0 else f32(0.0)
            xb = xbl[32 * ib:32 * ib + 32]
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, W_SQ, w)
            if is3:               # (l = 0 still stores the indices of 0)
                sumqx, sumq2 = _put_quants(bi, off, idl, f32(l), xb, w, out, o + 6 + 32 * (ib // 4), 2,
                                           2 * (ib % 4), o + 70, ib, sumqx, sumq2)
            elif qtype == IQ5_KS:
                sumqx, sumq2 = _put_quants(bi, off, idl, f32(l), xb, w, out, o + 8 + 32 * (ib // 2), 4,
                                           4 * (ib % 2), o + 136, ib, sumqx, sumq2)
            else:                 # IQ4_KS: value j and j + 16 share a byte, their sums are added
                for j in range(16):
                    i1 = _best_index(blv, off, bn, bcells, blim, brel, idl * xb[j])
                    i2 = _best_index(blv, off, bn, bcells, blim, brel, idl * xb[j + 16])
                    out[o + 8 + 16 * ib + j] = np.uint8(i1 | (i2 << 4))
                    q1 = lv[off + i1] * f32(l)
                    q2 = lv[off + i2] * f32(l)
                    t1 = q1 * w[j]
                    t2 = q2 * w[j + 16]
                    sumqx += _fma(t1, xb[j], t2 * xb[j + 16])
                    sumq2 += _fma(t1, q1, t2 * q2)
    if sumq2 > 0:
        if is3:
            _put_u16(out, 0, _f16_bits(sumqx / sumq2))
        else:
            _put_f32(out, 0, sumqx / sumq2)


@njit(**_opts)
def _put_f32(out, o, v):
    b = np.empty(1, dtype=np.float32)
    b[0] = v
    u = b.view(np.uint32)[0]
    for k in range(4):
        out[o + k] = np.uint8((u >> np.uint32(8 * k)) & np.uint32(255))


# ----------------------------------------------------------------------------------------
# IQ4_KSS: IQ4_KS with every group of four 4-bit quants pruned to an even number of set bits,
# so that the 16-bit group fits in 15 bits (stored scrambled, beside one bit of the scale)
# ----------------------------------------------------------------------------------------
def _scramble_table() -> np.ndarray:
    """table[v & 0x7fff] = j with j ^ (j << 1) == v, for every 16-bit v of even parity (the
    decoder undoes it as w ^ (w >> 1) with w = j << 1)."""
    j = np.arange(1 << 15, dtype=np.int32)
    tab = np.empty(1 << 15, dtype=np.int32)
    tab[(j ^ (j << 1)) & 0x7FFF] = j
    return tab


SCRAMBLE = _scramble_table()
_PARITY4 = np.array([bin(i).count("1") & 1 for i in range(16)], dtype=np.int32)
# the quants prune_iq4ks may move quant q to: q-2..q+2 of opposite bit-count parity, ascending
_PRUNE_TO = np.full((16, 4), -1, dtype=np.int32)
for _q in range(16):
    _c = [qq for qq in range(max(_q - 2, 0), min(_q + 2, 15) + 1) if _PARITY4[qq] != _PARITY4[_q]]
    _PRUNE_TO[_q, :len(_c)] = _c
_FLT_MAX = f32(np.finfo(np.float32).max)


@njit(**_inl)
def _prune4(v, lv, off, xp, wp, g, dl):
    """ik's prune_iq4ks: a group of four quants v (nibbles) with an odd number of set bits
    gets the one change (a quant moved by 1 or 2 to one of odd bit-count difference) of least
    weighted squared-error increase.  The old error is measured on the plain levels whatever
    the table (as ik does)."""
    if _PARITY4[(v ^ (v >> 4) ^ (v >> 8) ^ (v >> 12)) & 15] == 0:
        return v
    best = _FLT_MAX
    jbest = 0
    qbest = 0
    for j in range(4):
        q = (v >> (4 * j)) & 15
        x = xp[g + j]
        e0 = _fma(dl, LV4[q], -x)
        e0sq = e0 * e0
        for k in range(4):
            qq = _PRUNE_TO[q, k]
            if qq < 0:
                break
            e1 = _fma(dl, lv[off + qq], -x)
            score = wp[g + j] * _fma(e1, e1, -e0sq)
            if score < best:
                best = score
                jbest = j
                qbest = qq
    return (v & ~(15 << (4 * jbest))) | (qbest << (4 * jbest))


IDXP4 = np.tile(np.arange(1, 17, dtype=np.float32), 2)     # _pick_lanes entries: indices


@njit(**_opts)
def _kss_search(xp, wp, mx, lanes):
    """IQ4_KSS's scale search for one block (values and weights in group order): for itry in
    -7..7 and each table half, the inverse scale (itry + v0)/max with both signs, quants
    pruned per group (with this_d = 1/id for both signs, as ik does).  The nearest levels
    of all 60 candidates come from _pick_lanes; pruning and sums are per candidate.
    Returns d."""
    lv = LV4
    n = TP4.size // 2                  # 16 (a run-time value: one compiled _pick_lanes)
    sidv = lanes[0]
    sqx = lanes[1]
    sq2 = lanes[2]
    for h in range(2):
        for t in range(15):
            idv = f32(t - 7 + np.int32(lv[16 * h])) / mx
            sidv[32 * h + 2 * t] = idv
            sidv[32 * h + 2 * t + 1] = -idv
        sidv[32 * h + 30] = f32(0.0)
        sidv[32 * h + 31] = f32(0.0)
    al = lanes[3]                      # 32 values x 32 lanes
    qi = lanes[4]
    for h in range(2):
        off = 16 * h
        _pick_lanes(xp, h, n, TP4, IDXP4, np.float32(0.0), XBIG4[h], sidv[32 * h:32 * h + 32], al, qi)
        for c in range(30):
            dl = f32(1.0) / sidv[32 * h + (c & ~1)]
            sx = f32(0.0)
            s2 = f32(0.0)
            for g in range(0, 32, 4):
                v = 0
                for j in range(4):
                    v |= np.int32(qi[(g + j) * 32 + c]) << (4 * j)
                v = _prune4(v, lv, off, xp, wp, g, dl)
                for j in range(4):
                    q = lv[off + ((v >> (4 * j)) & 15)]
                    t = wp[g + j] * q
                    sx = _fma(t, xp[g + j], sx)
                    s2 = _fma(t, q, s2)
            sqx[32 * h + c] = sx
            sq2[32 * h + c] = s2
    best = f32(0.0)
    d = (-mx) / lv[0]
    for t in range(15):
        for h in range(2):
            for c in (32 * h + 2 * t, 32 * h + 2 * t + 1):
                if sq2[c] > 0 and sqx[c] * sqx[c] > best * sq2[c]:
                    d = sqx[c] / sq2[c]
                    best = d * sqx[c]
    return d


@njit(**_opts)
def _kss_gather(xb, w, xp, wp):
    """Values (and weights) in ik's group order: group k = x[2k], x[2k+16], x[2k+1], x[2k+17]."""
    for k in range(8):
        xp[4 * k] = xb[2 * k]
        xp[4 * k + 1] = xb[2 * k + 16]
        xp[4 * k + 2] = xb[2 * k + 1]
        xp[4 * k + 3] = xb[2 * k + 17]
        wp[4 * k] = w[2 * k]
        wp[4 * k + 1] = w[2 * k + 16]
        wp[4 * k + 2] = w[2 * k + 1]
        wp[4 * k + 3] = w[2 * k + 17]


@njit(**_opts)
def _quantize_iq4_kss_row(x, qw, has_qw, out, lanes):
    """One row -> f32 row scale + 128-byte blocks (8 u16 words per 32 values) in out."""
    nb = x.shape[0] // QK_K
    lv = LV4
    for k in range(out.shape[0]):
        out[k] = 0
    scales = np.empty(nb * 8, dtype=np.float32)
    w = np.empty(32, dtype=np.float32)
    xp = np.empty(32, dtype=np.float32)
    wp = np.empty(32, dtype=np.float32)
    vv = np.empty((2, 8), dtype=np.int64)
    mses = np.empty(2, dtype=np.float32)
    blv, bn, bcells, blim, brel = _lset(_kparams(IQ4_KSS)[0])
    shifts = np.empty(nb * 8, dtype=np.int64)
    amax_scale = _row_scales32(IQ4_KSS, x, qw, has_qw, lanes, scales, shifts)[0]
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
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, W_SQ, w)
            _kss_gather(xb, w, xp, wp)
            l = _ks_scale(idv, scales[8 * ibl + ib]) - 127      # odd: never 0
            dl = d * f32(l)
            idl = f32(1.0) / dl
            for h in range(2):                  # plain, then shifted levels
                off = 16 * h
                mse = f32(0.0)
                for g in range(8):
                    v = 0
                    for j in range(4):
                        v |= _best_index(blv, off, bn, bcells, blim, brel, idl * xp[4 * g + j]) << (4 * j)
                    v = _prune4(v, lv, off, xp, wp, 4 * g, dl)
                    for j in range(4):
                        e = _fma(-dl, lv[off + ((v >> (4 * j)) & 15)], xp[4 * g + j])
                        mse = _fma(wp[4 * g + j] * e, e, mse)
                    vv[h, g] = v
                mses[h] = mse
            shifted = mses[1] < mses[0]
            off = 16 if shifted else 0
            for g in range(8):
                v = vv[1, g] if shifted else vv[0, g]
                for j in range(4):
                    q = f32(np.int32(lv[off + ((v >> (4 * j)) & 15)]) * l)
                    t = wp[4 * g + j] * q
                    sumqx = _fma(t, xp[4 * g + j], sumqx)
                    sumq2 = _fma(t, q, sumq2)
            l += 127
            if shifted:
                l |= 1
            o = 4 + 128 * ibl + 16 * ib
            for g in range(8):
                v = vv[1, g] if shifted else vv[0, g]
                _put_u16(out, o + 2 * g, (SCRAMBLE[v & 0x7FFF] << 1) | ((l >> g) & 1))
    if sumq2 > 0:
        _put_f32(out, 0, (sumqx / sumq2) * f32(1.01))


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


@njit(**_inl)
def _better(sumq2, sumqx, best, d):
    """ik's candidate test: (True, sumqx/sumq2, its score) when the candidate beats `best`,
    else (False, d, best)."""
    if sumq2 > 0 and sumqx * sumqx > best * sumq2:
        dn = sumqx / sumq2
        return True, dn, dn * sumqx
    return False, d, best


@njit(**_opts)
def _iq2k_search(xb, w, sumx, sumw, idx, pre, max_i1, min_i3, fused_prefix):
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
    # the last run's terms, which depend on i3 only: dx and the rounded products dw*c
    # (pre: (5, >= n) scratch from the caller)
    for i3 in range(n):
        dw = wt - sumw[i3]
        pre[0, i3] = xt - sumx[i3]
        pre[1, i3] = dw * c17
        pre[2, i3] = dw * c22
        pre[3, i3] = dw * c31
        pre[4, i3] = dw * c26
    dxs, p17, p22, p31, p26 = pre[0], pre[1], pre[2], pre[3], pre[4]
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
            lo = max(i2, min_i3)
            # Filter: with `best` as it is now, which is the first i3 that improves on it?
            # (The sequential scan changes nothing before it.)  All n lanes, those below lo
            # masked: a fixed-length loop that LLVM vectorizes; the scan runs rarely.
            first = n
            for i3 in range(n):
                cw = sumw[i3] - sumw[i2]
                cx = sumx[i3] - sumx[i2]
                dx = dxs[i3]
                s2a = _fma(p17[i3], c17, q2_1 + cw)
                sxa = _fma(dx, c17, qx_1 + cx)
                s2b = _fma(p22[i3], c22, _fma(cw * c6, c6, q2_2))
                sxb = _fma(dx, c22, _fma(cx, c6, qx_2))
                s2c = _fma(p31[i3], c31, _fma(cw * c13, c13, q2_3))
                sxc = _fma(dx, c31, _fma(cx, c13, qx_3))
                s2d = _fma(p26[i3], c26, _fma(cw * c8, c8, q2_4))
                sxd = _fma(dx, c26, _fma(cx, c8, qx_4))
                ok = (((s2a > 0) & (sxa * sxa > best * s2a)) | ((s2b > 0) & (sxb * sxb > best * s2b))
                      | ((s2c > 0) & (sxc * sxc > best * s2c)) | ((s2d > 0) & (sxd * sxd > best * s2d)))
                first = min(first, i3 if ok & (i3 >= lo) else n)
            # the scan changes nothing before the first i3 that beats `best`
            for i3 in range(first, n):
                cw = sumw[i3] - sumw[i2]
                cx = sumx[i3] - sumx[i2]
                dw = wt - sumw[i3]
                dx = xt - sumx[i3]
                # levels -31 -13 1 17, shifted -26 -8 6 22, reversed 17 1 -13 -31, reversed shifted
                ok, d, best = _better(_fma(dw * c17, c17, q2_1 + cw), _fma(dx, c17, qx_1 + cx), best, d)
                if ok:
                    shifted = False
                ok, d, best = _better(_fma(dw * c22, c22, _fma(cw * c6, c6, q2_2)),
                                      _fma(dx, c22, _fma(cx, c6, qx_2)), best, d)
                if ok:
                    shifted = True
                ok, d, best = _better(_fma(dw * c31, c31, _fma(cw * c13, c13, q2_3)),
                                      _fma(dx, c31, _fma(cx, c13, qx_3)), best, d)
                if ok:
                    shifted = False
                ok, d, best = _better(_fma(dw * c26, c26, _fma(cw * c8, c8, q2_4)),
                                      _fma(dx, c26, _fma(cx, c8, qx_4)), best, d)
                if ok:
                    shifted = True
    return d, shifted


@njit(**_opts)
def _iq2_scale(xb, qw, has_qw, sigma2, w, sumx, sumw, idx, pre, max_i1, min_i3, fused_prefix):
    """IQ2_K / IQ2_KS first pass on one sub-block: its weights into w, then (sum of the
    weights, scale, shifted) by _iq2k_search (scale 0 where max|x| < 1e-16)."""
    _weights(xb, qw, has_qw, sigma2, W_SIGMA, w)
    s = f32(0.0)
    for j in range(xb.shape[0]):
        s += w[j]
    if _amax_mx(xb)[0] < f32(1e-16):
        return s, f32(0.0), False
    d, shifted = _iq2k_search(xb, w, sumx, sumw, idx, pre, max_i1, min_i3, fused_prefix)
    return s, d, shifted


@njit(**_opts)
def _put_iq2(off, idl, ls, xb, w, out, qo, sh, sumqx, sumq2):
    """IQ2_K / IQ2_KS: xb's 2-bit indices at inverse scale idl to out[qo + j] << sh; returns
    sumqx, sumq2 plus the sums of w*q*x, w*q*q (q = level * ls)."""
    tab = IQ2NL_I
    for j in range(xb.shape[0]):
        k = _best_index_iq2nl(tab, off, idl * xb[j])
        out[qo + j] |= np.uint8(k << sh)
        q = f32(tab[off + k] * ls)
        t = q * w[j]
        sumqx = _fma(t, xb[j], sumqx)
        sumq2 = _fma(t, q, sumq2)
    return sumqx, sumq2


@njit(**_opts)
def _quantize_iq2_k_block(x, qw, has_qw, out, o):
    """One super-block of 256 values -> 76 bytes at out[o:]."""
    for k in range(76):
        out[o + k] = 0
    sigma2 = (f32(1.5) * _sum_sq(x)) * f32(1.0 / 256)
    scales = np.empty(16, dtype=np.float32)
    sw = np.empty(16, dtype=np.float32)
    w = np.empty(16, dtype=np.float32)
    sumx = np.empty(17, dtype=np.float32)
    sumw = np.empty(17, dtype=np.float32)
    idx = np.empty(16, dtype=np.int64)
    pre = np.empty((5, 16), dtype=np.float32)
    extra = 0
    max_abs_scale = f32(0.0)
    for ib in range(16):
        sw[ib], d, shifted = _iq2_scale(x[16 * ib:16 * ib + 16], qw[16 * ib:16 * ib + 16], has_qw, sigma2,
                                        w, sumx, sumw, idx, pre, 16, 0, True)
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
            _weights(xb, qw[16 * ib:16 * ib + 16], has_qw, sigma2, W_SIGMA, w)
            ib32 = ib // 2
            sumqx, sumq2 = _put_iq2(off, f32(1.0) / dl, ls, xb, w, out, o + 12 + 32 * (ib32 // 4) + 16 * (ib % 2),
                                    2 * (ib32 % 4), sumqx, sumq2)
    dd = sumqx / sumq2 if sumq2 > 0 else d
    _put_u16(out, o, _f16_bits(f32(1.030) * dd))


@njit(**_opts)
def _quantize_iq2_ks_row(x, qw, has_qw, out):
    """One row -> f16 row scale + 70-byte blocks (u16 extra | scales[4] | qs[64]) in out."""
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
    pre = np.empty((5, 32), dtype=np.float32)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = (f32(1.5) * _sum_sq(xbl)) * f32(1.0 / 256)
        extra = 0
        for ib in range(8):
            sw[8 * ibl + ib], d, shifted = _iq2_scale(xbl[32 * ib:32 * ib + 32],
                                                      qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw,
                                                      sigma2, w, sumx, sumw, idx, pre, 24, 8, False)
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
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, W_SIGMA, w)
            sumqx, sumq2 = _put_iq2(off, f32(1.0) / dl, ls, xb, w, out, o + 6 + 32 * (ib // 4), 2 * (ib % 4),
                                    sumqx, sumq2)
        _put_u16(out, o, extra)
    dd = sumqx / sumq2 if sumq2 > 0 else d
    _put_u16(out, 0, _f16_bits(f32(1.030) * dd))


# ----------------------------------------------------------------------------------------
# IQ2_KL: pairs of values quantized together to one of 32 pairs of IQ3_K's first-table
# levels (5 bits a pair), 6-bit scales per 32, an f16 row scale
# ----------------------------------------------------------------------------------------
# iqk_quantize.cpp's k_index: IQ3_K level pair (l1, l2) -> the grid entry holding it (8 l1 + l2),
# or -(m + 1) for a pair not on the grid, whose eight candidate entries are KL_NEIGHBOURS[m]
KL_INDEX = np.array([
    -1, -2, 0, -3, -4, 1, -5, -6, 2, -7, -8, 3, -9, 4, -10, 5, -11, 6, 7, -12, 8, 9, 10, -13, 11, -14,
    -15, -16, 12, 13, -17, 14, -18, -19, 15, 16, 17, 18, 19, -20, -21, 20, 21, 22, 23, 24, -22, -23,
    25, -24, 26, -25, 27, -26, 28, 29, -27, -28, 30, -29, -30, 31, -31, -32], dtype=np.int32)
KL_NEIGHBOURS = np.array([
    [2, 0, 6, 11, 7, 3, 8, 15], [0, 2, 3, 6, 7, 1, 8, 4], [0, 1, 3, 4, 8, 7, 9, 6],
    [1, 0, 3, 4, 8, 9, 7, 10], [1, 4, 5, 10, 9, 3, 8, 0], [5, 1, 4, 10, 9, 14, 8, 3],
    [6, 2, 7, 0, 3, 11, 8, 15], [3, 7, 0, 6, 8, 4, 12, 9], [3, 4, 8, 9, 1, 7, 12, 10],
    [4, 10, 5, 9, 1, 8, 13, 14], [11, 2, 6, 7, 20, 15, 25, 21], [8, 7, 3, 12, 9, 16, 17, 13],
    [14, 5, 10, 19, 9, 13, 4, 18], [6, 15, 7, 11, 20, 21, 16, 2], [15, 7, 16, 6, 21, 12, 17, 22],
    [12, 16, 17, 8, 15, 7, 13, 22], [19, 10, 13, 18, 14, 9, 12, 24], [11, 20, 25, 6, 15, 2, 21, 7],
    [20, 15, 21, 6, 11, 7, 16, 26], [14, 19, 29, 10, 28, 18, 13, 24], [25, 11, 20, 21, 15, 6, 26, 30],
    [19, 24, 28, 18, 29, 23, 13, 17], [29, 19, 14, 28, 24, 18, 10, 13], [20, 26, 21, 25, 30, 15, 22, 16],
    [27, 26, 22, 23, 21, 30, 16, 24], [27, 24, 28, 31, 23, 18, 22, 17], [25, 30, 20, 26, 21, 11, 15, 22],
    [30, 26, 25, 20, 21, 27, 22, 15], [30, 27, 31, 26, 22, 23, 21, 24], [31, 27, 30, 26, 28, 23, 22, 24],
    [31, 28, 29, 27, 24, 23, 19, 18], [29, 28, 31, 24, 19, 27, 14, 18]], dtype=np.int32)
KL_G1 = np.ascontiguousarray(iqk.IQ2KL_PAIRS[:, 0])      # first / second level of each grid pair
KL_G2 = np.ascontiguousarray(iqk.IQ2KL_PAIRS[:, 1])
assert all(KL_INDEX[8 * a + b] < 0 or (KL_G1[KL_INDEX[8 * a + b]], KL_G2[KL_INDEX[8 * a + b]]) == (LV3[a], LV3[b])
           for a in range(8) for b in range(8)), "iq2kl grid and k_index disagree"


@njit(**_inl)
def _kl_index(idv, x1, x2, w1, w2, cells):
    """ik's pair index: the grid entry of the nearest IQ3_K levels of (idv*x1, idv*x2) when
    that pair is on the grid, else the one of its eight neighbours of least weighted error
    w1 e1^2 + w2 e2^2 (first product fused with the second as addend; ties to the first)."""
    s1 = idv * x1
    s2 = idv * x2
    l1 = _best_index(LV3, 0, 8, cells, 111, False, s1)
    l2 = _best_index(LV3, 0, 8, cells, 111, False, s2)
    i = KL_INDEX[8 * l1 + l2]
    if i >= 0:
        return i
    m = -i - 1
    best = _FLT_MAX
    ibest = KL_NEIGHBOURS[m, 0]       # (ik asserts one is found: only NaN scores fail)
    for k in range(8):
        c = KL_NEIGHBOURS[m, k]
        e1 = KL_G1[c] - s1
        e2 = KL_G2[c] - s2
        score = _fma(w1 * e1, e1, (w2 * e2) * e2)
        if score < best:
            best = score
            ibest = c
    return ibest


IDXP3 = np.tile(np.arange(1, 9, dtype=np.float32), 2)      # _pick_lanes entries: IQ3_K indices


@njit(**_opts)
def _kl_search(xb, w, mx, lanes):
    """Best scale of one sub-block: a first fit at d = max/63, then the 11 inverse scales
    (itry - 63)/max, each with both signs, compared in ik's order.  The 24 candidates are
    lanes: their level picks come from _pick_lanes, then the pair lookup (and, off the grid,
    the neighbour search) per pair and lane, then the sums per lane in ik's pair order."""
    nl = 32
    sidv = lanes[0, :nl]
    sqx = lanes[1]
    sq2 = lanes[2]
    d0 = (-mx) / LV3[0]
    idv = f32(1.0) / d0
    sidv[0] = idv
    sidv[1] = -idv
    for t in range(11):
        idv = f32(t - 5 + np.int32(LV3[0])) / mx
        sidv[2 + 2 * t] = idv
        sidv[3 + 2 * t] = -idv
    for c in range(24, nl):
        sidv[c] = f32(0.0)
    al = lanes[3]                      # 32 values x 32 lanes
    q = lanes[4]
    _pick_lanes(xb, np.int64(0), TP3.size // 2, TP3, IDXP3, np.float32(0.0), XBIG3[0], sidv, al, q)
    for jp in range(16):               # q <- grid entry of pair jp, lane c (at the pair's first row)
        a = 2 * jp * nl
        b = a + nl
        w1 = w[2 * jp]
        w2 = w[2 * jp + 1]
        for c in range(24):
            i = KL_INDEX[8 * np.int32(q[a + c]) + np.int32(q[b + c])]
            if i < 0:
                m = -i - 1
                s1 = al[a + c]
                s2 = al[b + c]
                best = _FLT_MAX
                i = KL_NEIGHBOURS[m, 0]
                for k in range(8):
                    g = KL_NEIGHBOURS[m, k]
                    e1 = KL_G1[g] - s1
                    e2 = KL_G2[g] - s2
                    score = _fma(w1 * e1, e1, (w2 * e2) * e2)
                    if score < best:
                        best = score
                        i = g
            q[a + c] = f32(i)
    for c in range(nl):
        sqx[c] = f32(0.0)
        sq2[c] = f32(0.0)
    for jp in range(16):
        a = 2 * jp * nl
        w1 = w[2 * jp]
        w2 = w[2 * jp + 1]
        x1 = xb[2 * jp]
        x2 = xb[2 * jp + 1]
        for c in range(24):
            g = np.int32(q[a + c])
            q1 = KL_G1[g]
            q2 = KL_G2[g]
            sqx[c] += _fma(w1 * q1, x1, (w2 * q2) * x2)
            sq2[c] += _fma(w1 * q1, q1, (w2 * q2) * q2)
    d = sqx[0] / sq2[0]
    best = d * sqx[0]
    for c in range(1, 24):
        if sq2[c] > 0 and sqx[c] * sqx[c] > best * sq2[c]:
            d = sqx[c] / sq2[c]
            best = d * sqx[c]
    return d


@njit(**_opts)
def _quantize_iq2_kl_row(x, qw, has_qw, out, lanes):
    """One row -> f16 row scale + 86-byte blocks (u16 scales_h | scales_l[4] | qs[64] | qh[16])."""
    nb = x.shape[0] // QK_K
    cells = CELLS3
    for k in range(out.shape[0]):
        out[k] = 0
    scales = np.empty(nb * 8, dtype=np.float32)
    shifts = np.empty(nb * 8, dtype=np.int64)
    w = np.empty(32, dtype=np.float32)
    amax_scale, max_scale = _row_scales32(IQ2_KL, x, qw, has_qw, lanes, scales, shifts)
    if amax_scale == 0:
        return                                  # row scale 0, all blocks zero
    d = (-max_scale) * f32(1.0 / 32)
    idv = f32(1.0) / d
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ibl in range(nb):
        xbl = x[QK_K * ibl:QK_K * ibl + QK_K]
        sigma2 = _sum_sq(xbl) * f32(2.25 / 256)
        o = 2 + 86 * ibl
        sc_h = 0
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            _weights(xb, qw[QK_K * ibl + 32 * ib:QK_K * ibl + 32 * ib + 32], has_qw, sigma2, W_ABS, w)
            ls = max(-32, min(31, _nint_fma(idv, scales[8 * ibl + ib])))
            # the best of ls - 1, ls, ls + 1 by weighted squared error
            best_score = _FLT_MAX
            best_ls = ls
            for ils in range(max(-32, ls - 1), min(31, ls + 1) + 1):
                dl = d * f32(ils)
                idl = f32(1.0) / dl if dl != 0 else f32(0.0)
                score = f32(0.0)
                for j in range(0, 32, 2):
                    w1 = w[j]
                    w2 = w[j + 1]
                    c = _kl_index(idl, xb[j], xb[j + 1], w1, w2, cells)
                    e1 = _fma(dl, KL_G1[c], -xb[j])
                    e2 = _fma(dl, KL_G2[c], -xb[j + 1])
                    score += _fma(w1 * e1, e1, (w2 * e2) * e2)
                if score < best_score:
                    best_score = score
                    best_ls = ils
            ls = best_ls
            uls = ls + 32
            out[o + 2 + ib % 4] |= np.uint8((uls & 15) << (4 * (ib // 4)))
            sc_h |= (uls >> 4) << (2 * ib)
            if ls == 0:
                continue
            dl = d * f32(ls)
            idl = f32(1.0) / dl
            qo = o + 6 + 16 * (ib // 2)
            sh = 4 * (ib % 2)
            for j in range(16):
                w1 = w[2 * j]
                w2 = w[2 * j + 1]
                x1 = xb[2 * j]
                x2 = xb[2 * j + 1]
                c = _kl_index(idl, x1, x2, w1, w2, cells)
                out[qo + j] |= np.uint8((c & 15) << sh)
                out[o + 70 + j] |= np.uint8((c >> 4) << ib)
                q1 = KL_G1[c] * f32(ls)
                q2 = KL_G2[c] * f32(ls)
                sumqx += _fma(w1 * q1, x1, (w2 * q2) * x2)
                sumq2 += _fma(w1 * q1, q1, (w2 * q2) * q2)
        _put_u16(out, o, sc_h)
    if sumq2 > 0:
        d = sumqx / sumq2
    _put_u16(out, 0, _f16_bits(f32(1.025) * d))


# ----------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _quantize_rows(x, qtype, imat, has_imat, out, lanes):
    """x (nrows, n) f32 -> out (nrows, row_bytes) uint8; imat: n column weights (has_imat);
    lanes: _lane_scratch()."""
    nrows, n = x.shape
    nb = n // QK_K
    w = np.zeros(n, dtype=np.float32)
    block = 16 if qtype == IQ2_K or qtype == IQ3_K or qtype == IQ4_K or qtype == IQ5_K or qtype == IQ6_K else 32
    bsize = out.shape[1] // max(nb, 1)            # (the types with a row scale return before)
    for r in range(nrows):
        xr = x[r]
        if has_imat:
            _row_weights(imat, xr, block, w)
        orow = out[r]
        if qtype == IQ4_KS or qtype == IQ3_KS or qtype == IQ5_KS:
            _quantize_ks_row(qtype, xr, w, has_imat, orow, lanes)
            continue
        if qtype == IQ2_KS:
            _quantize_iq2_ks_row(xr, w, has_imat, orow)
            continue
        if qtype == IQ4_KSS:
            _quantize_iq4_kss_row(xr, w, has_imat, orow, lanes)
            continue
        if qtype == IQ2_KL:
            _quantize_iq2_kl_row(xr, w, has_imat, orow, lanes)
            continue
        for ibl in range(nb):
            xs = xr[QK_K * ibl:QK_K * ibl + QK_K]
            ws = w[QK_K * ibl:QK_K * ibl + QK_K]
            if qtype == IQ2_K:
                _quantize_iq2_k_block(xs, ws, has_imat, orow, bsize * ibl)
            else:
                _quantize_kblock(qtype, xs, ws, has_imat, orow, bsize * ibl, lanes)


QUANTIZE_TYPES = frozenset({IQ4_K, IQ2_K, IQ3_K, IQ5_K, IQ6_K, IQ4_KS, IQ4_KSS, IQ2_KS, IQ3_KS, IQ5_KS, IQ2_KL})


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize f32 rows to the bytes ik_llama.cpp's ggml_quantize_chunk writes for IQK `qtype`.

    x: (nrows, n_per_row), or flat (one row; with an imatrix, rows of len(imatrix));
    imatrix: None or n_per_row f32 column importances.  Returns flat uint8 bytes,
    nrows * row_bytes(n_per_row).
    """
    ti = type_info(qtype)
    if ti.id not in QUANTIZE_TYPES:
        raise NotImplementedError(f"IQK quantize: type {ti.name} not supported")
    x, im = quantizer_rows(x, imatrix, ti, QK_K)
    nrows, n = x.shape
    if im is None:
        im = np.zeros(1, dtype=np.float32)
    out = np.zeros((nrows, ti.row_bytes(n)), dtype=np.uint8)
    _quantize_rows(x, ti.id, im, imatrix is not None, out, _lane_scratch())
    return out.reshape(-1)
