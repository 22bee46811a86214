"""Quantizers for the mainline low-bit i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M, byte
for byte like ik_llama.cpp's ggml_quantize_chunk (quantize_iq2_xxs ... quantize_iq1_m).
Checked identical to ik's bytes on every super-block of the golden data, of 4096 x 4096
Gaussian rows per type and of stress sets (ties, zero and tiny blocks, scales 1e-9 .. 1e3).

The layouts and grids are quant.iquants' (which decodes them).  All five quantize groups of 8
values onto a lattice grid: the 2-bit types on points whose coordinates are levels 1, 3, 5
(stored as 8, 25, 43), with per-group signs (IQ2_XXS / IQ2_XS keep seven sign bits, the eighth
being their parity, so an odd number of negatives flips the least important value); the 1-bit
types on points of -1, 0, 1 plus a shift of +-1/8 (IQ1S_DELTA) per 32 (IQ1_S) or 8 (IQ1_M) values.

Grid maps (ik's iq2xs_init_impl, rebuilt here from quant.iquants' tables by _grid_tables): a
group's levels l0..l7 in 0..2 pack into u = sum l_k << 2k; kmap[u] is the grid index when u is a
grid point, otherwise -(start + 1), with nbrs[start] the number of candidate neighbours and
nbrs[start + 1 ...] their indices: every grid point at one of the `nwant` smallest squared
distances (on coordinates 2l + 1) from u, ordered by (distance, index).  nwant is 2 for
IQ2_XXS / IQ2_XS, 1 for IQ2_S and 3 for the 2048-point IQ1 grid (shared by IQ1_S and IQ1_M).
Only the 3^8 reachable u get lists (ik also fills unreachable ones that contain level 3).

Searches, per type (ggml-quants.c):
* IQ2_XXS (blocks of 32): make_qp_quants gives a first scale, then 13 candidate inverse scales
  (5 + 0.1 is) / (3 scale) map each group to the grid (a neighbour search when off the grid);
  the best weighted fit wins and is refined once; per-block scales are 4 bits under an f16 d.
* IQ2_XS (16): an exhaustive split search over the values sorted by magnitude gives the first
  scale, 15 candidates follow, then up to 3 refit iterations; d is refitted over the
  super-block (times 1.05).
* IQ2_S (16): 19 candidates from max / 5, then a refit of the groups that were off the grid;
  d times 0.9875.
* IQ1_S (32) / IQ1_M (16): the split search into levels -1, 0, 1 over sorted values, with the
  shift +1/8 or -1/8 (IQ1_M: per 8-value half, four combinations), then neighbour search and a
  refit.  IQ1_S stores d * 1.125, IQ1_M a refitted d times 1.085 in the scale nibbles.
IQ2_XXS, IQ2_XS and IQ1_S require an importance matrix (ggml_quantize_requires_imatrix).

Bit-exactness: ik is built with GCC -O3 -march=native, which fuses a product into the add that
uses it where both end up in one basic block, and vectorizes some loops (their reductions then
add rounded products in order).  The places were read from the disassembly of ik's libggml.so
and are reproduced with an explicit fused multiply-add (_fma) and otherwise separate f32
operations, in the C order:
* sum of x^2 over a super-block (IQ1_M: over 32 values): squares rounded, added in order;
* weights qw * sqrt(x*x + sigma2): the x*x is fused (IQ2_S's 0.25 sigma2 + x*x is not);
* nearest_int(a*b) fuses the product into the + 1.5*2^23; nearest_int(0.5*(id*x - 1)) is
  fma(fma(id, x, -1), 0.5, 1.5*2^23); nearest_int(x*s/t) is not fused (a quotient);
* `s += a*b*c` loops: t = a*b rounded, s = fma(t, c, s) (neighbour distances use
  fma(q, scale, -x) for the difference), except IQ1_M's refit sums (rounded products, added);
* make_qp_quants' candidate errors are vectorized: (x - l*s fused) * w * diff rounded, added in
  order; its other sums follow the loop rule.  Its levels are uint8 in ik: IQ2_XXS's parity flip
  can make an x negative, whose level -1 is stored (and read back) as 255;
* the split searches have loop-invariant products hoisted out of the inner loop (never fused)
  and a pattern per type, spelled out in _iq2xs_split, _iq1s_block and _iq1m_block;
* IQ1_S / IQ1_M / IQ2_XS prefix sums: IQ2_XS and IQ1_S fuse w*x into the running sum, IQ1_M
  does not.
Sorting uses a stable order (glibc's qsort of these sizes is a merge sort).  f16 values are
rounded to nearest even (F16C).

Behaviours kept from ik: an all-zero IQ1_M block keeps the previous block's shift (ik's
`shifts` array is reused across rows; it starts as zeros here); IQ2_S keeps the previous
block's levels when no candidate scale fits (only with all-zero importances).

Speed: Numba kernels process whole rows (f32 arithmetic, nogil, no fastmath): one for the
three IQ2 types (_rows_iq2, the type a run-time `kind`), one per IQ1 type; the trial-scale
search (_lattice_search, also IQ3's) is compiled once per group width; `quantize` is the
NumPy-level entry point.  One thread, 4096 x 4096 with an imatrix: 3-10 s
per type, 0.96-1.3x ik's own single-thread time.
"""
from __future__ import annotations

import numpy as np
from numba import literally, njit

from . import iquants
from .f32ops import MAGIC, f16_bits, f32_bits as _f32_bits, fma_f32, quantizer_rows
from .iquants import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, QK_K
from .types import type_info

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division, no fastmath
_inl = dict(_opts, inline="always")
f32 = np.float32

QUANTIZE_TYPES = frozenset({IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M})
REQUIRES_IMATRIX = iquants.REQUIRES_IMATRIX

_MAGIC = MAGIC                             # 1.5 * 2^23: nearest_int's rounding constant
_FLT_MAX = f32(np.finfo(np.float32).max)
_FLT_MIN = f32(np.finfo(np.float32).tiny)
# IQ1 levels -1, 0, 1 shifted by +1/8 (x_p) or -1/8 (x_m)
_XP = np.array([-0.875, 0.125, 1.125], dtype=np.float32)
_XM = np.array([-1.125, -0.125, 0.875], dtype=np.float32)
_KMAP_SIZE = 43692
_SIGNS = iquants.sign_byte(np.arange(128))   # 7 sign bits -> 8 with the parity bit


