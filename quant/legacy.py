"""The legacy 32-weight block family: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_0 (ik_llama.cpp) and IQ4_NL.

Layouts (ggml-common.h of ik_llama.cpp, same as mainline ggml; f16 little-endian):

    Q8_0    34 bytes   f16 d, qs[32] int8              x = q*d
    Q4_0    18 bytes   f16 d, qs[16]                   x = (q - 8)*d, q = 4-bit nibble
    Q4_1    20 bytes   f16 d, f16 m, qs[16]            x = q*d + m,   q = 4-bit nibble
    Q5_0    22 bytes   f16 d, qh[4], qs[16]            x = (q - 16)*d, q = nibble | 5th bit << 4
    Q5_1    24 bytes   f16 d, f16 m, qh[4], qs[16]     x = q*d + m,   q as Q5_0
    Q6_0    26 bytes   f16 d, qh[8], qs[16]            x = (q - 32)*d, two high bits per value in qh
    IQ4_NL  18 bytes   f16 d, qs[16]                   x = d * KVALUES_IQ4NL[nibble]
    MXFP4   17 bytes   u8 e (E8M0), qs[16]             x = 2^(e - 128) * KVALUES_MXFP4[nibble]
                                                       (the e2m1 values doubled, the scale halved)
    Q8_KV   32 bytes   qs[32] int8                     x = q*d, d the row's
            (ik_llama.cpp; row meta 8 bytes: f32 d, i32 sum of the row's q)

In every type weight j < 16 of a block takes the low nibble of qs[j], weight j + 16 the
high nibble.  The 5th bits are the 32-bit little-endian word qh: bit j belongs to weight j.

Bit-exactness: every product here is exact in f32 (an f16 scale has 11 significant bits,
the integer factor at most 7), so the only rounding is the final `+ m`.  ik_llama.cpp built
with -march=native fuses q*d + m into one FMA; with an exact product that gives the same bits
as the separate multiply and add of NumPy (and of gguf.quants), so all three agree.

Q8_KV (ik's quantize_row_q8_KV, AVX2 path, which is what its x86 builds run): one scale per
row, d = amax/127 in f32, q = round-half-even(x * (1/d)) with the f32 reciprocal (never
saturates: |x * (1/d)| < 127.5), the i32 sum of the unsaturated q; an all-zero row stores
d = sum = 0.  ik's quantize_q8_KV ignores the imatrix.  Its rows are the `rows` of quantize_row
too (ggml's from_float is called per row).

Q6_0's qh[j % 8] holds the two high bits of values j and j + 16 at bit 4*(j // 8) and
4*(j // 8) + 2.

The family's codecs (quant.registry binds them per type): `dequantize` (NumPy reference),
`quantize_row` (ggml's quantize_row_<type>_ref), `quantize` (ggml_quantize_chunk, with or without
an imatrix), and `decode_row_legacy`, the Numba decoder of Q4_1 / Q5_0 / Q5_1 / IQ4_NL with the
calling convention of quant.kernels.decode_row (without its qk argument; quant.kernels decodes
Q8_0 / Q4_0 / Q6_0 inline).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .numeric import (blocks as _blocks, f16_at, f16_field as _f16, fma32 as _fma32,
                      inv_or_zero as _inv_or_zero, raw_bytes, round_half_away, rows as _rows)
from . import kquants as kq     # the fits (make_qx_quants ...) the legacy imatrix quantizers share
from .types import type_info

Q4_1_ID, Q5_0_ID, Q5_1_ID, IQ4_NL_ID = 3, 6, 7, 20
Q4_0_ID, Q8_0_ID, Q6_0_ID, MXFP4_ID, Q8_KV_ID = 2, 8, 133, 39, 151
TYPES = frozenset({Q4_0_ID, Q4_1_ID, Q5_0_ID, Q5_1_ID, Q8_0_ID, Q6_0_ID, IQ4_NL_ID, MXFP4_ID, Q8_KV_ID})
Q8_KV_META = 8             # f32 d, i32 sum of the row's quants

# the 16 non-linear levels of IQ4_NL (and IQ4_XS), kvalues_iq4nl in ggml-quants.c
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_KV_F32 = KVALUES_IQ4NL.astype(np.float32)
# MXFP4's 16 levels: the e2m1 values times 2 (kvalues_mxfp4)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_KVM_F32 = KVALUES_MXFP4.astype(np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """The f32 2^(e - 128) of E8M0 exponent bytes e (ggml's e8m0_to_fp32_half: e 0 and 1 give
    the subnormals 2^-128 and 2^-127)."""
    e = np.asarray(e).astype(np.uint32)
    bits = np.where(e >= 2, (e - 1) << 23, np.uint32(0x00200000) << e)
    return bits.astype(np.uint32).view(np.float32)


_E8M0_HALF = e8m0_half(np.arange(256))


# ----------------------------------------------------------------------------------------
# NumPy reference
# ----------------------------------------------------------------------------------------
def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) bytes -> (nb, 32) values: low nibbles (weights 0..15), then high (16..31)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) bytes of the little-endian word qh -> (nb, 32) values 0 / 16, bit j for weight j."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")      # bit j of the word at column j
    return bits << 4


def dequantize(raw: np.ndarray, qtype: int, n: int, n_per_row: int | None = None) -> np.ndarray:
    """The first `n` values (a multiple of 32) of the flat bytes `raw` of a legacy type, as f32
    (Q8_KV: rows of n_per_row values, default n, each with its row meta)."""
    ti = type_info(qtype)
    if ti.id not in TYPES:
        raise ValueError(f"{ti.name} is not a legacy type")
    if ti.id == Q8_KV_ID:
        return _dequantize_q8_kv(raw, n, n if n_per_row is None else n_per_row)
    b = raw_bytes(raw, qtype, n).reshape(-1, ti.type_size)
    if ti.id == MXFP4_ID:
        return (_KVM_F32[_nibbles(b[:, 1:])] * e8m0_half(b[:, 0:1])).reshape(-1)
    d = _f16(b[:, 0:2])
    if ti.id == Q8_0_ID:
        y = b[:, 2:].view(np.int8).astype(np.float32) * d
    elif ti.id == Q4_0_ID:
        y = (_nibbles(b[:, 2:]).astype(np.float32) - 8) * d
    elif ti.id == Q6_0_ID:
        qh, qs = b[:, 2:10].astype(np.int32), b[:, 10:].astype(np.int32)
        j = np.arange(16)
        h = qh[:, j % 8] >> (4 * (j // 8))
        lo = ((qs & 15) | ((h << 4) & 0x30)) - 32
        hi = ((qs >> 4) | ((h << 2) & 0x30)) - 32
        y = np.concatenate([lo, hi], axis=1).astype(np.float32) * d
    elif ti.id == Q4_1_ID:
        m = _f16(b[:, 2:4])
        y = _nibbles(b[:, 4:]).astype(np.float32) * d + m
    elif ti.id == Q5_0_ID:
        q = (_nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])).astype(np.float32) - 16
        y = q * d
    elif ti.id == Q5_1_ID:
        m = _f16(b[:, 2:4])
        q = (_nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])).astype(np.float32)
        y = q * d + m
    else:  # IQ4_NL
        y = _KV_F32[_nibbles(b[:, 2:])] * d
    return y.reshape(-1)


def _dequantize_q8_kv(raw: np.ndarray, n: int, n_per_row: int) -> np.ndarray:
    ti = type_info(Q8_KV_ID)
    if n_per_row <= 0 or n % n_per_row:
        raise ValueError(f"Q8_KV: {n} values are not whole rows of {n_per_row}")
    rb = ti.row_bytes(n_per_row)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size < n // n_per_row * rb:
        raise ValueError(f"Q8_KV: {n} values need {n // n_per_row * rb} bytes, got {raw.size}")
    r = raw[:n // n_per_row * rb].reshape(-1, rb)
    d = np.ascontiguousarray(r[:, 0:4]).view(np.float32)
    return (r[:, Q8_KV_META:].view(np.int8).astype(np.float32) * d).reshape(-1)


# ----------------------------------------------------------------------------------------
# Numba decoder
# ----------------------------------------------------------------------------------------
@njit(cache=True, fastmath=True, nogil=True)
def _u32_at(buf, o):
    """The little-endian uint32 stored at byte offset o."""
    return (np.uint32(buf[o]) | (np.uint32(buf[o + 1]) << np.uint32(8))
            | (np.uint32(buf[o + 2]) << np.uint32(16)) | (np.uint32(buf[o + 3]) << np.uint32(24)))


@njit(cache=True, fastmath=True, nogil=True)
def decode_row_legacy(buf, qtype, base, cols, lut, y):
    """Write the `cols` values (a multiple of 32) of the row at byte `base` of `buf` into y[:cols].

    buf: flat read-only uint8 array; lut: quant.kernels.F16_TO_F32 (it must be that 65536-entry
    table).  The half-block length h (16) is read from lut's run-time length, not written as a
    constant: with a constant trip count LLVM unrolls the 16-step loops into scalar code
    instead of vectorizing them (Q4_1: 0.9 vs 1.9 ms for 1024 rows of 4096).  IQ4_NL is the
    exception, see there.  A trailing partial block of cols is not decoded.
    """
    h = lut.shape[0] >> 12        # 65536 >> 12 = 16 weights per half block
    qk = 2 * h
    nb = cols // qk
    if qtype == Q4_1_ID:
        for b in range(nb):
            o = base + b * (h + 4)
            d = f16_at(buf, o, lut)
            m = f16_at(buf, o + 2, lut)
            wv = buf[o + 4:o + 4 + h]
            lo = y[b * qk:b * qk + h]
            hi = y[b * qk + h:b * qk + qk]
            for j in range(h):
                v = np.int32(wv[j])
                lo[j] = np.float32(v & 15) * d + m
                hi[j] = np.float32(v >> 4) * d + m
    elif qtype == Q5_0_ID:
        for b in range(nb):
            o = base + b * (h + 6)
            d = f16_at(buf, o, lut)
            qh = _u32_at(buf, o + 2)
            wv = buf[o + 6:o + 6 + h]
            lo = y[b * qk:b * qk + h]
            hi = y[b * qk + h:b * qk + qk]
            for j in range(h):
                v = np.int32(wv[j])
                h0 = np.int32((qh >> np.uint32(j)) << np.uint32(4)) & 16
                h1 = np.int32(qh >> np.uint32(j + 12)) & 16
                lo[j] = np.float32(((v & 15) | h0) - 16) * d
                hi[j] = np.float32(((v >> 4) | h1) - 16) * d
    elif qtype == Q5_1_ID:
        for b in range(nb):
            o = base + b * (h + 8)
            d = f16_at(buf, o, lut)
            m = f16_at(buf, o + 2, lut)
            qh = _u32_at(buf, o + 4)
            wv = buf[o + 8:o + 8 + h]
            lo = y[b * qk:b * qk + h]
            hi = y[b * qk + h:b * qk + qk]
            for j in range(h):
                v = np.int32(wv[j])
                h0 = np.int32((qh >> np.uint32(j)) << np.uint32(4)) & 16
                h1 = np.int32(qh >> np.uint32(j + 12)) & 16
                lo[j] = np.float32((v & 15) | h0) * d + m
                hi[j] = np.float32((v >> 4) | h1) * d + m
    elif qtype == IQ4_NL_ID:
        # the one exception: the table lookups run faster as unrolled scalar code than as
        # vector gathers (measured on AMD EPYC, AVX-512: 1.3 vs 2.2 ms for 4096 x 1024), so
        # this loop keeps the constant trip count 16
        kv = _KV_F32
        for b in range(nb):
            o = base + b * 18
            d = f16_at(buf, o, lut)
            wv = buf[o + 2:o + 18]
            lo = y[b * 32:b * 32 + 16]
            hi = y[b * 32 + 16:b * 32 + 32]
            for j in range(16):
                v = np.int32(wv[j])
                lo[j] = d * kv[v & 15]
                hi[j] = d * kv[v >> 4]
    elif qtype == Q8_KV_ID:
        d = np.empty(1, np.uint32)       # the row's f32 scale, from its bits
        d[0] = _u32_at(buf, base)
        dv = d.view(np.float32)[0]
        o = base + 8
        for j in range(nb * qk):
            y[j] = dv * np.float32(np.int8(buf[o + j]))
    elif qtype == MXFP4_ID:
        kv = _KVM_F32
        for b in range(nb):
            o = base + b * 17
            d = _E8M0_HALF[buf[o]]
            wv = buf[o + 1:o + 17]
            lo = y[b * 32:b * 32 + 16]
            hi = y[b * 32 + 16:b * 32 + 32]
            for j in range(16):
                v = np.int32(wv[j])
                lo[j] = d * kv[v & 15]
                hi[j] = d * kv[v >> 4]
    else:
        raise ValueError("decode_row_legacy: unsupported type")


# ----------------------------------------------------------------------------------------
# NumPy reference quantizers (no importance matrix): the bytes of ggml's quantize_row_*_ref
# ----------------------------------------------------------------------------------------
# ik_llama.cpp is built with -O3 -march=native in GNU C, so GCC contracts `a*b + c` into one
# fused multiply-add (a single rounding); quant.reference.fma32 (_fma32) reproduces that.


def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """(nb, 32) values 0..31 -> (nb, 4) bytes of the little-endian word with bit j = q[j] >> 4."""
    return np.packbits(((q >> 4) & 1).astype(np.uint8), axis=1, bitorder="little")


def _pack_qx_0(L: np.ndarray, d: np.ndarray, nbits: int) -> np.ndarray:
    """L (nb, 32) unsigned quants and d (nb,) -> Q4_0 / Q5_0 / Q6_0 blocks (nb, type_size)."""
    d16 = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    lo, hi = L[:, :16], L[:, 16:]
    qs = ((lo & 15) | ((hi & 15) << 4)).astype(np.uint8)
    if nbits == 4:
        return np.concatenate([d16, qs], axis=1)
    if nbits == 5:
        return np.concatenate([d16, _pack_fifth_bits(L), qs], axis=1)
    qh = np.zeros((L.shape[0], 8), np.uint8)
    h = (lo >> 4) | ((hi >> 4) << 2)
    for j in range(16):
        qh[:, j % 8] |= (h[:, j] << (4 * (j // 8))).astype(np.uint8)
    return np.concatenate([d16, qh, qs], axis=1)


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows x (nrows, n_per_row) -> the flat bytes of ggml_quantize_chunk for the 32-weight types
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_0 (id 133), IQ4_NL, with the imatrix (n_per_row,) or without
    (Q8_0 ignores it, as ik does; the others without one are their row _ref quantizers).

    With an imatrix every block is fitted by weighted least squares with weights
    qw * sqrt(sigma2 + x^2), sigma2 = mean x^2 of the row: make_qx_quants for the symmetric
    types (Q4_0 nmax 8, Q5_0 16, Q6_0 32), make_qkx3_quants for Q4_1 / Q5_1.  Q6_0 takes that
    path without imatrix too (weights x^2); IQ4_NL always runs quantize_row_iq4_nl_impl."""
    ti = type_info(qtype)
    x = _rows(x)
    if ti.id == Q8_KV_ID:
        return quantize_q8_kv(x)
    if ti.id == IQ4_NL_ID:
        return kq.quantize_iq4(x, imatrix, False)
    if ti.id == MXFP4_ID:
        return quantize_row(x, ti.id)
    if ti.id == Q8_0_ID or (imatrix is None and ti.id != Q6_0_ID):
        return quantize_row(x, ti.id)
    b = _blocks(x)
    if imatrix is None:
        w = (b * b).astype(np.float32)
    else:
        qw = np.broadcast_to(np.asarray(imatrix, np.float32).reshape(1, -1), x.shape)
        w = kq.imatrix_weights(x, qw, 1.0, False, True).reshape(-1, 32)
    if ti.id in (Q4_1_ID, Q5_1_ID):
        nmax = 15 if ti.id == Q4_1_ID else 31
        d, the_min, L = kq.make_qkx3_quants(b, nmax, w, -0.9, 0.05, 36)
        hdr = np.concatenate([d.astype(np.float16).reshape(-1, 1).view(np.uint8),
                              (-the_min).astype(np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)], axis=1)
        parts = [hdr] + ([_pack_fifth_bits(L)] if ti.id == Q5_1_ID else [])
        Lq = L & 15
        parts.append((Lq[:, :16] | (Lq[:, 16:] << 4)).astype(np.uint8))
        return np.concatenate(parts, axis=1).reshape(-1)
    nmax, nbits = {Q4_0_ID: (8, 4), Q5_0_ID: (16, 5), Q6_0_ID: (32, 6)}[ti.id]
    d, L = kq.make_qx_quants(b, nmax, w, kq.QX_FUSE_LEGACY)
    return _pack_qx_0(L, d, nbits).reshape(-1)


