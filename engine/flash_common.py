"""Pieces the flash-attention kernels share (engine.flash_attn's portable one and engine.flash_lanes'):
the exp2 of the online softmax, the split-K cell ranges, the merge of the splits, and the prefetch
of cache rows."""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from quant.kernels import _bits_to_f32
from quant.simd import prefetch as simd_prefetch

# no "ninf"/"nnan": the softmax compares against -inf (masked cells), which LLVM folds away under ninf
_opts = dict(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp", "afn"}, nogil=True)


@njit(**_opts)
def _exp2(t):
    """2**t for t <= 0 (relative error ~2e-7); t < -126 gives ~1e-38, callers zero masked cells."""
    t = max(t, np.float32(-126.0))
    ri = np.rint(t)
    f = (t - ri) * np.float32(0.6931471805599453)           # e**f, |f| <= ln2/2
    p = np.float32(1.0) + f * (np.float32(1.0) + f * (np.float32(0.5) + f * (np.float32(1.0 / 6) + f * (
        np.float32(1.0 / 24) + f * (np.float32(1.0 / 120) + f * np.float32(1.0 / 720))))))
    return p * _bits_to_f32(np.uint32(np.int32(ri) + np.int32(127)) << np.uint32(23))


@njit(**_opts)
def _split_cells(n_kv, nsplit, s, B):
    """Cells [c0, c1) of split s of n_kv cells in nsplit ranges of whole B-cell blocks (empty
    past the last cell)."""
    per = (n_kv + nsplit - 1) // nsplit
    per = (per + B - 1) // B * B
    return s * per, min(n_kv, s * per + per)


@njit(**_opts)
def _combine(acc, m, l, R, lanes, out):
    """out (Hkv, R, dv) = merged splits; rows that saw nothing get zeros.  acc (Hkv, nsplit,
    R / lanes, dv * lanes): value d of row r at [r // lanes, d * lanes + r % lanes] - lanes 1
    for the portable kernel's (R, dv) rows, 16 for the lanes kernels' transposed row chunks.
    A chunk's splits are summed in acc's own layout (the loop over a chunk's lanes is one vector
    op), each split's values read once, then the chunk is transposed into out.  (Row by row, each
    row read every split's whole chunk through a stride of 16 values: 21 us for 16 rows of 512
    over 4 splits, 6.9-7.5 now.)"""
    hkv, nsplit, nch = acc.shape[0], acc.shape[1], acc.shape[2]
    dv = out.shape[2]
    w = np.empty((nsplit, lanes), dtype=np.float32)
    t = np.empty(dv * lanes, dtype=np.float32)
    for g in range(hkv):
        for ch in range(nch):
            for i in range(lanes):
                mx = -np.inf
                for s in range(nsplit):
                    mx = max(mx, m[g, s, ch * lanes + i])
                tot = np.float32(0.0)
                for s in range(nsplit):
                    mi = m[g, s, ch * lanes + i]
                    w[s, i] = 0.0 if mx == -np.inf or mi == -np.inf else _exp2(mi - mx)
                    tot += w[s, i] * l[g, s, ch * lanes + i]
                inv = np.float32(0.0) if tot == 0.0 else np.float32(1.0) / tot
                for s in range(nsplit):
                    w[s, i] *= inv
            t[:] = 0.0
            for s in range(nsplit):
                a, ws = acc[g, s, ch], w[s]
                if ws.max() == 0.0:
                    continue          # a split no row of the chunk saw: its acc was never written
                for d in range(dv):
                    for i in range(lanes):
                        t[d * lanes + i] += ws[i] * a[d * lanes + i]
            for i in range(min(lanes, R - ch * lanes)):
                o = out[g, ch * lanes + i]
                for d in range(dv):
                    o[d] = t[d * lanes + i]


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Prefetch the cache line holding arr[idx] (1-D array) into L2 (prefetcht1; the weight
    kernels' quant.simd.prefetch, locality 2)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        simd_prefetch(builder, ptr, 0, 64, locality=2)
        return context.get_dummy_value()
    return types.none(arr, idx), codegen


@njit(**_opts)
def _prefetch_rows(buf, r0, n, stride):
    """Prefetch rows r0 .. r0 + n - 1 (stride bytes each) of the flat byte buffer buf."""
    for i in range(r0 * stride, (r0 + n) * stride, 64):
        _prefetch(buf, i)
