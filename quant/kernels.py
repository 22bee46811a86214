"""Numba kernels for the compute types F32, F16, BF16, Q8_0, Q4_0.

Calling convention shared by every weight kernel (quant.matmul builds these arguments):

    buf     read-only 1-D uint8 array (C layout) that starts at the first byte of row 0;
            row r starts at byte r * stride.  Rows may be further apart than their length
            (a view into a memory map), so nothing here assumes stride == row bytes.
    qtype   GGML type id (ints below), branched on once per row, never per element.
    lut     F16_TO_F32: 65536-entry table that turns f16 bit patterns into f32 (block
            scales; whole F16 rows use the vectorizable f16_bits_to_f32 instead).
    qk      the block size, 32.  It is an argument, not a constant, on purpose: with a
            constant trip count LLVM fully unrolls the 32-step block loops into scalar
            code; with a run-time count it vectorizes them (vpmaddwd for the int8 dots).

Activation side of the integer dot products: a row of f32 values is quantized once per
matmul into int8 values plus one scale per 32 (`quantize_act_q8`), with the rounding of the
Q8_2 blocks ik_llama.cpp uses for the same purpose (bf16 scale, round half to even).

matvec_q8_0 and matvec_q4_0 share their row loop on purpose: one generic loop over a
per-type block dot (inlined, or passed as a first-class function) measured 1.9-5x slower
for Q4_0 at n=1, 4096x4096 (the block loop stops vectorizing).

Inner loops index slices with the bare loop counter (`wv[j]`, not `buf[o + j]`): numba
must allow negative indices on `o + j`, and that wrap-around check blocks vectorization.

Everything is compiled lazily with cache=True; matmul passes the same argument types on
every call (read-only buf, int64 ints, C-contiguous arrays), so each kernel compiles once.
"""
from __future__ import annotations

import os

# Idle OpenMP threads of numba's pool sleep instead of spinning.  Must be set before numba
# starts the pool (its first parallel call), so it is done here, at import; an explicit
# setting in the environment wins.  Measured on a 2-core box shared with one busy process:
# a 2-thread Q8_0 4096x4096 matvec took 16 ms with the default spinning, 2 ms with PASSIVE;
# on an idle box PASSIVE costs ~5 % (1.00 -> 1.05 ms) and halves the many-token path's time
# (numba and OpenBLAS pools no longer spin against each other).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

F32_ID, F16_ID, Q4_0_ID, Q8_0_ID, BF16_ID = 0, 1, 2, 8, 30
QK = 32            # weights per block (Q8_0, Q4_0, activation q8)
Q8_0_BYTES = 34    # f16 d + 32 x int8        (layouts; kernels derive them from qk)
Q4_0_BYTES = 18    # f16 d + 16 bytes of nibbles

F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_opts = dict(cache=True, fastmath=True, nogil=True)


# ----------------------------------------------------------------------------------------
# one row of weights -> f32
# ----------------------------------------------------------------------------------------
@njit(**_opts)
def _f16_at(buf, o, lut):
    """f32 value of the little-endian f16 stored at byte offset o."""
    return lut[np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)]


@njit(**_opts)
def f16_bits_to_f32(hv, y):
    """y[:n] = IEEE half values with bit patterns hv[:n], exactly (inf/NaN/subnormals too).

    Vectorizable bit arithmetic, no table gathers: a normal half becomes an f32 by moving
    exponent+mantissa up 13 bits and rebasing the exponent (+112; +224 for inf/NaN);
    zero / subnormal halves are mantissa * 2^-24, computed in float without denormals.
    """
    n = hv.shape[0]
    yu = y.view(np.uint32)
    for j in range(n):
        y[j] = np.float32(hv[j] & 0x3FF) * np.float32(5.960464477539063e-08)
    for j in range(n):
        # every intermediate is cast back to uint32 (numba widens integer ops to 64 bits;
        # the casts let LLVM use 32-bit lanes, 2.5x faster)
        h = np.uint32(hv[j])
        e = np.uint32(h & np.uint32(0x7C00))
        em = np.uint32(np.uint32(h & np.uint32(0x7FFF)) << np.uint32(13))
        inf = np.uint32(np.uint32(e == np.uint32(0x7C00)) * np.uint32(0x38000000))
        nrm = np.uint32(np.uint32(em + np.uint32(0x38000000)) + inf)
        sub = np.uint32(np.uint32(0) - np.uint32(e == np.uint32(0)))   # all ones: zero/subnormal
        sgn = np.uint32(np.uint32(h & np.uint32(0x8000)) << np.uint32(16))
        yu[j] = np.uint32(np.uint32(np.uint32(yu[j] & sub) | np.uint32(nrm & np.uint32(~sub))) | sgn)


