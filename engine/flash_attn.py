"""Flash attention over a KV cache kept in its stored type (f32/f16/bf16/q8_0/q4_0/q6_0).

flash_attn(q, k, v, ...) computes softmax(scale * q·k) · v over the visible cells with an
online softmax over blocks of cells: no (queries x cells) matrix is held for the whole
cache, scratch is bounded by the block sizes.  Two paths, picked by `use_kernel_path`
(multiply-adds per cache cell):

* few queries (token generation): a Numba kernel reads the cache rows in place.  Work items
  are (block of query rows, range of cells) - split-K / flash-decoding - each with its own
  running max / sum / accumulator, merged at the end.  An item walks its cells BLOCK at a
  time; per kv head it decodes the block into an L1-sized f32 scratch and uses it for every
  query row of that head (all 16..128 heads of an MLA cache share one row, and V, the
  first dv values of the row, is read from the same scratch).  Scores and probabilities
  come from 4 rows x 4 cells register-blocked loops; scores are kept in the log2 domain (q
  is pre-scaled by scale*log2(e)) so the softmax needs only a vectorizable exp2.
  Where a kv head has >= 12 query rows (16-lane chunks at least 3/4 full; dk, dv multiples of
  16) and there is no sliding window or sink, engine.flash_lanes runs instead: the same
  split-K structure with 16 query rows in the lanes of a vector, so each cached value is
  loaded once and broadcast into 16 multiply-adds.  Its products are f32 where the CPU has
  AVX-512 (1.20-1.52x this module's speed for 16 latent heads of 576/512 at 3584 cells, one
  thread, Intel: scripts/bench_gen_attention.py), bf16 (AVX512-BF16, outputs within ~2.5e-3 of
  f32) on AMD cores (Zen 4: ~1.7x faster than this module's kernel, measured; later cores
  assumed alike).  IKCLI_FA_BF16=1 / 0 forces bf16 on (where the CPU has AVX512-BF16) / off,
  IKCLI_FA_LANES=0 keeps this module's kernel for f32.
* many queries (prompt processing): tiles of cells are decoded to f32 once per query tile
  and every kv head is updated with two batched BLAS products (scores, P·V) around one
  Numba pass for the masked online softmax; tiles no query of the query tile sees are
  skipped.
"""
from __future__ import annotations

import os

import numba
import numpy as np
from numba import njit, prange, types

import quant.gemm as _qgemm
from quant.gemm import gemm, gemm_t
from quant.fnptr import arrays_key, cached_address, call_at
from quant.kernels import F16_TO_F32, QK, decode_cache_rows

from .device import on_device, to_host
from .flash_common import _combine, _exp2, _prefetch_rows, _split_cells
from .kv_cache import RowStore

F32_ID = 0
LOG2E = 1.4426950408889634
NO_WINDOW = -(1 << 62)  # the lower visibility edge of a query without a sliding window

BLOCK = 8              # cells decoded per step of the kernel path (multiple of 8)
ROW_BLOCK = 32         # query rows per work item of the kernel path
MIN_SPLIT_CELLS = 64   # cells per work item at least (split-K): generation at 128-511 cells runs
                       # on both threads (256 latent cells, 2 threads: ~148 -> ~110-127 us)
SPLITS_PER_THREAD = 2  # work items per thread (measured faster than 3, 4 or 6)
# kernel path while T * H * (dk + dv), the multiply-adds per cache cell, is at most this:
# the measured crossover on 2 Zen 4 cores (n_kv 4096, f16) was T 8..12 for H=16 latent
# (dk+dv 1088), T 1..2 for H=128 latent and T 32..64 for H=16 standard heads (dk+dv 320)
KERNEL_MAX_WORK = 200_000
# BLAS path tiles: queries x heads per query tile, and cells per tile (flash_attn's `block`).
# Tiles wholly above the causal diagonal are skipped, so smaller tiles skip more of a prompt's
# own triangle: 512 queries x 16 heads of 192/128 (decompressed MLA), one / two threads,
# 4096 x 256 against 8192 x 512: n_kv 512 40.1 -> 32.5 / 21.7 -> 17.6 ms, 1024 80 -> 74 /
# 54 -> 38 ms, 2048 168 -> 159 / 82 -> 79 ms (128 cells measured the same or slower then).
# With quant.simd_sgemm's products, 4096 x 256 -> 2048 x 128, two threads, same shapes, the
# causal prompt at the end of n_kv cells: 512 10.35 -> 8.34 ms, 1024 20.2 -> 18.8, 1536 28.3-29.1
# -> 27.0-27.3, 2048 38.6-39.2 -> 38.4-39.0, 4096 76.4 -> 75.7
Q_TILE_ROWS = 2048
CELL_TILE = 128