# ----------------------------------------------------------------------------------------
# scalar primitives (quant.f32ops)
# ----------------------------------------------------------------------------------------
_fma, _f16_bits = fma_f32, f16_bits


@njit(**_inl)
def _nbits(v):
    """nearest_int's result from v = value + 1.5*2^23 (its mantissa trick, also out of range)."""
    return np.int32((np.int32(_f32_bits(v)) & 0x7FFFFF) - 0x400000)


@njit(**_inl)
def _ni_fma(a, b):
    """nearest_int(a*b), the product fused into the rounding constant."""
    return _nbits(_fma(a, b, _MAGIC))


@njit(**_inl)
def _ni_half(idv, x):
    """nearest_int(0.5f*(id*x - 1)) as GCC evaluates it (two fused steps)."""
    return _nbits(_fma(_fma(idv, x, f32(-1.0)), f32(0.5), _MAGIC))


@njit(**_inl)
def _put_u16(out, o, v):
    out[o] = np.uint8(v & 0xFF)
    out[o + 1] = np.uint8((v >> 8) & 0xFF)


@njit(**_inl)
def _put_u32(out, o, v):
    _put_u16(out, o, v & 0xFFFF)
    _put_u16(out, o + 2, (v >> 16) & 0xFFFF)


@njit(**_inl)
def _sum_sq(x, o, n):
    """Sum of x[o:o+n]^2, squares rounded then added in order (GCC's vectorized reduction)."""
    s = f32(0.0)
    for i in range(n):
        s += x[o + i] * x[o + i]
    return s


@njit(**_inl)
def _argsort(v, n, idx):
    """idx[:n] = the stable ascending order of v[:n] (ties keep their original order)."""
    for j in range(n):
        idx[j] = j
    for j in range(1, n):
        t = idx[j]
        vt = v[t]
        k = j
        while k > 0 and v[idx[k - 1]] > vt:
            idx[k] = idx[k - 1]
            k -= 1
        idx[k] = t


# ----------------------------------------------------------------------------------------
# grid maps (ik's iq2xs_init_impl)
# ----------------------------------------------------------------------------------------
_TABLES: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
_LEVELS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _grid_levels(qtype: int) -> tuple[np.ndarray, int]:
    """(levels (N, 8) int in 0..2 of the type's grid, nwant)."""
    if qtype in (IQ1_S, IQ1_M):
        return iquants.GRID_IQ1S.astype(np.int64) + 1, 3
    grid = {IQ2_XXS: iquants.GRID_IQ2XXS, IQ2_XS: iquants.GRID_IQ2XS, IQ2_S: iquants.GRID_IQ2S}[qtype]
    lv = np.searchsorted(np.array([8, 25, 43]), grid.astype(np.int64))
    if not np.array_equal(np.array([8, 25, 43])[lv], grid):
        raise ValueError("unexpected IQ2 grid values")
    return lv, (1 if qtype == IQ2_S else 2)


@njit(**_opts)
def _neighbour_lists(p, g, nwant):
    """For each row of p (off-grid points, coordinates 2l+1): the grid rows of g at its nwant
    smallest distinct squared distances, by (distance, index).  Returns (flat lists, each a
    count then the indices; the start of each row's list)."""
    m, n = p.shape[0], g.shape[0]
    d2 = np.empty(n, dtype=np.int32)
    counts = np.zeros(m, dtype=np.int64)
    for r in range(m):
        for j in range(n):
            s = 0
            for k in range(8):
                t = g[j, k] - p[r, k]
                s += t * t
            d2[j] = s
        t = -1
        for _ in range(nwant):          # next distinct distance above t
            nxt = 1 << 30
            for j in range(n):
                if d2[j] > t and d2[j] < nxt:
                    nxt = d2[j]
            if nxt == 1 << 30:
                break
            t = nxt
        for j in range(n):
            if d2[j] <= t:
                counts[r] += 1
    starts = np.zeros(m, dtype=np.int64)
    tot = 0
    for r in range(m):
        starts[r] = tot
        tot += 1 + counts[r]
    out = np.empty(tot, dtype=np.int32)
    for r in range(m):
        for j in range(n):
            s = 0
            for k in range(8):
                t = g[j, k] - p[r, k]
                s += t * t
            d2[j] = s
        o = starts[r]
        out[o] = counts[r]
        o += 1
        t = -1
        while o < starts[r] + 1 + counts[r]:   # distances in increasing order, indices ascending
            nxt = 1 << 30
            for j in range(n):
                if d2[j] > t and d2[j] < nxt:
                    nxt = d2[j]
            for j in range(n):
                if d2[j] == nxt:
                    out[o] = j
                    o += 1
            t = nxt
    return out, starts


