"""Numba helpers for the k-quant quantizers of quant.kquants (compiled on first use, cached).

`seq_sum_sq_f32`: a sum of squares accumulated in f32 in element order, as a plain C loop
does it (no reassociation: fastmath off), for the whole-chunk test of quantize_row_q2_K_ref.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, fastmath=False, nogil=True)
def seq_sum_sq_f32(v):
    """sum of v[i]*v[i] over a flat f32 array, each product and sum rounded to f32 in order."""
    s = np.float32(0)
    for i in range(v.shape[0]):
        s = np.float32(s + np.float32(v[i] * v[i]))
    return s