# fast-math without nnan/ninf: the kernels compare with -inf (masked cells, empty rows),
# which LLVM folds away under ninf; reassoc + contract are what vectorize the dots
_opts = dict(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp", "afn"}, nogil=True)
_fast = dict(cache=True, fastmath=True, nogil=True)     # inf-free inner loops (~5 % faster)


# ----------------------------------------------------------------------------------------
# register-blocked micro kernels: 4 query rows x 4 cells share each load.
# Scores / probabilities are stored S[cell, row] so the softmax vectorizes over rows.
# ----------------------------------------------------------------------------------------
@njit(**_fast)
def _scores4x4(Q, r, kb, b, dk, S):
    q0 = Q[r]
    q1 = Q[r + 1]
    q2 = Q[r + 2]
    q3 = Q[r + 3]
    k0 = kb[b]
    k1 = kb[b + 1]
    k2 = kb[b + 2]
    k3 = kb[b + 3]
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0)
    for j in range(dk):
        a0 = q0[j]
        a1 = q1[j]
        a2 = q2[j]
        a3 = q3[j]
        c0 = k0[j]
        c1 = k1[j]
        c2 = k2[j]
        c3 = k3[j]
        s00 += a0 * c0
        s01 += a0 * c1
        s02 += a0 * c2
        s03 += a0 * c3
        s10 += a1 * c0
        s11 += a1 * c1
        s12 += a1 * c2
        s13 += a1 * c3
        s20 += a2 * c0
        s21 += a2 * c1
        s22 += a2 * c2
        s23 += a2 * c3
        s30 += a3 * c0
        s31 += a3 * c1
        s32 += a3 * c2
        s33 += a3 * c3
    S[b, r], S[b + 1, r], S[b + 2, r], S[b + 3, r] = s00, s01, s02, s03
    S[b, r + 1], S[b + 1, r + 1], S[b + 2, r + 1], S[b + 3, r + 1] = s10, s11, s12, s13
    S[b, r + 2], S[b + 1, r + 2], S[b + 2, r + 2], S[b + 3, r + 2] = s20, s21, s22, s23
    S[b, r + 3], S[b + 1, r + 3], S[b + 2, r + 3], S[b + 3, r + 3] = s30, s31, s32, s33


@njit(**_fast)
def _scores1x4(Q, r, kb, b, dk, S):
    q0 = Q[r]
    k0 = kb[b]
    k1 = kb[b + 1]
    k2 = kb[b + 2]
    k3 = kb[b + 3]
    s0 = s1 = s2 = s3 = np.float32(0)
    for j in range(dk):
        a = q0[j]
        s0 += a * k0[j]
        s1 += a * k1[j]
        s2 += a * k2[j]
        s3 += a * k3[j]
    S[b, r], S[b + 1, r], S[b + 2, r], S[b + 3, r] = s0, s1, s2, s3


@njit(**_fast)
def _pv4x4(P, r, vb, b, dv, acc):
    a0 = acc[r]
    a1 = acc[r + 1]
    a2 = acc[r + 2]
    a3 = acc[r + 3]
    v0 = vb[b]
    v1 = vb[b + 1]
    v2 = vb[b + 2]
    v3 = vb[b + 3]
    p00, p01, p02, p03 = P[b, r], P[b + 1, r], P[b + 2, r], P[b + 3, r]
    p10, p11, p12, p13 = P[b, r + 1], P[b + 1, r + 1], P[b + 2, r + 1], P[b + 3, r + 1]
    p20, p21, p22, p23 = P[b, r + 2], P[b + 1, r + 2], P[b + 2, r + 2], P[b + 3, r + 2]
    p30, p31, p32, p33 = P[b, r + 3], P[b + 1, r + 3], P[b + 2, r + 3], P[b + 3, r + 3]
    for d in range(dv):
        x0 = v0[d]
        x1 = v1[d]
        x2 = v2[d]
        x3 = v3[d]
        a0[d] += (p00 * x0 + p01 * x1) + (p02 * x2 + p03 * x3)
        a1[d] += (p10 * x0 + p11 * x1) + (p12 * x2 + p13 * x3)
        a2[d] += (p20 * x0 + p21 * x1) + (p22 * x2 + p23 * x3)
        a3[d] += (p30 * x0 + p31 * x1) + (p32 * x2 + p33 * x3)


