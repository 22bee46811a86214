"""Pieces both flash-attention kernels share (engine.flash_attn's f32 one and engine.flash_bf16's):
the exp2 of the online softmax, the split-K cell ranges and the merge of the splits."""
from __future__ import annotations

import numpy as np
from numba import njit

from quant.kernels import _bits_to_f32

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
    for the f32 kernel's (R, dv) rows, 16 for the bf16 kernel's transposed row chunks."""
    hkv, nsplit = acc.shape[0], acc.shape[1]
    dv = out.shape[2]
    for g in range(hkv):
        for r in range(R):
            ch, lane = r // lanes, r % lanes
            mx = -np.inf
            for s in range(nsplit):
                mx = max(mx, m[g, s, r])
            o = out[g, r]
            o[:] = 0.0
            if mx == -np.inf:
                continue
            tot = np.float32(0.0)
            for s in range(nsplit):
                if m[g, s, r] == -np.inf:
                    continue
                w = _exp2(m[g, s, r] - mx)
                tot += w * l[g, s, r]
                if lanes == 1:            # contiguous rows: vectorized (3x the strided loop)
                    a = acc[g, s, r]
                    for d in range(dv):
                        o[d] += w * a[d]
                else:
                    a = acc[g, s, ch]
                    for d in range(dv):
                        o[d] += w * a[d * lanes + lane]
            inv = np.float32(1.0) / tot
            for d in range(dv):
                o[d] *= inv