def _grid_tables(qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pos (N, 8) int8 grid coordinates 2l+1, kmap (43692,) int32, nbrs int32) for qtype."""
    key = IQ1_S if qtype == IQ1_M else qtype
    if key in _TABLES:
        return _TABLES[key]
    lv, nwant = _grid_levels(key)
    n = lv.shape[0]
    pos = (2 * lv + 1).astype(np.int8)
    shifts = 2 * np.arange(8)
    kmap = np.full(_KMAP_SIZE, -1, dtype=np.int32)
    kmap[(lv << shifts).sum(axis=1)] = np.arange(n, dtype=np.int32)
    # every u with all levels in 0..2, those off the grid
    digits = (np.arange(3 ** 8)[:, None] // 3 ** np.arange(8)) % 3
    u_all = (digits << shifts).sum(axis=1)
    off = kmap[u_all] < 0
    u_off = u_all[off]
    nbrs, starts = _neighbour_lists((2 * digits[off] + 1).astype(np.int32), pos.astype(np.int32), nwant)
    kmap[u_off] = -(starts + 1)
    tabs = (np.ascontiguousarray(pos), kmap, nbrs)
    _TABLES[key] = tabs
    return tabs


def _level_tables(qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """(gl (N, 8) int32 grid levels 0..2, gq (N, 8) f32 coordinates 2l+1) for qtype."""
    key = IQ1_S if qtype == IQ1_M else qtype
    if key not in _LEVELS:
        pos = _grid_tables(qtype)[0]
        _LEVELS[key] = (np.ascontiguousarray((pos.astype(np.int32) - 1) // 2), pos.astype(np.float32))
    return _LEVELS[key]


_GV_IQ2XS = iquants.GRID_IQ2XS.astype(np.float32)   # IQ2_XS's decoder values, for its d refit


# ----------------------------------------------------------------------------------------
# lattice helpers (shared with quant.iq3_quantize)
# ----------------------------------------------------------------------------------------
# A type's grid enters the searches as gq (N, w) f32, the value each coordinate stands for
# (2l+1 for IQ2 / IQ3, the shifted IQ1 level), and gl (N, w) int32, its level l.
@njit(**_inl)
def _grid_neighbour(nbrs, start, gq, gl, w, xv, wv, o, scale, L):
    """Best grid point among u's neighbour list (least sum of wv (scale q - x)^2 over the group
    at o, first in list order on ties); writes its levels to L[o:o+w] and returns its index
    (ik's iq2_find_best_neighbour / iq1_find_best_neighbour2 / iq3_find_best_neighbour)."""
    n = nbrs[start]
    best = _FLT_MAX
    gi = np.int32(-1)
    for j in range(1, n + 1):
        g = nbrs[start + j]
        d2 = f32(0.0)
        for i in range(w):
            diff = _fma(scale, gq[g, i], -xv[o + i])
            d2 = _fma(wv[o + i] * diff, diff, d2)
        if d2 < best:
            best = d2
            gi = g
    if gi < 0:                     # ik aborts (all distances NaN / huge); keep the first
        gi = nbrs[start + 1]
    for i in range(w):
        L[o + i] = gl[gi, i]
    return gi


@njit(**_inl)
def _grid_code(L, o, w, nbit):
    """u = sum L[o+i] << (nbit i) over the group's w levels (each masked to nbit bits)."""
    u = 0
    mask = (1 << nbit) - 1
    for i in range(w):
        u |= (L[o + i] & mask) << (nbit * i)
    return u


@njit(**_inl)
def _grid_lookup(kmap, nbrs, gq, gl, w, nbit, xv, wv, o, scale, L):
    """The group at o with levels L[o:o+w] moved onto the grid: (grid index, was on grid)."""
    gi = kmap[_grid_code(L, o, w, nbit)]
    if gi < 0:
        return _grid_neighbour(nbrs, -gi - 1, gq, gl, w, xv, wv, o, scale, L), False
    return gi, True


@njit(**_inl)
def _grid_pick(xval, o, idv, scale, waux, kmap, nbrs, gq, gl, w, lmax, nbit, L):
    """Levels nearest_int(0.5 (idv x - 1)) in 0..lmax of the group at o, moved onto the grid:
    (grid index, was on grid)."""
    for i in range(w):
        L[o + i] = max(0, min(lmax, _ni_half(idv, xval[o + i])))
    return _grid_lookup(kmap, nbrs, gq, gl, w, nbit, xval, waux, o, scale, L)


@njit(**_inl)
def _grid_fit(gv, g, mul, sgn, weight, xb, o, sumqx, sumq2):
    """Adds grid point g's fit to the group at o: q = gv[g] * mul, negated where sgn has the bit;
    t = w*q rounded, sums fused (the loop rule)."""
    for j in range(8):
        q = gv[g, j] * mul
        if (sgn >> j) & 1:
            q = -q
        t = weight[o + j] * q
        sumqx = _fma(t, xb[o + j], sumqx)
        sumq2 = _fma(t, q, sumq2)
    return sumqx, sumq2


@njit(**_inl)
def _level_fit(xval, weight, L, n):
    """(sum w x q, sum w q q) with q = 2L+1, in the loop rule (t = w*a rounded, fused add)."""
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for i in range(n):
        w = weight[i]
        q = f32(2 * L[i] + 1)
        sumqx = _fma(w * xval[i], q, sumqx)
        sumq2 = _fma(w * q, q, sumq2)
    return sumqx, sumq2


@njit(**_inl)
def _block_weights(xb, qw, qo, has_qw, sigma2, s0, n, weight):
    """qw * sqrt(sigma2 + x^2) (x*x fused); without qw x^2 + s0 (IQ2_S: 0.25 sigma2, else 0),
    where GCC rounds x*x (SLP-vectorized add)."""
    if has_qw:
        for i in range(n):
            weight[i] = qw[qo + i] * np.sqrt(_fma(xb[i], xb[i], sigma2))
    else:
        for i in range(n):
            weight[i] = xb[i] * xb[i] + s0


@njit(**_inl)
def _sqrt_into(v, n, out):
    for i in range(n):
        out[i] = np.sqrt(v[i])


@njit(**_inl)
def _group_signs(xb, weight, k, xval, parity):
    """|x| of 8-value group k into xval, returns its sign bits; with parity, an odd count of
    negatives flips the value of least w x^2 (its sign bit toggles, its xval turns negative)."""
    nflip = 0
    s = 0
    for i in range(8):
        v = xb[8 * k + i]
        if v >= 0:
            xval[8 * k + i] = v
        else:
            xval[8 * k + i] = -v
            nflip += 1
            s |= 1 << i
    if parity and nflip % 2:
        imin = 0
        mn = weight[8 * k] * xb[8 * k] * xb[8 * k]
        for i in range(1, 8):
            ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
            if ax < mn:
                mn = ax
                imin = i
        xval[8 * k + imin] = -xval[8 * k + imin]
        s ^= 1 << imin
    return s


@njit(**_inl)
def _vmax(v, n):
    m = v[0]
    for i in range(1, n):
        m = m if m > v[i] else v[i]
    return m


@njit(**_inl)
def _prefix_sums(v, weight, n, idx, sumx, sumw):
    """idx = stable order of v[:n]; sumx / sumw = prefix sums of w v (fused) / w in that order."""
    _argsort(v, n, idx)
    sumx[0] = f32(0.0)
    sumw[0] = f32(0.0)
    for j in range(n):
        i = idx[j]
        sumx[j + 1] = _fma(weight[i], v[i], sumx[j])
        sumw[j + 1] = sumw[j] + weight[i]


@njit(**_inl)
def _split_levels(idx, n, i1, i2, flip, L):
    """Levels 0 / 1 / 2 below i1 / below i2 / above in sorted order (2 - that with flip)."""
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)
    if flip:
        for j in range(n):
            L[j] = 2 - L[j]