@njit(**_fast)
def _pv1x8(P, r, vb, b, dv, acc):
    a0 = acc[r]
    v0 = vb[b]
    v1 = vb[b + 1]
    v2 = vb[b + 2]
    v3 = vb[b + 3]
    v4 = vb[b + 4]
    v5 = vb[b + 5]
    v6 = vb[b + 6]
    v7 = vb[b + 7]
    p0, p1, p2, p3 = P[b, r], P[b + 1, r], P[b + 2, r], P[b + 3, r]
    p4, p5, p6, p7 = P[b + 4, r], P[b + 5, r], P[b + 6, r], P[b + 7, r]
    for d in range(dv):
        a0[d] += ((p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d])) + \
                 ((p4 * v4[d] + p5 * v5[d]) + (p6 * v6[d] + p7 * v7[d]))


# ----------------------------------------------------------------------------------------
# kernel path
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _attend_range(kbuf, kqt, khead, kstride, vbuf, vqt, vhead, vstride, v_is_k, c0, c1, dk, dv,
                  cell_pos, qg, rpos, rlo, r0, r1, s, B, lut, acc, m, l):
    """Online softmax of rows r0..r1 of every kv head (qg (Hkv, R, dk), log2 domain) over
    cells [c0, c1) into acc[g, s, r0:r1] / m / l; row r sees the cells with rlo[r] < position
    <= rpos[r] (rlo: the sliding window's edge, or far below every position).

    The kv-head loop is inside the cell-block loop so that the rows of a block are read
    whole while they are cached: one kv head per work item walked 6 KB rows 384 bytes at a
    time and ran several times slower on a standard 16-head f16 cache.  Decoding to f32
    goes to an L1-sized scratch: a block of 8 full 16-head rows (96 KB) decoded at a third
    of the speed."""
    hkv = qg.shape[0]
    R = r1 - r0
    R4 = R - R % 4
    kb = np.zeros((B, dk), dtype=np.float32)
    vb = kb if v_is_k else np.zeros((B, dv), dtype=np.float32)
    S = np.empty((B, R), dtype=np.float32)
    mnew = np.empty(R, dtype=np.float32)
    rp = rpos[r0:r1]
    rl = rlo[r0:r1]
    maxpos = rp.max()
    minlo = rl.min()
    # row r sees cell position c iff rl < c <= rp: one unsigned compare, (rp - c) < (rp - rl)
    span = np.empty(R, dtype=np.uint64)
    for r in range(R):
        span[r] = np.uint64(rp[r] - rl[r])
    for g in range(hkv):
        m[g, s, r0:r1] = -np.inf
        l[g, s, r0:r1] = 0.0
        acc[g, s, r0:r1] = 0.0
    for j0 in range(c0, c1, B):
        nb = min(B, c1 - j0)
        cp = cell_pos[j0:j0 + nb]
        if cp.min() > maxpos or (minlo > NO_WINDOW and cp.max() <= minlo):
            continue                      # no row sees any of these cells
        if hkv > 1:                       # the heads' slices of a row are read far apart in
            nn = min(B, c1 - j0 - B)      # time, which the hardware prefetchers miss (~15 %)
            if nn > 0:
                _prefetch_rows(kbuf, j0 + B, nn, kstride)
                if not v_is_k:
                    _prefetch_rows(vbuf, j0 + B, nn, vstride)
        for g in range(hkv):
            Q = qg[g, r0:r1]
            a = acc[g, s, r0:r1]
            mg = m[g, s, r0:r1]
            lg = l[g, s, r0:r1]
            decode_cache_rows(kbuf, kqt, g * khead + j0 * kstride, kstride, nb, dk, QK, lut, kb)
            if not v_is_k:
                decode_cache_rows(vbuf, vqt, g * vhead + j0 * vstride, vstride, nb, dv, QK, lut, vb)
            if nb < B:                    # stale rows could hold inf; their p is 0 anyway
                kb[nb:] = 0.0
                vb[nb:] = 0.0
            for r in range(0, R4, 4):
                for b in range(0, B, 4):
                    _scores4x4(Q, r, kb, b, dk, S)
            for r in range(R4, R):
                for b in range(0, B, 4):
                    _scores1x4(Q, r, kb, b, dk, S)
            for r in range(R):
                mnew[r] = mg[r]
            for b in range(nb):
                sb = S[b]
                cb = cp[b]
                for r in range(R):
                    if np.uint64(rp[r] - cb) < span[r]:
                        mnew[r] = max(mnew[r], sb[r])
            for r in range(R):
                if mnew[r] > mg[r]:       # rescale only when the running max moved (rare)
                    alpha = _exp2(mg[r] - mnew[r]) if mg[r] > -np.inf else np.float32(0.0)
                    lg[r] *= alpha
                    ar = a[r]
                    for d in range(dv):
                        ar[d] *= alpha
                    mg[r] = mnew[r]
            for b in range(nb):
                sb = S[b]
                cb = cp[b]
                for r in range(R):        # rows that saw nothing yet (m = -inf) add nothing
                    p = _exp2(sb[r] - mg[r]) if np.uint64(rp[r] - cb) < span[r] and mg[r] > -np.inf \
                        else np.float32(0.0)
                    sb[r] = p
                    lg[r] += p
            S[nb:] = 0.0
            for r in range(0, R4, 4):
                for b in range(0, B, 4):
                    _pv4x4(S, r, vb, b, dv, a)
            for r in range(R4, R):
                for b in range(0, B, 8):
                    _pv1x8(S, r, vb, b, dv, a)


