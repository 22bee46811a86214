"""Quantizers for the mainline 3-bit i-quants IQ3_XXS and IQ3_S, byte for byte like
ik_llama.cpp's ggml_quantize_chunk (quantize_iq3_xxs / quantize_iq3_s), without and with an
importance matrix.

Layouts and the decoder are in quant.iquants.  Both types code each group of 4 values as a
point of a lattice grid (256 points for IQ3_XXS, 512 for IQ3_S) whose coordinates are odd
levels 2l+1, l in 0..7, times a per-32 scale; signs are stored apart (IQ3_XXS: 7 bits per 8
values, the eighth being their parity, so an odd count of negatives flips the least important
value; IQ3_S: 8 bits).  The grid is a subset of the 8^4 = 4096 level tuples, so the search
uses two tables built from the grid (ik's iq3xs_init_impl, rebuilt here by `grid_tables`):

* map: for each tuple u = l0 | l1 << 3 | l2 << 6 | l3 << 9, its grid index, or, for a tuple
  off the grid, -(1 + offset) of its neighbour list in `neigh`;
* neigh: per off-grid tuple, a count then the grid indices of every point at one of the 2
  (IQ3_XXS) or 3 (IQ3_S) smallest squared distances, in (distance, index) order.  The search
  takes the first point of least weighted error in that order.

Per 32 values the quantizer tries 31 (IQ3_XXS) or 19 (IQ3_S) trial scales around max/15, rounds
each value to a level, replaces off-grid groups by their best neighbour, keeps the scale of
the best weighted least-squares fit, re-rounds the off-grid groups (IQ3_XXS) or all groups
(IQ3_S) at that fitted scale and refits once.  The per-32 scales become 4-bit ls under one f16
super-block scale d = max/31 * 1.0125 (IQ3_XXS) or * 1.033 (IQ3_S).

Bit-exactness: the operations follow the disassembly of ik's build (GCC, -O3 -march=native),
with every fused multiply-add explicit (quant.iqk_quantize's _fma) and all else f32, as
quant.iqk_quantize's docstring explains.  Here:

* sum of x^2 over the super-block: squares rounded, then added in order (not fused);
* imatrix weight qw * sqrt(fma(x, x, sigma2)); without one, x*x; the neighbour search
  weighs by sqrt(weight);
* trial id = fma(is, 0.2, 15) / max; level = nearest_int(fma(0.5, fma(id, x, -1), 1.5*2^23)),
  reading the integer from the float's mantissa bits as ik does;
* the neighbour error: diff = fma(scale, q, -x), d2 = fma(w*diff, diff, d2);
* sumqx = fma(q, w*x, sumqx), sumq2 = fma(q, w*q, sumq2); a trial wins when
  sumqx*sumqx > best*sumq2 (both products rounded).

ik's quirks that change bytes are kept: IQ3_S does not advance its qs / signs write position
past a 32-value group that is all zeros (the following groups' indices and signs land one slot
early, the last slots stay 0); IQ3_XXS keeps its chosen levels and on-grid flags from one
32-value group to the next, so a group where no trial scale wins (its important values all 0,
e.g. an all-zero importance run) reuses the previous group's levels for its on-grid parts.
That state carries across the rows of one call, as ik's stack frame does (checked against
ik); it starts as zeros, where ik reads uninitialized stack (and may abort on an off-grid
point) when the very first group of a call has no winner.

Checked identical to ik's bytes on every super-block of tests/data/golden_quantize_iq3.npz
and golden_iquants.npz, and of a 4096 x 4096 Gaussian tensor per type, with and without an
imatrix.

Numba kernels process one row per call (f32 arithmetic, nogil, no fastmath); `quantize` is the
NumPy-level entry point.  Single thread, 4096 x 4096: IQ3_XXS ~5.6 s (ik 6.1-6.4 s), IQ3_S
~3.9 s (ik 4.4-4.7 s).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .f32ops import MAGIC as _MAGIC, f16_bits as _f16_bits, fma_f32 as _fma, quantizer_rows
from .iquants import GRID_IQ3S, GRID_IQ3XXS, IQ3_S, IQ3_XXS, QK_K
from .types import type_info

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division, no fastmath
_inl = dict(_opts, inline="always")
f32 = np.float32

QUANTIZE_TYPES = frozenset({IQ3_XXS, IQ3_S})

_MINUS1 = f32(-1.0)
_HALF = f32(0.5)
_ONE = f32(1.0)
_ZERO = f32(0.0)
_FLT_MAX = f32(np.finfo(np.float32).max)
_EPS_XXS = f32(1e-8)         # a 32-value group below this max is stored as zeros (IQ3_XXS)


# ----------------------------------------------------------------------------------------
# grid tables (ik's iq3xs_init_impl)
# ----------------------------------------------------------------------------------------
def grid_levels(grid: np.ndarray) -> np.ndarray:
    """(n, 4) decoder grid -> (n, 4) int32 levels l in 0..7 (the quantizer's point is 2l+1).
    IQ3_S stores 2l+1 itself; IQ3_XXS's decoder values are 4, 12, .., 52, 62 for l = 0..7."""
    vals = np.unique(grid)
    if vals.size != 8:
        raise ValueError("grid must use 8 distinct levels")
    return np.searchsorted(vals, grid).astype(np.int32)


def grid_tables(levels: np.ndarray, nwant: int) -> tuple[np.ndarray, np.ndarray]:
    """(map (4096,) int32, neigh int32) for grid points `levels` (n, 4); see the docstring."""
    n = levels.shape[0]
    codes = (levels[:, 0] | (levels[:, 1] << 3) | (levels[:, 2] << 6) | (levels[:, 3] << 9)).astype(np.int64)
    kmap = np.full(4096, -1, dtype=np.int64)
    kmap[codes] = np.arange(n)
    u = np.arange(4096)
    tup = (u[:, None] >> (3 * np.arange(4))) & 7                             # (4096, 4)
    pos = 2 * tup + 1
    gpos = 2 * levels.astype(np.int64) + 1
    d2 = ((pos[:, None, :] - gpos[None, :, :]) ** 2).sum(axis=2)            # (4096, n)
    neigh: list[int] = []
    for i in np.nonzero(kmap < 0)[0]:
        order = np.argsort(d2[i], kind="stable")                             # by (distance, index)
        dist = d2[i][order]
        keep = dist <= np.unique(dist)[nwant - 1]
        kmap[i] = -(len(neigh) + 1)
        neigh.append(int(keep.sum()))
        neigh.extend(order[keep].tolist())
    return kmap.astype(np.int32), np.asarray(neigh, dtype=np.int32)


_L_XXS = grid_levels(GRID_IQ3XXS)
_L_S = grid_levels(GRID_IQ3S)
_MAP_XXS, _NB_XXS = grid_tables(_L_XXS, 2)
_MAP_S, _NB_S = grid_tables(_L_S, 3)
_Q_XXS = (2 * _L_XXS + 1).astype(np.float32)      # grid points as f32 odd levels
_Q_S = (2 * _L_S + 1).astype(np.float32)


# ----------------------------------------------------------------------------------------
# scalar primitives
# ----------------------------------------------------------------------------------------
@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bit pattern of f32 x as int32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(**_inl)
def _level(id_, x, lmax):
    """ik's nearest_int(0.5*(id*x - 1)) (both products fused, the integer taken from the
    mantissa bits of v + 1.5*2^23), clamped to 0..lmax."""
    v = _fma(_HALF, _fma(id_, x, _MINUS1), _MAGIC)
    l = (_f32_bits(v) & 0x7FFFFF) - 0x400000
    if l > lmax:
        l = lmax
    if l < 0:
        l = 0
    return l


@njit(**_inl)
def _best_neighbour(neigh, start, gq, gl, xval, waux, o, scale, L):
    """ik's iq3_find_best_neighbour: the first listed grid point of least sum of
    waux * (scale*q - x)^2 over the group at o; its levels go to L[o:o+4]."""
    cnt = neigh[start]
    best = _FLT_MAX
    gi = -1
    for j in range(1, cnt + 1):
        g = neigh[start + j]
        d2 = _ZERO
        for i in range(4):
            diff = _fma(scale, gq[g, i], -xval[o + i])
            d2 = _fma(waux[o + i] * diff, diff, d2)
        if d2 < best:
            best = d2
            gi = g
    for i in range(4):
        L[o + i] = gl[gi, i]
    return gi


@njit(**_inl)
def _fit(weight, xval, L):
    """(sumqx, sumq2) of levels L against xval, accumulated as ik does."""
    sumqx = _ZERO
    sumq2 = _ZERO
    for i in range(32):
        w = weight[i]
        q = f32(2 * L[i] + 1)
        sumqx = _fma(q, w * xval[i], sumqx)
        sumq2 = _fma(q, w * q, sumq2)
    return sumqx, sumq2


@njit(**_inl)
def _round_group(kmap, neigh, gq, gl, xval, waux, o, id_, scale, L):
    """Round the group at o to levels at 1/id_; off the grid, take the best neighbour at
    `scale`.  Returns (grid index, on grid)."""
    u = 0
    for i in range(4):
        l = _level(id_, xval[o + i], 7)
        L[o + i] = l
        u |= l << (3 * i)
    gi = kmap[u]
    if gi >= 0:
        return gi, True
    return _best_neighbour(neigh, -gi - 1, gq, gl, xval, waux, o, scale, L), False


# ----------------------------------------------------------------------------------------
# the 32-value group search (shared by both types)
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _search_group(is_s, xval, weight, waux, mx, kmap, neigh, gq, gl, L, on_grid, Laux, on_aux):
    """Levels L[0:32] (and on_grid[0:8]) of one 32-value group with maximum mx > 0; returns
    the fitted scale.  L and on_grid come in holding the previous group's (IQ3_XXS keeps
    them when no trial wins)."""
    best = _ZERO
    scale = mx / f32(15.0)
    if is_s:
        for k in range(8):
            on_grid[k] = False
        lo = -9
    else:
        lo = -15
    for itrial in range(lo, -lo + 1):
        id_ = _fma(f32(itrial), f32(0.2), f32(15.0)) / mx
        this_scale = _ONE / id_
        for k in range(8):
            gi, on = _round_group(kmap, neigh, gq, gl, xval, waux, 4 * k, id_, this_scale, Laux)
            on_aux[k] = on
        sumqx, sumq2 = _fit(weight, xval, Laux)
        if sumq2 > _ZERO and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(32):
                L[i] = Laux[i]
            for k in range(8):
                on_grid[k] = on_aux[k]
    n_off = 0
    for k in range(8):
        if not on_grid[k]:
            n_off += 1
    if n_off > 0 and scale > _ZERO:
        id_ = _ONE / scale
        for k in range(8):
            if on_grid[k] and not is_s:      # IQ3_S re-rounds every group
                continue
            gi, _ = _round_group(kmap, neigh, gq, gl, xval, waux, 4 * k, id_, scale, L)
            for i in range(4):
                L[4 * k + i] = gl[gi, i]
        sumqx, sumq2 = _fit(weight, xval, L)
        if sumq2 > _ZERO:
            scale = sumqx / sumq2
    return scale


@njit(**_inl)
def _group_inputs(xb, qw, has_w, sigma2, weight, waux, xval):
    """weight, waux = sqrt(weight), xval = |x| of a 32-value group."""
    for i in range(32):
        if has_w:
            weight[i] = qw[i] * np.sqrt(_fma(xb[i], xb[i], sigma2))
        else:
            weight[i] = xb[i] * xb[i]
    for i in range(32):
        waux[i] = np.sqrt(weight[i])
    for i in range(32):
        xval[i] = xb[i] if xb[i] >= _ZERO else -xb[i]


@njit(**_inl)
def _sigma2(xs):
    s = _ZERO
    for i in range(QK_K):
        s += xs[i] * xs[i]
    return (s + s) * f32(1.0 / QK_K)


@njit(**_inl)
def _put_u32(out, o, v):
    for j in range(4):
        out[o + j] = np.uint8((v >> (8 * j)) & 0xFF)


# ----------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _quantize_row_xxs(xr, qw, has_w, out, kmap, neigh, gq, gl, L, on_grid):
    """One row of IQ3_XXS (98-byte blocks) into out; L / on_grid: the carried search state."""
    weight = np.empty(32, dtype=np.float32)
    waux = np.empty(32, dtype=np.float32)
    xval = np.empty(32, dtype=np.float32)
    Laux = np.empty(32, dtype=np.int32)
    on_aux = np.zeros(8, dtype=np.bool_)
    scales = np.zeros(8, dtype=np.float32)
    sas = np.zeros(8, dtype=np.int64)          # per group: 4 x 7 sign bits (| ls << 28)
    qs = np.zeros(64, dtype=np.uint8)
    for ibl in range(xr.size // QK_K):
        xs = xr[QK_K * ibl:QK_K * (ibl + 1)]
        o = 98 * ibl
        for j in range(98):
            out[o + j] = 0
        qs[:] = 0
        sas[:] = 0
        sigma2 = _sigma2(xs)
        max_scale = _ZERO
        for ib in range(8):
            xb = xs[32 * ib:32 * ib + 32]
            _group_inputs(xb, qw[QK_K * ibl + 32 * ib:] if has_w else qw, has_w, sigma2, weight, waux, xval)
            sg = 0
            for k in range(4):
                s = 0
                nflip = 0
                for i in range(8):
                    if not (xb[8 * k + i] >= _ZERO):
                        s |= 1 << i
                        nflip += 1
                if nflip & 1:                # flip the least important value back to +
                    imin = 0
                    vmin = weight[8 * k] * xb[8 * k] * xb[8 * k]
                    for i in range(1, 8):
                        a = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                        if a < vmin:
                            vmin = a
                            imin = i
                    xval[8 * k + imin] = -xval[8 * k + imin]
                    s ^= 1 << imin
                sg |= (s & 127) << (7 * k)
            mx = xval[0]
            for i in range(1, 32):
                mx = mx if mx > xval[i] else xval[i]
            if mx < _EPS_XXS:
                scales[ib] = _ZERO
                for i in range(32):
                    L[i] = 0
                continue
            scale = _search_group(False, xval, weight, waux, mx, kmap, neigh, gq, gl, L, on_grid, Laux, on_aux)
            if scale < _ZERO:
                scale = -scale
                sg = (~sg) & 0xFFFFFFF
            for k in range(8):
                u = L[4 * k] | (L[4 * k + 1] << 3) | (L[4 * k + 2] << 6) | (L[4 * k + 3] << 9)
                qs[8 * ib + k] = np.uint8(kmap[u])
            sas[ib] = sg
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == _ZERO:
            continue                         # d = 0 and all-zero bytes
        d = max_scale / f32(31.0)
        h = _f16_bits(d * f32(1.0125))
        out[o] = np.uint8(h & 0xFF)
        out[o + 1] = np.uint8(h >> 8)
        id_ = _ONE / d
        for j in range(64):
            out[o + 2 + j] = qs[j]
        for ib in range(8):
            _put_u32(out, o + 66 + 4 * ib, sas[ib] | (np.int64(_level(id_, scales[ib], 15)) << 28))


@njit(**_opts)
def _quantize_row_s(xr, qw, has_w, out, kmap, neigh, gq, gl, L, on_grid):
    """One row of IQ3_S (110-byte blocks) into out; L / on_grid: the carried search state."""
    weight = np.empty(32, dtype=np.float32)
    waux = np.empty(32, dtype=np.float32)
    xval = np.empty(32, dtype=np.float32)
    Laux = np.empty(32, dtype=np.int32)
    on_aux = np.zeros(8, dtype=np.bool_)
    scales = np.zeros(8, dtype=np.float32)
    for ibl in range(xr.size // QK_K):
        xs = xr[QK_K * ibl:QK_K * (ibl + 1)]
        o = 110 * ibl
        for j in range(110):
            out[o + j] = 0
        sigma2 = _sigma2(xs)
        max_scale = _ZERO
        qpos = o + 2                         # ik's qs / signs write positions: they advance
        spos = o + 74                        # only past groups that are not all zeros
        for ib in range(8):
            xb = xs[32 * ib:32 * ib + 32]
            _group_inputs(xb, qw[QK_K * ibl + 32 * ib:] if has_w else qw, has_w, sigma2, weight, waux, xval)
            sg = 0
            for i in range(32):
                if not (xb[i] >= _ZERO):
                    sg |= 1 << i
            mx = xval[0]
            for i in range(1, 32):
                mx = mx if mx > xval[i] else xval[i]
            if mx == _ZERO:
                scales[ib] = _ZERO
                continue
            scale = _search_group(True, xval, weight, waux, mx, kmap, neigh, gq, gl, L, on_grid, Laux, on_aux)
            if scale < _ZERO:
                scale = -scale
                sg = (~sg) & 0xFFFFFFFF
            for k in range(8):
                u = L[4 * k] | (L[4 * k + 1] << 3) | (L[4 * k + 2] << 6) | (L[4 * k + 3] << 9)
                gi = kmap[u]
                out[qpos + k] = np.uint8(gi & 255)
                out[o + 66 + ib] |= np.uint8((gi >> 8) << k)
            qpos += 8
            _put_u32(out, spos, sg)
            spos += 4
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == _ZERO:
            continue
        d = max_scale / f32(31.0)
        h = _f16_bits(d * f32(1.033))
        out[o] = np.uint8(h & 0xFF)
        out[o + 1] = np.uint8(h >> 8)
        id_ = _ONE / d
        for j in range(4):
            l1 = _level(id_, scales[2 * j], 15)
            l2 = _level(id_, scales[2 * j + 1], 15)
            out[o + 106 + j] = np.uint8(l1 | (l2 << 4))


@njit(**_opts)
def _quantize_rows(x, qw, has_w, is_s, out, kmap, neigh, gq, gl):
    L = np.zeros(32, dtype=np.int32)
    on_grid = np.zeros(8, dtype=np.bool_)
    for r in range(x.shape[0]):
        if is_s:
            _quantize_row_s(x[r], qw, has_w, out[r], kmap, neigh, gq, gl, L, on_grid)
        else:
            _quantize_row_xxs(x[r], qw, has_w, out[r], kmap, neigh, gq, gl, L, on_grid)


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize f32 rows to the bytes ik_llama.cpp's ggml_quantize_chunk writes for IQ3_XXS or
    IQ3_S.

    x: (nrows, n_per_row), or flat (one row; with an imatrix, rows of len(imatrix));
    imatrix: None or n_per_row f32 column importances.  Returns flat uint8 bytes,
    nrows * row_bytes(n_per_row).
    """
    ti = type_info(qtype)
    if ti.id not in QUANTIZE_TYPES:
        raise NotImplementedError(f"IQ3 quantize: type {ti.name} not supported")
    x, qw = quantizer_rows(x, imatrix, ti, QK_K)
    nrows, n = x.shape
    if qw is None:
        qw = np.zeros(1, dtype=np.float32)
    out = np.zeros((nrows, ti.row_bytes(n)), dtype=np.uint8)
    if ti.id == IQ3_S:
        _quantize_rows(x, qw, imatrix is not None, True, out, _MAP_S, _NB_S, _Q_S, _L_S)
    else:
        _quantize_rows(x, qw, imatrix is not None, False, out, _MAP_XXS, _NB_XXS, _Q_XXS, _L_XXS)
    return out.reshape(-1)