def quantize_row(x: np.ndarray, qtype: int) -> np.ndarray:
    """f32 values (any shape, C order, a multiple of 32) -> flat bytes, ggml's quantize_row_<type>_ref
    (what a KV cache's from_float does; for every type but Q6_0 and IQ4_NL the bytes `quantize`
    writes without an imatrix).

    Q8_0: d = amax/127 stored as f16, q = roundf(x / d) (half away from 0), the division done
    as a multiplication by the f32 reciprocal of the *unrounded* d.
    Q4_0: m = the element of largest magnitude (first one on ties), d = m / -8 stored as f16,
    q = min(15, trunc(x / d + 8.5)); value = (q - 8) * d.
    Q6_0: 6-bit q = trunc(x / d + 32.5) capped at 63 with d = m / -32, then d refitted by
    weighted least squares (weights (x/d)^2, sums in element order).

    Q4_1 / Q5_1: d = (max - min) / (2^bits - 1), m = min, q = trunc((x - min) * (1/d) + 0.5)
    (Q4_1 capped at 15); Q5_0: d = (the element of largest magnitude, first on ties) / -16,
    q = min(31, trunc(x * (1/d) + 16.5)).  The `* id + c` is one FMA in ik's build."""
    ti = type_info(qtype)
    if ti.id == Q8_KV_ID:             # a row type: the rows of x's last axis
        x = np.asarray(x, dtype=np.float32)
        return quantize_q8_kv(x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1))
    b = _blocks(x)
    nb = b.shape[0]
    f32 = np.float32
    if ti.id == Q8_0_ID:
        d = np.abs(b).max(axis=1, keepdims=True) / f32(127)
        q = round_half_away(b * _inv_or_zero(d)).astype(np.int8)
        return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1).reshape(-1)
    if ti.id == Q4_0_ID:
        imax = np.abs(b).argmax(axis=1)[:, None]            # first index on ties, like ggml
        d = np.take_along_axis(b, imax, axis=1) / f32(-8)
        q = np.trunc(b * _inv_or_zero(d) + f32(8.5)).astype(np.int32)
        q = np.minimum(q, 15).astype(np.uint8)               # lower end is >= 0 by construction
        return np.concatenate([d.astype(np.float16).view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1).reshape(-1)
    if ti.id == Q6_0_ID:
        return _quantize_q6_0(b)
    if ti.id == MXFP4_ID:
        return _quantize_mxfp4(b).reshape(-1)
    if ti.id == IQ4_NL_ID:                                   # quantize_row_iq4_nl_ref is ntry -1
        raise NotImplementedError("quantize_row: IQ4_NL's row reference (ntry -1) is not implemented")
    if ti.id in (Q4_1_ID, Q5_1_ID):
        nmax = 15 if ti.id == Q4_1_ID else 31
        mn = b.min(axis=1, keepdims=True)
        mx = b.max(axis=1, keepdims=True)
        d = ((mx - mn) / f32(nmax)).astype(f32)
        iv = _inv_or_zero(d)
        q = np.trunc(_fma32(b - mn, iv, f32(0.5))).astype(np.int32)
        q = np.minimum(q, nmax).astype(np.uint8)
        hdr = np.concatenate([d.astype(np.float16).view(np.uint8), mn.astype(np.float16).view(np.uint8)], axis=1)
    elif ti.id == Q5_0_ID:
        imax = np.abs(b).argmax(axis=1)[:, None]             # first on ties, like the strict <
        d = (np.take_along_axis(b, imax, axis=1) / f32(-16)).astype(f32)
        iv = _inv_or_zero(d)
        q = np.minimum(np.trunc(_fma32(b, iv, f32(16.5))).astype(np.int32), 31).astype(np.uint8)
        hdr = d.astype(np.float16).view(np.uint8)
    else:
        raise NotImplementedError(f"legacy quantize: type {ti.name} not supported")
    parts = [hdr]
    if ti.id != Q4_1_ID:
        parts.append(_pack_fifth_bits(q))
    q = q & 15
    parts.append(q[:, :16] | (q[:, 16:] << 4))
    out = np.concatenate(parts, axis=1).astype(np.uint8)
    assert out.shape == (nb, ti.type_size)
    return out.reshape(-1)


def _quantize_q6_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, imax, axis=1)[:, 0] / np.float32(-32)).astype(np.float32)
    inv = _inv_or_zero(d)
    xs = b * inv[:, None]                                     # scaled values, f32
    q = np.minimum(63, np.trunc(xs + np.float32(32.5)).astype(np.int32))
    qf = (q - 32).astype(np.float32)
    w = xs * xs
    sumqx = np.zeros(len(b), dtype=np.float32)
    sumq2 = np.zeros(len(b), dtype=np.float32)
    for j in range(16):                                       # C's summation order
        a, c = j, j + 16
        sumqx = (sumqx + w[:, a] * b[:, a] * qf[:, a] + w[:, c] * b[:, c] * qf[:, c]).astype(np.float32)
        sumq2 = (sumq2 + w[:, a] * qf[:, a] * qf[:, a] + w[:, c] * qf[:, c] * qf[:, c]).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        dd = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, 1), d).astype(np.float32)
    return _pack_qx_0(q, dd, 6).reshape(-1)