@njit(parallel=True, **_opts)
def _fa_kernel(kbuf, kqt, kstride, khead, vbuf, vqt, vstride, vhead, v_is_k, n_kv, dk, dv, cell_pos,
               qg, rpos, rlo, B, RB, nsplit, lut, acc, m, l, attend):
    """qg (Hkv, R, dk); acc (Hkv, nsplit, R, dv), m / l (Hkv, nsplit, R): one work item per
    (block of query rows, range of cells).  attend: _attend_range's address for these arguments
    (_attend_address): called by address, its code is not compiled again into this loop's
    parfor gufunc and wrappers (quant.fnptr)."""
    R = qg.shape[1]
    nrb = (R + RB - 1) // RB
    for it in prange(nrb * nsplit):
        rb, s = it // nsplit, it % nsplit
        r0, r1 = rb * RB, min(R, rb * RB + RB)
        c0, c1 = _split_cells(n_kv, nsplit, s, B)
        # the arguments' types are _attend_address's signature: scalars made int64 here
        call_at(attend, (kbuf, np.int64(kqt), np.int64(khead), np.int64(kstride), vbuf, np.int64(vqt),
                         np.int64(vhead), np.int64(vstride), v_is_k, np.int64(c0), np.int64(c1), np.int64(dk),
                         np.int64(dv), cell_pos, qg, rpos, rlo, np.int64(r0), np.int64(r1), np.int64(s), np.int64(B),
                         lut, acc, m, l))


_ATTEND: dict = {}      # arrays_key of the varying arguments -> (_attend_range, its address for their types)


def _attend_address(kbuf, vbuf, cell_pos, qg, rpos, rlo, lut) -> int:
    """The address of _attend_range compiled for _fa_kernel's argument types (acc, m, l are
    always C-contiguous f32), compiled or loaded from the cache on first use."""
    def make():
        ty, i64 = numba.typeof, types.int64
        f3 = types.Array(types.float32, 3, "C")
        return _attend_range, (ty(kbuf), i64, i64, i64, ty(vbuf), i64, i64, i64, types.boolean, i64, i64, i64, i64,
                               ty(cell_pos), ty(qg), ty(rpos), ty(rlo), i64, i64, i64, i64, ty(lut),
                               types.Array(types.float32, 4, "C"), f3, f3)
    return cached_address(_ATTEND, arrays_key(kbuf, vbuf, cell_pos, qg, rpos, rlo, lut), make)