@njit(**_opts)
def decode_row(buf, qtype, base, cols, qk, lut, y):
    """Write the `cols` values of the row that starts at byte `base` into y[:cols]."""
    if qtype == Q8_0_ID:
        qs = buf.view(np.int8)
        for b in range(cols // qk):
            o = base + b * (qk + 2)
            d = _f16_at(buf, o, lut)
            wv = qs[o + 2:o + 2 + qk]
            yv = y[b * qk:b * qk + qk]
            for j in range(qk):
                yv[j] = d * np.float32(wv[j])
    elif qtype == Q4_0_ID:
        h = qk // 2
        for b in range(cols // qk):
            o = base + b * (h + 2)
            d = _f16_at(buf, o, lut)
            wv = buf[o + 2:o + 2 + h]
            lo = y[b * qk:b * qk + h]
            hi = y[b * qk + h:b * qk + qk]
            for j in range(h):
                v = np.int32(wv[j])
                lo[j] = d * np.float32((v & 15) - 8)
                hi[j] = d * np.float32((v >> 4) - 8)
    elif qtype == F16_ID:
        f16_bits_to_f32(buf.view(np.uint16)[base // 2:base // 2 + cols], y)
    elif qtype == BF16_ID:
        hv = buf.view(np.uint16)[base // 2:base // 2 + cols]
        yu = y.view(np.uint32)          # bf16 bits are the top half of an f32
        for j in range(cols):
            yu[j] = np.uint32(hv[j]) << np.uint32(16)
    elif qtype == F32_ID:
        fv = buf.view(np.float32)[base // 4:base // 4 + cols]
        for j in range(cols):
            y[j] = fv[j]
    else:
        raise ValueError("decode_row: unsupported type")


@njit(parallel=True, **_opts)
def dequant_rows(buf, qtype, stride, row_ids, cols, qk, lut, out):
    """out[i, :] = row row_ids[i] as f32, in parallel over i.  out: (len(row_ids), cols)."""
    for i in prange(row_ids.shape[0]):
        decode_row(buf, qtype, row_ids[i] * stride, cols, qk, lut, out[i])


# ----------------------------------------------------------------------------------------
# activations -> int8 + f32 scale per block
# ----------------------------------------------------------------------------------------
@njit(parallel=True, cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz"})
def quantize_act_q8(x, qk, q, s):
    """x (n, cols) f32 -> q (n, cols) int8, s (n, cols//qk) f32 with x ~= q * s (per block).

    The rule of the Q8_2 activation blocks ik_llama.cpp multiplies Q8_0 / Q4_0 weights with:
    d = amax/127 rounded to bfloat16 (nearest even), q = x/d rounded to nearest even and
    saturated to int8.  Matching it keeps perplexities within noise of the C++ tool.
    """
    n, cols = x.shape
    nb = cols // qk
    for t in prange(n):
        for b in range(nb):
            xv = x[t, b * qk:b * qk + qk]
            qv = q[t, b * qk:b * qk + qk]
            amax = np.float32(0.0)
            for j in range(qk):
                amax = max(amax, abs(xv[j]))
            d = amax / np.float32(127.0)
            if d > 0:
                m, e = math.frexp(np.float64(d))          # bf16 keeps 8 significant bits
                d = np.float32(math.ldexp(np.rint(m * 256.0) / 256.0, e))
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s[t, b] = d
            for j in range(qk):
                r = np.rint(xv[j] * inv)
                qv[j] = np.int8(min(127.0, max(-128.0, r)))


# ----------------------------------------------------------------------------------------
# few-token matmuls: out[t, r] = dot(W[r], x[t]), parallel over rows r
# ----------------------------------------------------------------------------------------
@njit(parallel=True, **_opts)
def matvec_q8_0(buf, stride, nrows, cols, qk, lut, q, s, out):
    """Q8_0 weights . int8 activations (q, s from quantize_act_q8), int32 block sums."""
    qw = buf.view(np.int8)
    n = q.shape[0]
    nb = cols // qk
    for r in prange(nrows):
        base = r * stride
        for t in range(n):
            acc = np.float32(0.0)
            for b in range(nb):
                o = base + b * (qk + 2)
                wv = qw[o + 2:o + 2 + qk]
                av = q[t, b * qk:b * qk + qk]
                isum = np.int32(0)
                for j in range(qk):   # |w*a| <= 127*128: int16 products, int32 sum
                    isum = np.int32(isum + np.int16(wv[j]) * np.int16(av[j]))
                acc += _f16_at(buf, o, lut) * s[t, b] * np.float32(isum)
            out[t, r] = acc


@njit(parallel=True, **_opts)
def matvec_q4_0(buf, stride, nrows, cols, qk, lut, q, s, out):
    """Q4_0 weights . int8 activations, int32 block sums of (nibble - 8) * a."""
    n = q.shape[0]
    nb = cols // qk
    h = qk // 2
    for r in prange(nrows):
        base = r * stride
        for t in range(n):
            acc = np.float32(0.0)
            for b in range(nb):
                o = base + b * (h + 2)
                wv = buf[o + 2:o + 2 + h]
                al = q[t, b * qk:b * qk + h]        # elements 0..15 pair with low nibbles
                ah = q[t, b * qk + h:b * qk + qk]   # elements 16..31 with high nibbles
                isum = np.int32(0)
                for j in range(h):
                    v = np.int32(wv[j])
                    isum = np.int32(isum + np.int16((v & 15) - 8) * np.int16(al[j])
                                    + np.int16((v >> 4) - 8) * np.int16(ah[j]))
                acc += _f16_at(buf, o, lut) * s[t, b] * np.float32(isum)
            out[t, r] = acc


@njit(parallel=True, **_opts)
def matvec_float(buf, qtype, stride, nrows, cols, qk, lut, x, out, nchunks):
    """Any type: decode each row once into a per-chunk f32 scratch, then f32 dots with x.

    Rows are split into `nchunks` runs (a few per thread) so each run allocates one scratch.
    """
    n = x.shape[0]
    nchunks = max(1, min(nrows, nchunks))
    per = (nrows + nchunks - 1) // nchunks
    for c in prange(nchunks):
        y = np.empty(cols, dtype=np.float32)
        for r in range(c * per, min(nrows, (c + 1) * per)):
            decode_row(buf, qtype, r * stride, cols, qk, lut, y)
            for t in range(n):
                xv = x[t]
                acc = np.float32(0.0)
                for j in range(cols):
                    acc += y[j] * xv[j]
                out[t, r] = acc