def _quantize_mxfp4(b: np.ndarray) -> np.ndarray:
    """MXFP4 blocks (ik ignores an imatrix): e = floor(log2 amax) - 2 + 127, each value to the
    nearest of d * KVALUES_MXFP4 (the first on ties, so 0 is nibble 0)."""
    amax = np.abs(b).max(axis=1)
    with np.errstate(divide="ignore"):
        lg = np.floor(np.log2(np.where(amax > 0, amax, np.float32(1)).astype(np.float32)))
    e = np.where(amax > 0, lg - 2 + 127, 0).astype(np.int64).astype(np.uint8)
    d = e8m0_half(e)
    err = np.abs(b[:, :, None] - (d[:, None, None] * _KVM_F32[None, None, :]).astype(np.float32))
    q = err.argmin(axis=2).astype(np.uint8)
    q[amax == 0] = 0
    return np.concatenate([e[:, None], q[:, :16] | (q[:, 16:] << 4)], axis=1)


def quantize_q8_kv(x: np.ndarray) -> np.ndarray:
    """f32 rows (nrows, n_per_row), n_per_row a multiple of 32 -> flat Q8_KV bytes, those of ik's
    quantize_row_q8_KV per row (see the module docstring).  Vectorized NumPy: every step is one
    f32 operation, as in ik's SIMD code, so the bytes are the same."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nrows, n = x.shape
    if n % 32:
        raise ValueError(f"Q8_KV rows of {n} values are not a multiple of 32")
    amax = np.abs(x).max(axis=1, keepdims=True) if n else np.zeros((nrows, 1), np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        mul = np.where(amax != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(x * mul).astype(np.int32)                 # |q| <= 127: no saturation
    out = np.empty((nrows, Q8_KV_META + n), dtype=np.uint8)
    out[:, 0:4] = d.view(np.uint8)
    out[:, 4:8] = q.sum(axis=1, dtype=np.int32).reshape(-1, 1).view(np.uint8)
    out[:, 8:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(-1)