def _n_splits(n_items: int, n_kv: int) -> int:
    """Cell ranges (split-K) for n_items row blocks: enough for SPLITS_PER_THREAD work items
    per thread, none shorter than MIN_SPLIT_CELLS."""
    return max(1, min(-(-SPLITS_PER_THREAD * numba.get_num_threads() // n_items), n_kv // MIN_SPLIT_CELLS))


@njit(parallel=True, **_opts)
def _softmax_tile(st, n, cp, qp, qlo, G, m, l, acc):
    """BLAS path: scores st[:, :, :n] (Hkv, rows, cells), row t * G + i -> probabilities in
    place, with the online-softmax update of m / l (Hkv, rows) and the rescaling of acc (Hkv,
    rows, dv); one pass instead of ~8 NumPy ones.  st is the whole C-contiguous scratch, not
    the slice: the loops over a row then vectorize (over an 'A'-layout slice they did not), and
    rows that see the whole tile skip the mask.  flash_attn_rows, 512 queries x 16 heads of
    192/128 over 4096 cells, two threads: 161 -> 132 ms (2048 cells: 81.7 -> 66.3)."""
    hkv, rows = st.shape[0], st.shape[1]
    cmin, cmax = cp.min(), cp.max()
    for it in prange(hkv * rows):
        g, r = it // rows, it % rows
        pos = qp[r // G]
        lo = qlo[r // G]
        sr = st[g, r, :n]
        mx = m[g, r]
        full = cmax <= pos and cmin > lo          # the row sees every cell: loops without the mask
        if full:
            for j in range(n):
                mx = max(mx, sr[j])
        else:
            for j in range(n):
                if cp[j] <= pos and cp[j] > lo:
                    mx = max(mx, sr[j])
        if mx == -np.inf:
            sr[:] = 0.0
            continue
        tot = np.float32(0.0)
        if full:
            for j in range(n):
                p = _exp2(sr[j] - mx)
                sr[j] = p
                tot += p
        else:
            for j in range(n):
                p = _exp2(sr[j] - mx) if cp[j] <= pos and cp[j] > lo else np.float32(0.0)
                sr[j] = p
                tot += p
        if mx > m[g, r]:
            alpha = _exp2(m[g, r] - mx) if m[g, r] > -np.inf else np.float32(0.0)
            l[g, r] *= alpha
            a = acc[g, r]
            for d in range(a.shape[0]):
                a[d] *= alpha
            m[g, r] = mx
        l[g, r] += tot


# ----------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------
def use_kernel_path(n_tokens: int, n_head: int, dk: int, dv: int) -> bool:
    """True when flash_attn takes the Numba kernel path (little work per cache cell)."""
    return n_tokens * n_head * (dk + dv) <= KERNEL_MAX_WORK


def _head_bytes(store: RowStore, n_head_kv: int) -> int:
    return store.data.shape[1] // n_head_kv


def flash_attn(q: np.ndarray, k: RowStore, v: "RowStore | HeadRows | None", n_kv: int, n_head_kv: int, dk: int,
               dv: int, cell_pos: np.ndarray, q_pos: np.ndarray, scale: float, block: int | None = None,
               path: str | None = None, window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """softmax(scale * q·k) · v over cells 0..n_kv-1 of the cache; query t sees cell j iff
    cell_pos[j] <= q_pos[t] and, with a sliding window (window > 0), q_pos[t] - cell_pos[j] < window.
    sinks (H,): attention sinks (gpt-oss): one more logit per head in every softmax, with no value.

    q (T, H, dk) f32 -> (T, H, dv) f32.  k rows hold n_head_kv heads of dk values (head-major),
    v rows n_head_kv heads of dv values; v None: V is the first dv values of each K head
    (MLA latent cache); HeadRows: computed values, head-major (the BLAS path only).  Query head
    h uses kv head h // (H // n_head_kv).  A query that sees no cell gets zeros.  block: cells per
    tile of the BLAS path (default CELL_TILE); path: None (choose by size with use_kernel_path),
    "kernel" or "blas".
    """
    if k.device != "CPU":               # the cache is in GPU memory: attend there
        from . import cuda_backend
        return cuda_backend.flash_attn(q, k, v, n_kv, n_head_kv, dk, dv, cell_pos, q_pos, scale, window, sinks)
    q = to_host(q)                      # a GPU query over a host cache (-nkvo) comes down
    if q.dtype != np.float32:
        q = q.astype(np.float32)
    T, H, _ = q.shape
    if H % n_head_kv or q.shape[2] != dk:
        raise ValueError(f"flash_attn: q {q.shape} does not fit {n_head_kv} kv heads of {dk} values")
    if path is None:
        path = "kernel" if use_kernel_path(T, H, dk, dv) else "blas"
    if n_kv == 0 or T == 0:
        return np.zeros((T, H, dv), dtype=np.float32)
    # (the conversions below copy nothing for the engine's own int64 arrays: ~1 us each a call)
    cell_pos = np.ascontiguousarray(cell_pos[:n_kv], dtype=np.int64)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    q_lo = q_pos - window if window > 0 else None     # None: no sliding window
    sink2 = None if sinks is None else np.asarray(sinks, dtype=np.float32) * np.float32(LOG2E)   # log2 domain
    if path == "kernel":
        if isinstance(v, HeadRows):
            raise ValueError("flash_attn: head-major values are for the BLAS path")
        return _flash_kernel(q, k, v, n_kv, n_head_kv, dk, dv, cell_pos, q_pos, q_lo, scale, sink2)
    if q_lo is None:
        q_lo = np.full_like(q_pos, NO_WINDOW)
    if path == "blas":
        return _flash_blas(q, k, v, n_kv, n_head_kv, dk, dv, cell_pos, q_pos, q_lo, scale, block or CELL_TILE, sink2)
    raise ValueError(f"flash_attn: unknown path {path!r}")


class HeadRows:
    """Values kept head-major, (Hkv, n_kv, dv) f32, for the BLAS path: a tile's P.V product then
    reads each head's rows one after the other.  From the cells' rows (n_kv, Hkv, dv) a head's
    rows lie Hkv * dv values apart (8 KiB for 16 heads of 128), in the same L1 sets: that product
    ran at 188 GFLOP/s against 237 head-major (128 x 128 x 128 x 16 heads, one thread)."""

    def __init__(self, v: np.ndarray) -> None:
        n, hkv, dv = v.shape
        self.heads = np.empty((hkv, n, dv), dtype=np.float32)
        s0, s1, s2 = v.strides
        if v.dtype == np.float32 and s2 == 4 and s0 > 0 and s1 > 0 and not (s0 | s1) % 4 and n:
            # the span the rows lie in as one flat array: Numba copies a strided 3-D view element
            # by element (3.8 ms for 4096 cells of 16 heads, NumPy 2.2), flat rows as vectors (0.8)
            span = (n - 1) * (s0 // 4) + (hkv - 1) * (s1 // 4) + dv
            _heads_first(np.lib.stride_tricks.as_strided(v, shape=(span,), strides=(4,)), s0 // 4, s1 // 4,
                         self.heads)
        else:
            np.copyto(self.heads, np.swapaxes(v, 0, 1))

    def tile(self, c0: int, c1: int) -> np.ndarray:
        """Cells [c0, c1) of every head: (Hkv, c1 - c0, dv), a view."""
        return self.heads[:, c0:c1]


@njit(parallel=True, cache=True, nogil=True)
def _heads_first(flat, cstride, hstride, out):
    """out[h, c] = the dv values at flat[c cstride + h hstride] (on the pool)."""
    hkv, n, dv = out.shape
    for h in prange(hkv):
        for c in range(n):
            o = c * cstride + h * hstride
            out[h, c, :] = flat[o:o + dv]


def flash_attn_rows(q, k, v, cell_pos: np.ndarray, q_pos: np.ndarray, scale: float):
    """flash_attn over computed f32 keys k (n_kv, Hkv, dk) and values v (n_kv, Hkv, dv) rather
    than a cache (decompressed MLA heads), on the side the arrays are.  v may be any strided
    view: it is copied once (head-major for the prompt path)."""
    n_kv, hkv, dk = k.shape
    dv = v.shape[-1]
    if on_device(k):
        from . import cuda_backend
        return cuda_backend.causal_attention(q, k, v, cell_pos, q_pos, scale)
    ks = RowStore.from_f32(k.reshape(n_kv, -1))
    if hkv > 1 and not use_kernel_path(q.shape[0], q.shape[1], dk, dv):
        return flash_attn(q, ks, HeadRows(v), n_kv, hkv, dk, dv, cell_pos, q_pos, scale, path="blas")
    return flash_attn(q, ks, RowStore.from_f32(v.reshape(n_kv, -1)), n_kv, hkv, dk, dv, cell_pos, q_pos, scale)


# engine.flash_lanes for the kernel path (see the module docstring).  USE_BF16: True / False
# force bf16 products on / off, None picks them where they measured faster (bf16_preferred);
# USE_LANES: the f32 lanes kernel where the CPU has AVX-512 (False: this module's kernel).
# Tests flip both to compare kernels.
_BF16_ENV = os.environ.get("IKCLI_FA_BF16")
USE_BF16: bool | None = None if _BF16_ENV in (None, "") else _BF16_ENV != "0"
USE_LANES = os.environ.get("IKCLI_FA_LANES", "1") != "0"
_FL = None    # engine.flash_lanes once _lanes_kind has imported it (it builds intrinsics: not at import)
_HOST: tuple | None = None      # (bf16 available, bf16 preferred, f32 preferred)


def _lanes_kind(rows: int, dk: int, dv: int) -> str | None:
    """The engine.flash_lanes kind ("bf16", "f32") for a kv head with `rows` query rows per token,
    or None for this module's kernel."""
    global _FL, _HOST
    if _HOST is None:
        from . import flash_lanes
        _FL = flash_lanes
        _HOST = (_FL.bf16_available(), _FL.bf16_preferred(), _FL.f32_preferred())
    if not _FL.supports(rows, dk, dv):
        return None
    if _HOST[0] and (USE_BF16 or (USE_BF16 is None and _HOST[1])):
        return "bf16"
    return "f32" if USE_LANES and _HOST[2] else None


def _sink_rows(sink2: np.ndarray, hkv: int, G: int, rows: int) -> np.ndarray:
    """(Hkv, rows) sink of each row: row r of kv head g is query head g * G + r % G."""
    return sink2.reshape(hkv, G)[:, np.arange(rows) % G]


def _flash_kernel(q, k, v, n_kv, hkv, dk, dv, cell_pos, q_pos, q_lo, scale, sink2=None):
    T, H, _ = q.shape
    G = H // hkv
    R = T * G
    # chosen by the rows one token gives a kv head (G), not by T * G: a token's result must not
    # depend on how many others share its batch (the server's slots decode side by side)
    kind = _lanes_kind(G, dk, dv) if q_lo is None and sink2 is None else None    # lanes: neither
    if kind is not None:
        nch = -(-R // _FL.LANES)
        nsplit = _n_splits(-(-nch // _FL.CHUNKS_PER_ITEM), n_kv)
        out = _FL.flash_kernel_lanes(np.ascontiguousarray(q), scale * LOG2E, q_pos, hkv, k, v, n_kv, dk, dv,
                                     cell_pos, nsplit, F16_TO_F32, _head_bytes(k, hkv),
                                     _head_bytes(k if v is None else v, hkv), kind)
        return out.reshape(hkv, T, G, dv).transpose(1, 0, 2, 3).reshape(T, H, dv)
    # rows of kv head g: (t, i) -> t * G + i, pre-scaled into the log2 domain
    qg = np.ascontiguousarray((q.reshape(T, hkv, G, dk) * np.float32(scale * LOG2E)).transpose(1, 0, 2, 3)
                              .reshape(hkv, R, dk), dtype=np.float32)
    rpos = np.repeat(q_pos, G) if G > 1 else q_pos
    rlo = np.repeat(np.full_like(q_pos, NO_WINDOW) if q_lo is None else q_lo, G)
    nsplit = _n_splits(-(-R // ROW_BLOCK), n_kv)
    acc = np.empty((hkv, nsplit, R, dv), dtype=np.float32)
    m = np.empty((hkv, nsplit, R), dtype=np.float32)
    l = np.empty((hkv, nsplit, R), dtype=np.float32)
    kbuf = k.data.reshape(-1)
    vs = k if v is None else v
    vbuf = vs.data.reshape(-1)
    _fa_kernel(kbuf, k.qtype, k.data.shape[1], _head_bytes(k, hkv), vbuf, vs.qtype, vs.data.shape[1],
               _head_bytes(vs, hkv), v is None, n_kv, dk, dv, cell_pos, qg, rpos, rlo, BLOCK, ROW_BLOCK, nsplit,
               F16_TO_F32, acc, m, l, _attend_address(kbuf, vbuf, cell_pos, qg, rpos, rlo, F16_TO_F32))
    if sink2 is not None:       # the sinks as one more split: their logit, weight 1, no value
        acc = np.concatenate([acc, np.zeros((hkv, 1, R, dv), dtype=np.float32)], axis=1)
        m = np.concatenate([m, _sink_rows(sink2, hkv, G, R)[:, None, :]], axis=1)
        l = np.concatenate([l, np.ones((hkv, 1, R), dtype=np.float32)], axis=1)
    out = np.empty((hkv, R, dv), dtype=np.float32)
    _combine(acc, m, l, R, 1, out)
    return out.reshape(hkv, T, G, dv).transpose(1, 0, 2, 3).reshape(T, H, dv)


def _read_tile(store: RowStore, c0: int, c1: int, out: np.ndarray) -> np.ndarray:
    """Rows [c0, c1) of the store (all heads) as f32 (c1 - c0, width)."""
    return store.read(c1 - c0, out[:c1 - c0], first=c0)


def _flash_blas(q, k, v, n_kv, hkv, dk, dv, cell_pos, q_pos, q_lo, scale, block, sink2=None):
    T, H, _ = q.shape
    G = H // hkv
    tq = max(1, Q_TILE_ROWS // H)                  # queries per tile
    kt = np.empty((block, k.width), dtype=np.float32)
    vt = np.empty((block, v.width), dtype=np.float32) if isinstance(v, RowStore) else None
    out = np.empty((T, H, dv), dtype=np.float32)
    q = np.ascontiguousarray(q, dtype=np.float32)
    qscale = np.float32(scale * LOG2E)
    # a query tile's arrays, made once and refilled by _start_tile (NumPy's scaling, transposes and
    # zeroing per tile, and the final division, were ~30 % of a 512 x 512 call: 8.9 ms, 2 threads)
    rmax = min(T, tq) * G
    qt_all = np.empty((hkv, rmax, dk), dtype=np.float32)
    # quant.simd_sgemm: scores as K . Q^T written transposed, Q^T once a tile (its rows padded to
    # 16 readable columns; the padding's products are never stored)
    qtt_all = np.zeros((hkv, dk, -(-rmax // 16) * 16 if _qgemm.OWN else 0), dtype=np.float32)
    m_all = np.empty((hkv, rmax), dtype=np.float32)
    lsum_all = np.empty((hkv, rmax), dtype=np.float32)
    acc_all = np.empty((hkv, rmax, dv), dtype=np.float32)
    for t0 in range(0, T, tq):
        t1 = min(T, t0 + tq)
        rows = (t1 - t0) * G                       # row (t, i) of kv head g: query t0 + t, head g*G + i
        _start_tile(q, t0, t1, G, qscale, qt_all, qtt_all, m_all, lsum_all, acc_all)
        qt = qt_all if rows == rmax else qt_all[:, :rows]
        qtt = qtt_all if _qgemm.OWN else None
        qp = q_pos[t0:t1]
        ql = q_lo[t0:t1]
        m = m_all if rows == rmax else np.ascontiguousarray(m_all[:, :rows])
        lsum = lsum_all if rows == rmax else np.ascontiguousarray(lsum_all[:, :rows])
        acc = acc_all if rows == rmax else np.ascontiguousarray(acc_all[:, :rows])
        # one spare column: every slice st[..., :n] has the same ('A') layout, so a full block does
        # not compile the kernels' C-layout variants in the middle of a timed pass
        st = np.empty((hkv, rows, block + 1), dtype=np.float32)
        for c0 in range(0, n_kv, block):
            c1 = min(n_kv, c0 + block)
            cp = cell_pos[c0:c1]
            if cp.min() > qp.max() or cp.max() <= ql.min():
                continue                           # nobody in this query tile sees these cells
            kf = _read_tile(k, c0, c1, kt).reshape(c1 - c0, hkv, dk)
            if v is None:
                vh = kf[:, :, :dv].transpose(1, 0, 2)
            elif isinstance(v, HeadRows):
                vh = v.tile(c0, c1)
            else:
                vh = _read_tile(v, c0, c1, vt).reshape(c1 - c0, hkv, dv).transpose(1, 0, 2)
            if qtt is None:     # (hkv, rows, cells), log2 domain
                s = gemm(qt, kf.transpose(1, 0, 2), st[:, :, :c1 - c0])
            else:
                s = gemm_t(kf.transpose(1, 0, 2), qtt, st[:, :, :c1 - c0])
            _softmax_tile(st, c1 - c0, cp, qp, ql, G, m, lsum, acc)
            gemm(s, vh, acc, trans_b=False, accumulate=True)
        if sink2 is not None:   # one more logit per row in the softmax sum, with no value
            sk = _sink_rows(sink2, hkv, G, rows)
            mx = np.maximum(m, sk)
            keep = np.where(m > -np.inf, np.exp2(m - mx), np.float32(0.0)).astype(np.float32)
            lsum = lsum * keep + np.exp2(sk - mx)
            acc *= keep[:, :, None]
        _finish_tile(acc, lsum, t0, G, out)
    return out


@njit(parallel=True, cache=True, nogil=True)     # no fastmath: NumPy's rounding, the division not a reciprocal
def _start_tile(q, t0, t1, G, qscale, qt, qtt, m, lsum, acc):
    """A query tile's rows (t, i) of kv head g (query t0 + t, head g G + i), scaled into the log2
    domain (the same f32 product as NumPy's q * qscale): into qt (hkv, >= rows, dk) and, where qtt
    has columns, transposed into qtt (hkv, dk, >= rows); m = -inf, lsum = acc = 0."""
    hkv, dk = qt.shape[0], qt.shape[2]
    rows = (t1 - t0) * G
    for g in prange(hkv):
        for r in range(rows):
            t, i = r // G, r % G
            for d in range(dk):
                x = q[t0 + t, g * G + i, d] * qscale
                qt[g, r, d] = x
                if qtt.shape[2]:
                    qtt[g, d, r] = x
            m[g, r] = -np.inf
            lsum[g, r] = 0.0
            acc[g, r, :] = 0.0


@njit(parallel=True, cache=True, nogil=True)
def _finish_tile(acc, lsum, t0, G, out):
    """out[t0 + t, g G + i] = acc[g, t G + i] / lsum[g, t G + i] (zeros where the row saw no cell)."""
    hkv, rows, dv = acc.shape
    for g in prange(hkv):
        for r in range(rows):
            t, i = r // G, r % G
            o = out[t0 + t, g * G + i]
            lr = lsum[g, r]
            if lr > 0:
                for d in range(dv):
                    o[d] = acc[g, r, d] / lr
            else:
                o[:] = 0.0
