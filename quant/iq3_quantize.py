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

The search, grid lookups and sign / weight helpers are quant.iq12_quantize's (the same
operations, groups of 4 instead of 8).  Numba kernels process one row per call (f32 arithmetic, nogil, no fastmath); `quantize` is the
NumPy-level entry point.  Single thread, 4096 x 4096: IQ3_XXS ~5.6 s (ik 6.1-6.4 s), IQ3_S
~3.9 s (ik 4.4-4.7 s).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .f32ops import f16_bits as _f16_bits, quantizer_rows
from .iq12_quantize import (_REFINE_ALL_IF_OFF, _REFINE_OFF, _block_weights, _grid_code, _group_signs,
                            _lattice_search, _ni_half, _put_u16, _put_u32, _sqrt_into, _sum_sq, _vmax)
from .iquants import GRID_IQ3S, GRID_IQ3XXS, IQ3_S, IQ3_XXS, QK_K
from .types import type_info

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division, no fastmath
f32 = np.float32

QUANTIZE_TYPES = frozenset({IQ3_XXS, IQ3_S})

_ONE = f32(1.0)
_ZERO = f32(0.0)
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
# rows (the lattice search and its helpers are quant.iq12_quantize's, group width 4)
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _quantize_row(is_s, xr, qw, has_w, out, kmap, neigh, gq, gl, L, on_grid):
    """One row of IQ3_XXS (98-byte blocks) or IQ3_S (is_s: 110 bytes) into out; L / on_grid:
    the search state carried from group to group (and row to row)."""
    bpb = 110 if is_s else 98
    weight = np.empty(32, dtype=np.float32)
    waux = np.empty(32, dtype=np.float32)
    xval = np.empty(32, dtype=np.float32)
    Laux = np.empty(32, dtype=np.int32)
    on_aux = np.zeros(8, dtype=np.bool_)
    index = np.zeros(8, dtype=np.int64)
    aux_index = np.zeros(8, dtype=np.int64)
    scales = np.zeros(8, dtype=np.float32)
    sas = np.zeros(8, dtype=np.int64)          # IQ3_XXS, per group: 4 x 7 sign bits (| ls << 28)
    qs = np.zeros(64, dtype=np.uint8)
    for ibl in range(xr.size // QK_K):
        o = bpb * ibl
        for j in range(bpb):
            out[o + j] = 0
        qs[:] = 0
        sas[:] = 0
        s2 = _sum_sq(xr, QK_K * ibl, QK_K)
        sigma2 = (s2 + s2) * f32(1.0 / QK_K)
        max_scale = _ZERO
        qpos = o + 2                         # IQ3_S's qs / signs write positions: they advance
        spos = o + 74                        # only past groups that are not all zeros
        for ib in range(8):
            xo = QK_K * ibl + 32 * ib
            xb = xr[xo:xo + 32]
            _block_weights(xb, qw, xo, has_w, sigma2, _ZERO, 32, weight)
            _sqrt_into(weight, 32, waux)
            sg = 0
            for k in range(4):
                s = _group_signs(xb, weight, k, xval, not is_s)
                sg |= (s << (8 * k)) if is_s else ((s & 127) << (7 * k))
            mx = _vmax(xval, 32)
            if mx == _ZERO if is_s else mx < _EPS_XXS:
                scales[ib] = _ZERO
                if not is_s:
                    for i in range(32):
                        L[i] = 0
                continue
            scale = _lattice_search(xval, weight, waux, 32, mx / f32(15.0), mx, f32(0.2), f32(15.0),
                                    9 if is_s else 15, _REFINE_ALL_IF_OFF if is_s else _REFINE_OFF,
                                    0 if is_s else -1, kmap, neigh, gq, gl, 4, 7, 3,
                                    L, Laux, on_grid, on_aux, index, aux_index)
            if scale < _ZERO:
                scale = -scale
                sg = (~sg) & (0xFFFFFFFF if is_s else 0xFFFFFFF)
            for k in range(8):
                gi = kmap[_grid_code(L, 4 * k, 4, 3)]
                if is_s:
                    out[qpos + k] = np.uint8(gi & 255)
                    out[o + 66 + ib] |= np.uint8((gi >> 8) << k)
                else:
                    qs[8 * ib + k] = np.uint8(gi)
            if is_s:
                qpos += 8
                _put_u32(out, spos, sg)
                spos += 4
            sas[ib] = sg
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == _ZERO:
            continue                         # d = 0 and all-zero bytes
        d = max_scale / f32(31.0)
        _put_u16(out, o, _f16_bits(d * (f32(1.033) if is_s else f32(1.0125))))
        id_ = _ONE / d
        for ib in range(8):
            ls = max(0, min(15, _ni_half(id_, scales[ib])))
            if is_s:
                out[o + 106 + ib // 2] |= np.uint8(ls << (4 * (ib % 2)))
            else:
                _put_u32(out, o + 66 + 4 * ib, sas[ib] | (np.int64(ls) << 28))
        if not is_s:
            for j in range(64):
                out[o + 2 + j] = qs[j]


@njit(**_opts)
def _quantize_rows(x, qw, has_w, is_s, out, kmap, neigh, gq, gl):
    L = np.zeros(32, dtype=np.int32)
    on_grid = np.zeros(8, dtype=np.bool_)
    for r in range(x.shape[0]):
        _quantize_row(is_s, x[r], qw, has_w, out[r], kmap, neigh, gq, gl, L, on_grid)


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