# refinement after the trial scales, see _lattice_search
_REFINE_ALL = 0        # IQ2_XXS: re-pick every group at the fitted scale (when > 0), refit
_REFINE_OFF = 1        # IQ2_S, IQ3_XXS: re-pick the off-grid groups, when there are any
_REFINE_ALL_IF_OFF = 2  # IQ3_S: re-pick every group when one was off the grid
_REFINE_ITER = 3       # IQ2_XS: up to 3 re-pick / refit rounds while the indices change


@njit(**_inl)
def _keep_levels(L, Laux, n, index, aux_index, ng):
    """A better scale was found: its levels and grid indices become the current ones."""
    for i in range(n):
        L[i] = Laux[i]
    for k in range(ng):
        index[k] = aux_index[k]


@njit(**_opts)
def _lattice_search(xval, weight, waux, n, scale, eff_max, step, centre, ntry, refine, on_init,
                    kmap, nbrs, gq, gl, w, lmax, nbit, L, Laux, on_grid, on_aux, index, aux_index):
    """The trial-scale search of the IQ2 / IQ3 types over the n values of one block: inverse
    scales fma(is, step, centre) / eff_max, is = -ntry..ntry, map each group onto the grid;
    the best weighted fit wins (L, on_grid, index), then `refine`.  scale: the starting
    scale (kept when no trial wins); on_init: on_grid's start (0 / 1, -1 keeps the previous
    block's, IQ3_XXS).  Returns the fitted scale."""
    literally(w)               # compiled per group width (8: IQ2, 4: IQ3): unrolled inner loops
    ng = n // w
    best = f32(0.0)
    for k in range(ng):
        index[k] = 0
        if on_init >= 0:
            on_grid[k] = on_init == 1
    for is_ in range(-ntry, ntry + 1):
        idv = _fma(f32(is_), step, centre) / eff_max
        this_scale = f32(1.0) / idv
        for k in range(ng):
            gi, on = _grid_pick(xval, w * k, idv, this_scale, waux, kmap, nbrs, gq, gl, w, lmax, nbit, Laux)
            aux_index[k] = gi
            on_aux[k] = on
        sumqx, sumq2 = _level_fit(xval, weight, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            _keep_levels(L, Laux, n, index, aux_index, ng)
            for k in range(ng):
                on_grid[k] = on_aux[k]
    if refine == _REFINE_ITER:
        if scale != 0:
            for it in range(3):
                idv = f32(1.0) / scale
                changed = False
                for k in range(ng):
                    gi, on = _grid_pick(xval, w * k, idv, scale, waux, kmap, nbrs, gq, gl, w, lmax, nbit, Laux)
                    aux_index[k] = gi
                    if gi != index[k]:
                        changed = True
                if not changed:
                    break
                sumqx, sumq2 = _level_fit(xval, weight, Laux, n)
                if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    _keep_levels(L, Laux, n, index, aux_index, ng)
                else:
                    break
        return scale
    any_off = refine == _REFINE_ALL
    for k in range(ng):
        if not on_grid[k]:
            any_off = True
    if any_off and scale > 0:
        idv = f32(1.0) / scale
        for k in range(ng):
            if refine == _REFINE_OFF and on_grid[k]:
                continue
            _grid_pick(xval, w * k, idv, scale, waux, kmap, nbrs, gq, gl, w, lmax, nbit, L)
        sumqx, sumq2 = _level_fit(xval, weight, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


# ----------------------------------------------------------------------------------------
# IQ2_XXS / IQ2_XS / IQ2_S
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _make_qp_quants(x, w, n, nmax, L):
    """ik's make_qp_quants (inlined and partly vectorized in quantize_row_iq2_xxs_impl): the
    scale of a level fit 0..nmax, L its levels.  ik's L is uint8: a negative level (x < 0
    after IQ2_XXS's parity flip) is stored as 256 + l and read back that way, while the sums
    use the signed value where it was computed; L here holds the stored bytes."""
    mx = _vmax(x, n)
    if mx < f32(1e-16):
        for i in range(n):
            L[i] = 0
        return f32(0.0)
    fn = f32(nmax)
    iscale = fn / mx
    for i in range(n):
        L[i] = _ni_fma(iscale, x[i]) & 255
    scale = f32(1.0) / iscale
    best_mse = f32(0.0)
    for i in range(n):
        diff = _fma(-scale, f32(L[i]), x[i])
        best_mse = _fma(diff * w[i], diff, best_mse)
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = _fma(f32(is_), f32(0.1), fn) / mx
        scale_is = f32(1.0) / iscale_is
        mse = f32(0.0)
        for i in range(n):
            l = min(nmax, _ni_fma(iscale_is, x[i]))
            diff = _fma(-f32(l), scale_is, x[i])
            mse += diff * w[i] * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = f32(0.0)
    suml2 = f32(0.0)
    for i in range(n):
        l = min(nmax, _ni_fma(iscale, x[i]))
        L[i] = l & 255
        fl = f32(l)
        sumlx = _fma(x[i] * w[i], fl, sumlx)
        suml2 = _fma(w[i] * fl, fl, suml2)
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            wx = w[i] * x[i]
            fl = f32(L[i])
            slx = _fma(-wx, fl, sumlx)
            if slx > 0:
                sl2 = _fma(-(w[i] * fl), fl, suml2)
                if sl2 > 0:
                    new_l = min(nmax, _nbits((x[i] * sl2) / slx + _MAGIC))
                    if new_l != L[i]:
                        fn_ = f32(new_l)
                        slx = _fma(wx, fn_, slx)
                        sl2 = _fma(w[i] * fn_, fn_, sl2)
                        if slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[i] = new_l & 255
                            sumlx = slx
                            suml2 = sl2
                            n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2


@njit(**_inl)
def _iq2xs_split(xval, weight, idx, sumx, sumw):
    """First scale of a 16-value block: the best split of the sorted values into levels 1, 3, 5."""
    _prefix_sums(xval, weight, 16, idx, sumx, sumw)
    best = f32(0.0)
    scale = f32(0.0)
    for i1 in range(17):
        for i2 in range(i1, 17):
            sumq2 = _fma(sumw[16] - sumw[i2], f32(25.0), _fma(sumw[i2] - sumw[i1], f32(9.0), sumw[i1]))
            if sumq2 > 0:
                sumqx = _fma(sumx[16] - sumx[i2], f32(5.0), _fma(sumx[i2] - sumx[i1], f32(3.0), sumx[i1]))
                if sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
    return scale


_K_XXS, _K_XS, _K_S = 0, 1, 2      # _rows_iq2's kind


@njit(**_inl)
def _off_grid(kind):
    if kind == _K_XXS:
        raise ValueError("IQ2_XXS: point not on the grid (ik aborts here)")
    if kind == _K_XS:
        raise ValueError("IQ2_XS: point not on the grid (ik aborts here)")
    raise ValueError("IQ2_S: point not on the grid (ik aborts here)")


@njit(**_opts)
def _rows_iq2(kind, x, qw, has_qw, out, kmap, nbrs, gq, gl, gv):
    """Whole rows of IQ2_XXS (kind 0: 66-byte super-blocks of 8 x 32 values), IQ2_XS (1: 74
    bytes, 16 x 16) or IQ2_S (2: 82 bytes, 16 x 16).  gv: IQ2_XS's decoder grid values (f32)."""
    nrows, n = x.shape
    nbl = n // QK_K
    nb = 32 if kind == _K_XXS else 16         # values per block scale
    ng = nb // 8
    bpb = 66 if kind == _K_XXS else (74 if kind == _K_XS else 82)
    smask = 255 if kind == _K_S else 127       # IQ2_XXS / IQ2_XS store 7 sign bits
    zero_max = f32(1e-8) if kind == _K_S else f32(1e-15)
    weight = np.empty(32, dtype=np.float32)
    waux = np.empty(32, dtype=np.float32)
    xval = np.empty(32, dtype=np.float32)
    L = np.zeros(32, dtype=np.int32)
    Laux = np.zeros(32, dtype=np.int32)
    Lqp = np.zeros(32, dtype=np.int32)
    scales = np.zeros(16, dtype=np.float32)
    q2 = np.zeros(32, dtype=np.int64)
    bsigns = np.zeros(4, dtype=np.int64)
    index = np.zeros(4, dtype=np.int64)
    aux_index = np.zeros(4, dtype=np.int64)
    on_grid = np.zeros(4, dtype=np.bool_)
    on_aux = np.zeros(4, dtype=np.bool_)
    idx = np.zeros(16, dtype=np.int64)
    sumx = np.zeros(17, dtype=np.float32)
    sumw = np.zeros(17, dtype=np.float32)
    for r in range(nrows):
        xr = x[r]
        orow = out[r]
        if kind == _K_S:
            for i in range(16):
                L[i] = 0
        for ibl in range(nbl):
            o = bpb * ibl
            for i in range(32):
                q2[i] = 0
            max_scale = f32(0.0)
            s2 = _sum_sq(xr, QK_K * ibl, QK_K)
            sigma2 = (f32(2.0) * s2 if kind == _K_S else s2) * f32(1.0 / QK_K)
            for ib in range(QK_K // nb):
                xo = QK_K * ibl + nb * ib
                xb = xr[xo:xo + nb]
                _block_weights(xb, qw, xo, has_qw, sigma2, f32(0.25) * sigma2, nb, weight)
                _sqrt_into(weight, nb, waux)
                for k in range(ng):
                    bsigns[k] = _group_signs(xb, weight, k, xval, kind != _K_S) & smask
                mx = _vmax(xval, nb)
                if mx < zero_max:
                    scales[ib] = 0
                    if kind != _K_S:
                        for i in range(nb):
                            L[i] = 0
                    continue
                if kind == _K_XXS:
                    scale = _make_qp_quants(xval, weight, 32, 4, Lqp)
                    for i in range(32):
                        L[i] = Lqp[i]
                    scale = _lattice_search(xval, weight, waux, 32, scale, scale * f32(3.0), f32(0.1), f32(5.0),
                                            6, _REFINE_ALL, -1, kmap, nbrs, gq, gl, 8, 2, 2,
                                            L, Laux, on_grid, on_aux, index, aux_index)
                elif kind == _K_XS:
                    scale = _iq2xs_split(xval, weight, idx, sumx, sumw)
                    scale = _lattice_search(xval, weight, waux, 16, scale, scale * f32(5.0), f32(0.1), f32(5.0),
                                            7, _REFINE_ITER, -1, kmap, nbrs, gq, gl, 8, 2, 2,
                                            L, Laux, on_grid, on_aux, index, aux_index)
                else:
                    scale = _lattice_search(xval, weight, waux, 16, mx / f32(5.0), mx, f32(0.1), f32(5.0),
                                            9, _REFINE_OFF, 1, kmap, nbrs, gq, gl, 8, 2, 2,
                                            L, Laux, on_grid, on_aux, index, aux_index)
                if scale < 0:
                    scale = -scale
                    for k in range(ng):
                        bsigns[k] = (~bsigns[k]) & smask
                for k in range(ng):
                    gi = kmap[_grid_code(L, 8 * k, 8, 2)]
                    if gi < 0:
                        _off_grid(kind)
                    if kind == _K_XXS:
                        q2[2 * ib] |= np.int64(gi) << (8 * k)
                        q2[2 * ib + 1] |= bsigns[k] << (7 * k)
                    elif kind == _K_XS:
                        q2[2 * ib + k] = np.int64(gi) | (bsigns[k] << 9)
                    else:
                        i8 = 2 * ib + k
                        orow[o + 2 + i8] = np.uint8(gi & 255)
                        orow[o + 66 + i8 // 4] |= np.uint8((gi >> 8) << (2 * (i8 % 4)))
                        orow[o + 34 + i8] = np.uint8(bsigns[k])
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            d = max_scale / f32(31.0)
            _put_u16(orow, o, _f16_bits(d * f32(0.9875) if kind == _K_S else d))
            idv = f32(1.0) / d
            sumqx = f32(0.0)
            sumq2 = f32(0.0)
            for ib in range(QK_K // nb):
                l = max(0, min(15, _ni_half(idv, scales[ib])))
                if kind == _K_XXS:
                    q2[2 * ib + 1] |= np.int64(l) << 28
                    continue
                orow[o + bpb - 8 + ib // 2] |= np.uint8(l << (4 * (ib % 2)))
                if kind == _K_XS:       # IQ2_XS refits d over the super-block
                    xo = QK_K * ibl + 16 * ib
                    xb = xr[xo:xo + 16]
                    _block_weights(xb, qw, xo, has_qw, sigma2, f32(0.25) * sigma2, 16, weight)
                    dl = f32(0.125) * f32(2 * l + 1)
                    for k in range(2):
                        sgn = np.int64(_SIGNS[q2[2 * ib + k] >> 9])
                        sumqx, sumq2 = _grid_fit(gv, q2[2 * ib + k] & 511, dl, sgn, weight, xb, 8 * k, sumqx, sumq2)
            if kind == _K_XXS:
                for i in range(16):
                    _put_u32(orow, o + 2 + 4 * i, q2[i])
            elif kind == _K_XS:
                for i in range(32):
                    _put_u16(orow, o + 2 + 2 * i, q2[i])
                if sumq2 > 0:
                    _put_u16(orow, o, _f16_bits(f32(1.05) * sumqx / sumq2))


# ----------------------------------------------------------------------------------------
# IQ1_S / IQ1_M
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _iq1s_block(xb, weight, L, index, idx, sumx, sumw, kmap, nbrs, gqp, gqm, gl):
    """One 32-value IQ1_S block: (scale, shift +1 / -1), grid indices into index[:4]."""
    mx = abs(xb[0])
    for i in range(1, 32):
        ax = abs(xb[i])
        mx = mx if mx > ax else ax
    if mx < f32(1e-12):
        for k in range(4):
            index[k] = 0
        return f32(0.0), 1
    _prefix_sums(xb, weight, 32, idx, sumx, sumw)
    best = -_FLT_MIN
    scale = mx
    besti1 = -1
    besti2 = -1
    shift = 0
    p0, p1, p2 = _XP[0], _XP[1], _XP[2]
    m0, m2 = _XM[0], _XM[2]
    for i1 in range(33):
        aw = sumw[i1]
        ax = sumx[i1]
        awp = aw * p0 * p0          # loop invariants: hoisted by GCC, never fused
        awm = aw * m0 * m0
        axp = ax * p0
        axm = ax * m0
        for i2 in range(i1, 33):
            bw = (sumw[i2] - sumw[i1]) * p1 * p1   # equal for x_m (-1/8)^2
            cw = sumw[32] - sumw[i2]
            bx = (sumx[i2] - sumx[i1]) * p1
            cx = sumx[32] - sumx[i2]
            sumq2 = (bw + awp) + cw * p2 * p2
            if sumq2 > 0:
                sumqx = _fma(cx, p2, bx + axp)
                if sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    besti1 = i1
                    besti2 = i2
                    shift = 1
            sumq2 = _fma(cw * m2, m2, bw + awm)
            if sumq2 > 0:
                sumqx = _fma(cx, m2, axm - bx)
                if sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    besti1 = i1
                    besti2 = i2
                    shift = -1
    if besti1 < 0:
        raise ValueError("IQ1_S: no split found (all importances zero? ik aborts here)")
    _split_levels(idx, 32, besti1, besti2, scale < 0, L)
    if scale < 0:
        scale = -scale
        shift = -shift
    gq = gqp if shift == 1 else gqm
    all_on = True
    for k in range(4):
        gi, on = _grid_lookup(kmap, nbrs, gq, gl, 8, 2, xb, weight, 8 * k, scale, L)
        all_on = all_on and on
        index[k] = gi
    if not all_on:
        sumqx = f32(0.0)
        sumq2 = f32(0.0)
        for k in range(4):
            sumqx, sumq2 = _grid_fit(gq, index[k], f32(1.0), 0, weight, xb, 8 * k, sumqx, sumq2)
        if sumqx > 0 and sumq2 > 0:
            scale = sumqx / sumq2
    return scale, shift


@njit(**_opts)
def _rows_iq1_s(x, qw, has_qw, out, kmap, nbrs, gqp, gqm, gl):
    nrows, n = x.shape
    nbl = n // QK_K
    weight = np.empty(32, dtype=np.float32)
    L = np.zeros(32, dtype=np.int32)
    index = np.zeros(4, dtype=np.int64)
    idx = np.zeros(32, dtype=np.int64)
    sumx = np.zeros(33, dtype=np.float32)
    sumw = np.zeros(33, dtype=np.float32)
    scales = np.zeros(8, dtype=np.float32)
    shifts = np.zeros(8, dtype=np.int64)
    for r in range(nrows):
        xr = x[r]
        orow = out[r]
        for ibl in range(nbl):
            o = 50 * ibl
            max_scale = f32(0.0)
            s2 = _sum_sq(xr, QK_K * ibl, QK_K)
            sigma2 = (s2 + s2) * f32(1.0 / QK_K)
            for ib in range(8):
                xo = QK_K * ibl + 32 * ib
                xb = xr[xo:xo + 32]
                _block_weights(xb, qw, xo, True, sigma2, f32(0.0), 32, weight)   # imatrix required
                scale, shift = _iq1s_block(xb, weight, L, index, idx, sumx, sumw, kmap, nbrs, gqp, gqm, gl)
                h = 0
                for k in range(4):
                    orow[o + 2 + 4 * ib + k] = np.uint8(index[k] & 255)
                    h |= (index[k] >> 8) << (3 * k)
                _put_u16(orow, o + 34 + 2 * ib, h)
                scales[ib] = scale
                shifts[ib] = shift
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            d = max_scale / f32(15.0)
            _put_u16(orow, o, _f16_bits(d * f32(1.125)))
            idv = f32(1.0) / d
            for ib in range(8):
                l = max(0, min(7, _ni_half(idv, scales[ib])))
                if shifts[ib] == -1:
                    l |= 8
                orow[o + 35 + 2 * ib] |= np.uint8(l << 4)


@njit(**_inl)
def _iq1m_half(pair, k, gqp, gqm):
    """The grid values (shift +1/8 or -1/8) of 8-value half k under shift pair `pair`."""
    if k == 0:
        return gqp if pair < 2 else gqm
    return gqp if pair % 2 == 0 else gqm


@njit(**_opts)
def _iq1m_block(xb, weight, L, index, idx, kmap, nbrs, gqp, gqm, gl, sc):
    """One 16-value IQ1_M block: (scale, k) with k the shift pair (0: +,+ 1: +,- 2: -,+ 3: -,-)
    of its two 8-value halves; grid indices into index[:2].  sc: (6, 17) f32 scratch."""
    _argsort(xb, 16, idx)
    sw1, sw2, sx1, sx2 = sc[0], sc[1], sc[2], sc[3]
    sw1[0] = sw2[0] = sx1[0] = sx2[0] = f32(0.0)
    for j in range(16):
        i = idx[j]
        w = weight[i]
        wx = w * xb[i]                 # rounded: not fused into the sums
        if i < 8:
            sw1[j + 1] = sw1[j] + w
            sx1[j + 1] = sx1[j] + wx
            sw2[j + 1] = sw2[j]
            sx2[j + 1] = sx2[j]
        else:
            sw2[j + 1] = sw2[j] + w
            sx2[j + 1] = sx2[j] + wx
            sw1[j + 1] = sw1[j]
            sx1[j + 1] = sx1[j]
    # shift pair k = 0..3: (+,+), (+,-), (-,+), (-,-) for the (first, second) 8-value half.
    # ik evaluates the four as one SLP vector; per lane that is, with A/B/C the sums below,
    # between and above the split (x: sum w x, w: sum w) and l0/l1/l2 the shifted levels:
    #   sumqx = fma(C2x, l2', ((fma(C1x, l2, A1x*l0 + B1x*l1) + A2x*l0') + B2x*l1'))
    #   sumq2 = fma(C2w*l2', l2', ((fma(C1w*l2, l2, B1w*l1*l1 + A1w*l0*l0) + A2w*l0'*l0') + B2w*l1'*l1'))
    # with the A terms hoisted out of the i2 loop (never fused).  Written out per lane.
    p0, p1, p2 = _XP[0], _XP[1], _XP[2]
    m0, m2 = _XM[0], _XM[2]
    best = f32(0.0)
    scale = f32(0.0)
    besti1 = -1
    besti2 = -1
    best_k = -1
    for i1 in range(17):
        x1p = sx1[i1] * p0
        x1m = sx1[i1] * m0
        x2p = sx2[i1] * p0
        x2m = sx2[i1] * m0
        w1p = sw1[i1] * p0 * p0
        w1m = sw1[i1] * m0 * m0
        w2p = sw2[i1] * p0 * p0
        w2m = sw2[i1] * m0 * m0
        for i2 in range(i1, 17):
            b1x = (sx1[i2] - sx1[i1]) * p1
            c1x = sx1[16] - sx1[i2]
            b2x = (sx2[i2] - sx2[i1]) * p1
            c2x = sx2[16] - sx2[i2]
            b1w = (sw1[i2] - sw1[i1]) * p1 * p1      # (-1/8)^2 alike
            c1w = sw1[16] - sw1[i2]
            b2w = (sw2[i2] - sw2[i1]) * p1 * p1
            c2w = sw2[16] - sw2[i2]
            h1p = _fma(c1x, p2, x1p + b1x)
            h1m = _fma(c1x, m2, x1m - b1x)
            u1p = _fma(c1w * p2, p2, b1w + w1p)
            u1m = _fma(c1w * m2, m2, b1w + w1m)
            for k in range(4):
                if k == 0:
                    qx = _fma(c2x, p2, (h1p + x2p) + b2x)
                    q2 = _fma(c2w * p2, p2, (u1p + w2p) + b2w)
                elif k == 1:
                    qx = _fma(c2x, m2, (h1p + x2m) - b2x)
                    q2 = _fma(c2w * m2, m2, (u1p + w2m) + b2w)
                elif k == 2:
                    qx = _fma(c2x, p2, (h1m + x2p) + b2x)
                    q2 = _fma(c2w * p2, p2, (u1m + w2p) + b2w)
                else:
                    qx = _fma(c2x, m2, (h1m + x2m) - b2x)
                    q2 = _fma(c2w * m2, m2, (u1m + w2m) + b2w)
                if q2 > 0 and qx * qx > best * q2:
                    scale = qx / q2
                    best = scale * qx
                    besti1 = i1
                    besti2 = i2
                    best_k = k
    if besti1 < 0:
        raise ValueError("IQ1_M: no split found (ik aborts here)")
    _split_levels(idx, 16, besti1, besti2, scale < 0, L)
    if scale < 0:
        scale = -scale
        best_k = 3 - best_k
    all_on = True
    for k in range(2):
        gq = _iq1m_half(best_k, k, gqp, gqm)
        gi, on = _grid_lookup(kmap, nbrs, gq, gl, 8, 2, xb, weight, 8 * k, scale, L)
        all_on = all_on and on
        index[k] = gi
    if not all_on:
        # refit: rounded products added in order (not fused), all four shift pairs
        sumqx, sumq2 = sc[4], sc[5]
        for k in range(4):
            sumqx[k] = f32(0.0)
            sumq2[k] = f32(0.0)
        for j in range(16):
            w = weight[j]
            wx = w * xb[j]
            qp = _XP[L[j]]
            qm = _XM[L[j]]
            tpx = wx * qp
            tmx = wx * qm
            tp2 = w * qp * qp
            tm2 = w * qm * qm
            sumqx[0] += tpx
            sumq2[0] += tp2
            sumqx[3] += tmx
            sumq2[3] += tm2
            if j < 8:
                sumqx[1] += tpx
                sumq2[1] += tp2
                sumqx[2] += tmx
                sumq2[2] += tm2
            else:
                sumqx[2] += tpx
                sumq2[2] += tp2
                sumqx[1] += tmx
                sumq2[1] += tm2
        best = f32(0.0)
        for k in range(4):
            if sumqx[k] > 0 and sumq2[k] > 0 and sumqx[k] * sumqx[k] > best * sumq2[k]:
                scale = sumqx[k] / sumq2[k]
                best = scale * sumqx[k]
                best_k = k
    return scale, best_k


@njit(**_opts)
def _rows_iq1_m(x, qw, has_qw, out, kmap, nbrs, gqp, gqm, gl):
    nrows, n = x.shape
    nbl = n // QK_K
    weight = np.empty(16, dtype=np.float32)
    L = np.zeros(16, dtype=np.int32)
    index = np.zeros(2, dtype=np.int64)
    idx = np.zeros(16, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    shifts = np.zeros(16, dtype=np.int64)      # kept across blocks and rows, as in ik
    all_sigma2 = np.zeros(8, dtype=np.float32)
    masks = np.array([0x00, 0x80, 0x08, 0x88], dtype=np.int64)
    scratch = np.zeros((6, 17), dtype=np.float32)
    sc = np.zeros(4, dtype=np.int64)
    for r in range(nrows):
        xr = x[r]
        orow = out[r]
        for ibl in range(nbl):
            o = 56 * ibl
            max_scale = f32(0.0)
            for ib in range(8):
                all_sigma2[ib] = (f32(1.5) * _sum_sq(xr, QK_K * ibl + 32 * ib, 32)) * f32(1.0 / 32)
            for ib in range(16):
                xo = QK_K * ibl + 16 * ib
                xb = xr[xo:xo + 16]
                _block_weights(xb, qw, xo, has_qw, all_sigma2[ib // 2], f32(0.0), 16, weight)
                mx = abs(xb[0])
                sumwx = f32(0.0)
                for i in range(1, 16):
                    ax = abs(xb[i])
                    mx = mx if mx > ax else ax
                    sumwx = _fma(weight[i], ax, sumwx)
                if mx < f32(1e-7):
                    scales[ib] = 0
                    continue
                if sumwx == 0:
                    _block_weights(xb, qw, xo, False, all_sigma2[ib // 2], f32(0.0), 16, weight)
                scale, best_k = _iq1m_block(xb, weight, L, index, idx, kmap, nbrs, gqp, gqm, gl, scratch)
                orow[o + 2 * ib] = np.uint8(index[0] & 255)
                orow[o + 2 * ib + 1] = np.uint8(index[1] & 255)
                orow[o + 32 + ib] = np.uint8((index[0] >> 8) | ((index[1] >> 8) << 4))
                scales[ib] = scale
                shifts[ib] = best_k
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            d = max_scale / f32(15.0)
            idv = f32(1.0) / d
            sumqx = f32(0.0)
            sumq2 = f32(0.0)
            sc[:] = 0
            for ib in range(16):
                l = max(0, min(7, _ni_half(idv, scales[ib])))
                sc[ib // 4] |= l << (3 * (ib % 4))
                qh = np.int64(orow[o + 32 + ib]) | masks[shifts[ib]]
                orow[o + 32 + ib] = np.uint8(qh)
                xo = QK_K * ibl + 16 * ib
                xb = xr[xo:xo + 16]
                _block_weights(xb, qw, xo, has_qw, all_sigma2[ib // 2], f32(0.0), 16, weight)
                fl = f32(2 * l + 1)
                for k in range(2):
                    g = np.int64(orow[o + 2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
                    sumqx, sumq2 = _grid_fit(_iq1m_half(shifts[ib], k, gqp, gqm), g, fl, 0, weight, xb, 8 * k,
                                             sumqx, sumq2)
            if sumq2 > 0:
                d = sumqx / sumq2
            h = _f16_bits(d * f32(1.085))
            sc[0] |= (h & 0x000F) << 12
            sc[1] |= (h & 0x00F0) << 8
            sc[2] |= (h & 0x0F00) << 4
            sc[3] |= h & 0xF000
            for i in range(4):
                _put_u16(orow, o + 48 + 2 * i, sc[i])


# ----------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------
def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None, require_imatrix: bool = True) -> np.ndarray:
    """Quantize f32 rows to the bytes ik_llama.cpp's ggml_quantize_chunk writes for `qtype`
    (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S or IQ1_M).

    x: (nrows, n_per_row), or flat (one row; with an imatrix, rows of len(imatrix));
    imatrix: None or n_per_row f32 column importances (required for IQ2_XXS, IQ2_XS and
    IQ1_S, as in ik's ggml_quantize_chunk; require_imatrix=False: without one, as ik's _R4
    quantizers run these).  Returns flat uint8 bytes, nrows * row_bytes(n_per_row).
    """
    ti = type_info(qtype)
    if ti.id not in QUANTIZE_TYPES:
        raise NotImplementedError(f"IQ1/IQ2 quantize: type {ti.name} not supported")
    if imatrix is None and require_imatrix and ti.id in REQUIRES_IMATRIX:
        raise ValueError(f"{ti.name} requires an importance matrix (imatrix), as in ik_llama.cpp")
    x, im = quantizer_rows(x, imatrix, ti, QK_K)
    nrows, n = x.shape
    if im is None:
        im = np.zeros(n, dtype=np.float32)
    out = np.zeros((nrows, ti.row_bytes(n)), dtype=np.uint8)
    if nrows == 0:
        return out.reshape(-1)
    _, kmap, nbrs = _grid_tables(ti.id)
    gl, gq = _level_tables(ti.id)
    has = imatrix is not None
    if ti.id in (IQ1_S, IQ1_M):
        gqp, gqm = _XP[gl], _XM[gl]
        rows = _rows_iq1_s if ti.id == IQ1_S else _rows_iq1_m
        rows(x, im, has, out, kmap, nbrs, gqp, gqm, gl)
    else:
        kind = {IQ2_XXS: _K_XXS, IQ2_XS: _K_XS, IQ2_S: _K_S}[ti.id]
        _rows_iq2(kind, x, im, has, out, kmap, nbrs, gq, gl, _GV_IQ2XS)
    return out.reshape(-1)
