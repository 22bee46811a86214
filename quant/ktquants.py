"""ik_llama.cpp's trellis ("KT") weight types IQ1_KT, IQ2_KT, IQ3_KT, IQ4_KT: the NumPy
reference decoder, a Numba row decoder, and the quantizers, byte for byte like ik's
ggml_quantize_chunk (checked on every row of the golden data and on ~1800 more rows per type
and imatrix mode: Gaussian, Student t, Laplace, uniform, scales 1e-4 .. 1e2, zero blocks /
groups, sparse importances).

Every row starts with an f32 row scale d, followed by super-blocks of 256 values.  A
super-block is 8 sub-blocks of 32 values, each with a small integer scale ls, and the
values come in groups of 8 (IQ1_KT .. IQ3_KT) or 4 (IQ4_KT) that are not stored: each group
stores one index i (13, 16 or 15 bits) into a fixed pseudo-random codebook, the trellis.

The trellis (all four types; ik's "integer" generator): x = i + offset (offset 4096, or
4096 + 32768 for IQ4_KT sub-blocks whose offset bit is set); the group's k-th value
(k = 0..g-1) comes from x_k = KA^(k+1) * x mod 2^32 (KA = 0xCBAC1FED): the four bytes of
x_k & 0x3f3f3f3f summed, minus 126, so every level is an integer in [-126, 126] (IQ3_KT
uses its absolute value and stores the signs separately).  A value is

    y = (d * ls) * level          (two f32 roundings, in that order; exact level)

Byte layouts of one super-block (e = value 0..255, B = e // 32 its sub-block, G = e // g its
group, iq4k = IQ4_K's 16 levels):

IQ1_KT  (56 B)  sh[8] | ql[32] | qh[16]
                ls = iq4k[sh[B] & 15]; index of group G (B = G // 4, j = G % 4):
                ql[G] | (qh[4*(B%4) + j] >> 4*(B//4) & 15) << 8 | (sh[B] >> (4+j) & 1) << 12.
IQ2_KT  (68 B)  scales[4] | 32 little-endian u16 indices (group order)
                ls = iq4k[scales[B % 4] >> 4*(B // 4) & 15].
IQ3_KT (100 B)  scales[4] | 32 u16 indices | qh[32]
                ls = scales[B % 4] >> 4*(B // 4) & 15 (0..15); level = |trellis level|,
                negated when bit B of qh[e % 32] is set.
IQ4_KT (128 B)  8 little-endian u32 words s[B] | ql[64] | qh[32]   (groups of 4)
                ls = ((s[B] & 255) >> 1) - 64, offset bit s[B] & 1; group G = 8B + j:
                ql[G] | (qh[G % 32] >> 4*(G // 32) & 15) << 8 | (s[B] >> (8+3j) & 7) << 12.

dequantize / decode_row_kt follow ik's dequantize_row_iq*_kt.  ik's CPU matmul kernels
(iqk_gemm_ktquants.cpp, activations in Q8_2_X4) compute with the same integer levels as int8
but multiply IQ2_KT's row scale by 1.05 and IQ3_KT's by 1.01 first (MATMUL_SCALE; its CUDA
kernels too), so they model slightly larger weights than dequantize_row gives;
decode_row_kt_mm is the decoder with that factor (d' = f32(d * factor)).  IQ1_KT's quantizer
stores 1.07 times its fitted row scale.

The quantizers (ik's quantize_row_iq*_kt_impl) search, per group, the codebook entry nearest
to x / (sub-block scale) in importance-weighted squared distance, but only among the points
of one of ik's clusters: the codebook is split into 256 clusters (groups of 8: by the sign
pattern of the coordinates against per-coordinate midpoints) or 625 (groups of 4: five bins
per coordinate), and each codebook point belongs to the clusters of its 8 / 32 / 8 / 6
nearest centroids (IQ2 / IQ1 / IQ3 / IQ4_KT; padded with the nearest other points to a
multiple of 8).  Codebook rebuilds ik's clusters exactly (same centroids, same fused
distance sums, same members).  The candidate scales per sub-block, the scale fit of each,
the row scale search (over the 16 iq4k levels for IQ1_KT / IQ2_KT, 0..15 for IQ3_KT) and the
final re-match under the stored scales follow ik step by step.

Bit-exactness with the C++ build (-O3 -march=native, GCC 12: see quant.iqk_quantize's
docstring for how fused multiply-adds are made explicit here; read from the disassembly of
ik_build's libggml.so and confirmed by the identical bytes):
* ik's best-point search and scale fit are AVX2 intrinsics: the point score is
  sum_k w_k * ((v_k - x_k/d)^2) (x_k/d = (1/d)*x_k and every product rounded), added as
  ((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7)) (groups of 4: (s0+s2)+(s1+s3)); the winner is the least
  score, ties broken as ik's 8-lane minimum does (lowest lane, then first position; for
  groups of 4 the lanes hold positions 0,2,4,6,1,3,5,7 of each run of 8).  The fit sums
  w*q*x and w*q*q with FMAs (w*q rounded) in 8 lanes (lane k: elements k, k+8, k+16, k+24),
  then adds the lanes as the score does.
* the scalar parts fuse as GCC does: s += a*b*c is fma(a*b, c, s), x - a*b is fma(-a, b, x),
  nearest_int(a*b) is fma(a, b, 1.5*2^23), itry*0.2 + 15 is one fma, the cluster distances
  are fma chains; but IQ3_KT's row-scale search (32 contiguous values: GCC vectorizes the
  products, then adds them in order) is not fused.
* set_weights: sum of x^2 over a super-block not fused; without an imatrix the weight is
  fma(x, x, sigma2/4); with one, qw*sqrt(sigma2 + x^2) has x^2 rounded (also added to the
  sub-block's sum) in IQ1_KT / IQ2_KT / IQ4_KT, but fused in IQ3_KT (inlined elsewhere).

Speed: a search scores all points of its cluster in one loop (the cluster's coordinates
stored coordinate-major and in ik's lane order, so the first least score is ik's pick) and
keeps the least (score bits, position) as one int64 key, which LLVM vectorizes.  Single
thread, 64 x 4096 Gaussian rows, thread CPU time scaled to 4096 x 4096, on a shared 2-core
AVX-512 host (ikcli / ik): IQ1_KT 8.9 / 9.0 s, IQ2_KT 13.3 / 12.7 s, IQ3_KT 30.4 / 31.9 s,
IQ4_KT 39.9 / 36.4 s (with an imatrix about the same).  Each type's first quantize builds
its codebook clusters (0.5 - 1 s).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .f32ops import fma_f32 as _fma, nint_fma as _nint_fma, quantizer_rows
from .iqk import dequant_rows
from .iqk_quantize import _bi
from .types import type_info

IQ2_KT, IQ3_KT, IQ4_KT, IQ1_KT = 153, 154, 155, 158
TYPES = KT_TYPES = frozenset({IQ1_KT, IQ2_KT, IQ3_KT, IQ4_KT})
QK_K = 256

f32 = np.float32
KA = np.uint32(0xCBAC1FED)
IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.int32)
IQ4K_F = IQ4K_VALUES.astype(np.float32)
# ik's CPU (and CUDA) matmul kernels scale the row scale by these before use
MATMUL_SCALE = {IQ1_KT: 1.0, IQ2_KT: 1.05, IQ3_KT: 1.01, IQ4_KT: 1.0}

_opts = dict(cache=True, nogil=True, error_model="numpy")   # IEEE division, no fastmath
_inl = dict(_opts, inline="always")


# ---------------------------------------------------------------------------------------
# the trellis
# ---------------------------------------------------------------------------------------
def trellis_levels(idx: np.ndarray, g: int, offset: int = 4096) -> np.ndarray:
    """Integer levels (..., g) of the codebook entries idx (any int array): before IQ3_KT's
    absolute value."""
    x = np.asarray(idx).astype(np.uint32) + np.uint32(offset)
    out = np.empty(x.shape + (g,), dtype=np.int32)
    m = np.uint32(0x3F3F3F3F)
    for k in range(g):
        x = x * KA                                   # wraps mod 2^32
        s = x & m
        out[..., k] = ((s & 0xFF) + ((s >> 8) & 0xFF) + ((s >> 16) & 0xFF) + (s >> 24)).astype(np.int32) - 126
    return out


# ---------------------------------------------------------------------------------------
# NumPy reference decoder
# ---------------------------------------------------------------------------------------
def _row_d(meta: np.ndarray) -> np.float32:
    return np.ascontiguousarray(meta[:4]).view("<f4")[0].astype(np.float32)


def _ref_iq1_kt(b: np.ndarray, d: np.float32) -> np.ndarray:
    nb = b.shape[0]
    sh, ql, qh = b[:, 0:8].astype(np.int64), b[:, 8:40].astype(np.int64), b[:, 40:56].astype(np.int64)
    G = np.arange(32)
    B, j = G // 4, G % 4
    idx = ql[:, G] | (((qh[:, 4 * (B % 4) + j] >> (4 * (B // 4))) & 15) << 8) | (((sh[:, B] >> (4 + j)) & 1) << 12)
    lv = trellis_levels(idx, 8).astype(np.float32)                      # (nb, 32, 8)
    sl = (d * IQ4K_F[sh & 15]).astype(np.float32)                        # (nb, 8)
    return (sl[:, B][:, :, None] * lv).astype(np.float32).reshape(nb, QK_K)


def _ref_iq2_kt(b: np.ndarray, d: np.float32) -> np.ndarray:
    nb = b.shape[0]
    sc = b[:, 0:4].astype(np.int64)
    idx = np.ascontiguousarray(b[:, 4:68]).view("<u2").astype(np.int64)  # (nb, 32)
    Bs = np.arange(8)
    sl = (d * IQ4K_F[(sc[:, Bs % 4] >> (4 * (Bs // 4))) & 15]).astype(np.float32)
    lv = trellis_levels(idx, 8).astype(np.float32)
    return (sl[:, np.arange(32) // 4][:, :, None] * lv).astype(np.float32).reshape(nb, QK_K)


def _ref_iq3_kt(b: np.ndarray, d: np.float32) -> np.ndarray:
    nb = b.shape[0]
    sc = b[:, 0:4].astype(np.int64)
    idx = np.ascontiguousarray(b[:, 4:68]).view("<u2").astype(np.int64)
    qh = b[:, 68:100].astype(np.int64)
    Bs = np.arange(8)
    sl = (d * ((sc[:, Bs % 4] >> (4 * (Bs // 4))) & 15).astype(np.float32)).astype(np.float32)
    lv = np.abs(trellis_levels(idx, 8)).astype(np.float32)
    y = (sl[:, np.arange(32) // 4][:, :, None] * lv).astype(np.float32).reshape(nb, QK_K)
    e = np.arange(QK_K)
    neg = ((qh[:, e % 32] >> (e // 32)) & 1).astype(bool)
    return np.where(neg, -y, y)


def _ref_iq4_kt(b: np.ndarray, d: np.float32) -> np.ndarray:
    nb = b.shape[0]
    s = np.ascontiguousarray(b[:, 0:32]).view("<u4").astype(np.int64)    # (nb, 8)
    ql, qh = b[:, 32:96].astype(np.int64), b[:, 96:128].astype(np.int64)
    G = np.arange(64)
    B, j = G // 8, G % 8
    idx = ql[:, G] | (((qh[:, G % 32] >> (4 * (G // 32))) & 15) << 8) | (((s[:, B] >> (8 + 3 * j)) & 7) << 12)
    idx = idx + 32768 * (s[:, B] & 1)
    lv = trellis_levels(idx, 4).astype(np.float32)                      # (nb, 64, 4)
    sl = (d * (((s & 255) >> 1) - 64).astype(np.float32)).astype(np.float32)
    return (sl[:, B][:, :, None] * lv).astype(np.float32).reshape(nb, QK_K)


_REF = {IQ1_KT: _ref_iq1_kt, IQ2_KT: _ref_iq2_kt, IQ3_KT: _ref_iq3_kt, IQ4_KT: _ref_iq4_kt}


def dequantize(raw: np.ndarray, qtype: int, n: int, n_per_row: int | None = None,
               matmul_scale: bool = False) -> np.ndarray:
    """Flat f32 values of the first n weights stored in `raw`, the bytes of whole rows of
    n_per_row weights each (default: one row of n), as ik's dequantize_row_iq*_kt.
    matmul_scale: multiply the row scale by MATMUL_SCALE first (what ik's matmuls use)."""
    ti = type_info(qtype)
    if ti.id not in _REF:
        raise ValueError(f"quant.ktquants.dequantize: {ti.name} is not a trellis type")
    raw, n_per_row, rb, nrows = dequant_rows(raw, ti, n, n_per_row)
    out = np.empty((nrows, n_per_row), dtype=np.float32)
    for r in range(nrows):
        row = raw[r * rb:(r + 1) * rb]
        d = _row_d(row)
        if matmul_scale:
            d = np.float32(d * np.float32(MATMUL_SCALE[ti.id]))
        out[r] = _REF[ti.id](row[4:].reshape(-1, ti.type_size), d).reshape(-1)
    return out.reshape(-1)[:n]


# ---------------------------------------------------------------------------------------
# Numba decoder (calling convention of quant.iqk.decode_row_iqk)
# ---------------------------------------------------------------------------------------
_KAU = np.uint64(0xCBAC1FED)
_M32 = np.uint64(0xFFFFFFFF)
_M3F = np.uint64(0x3F3F3F3F)


@njit(**_inl)
def _next(x):
    """KA * x mod 2^32 (x: uint64 holding a u32; Numba widens integer products to 64 bits)."""
    return (x * _KAU) & _M32


@njit(**_inl)
def _level(x):
    """Byte sum of x & 0x3f3f3f3f, minus 126 (x: uint64 holding a u32)."""
    s = x & _M3F
    s = (s & np.uint64(0x00FF00FF)) + ((s >> np.uint64(8)) & np.uint64(0x00FF00FF))
    return np.int32((s & np.uint64(0xFFFF)) + (s >> np.uint64(16))) - np.int32(126)


@njit(**_inl)
def _put_group(y, o, idx, g, sl):
    """y[o:o+g] = sl * level of trellis entry idx (offset included in idx)."""
    x = np.uint64(idx)
    for k in range(g):
        x = _next(x)
        y[o + k] = sl * f32(_level(x))


@njit(**_inl)
def _f32_at(buf, o):
    u = np.uint32(np.uint32(buf[o]) | (np.uint32(buf[o + 1]) << np.uint32(8)) |
                  (np.uint32(buf[o + 2]) << np.uint32(16)) | (np.uint32(buf[o + 3]) << np.uint32(24)))
    return u.view(np.float32)


@njit(**_inl)
def _u32_at(buf, o):
    return (np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8) |
            (np.int64(buf[o + 2]) << 16) | (np.int64(buf[o + 3]) << 24))


@njit(**_opts)
def _decode_kt(buf, qtype, base, cols, y, dfac):
    d = _f32_at(buf, base)
    if dfac != f32(1.0):
        d = d * dfac
    nb = cols // 256
    if qtype == IQ2_KT or qtype == IQ3_KT:
        bs = 68 if qtype == IQ2_KT else 100
        for b in range(nb):
            o = base + 4 + b * bs
            for B in range(8):
                ls = (np.int32(buf[o + B % 4]) >> (4 * (B // 4))) & 15
                if qtype == IQ2_KT:
                    sl = d * f32(IQ4K_VALUES[ls])
                else:
                    sl = d * f32(ls)
                for j in range(4):
                    G = 4 * B + j
                    idx = np.int64(buf[o + 4 + 2 * G]) | (np.int64(buf[o + 5 + 2 * G]) << 8)
                    if qtype == IQ2_KT:
                        _put_group(y, 256 * b + 8 * G, idx + 4096, 8, sl)
                    else:
                        x = np.uint64(idx + 4096)
                        for k in range(8):
                            x = _next(x)
                            v = abs(_level(x))
                            yv = sl * f32(v)
                            if (buf[o + 68 + 8 * j + k] >> B) & 1:
                                yv = -yv
                            y[256 * b + 8 * G + k] = yv
    elif qtype == IQ1_KT:
        for b in range(nb):
            o = base + 4 + b * 56
            for B in range(8):
                sh = np.int64(buf[o + B])
                sl = d * f32(IQ4K_VALUES[sh & 15])
                for j in range(4):
                    G = 4 * B + j
                    hi = (np.int64(buf[o + 40 + 4 * (B % 4) + j]) >> (4 * (B // 4))) & 15
                    idx = np.int64(buf[o + 8 + G]) | (hi << 8) | (((sh >> (4 + j)) & 1) << 12)
                    _put_group(y, 256 * b + 8 * G, idx + 4096, 8, sl)
    elif qtype == IQ4_KT:
        for b in range(nb):
            o = base + 4 + b * 128
            for B in range(8):
                s = _u32_at(buf, o + 4 * B)
                sl = d * f32(((s & 255) >> 1) - 64)
                off = 4096 + 32768 * (s & 1)
                for j in range(8):
                    G = 8 * B + j
                    hi = (np.int64(buf[o + 96 + G % 32]) >> (4 * (G // 32))) & 15
                    idx = np.int64(buf[o + 32 + G]) | (hi << 8) | (((s >> (8 + 3 * j)) & 7) << 12)
                    _put_group(y, 256 * b + 4 * G, idx + off, 4, sl)
    else:
        raise ValueError("decode_row_kt: not a trellis type")


@njit(**_opts)
def decode_row_kt(buf, qtype, base, cols, lut, y):
    """Write the `cols` values of the trellis-type row that starts (with its f32 row scale)
    at byte `base` of buf into y[:cols], as ik's dequantize_row_iq*_kt.  lut: unused (the
    f16 table of the other decoders' calling convention)."""
    _decode_kt(buf, qtype, base, cols, y, f32(1.0))


@njit(**_opts)
def decode_row_kt_mm(buf, qtype, base, cols, lut, y):
    """decode_row_kt with the row scale first multiplied by MATMUL_SCALE (1.05 for IQ2_KT,
    1.01 for IQ3_KT), i.e. the weights ik's matmul kernels compute with."""
    fac = f32(1.0)
    if qtype == IQ2_KT:
        fac = f32(1.05)
    elif qtype == IQ3_KT:
        fac = f32(1.01)
    _decode_kt(buf, qtype, base, cols, y, fac)


@njit(**_opts)
def is_kt(qtype):
    """True for the type ids decode_row_kt handles (usable inside other njit code)."""
    return qtype == IQ1_KT or qtype == IQ2_KT or qtype == IQ3_KT or qtype == IQ4_KT


# ---------------------------------------------------------------------------------------
# ik's codebooks and clusters
# ---------------------------------------------------------------------------------------
# per type: (values per group, index bits, absolute levels, clusters, neighbours per point)
_CB_PARAMS = {IQ1_KT: (8, 13, False, 256, 32), IQ2_KT: (8, 16, False, 256, 8),
              IQ3_KT: (8, 16, True, 256, 8), IQ4_KT: (4, 15, False, 625, 6)}


def _bin5(v: np.ndarray) -> np.ndarray:
    """ik's five bins of a group-of-4 coordinate (plain levels)."""
    return np.where(v < -48, 0, np.where(v < -16, 1, np.where(v < 16, 2, np.where(v < 48, 3, 4))))


@njit(**_opts)
def _nearest_clusters(vals, cents, nn):
    """For every point: its nn nearest centroids (squared distance as an fma chain over the
    coordinates; a tie keeps the earlier centroid), nearest first."""
    npt, g = vals.shape
    ncl = cents.shape[0]
    which = np.empty((npt, nn), dtype=np.int32)
    best = np.empty(nn, dtype=np.float32)
    ibest = np.empty(nn, dtype=np.int32)
    for ip in range(npt):
        for j in range(nn):
            best[j] = np.inf
            ibest[j] = -1
        for ic in range(ncl):
            d2 = f32(0.0)
            for k in range(g):
                t = vals[ip, k] - cents[ic, k]
                d2 = _fma(t, t, d2)
            if d2 < best[nn - 1]:
                j = nn - 1
                while j > 0 and d2 < best[j - 1]:
                    best[j] = best[j - 1]
                    ibest[j] = ibest[j - 1]
                    j -= 1
                best[j] = d2
                ibest[j] = ic
        which[ip] = ibest
    return which


@njit(**_opts)
def _pad_cluster(vals, cent, which, c, nadd):
    """The nadd points nearest to centroid `cent` among those not in cluster c, ordered by
    (distance, index) as ik's sort of (dist2, point) pairs."""
    npt, g = vals.shape
    nn = which.shape[1]
    d2s = np.empty(npt, dtype=np.float32)
    for ip in range(npt):
        d2 = f32(0.0)
        for k in range(g):
            t = vals[ip, k] - cent[k]
            d2 = _fma(t, t, d2)
        d2s[ip] = d2
        for j in range(nn):
            if which[ip, j] == c:
                d2s[ip] = np.inf      # excluded (a member: never among the first nadd)
                break
    res = np.empty(nadd, dtype=np.int32)
    for a in range(nadd):
        bi = -1
        bd = np.inf
        for ip in range(npt):
            if d2s[ip] < bd:
                bd = d2s[ip]
                bi = ip
        res[a] = bi
        d2s[bi] = np.inf
    return res


class Codebook:
    """One of ik's trellis quantizer objects (QuantizerIQKT): the codebook values (npts, g)
    f32, the cluster split (mid: the per-coordinate midpoints of groups of 8), and per cluster
    its member points (cmem[coff[c]:coff[c+1]], in ik's lane order: every 8th member of ik's
    list first, see below) with their values stored coordinate-major (cval[g*coff[c]:], g rows
    of n).  Cluster ncl is all points: ik's fallback for an empty cluster of groups of 8 (for
    groups of 4 ik asserts); none of the built clusters is empty."""

    def __init__(self, qtype: int, offset: int = 4096) -> None:
        g, nbits, absval, ncl, nn = _CB_PARAMS[qtype]
        self.g, self.ncl = g, ncl
        lv = trellis_levels(np.arange(1 << nbits), g, offset)
        if absval:
            lv = np.abs(lv)
        vals = lv.astype(np.float32)
        npt = vals.shape[0]
        self.vals = vals
        # ik's cluster_points: coordinates are integers, so the centroid sums are exact
        if g == 8:
            if absval:
                P = np.sort(lv, axis=0)
                mid = (np.float32(0.5) * (P[npt // 2] + P[npt // 2 - 1]).astype(np.float32)).astype(np.float32)
            else:
                mid = (np.float32(0.5) * (vals.min(0) + vals.max(0))).astype(np.float32)
            u = ((vals > mid).astype(np.int64) << np.arange(8)).sum(1)
        else:
            mid = np.zeros(8, dtype=np.float32)
            u = (_bin5(lv) * 5 ** np.arange(4)).sum(1)
        counts = np.bincount(u, minlength=ncl)
        sums = np.zeros((ncl, g), dtype=np.float64)
        np.add.at(sums, u, lv.astype(np.float64))
        with np.errstate(invalid="ignore", divide="ignore"):
            cents = np.where(counts[:, None] > 0, sums.astype(np.float32) / counts[:, None].astype(np.float32), 0)
        cents = cents.astype(np.float32)
        self.mid = mid
        # ik's finalize_clusters
        which = _nearest_clusters(vals, cents, nn)
        members = [[] for _ in range(ncl)]
        order = np.argsort(which.reshape(-1), kind="stable")
        ips = order // nn
        cl = which.reshape(-1)[order]
        bounds = np.searchsorted(cl, np.arange(ncl + 1))
        for c in range(ncl):
            m = np.sort(ips[bounds[c]:bounds[c + 1]])
            if m.size % 8:
                m = np.concatenate([m, _pad_cluster(vals, cents[c], which, c, 8 - m.size % 8)])
            members[c] = m.astype(np.int32)
        members.append(np.arange(npt, dtype=np.int32))
        # ik scans a cluster 8 points at a time, one per vector lane (groups of 4: the lanes
        # hold positions 0,2,4,6,1,3,5,7 of the run), keeps each lane's first least score and
        # then takes the lowest lane among equal ones: stored lane by lane, the first least
        # stored point is ik's pick
        lane_pos = np.arange(8) if g == 8 else np.array([0, 2, 4, 6, 1, 3, 5, 7])
        members = [m.reshape(-1, 8)[:, lane_pos].T.reshape(-1) for m in members]
        sizes = np.array([m.size for m in members], dtype=np.int64)
        self.coff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.cmem = np.concatenate(members).astype(np.int32)
        self.cval = np.concatenate([vals[m].T.reshape(-1) for m in members]).astype(np.float32)

    def arrays(self):
        return self.vals, self.mid, self.coff, self.cmem, self.cval


_CODEBOOKS: dict = {}


def codebook(qtype: int, offset: int = 4096) -> Codebook:
    """ik's quantizer codebook of a trellis type (built once, on first use: about a second)."""
    key = (qtype, offset)
    if key not in _CODEBOOKS:
        _CODEBOOKS[key] = Codebook(qtype, offset)
    return _CODEBOOKS[key]


# ---------------------------------------------------------------------------------------
# ik's find_best_match / find_best_scale
# ---------------------------------------------------------------------------------------
@njit(**_inl)
def _key(score, i):
    """Order key of (score, position): score's f32 order (-0 just below +0) in the high 32 bits."""
    b = np.int64(np.float32(score).view(np.int32))
    if b < 0:
        b = b ^ np.int64(0x7FFFFFFF)
    return (b << 32) | np.int64(i)


@njit(**_opts)
def _scan8(cval, s, n, vx, vw):
    """Stored position (0..n-1) of the best point of a cluster of groups of 8: least
    sum_k w_k (v_k - x_k)^2 added as ((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7)), ties to the lowest
    stored position (the storage is in ik's lane order, see Codebook)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = vx[0], vx[1], vx[2], vx[3], vx[4], vx[5], vx[6], vx[7]
    w0, w1, w2, w3, w4, w5, w6, w7 = vw[0], vw[1], vw[2], vw[3], vw[4], vw[5], vw[6], vw[7]
    c0 = cval[8 * s:8 * s + n]
    c1 = cval[8 * s + n:8 * s + 2 * n]
    c2 = cval[8 * s + 2 * n:8 * s + 3 * n]
    c3 = cval[8 * s + 3 * n:8 * s + 4 * n]
    c4 = cval[8 * s + 4 * n:8 * s + 5 * n]
    c5 = cval[8 * s + 5 * n:8 * s + 6 * n]
    c6 = cval[8 * s + 6 * n:8 * s + 7 * n]
    c7 = cval[8 * s + 7 * n:8 * s + 8 * n]
    best = np.int64(0x7FFFFFFFFFFFFFFF)
    for i in range(n):
        d0 = c0[i] - x0
        d1 = c1[i] - x1
        d2 = c2[i] - x2
        d3 = c3[i] - x3
        d4 = c4[i] - x4
        d5 = c5[i] - x5
        d6 = c6[i] - x6
        d7 = c7[i] - x7
        sc = (((w0 * (d0 * d0) + w4 * (d4 * d4)) + (w2 * (d2 * d2) + w6 * (d6 * d6)))
              + ((w1 * (d1 * d1) + w5 * (d5 * d5)) + (w3 * (d3 * d3) + w7 * (d7 * d7))))
        best = min(best, _key(sc, i))
    return np.int64(best & 0xFFFFFFFF)


@njit(**_opts)
def _scan4(cval, s, n, vx, vw):
    """_scan8 for groups of 4: score (s0+s2)+(s1+s3)."""
    x0, x1, x2, x3 = vx[0], vx[1], vx[2], vx[3]
    w0, w1, w2, w3 = vw[0], vw[1], vw[2], vw[3]
    c0 = cval[4 * s:4 * s + n]
    c1 = cval[4 * s + n:4 * s + 2 * n]
    c2 = cval[4 * s + 2 * n:4 * s + 3 * n]
    c3 = cval[4 * s + 3 * n:4 * s + 4 * n]
    best = np.int64(0x7FFFFFFFFFFFFFFF)
    for i in range(n):
        d0 = c0[i] - x0
        d1 = c1[i] - x1
        d2 = c2[i] - x2
        d3 = c3[i] - x3
        sc = (w0 * (d0 * d0) + w2 * (d2 * d2)) + (w1 * (d1 * d1) + w3 * (d3 * d3))
        best = min(best, _key(sc, i))
    return np.int64(best & 0xFFFFFFFF)


@njit(**_opts)
def _match(g, mid, coff, cmem, cval, d, xb, w, out, o):
    """ik's find_best_match: out[o + l] = codebook index of group l (32 // g groups) of xb
    for the scale d (0 for all when d == 0)."""
    ng = 32 // g
    if d == 0:
        for l in range(ng):
            out[o + l] = 0
        return
    idv = f32(1.0) / d
    ncl = coff.shape[0] - 2
    vx = np.empty(8, dtype=np.float32)
    for l in range(ng):
        for k in range(g):
            vx[k] = idv * xb[g * l + k]
        if g == 8:
            u = 0
            for k in range(8):
                if vx[k] > mid[k]:
                    u |= 1 << k
        else:
            u = 0
            m = 1
            for k in range(4):
                v = vx[k]
                b = 0 if v < -48 else 1 if v < -16 else 2 if v < 16 else 3 if v < 48 else 4
                u += b * m
                m *= 5
        s = coff[u]
        n = coff[u + 1] - s
        if n == 0:                    # ik: all points (groups of 8); an assert (groups of 4)
            s = coff[ncl]
            n = coff[ncl + 1] - s
        if g == 8:
            i = _scan8(cval, s, n, vx, w[g * l:g * l + g])
        else:
            i = _scan4(cval, s, n, vx, w[g * l:g * l + g])
        out[o + l] = cmem[s + i]


@njit(**_inl)
def _hsum8(a):
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


@njit(**_opts)
def _fit(g, vals, xb, w, idx, o):
    """ik's find_best_scale for the groups idx[o:]: (sumqx/sumq2, sumqx^2/sumq2), or (0, 0);
    sums in 8 lanes (lane k: elements k, k+8, k+16, k+24; w*q rounded, then fused)."""
    a = np.zeros(8, dtype=np.float32)
    b = np.zeros(8, dtype=np.float32)
    for e in range(32):
        q = vals[idx[o + e // g], e % g]
        t = q * w[e]
        a[e % 8] = _fma(t, xb[e], a[e % 8])
        b[e % 8] = _fma(t, q, b[e % 8])
    sumqx = _hsum8(a)
    sumq2 = _hsum8(b)
    if sumq2 > 0:
        return sumqx / sumq2, sumqx * sumqx / sumq2
    return f32(0.0), f32(0.0)


@njit(**_inl)
def _sums(vals, bidx, g, fl, xb, wb, sumqx, sumq2):
    """sumqx, sumq2 plus the sums of w*x*q and w*q*q over the 32 // g groups bidx[0:] of a
    sub-block (q = codebook value * fl; w*x, w*q rounded, then fused), in value order."""
    for j in range(32 // g):
        pi = bidx[j]
        for k in range(g):
            e = g * j + k
            q = vals[pi, k] * fl
            sumqx = _fma(wb[e] * xb[e], q, sumqx)
            sumq2 = _fma(wb[e] * q, q, sumq2)
    return sumqx, sumq2


@njit(**_opts)
def _try_scales(cb, amax, scale_0, xb, wb, bidx, best, scale):
    """IQ4_KT's candidate scales on codebook cb: d = amax / (scale_0 + 8 itry), itry -2..2,
    then -d, each matched and fitted; returns (best score, its scale, True if one beat
    `best`; else best, scale, False)."""
    vals, mid, coff, cmem, cval = cb
    found = False
    for itry in range(-2, 3):
        den = _fma(f32(8.0), f32(itry), scale_0)
        for a in (amax, -amax):
            _match(4, mid, coff, cmem, cval, a / den, xb, wb, bidx, 0)
            dd, sc = _fit(4, vals, xb, wb, bidx, 0)
            if sc > best:
                best = sc
                scale = dd
                found = True
    return best, scale, found


# ---------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------
@njit(**_opts)
def _set_weights(x, imat, has_imat, fused, w):
    """ik's QuantizerIQKT::set_weights (sigma2 scale 2): per super-block, with an imatrix
    qw * sqrt(sigma2 + x^2) (1e-4 for a sub-block whose weights are ~0), else sigma2/4 + x^2;
    1e-4 everywhere for an all-~0 super-block.  GCC fuses x^2 into sigma2 + x^2 (and into the
    sub-block's sum of x^2) where it inlined set_weights into quantize_row_iq3_kt_impl
    (fused=True), not in the IQ1_KT / IQ2_KT / IQ4_KT quantizers (x^2 rounded once, then
    used by both sums)."""
    for ibl in range(x.shape[0] // QK_K):
        o = QK_K * ibl
        sumx2 = f32(0.0)
        for j in range(QK_K):
            sumx2 += x[o + j] * x[o + j]
        if sumx2 < f32(1e-14) * f32(256.0):
            for j in range(QK_K):
                w[o + j] = f32(1e-4)
            continue
        sigma2 = f32(2.0) * sumx2 / f32(256.0)
        if has_imat:
            for ib in range(8):
                ob = o + 32 * ib
                swx = f32(0.0)
                sw2 = f32(0.0)
                sx2 = f32(0.0)
                for j in range(32):
                    xj = x[ob + j]
                    if fused:
                        wj = imat[ob + j] * f32(np.sqrt(_fma(xj, xj, sigma2)))
                        sx2 = _fma(xj, xj, sx2)
                    else:
                        x2 = xj * xj
                        wj = imat[ob + j] * f32(np.sqrt(sigma2 + x2))
                        sx2 += x2
                    w[ob + j] = wj
                    swx = _fma(wj, abs(xj), swx)
                    sw2 = _fma(wj, wj, sw2)
                if sx2 < f32(1e-14) or sw2 < f32(1e-14) or swx < f32(1e-14):
                    for j in range(32):
                        w[ob + j] = f32(1e-4)
        else:
            s4 = f32(0.25) * sigma2
            for j in range(QK_K):
                w[o + j] = _fma(x[o + j], x[o + j], s4)


@njit(**_inl)
def _amax(x, o, n):
    m = f32(0.0)
    for j in range(n):
        m = max(m, abs(x[o + j]))
    return m


@njit(**_opts)
def _row_iq12(is1, x, w, cb, out, scales, aidx, bidx):
    """quantize_row_iq1_kt_impl / quantize_row_iq2_kt_impl for one row (out: its bytes)."""
    vals, mid, coff, cmem, cval = cb
    n = x.shape[0]
    nb = n // QK_K
    bs = 56 if is1 else 68
    out[:] = 0
    amax_row = _amax(x, 0, n)
    amax_scale = f32(0.0)
    max_scale = f32(0.0)
    for ibl in range(nb):
        for ib in range(8):
            o = QK_K * ibl + 32 * ib
            xb = x[o:o + 32]
            wb = w[o:o + 32]
            gi = o // 8
            amax = _amax(x, o, 32)
            if amax < f32(1e-16):
                scales[8 * ibl + ib] = f32(0.0)
                for ig in range(4):
                    aidx[gi + ig] = 0
                continue
            scale_0 = max(f32(90.0), f32(124.0) * amax / amax_row)
            _match(8, mid, coff, cmem, cval, amax / scale_0, xb, wb, bidx, 0)
            dp, score_p = _fit(8, vals, xb, wb, bidx, 0)
            _match(8, mid, coff, cmem, cval, -amax / scale_0, xb, wb, bidx, 4)
            dm, score_m = _fit(8, vals, xb, wb, bidx, 4)
            if score_p > score_m:
                scales[8 * ibl + ib] = dp
                so = 0
            else:
                scales[8 * ibl + ib] = dm
                so = 4
                score_p = score_m
            for ig in range(4):
                aidx[gi + ig] = bidx[so + ig]
            if is1:
                scale_0 -= f32(8.0)
                _match(8, mid, coff, cmem, cval, amax / scale_0, xb, wb, bidx, 0)
                dp1, score_p1 = _fit(8, vals, xb, wb, bidx, 0)
                _match(8, mid, coff, cmem, cval, -amax / scale_0, xb, wb, bidx, 4)
                dm1, score_m1 = _fit(8, vals, xb, wb, bidx, 4)
                if score_p1 > score_p or score_m1 > score_p:
                    if score_p1 > score_m1:
                        scales[8 * ibl + ib] = dp1
                        so = 0
                    else:
                        scales[8 * ibl + ib] = dm1
                        so = 4
                    for ig in range(4):
                        aidx[gi + ig] = bidx[so + ig]
            a = abs(scales[8 * ibl + ib])
            if a > amax_scale:
                amax_scale = a
                max_scale = scales[8 * ibl + ib]
    if max_scale == 0:
        return                                   # d = 0, all blocks zero
    # the row scale: 19 trial inverse scales over the iq4k levels of the sub-block scales
    d = max_scale / f32(-127.0)
    best = f32(0.0)
    for itry in range(-9, 10):
        idv = f32(itry - 127) / max_scale
        sumqx = f32(0.0)
        sumq2 = f32(0.0)
        for ibl in range(nb):
            for ib in range(8):
                dl = IQ4K_F[_bi(4, 0, idv * scales[8 * ibl + ib])]
                o = QK_K * ibl + 32 * ib
                for ig in range(4):
                    pi = aidx[o // 8 + ig]
                    for j in range(8):
                        q = dl * vals[pi, j]
                        sumqx = _fma(w[o + 8 * ig + j] * x[o + 8 * ig + j], q, sumqx)
                        sumq2 = _fma(w[o + 8 * ig + j] * q, q, sumq2)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    idv = f32(1.0) / d if d != 0 else f32(0.0)
    for ibl in range(nb):
        ob = 4 + bs * ibl
        for ib in range(8):
            ls = _bi(4, 0, idv * scales[8 * ibl + ib])
            if is1:
                out[ob + ib] = ls
            else:
                out[ob + ib % 4] |= np.uint8(ls << (4 * (ib // 4)))
    _put_f32(out, 0, d)
    if d == 0:
        return
    # final: re-match every sub-block under its stored scale, keep the better of old / new
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ibl in range(nb):
        ob = 4 + bs * ibl
        for ib in range(8):
            o = QK_K * ibl + 32 * ib
            xb = x[o:o + 32]
            wb = w[o:o + 32]
            if is1:
                ls = IQ4K_VALUES[out[ob + ib] & 15]
            else:
                ls = IQ4K_VALUES[(out[ob + ib % 4] >> (4 * (ib // 4))) & 15]
            dl = d * f32(ls)
            _match(8, mid, coff, cmem, cval, dl, xb, wb, bidx, 0)
            gi = o // 8
            mse1 = f32(0.0)
            mse2 = f32(0.0)
            for ig in range(4):
                p1 = aidx[gi + ig]
                p2 = bidx[ig]
                for j in range(8):
                    e = 8 * ig + j
                    diff1 = _fma(-dl, vals[p1, j], xb[e])
                    diff2 = _fma(-dl, vals[p2, j], xb[e])
                    mse1 = _fma(wb[e] * diff1, diff1, mse1)
                    mse2 = _fma(wb[e] * diff2, diff2, mse2)
            if mse1 < mse2:
                for ig in range(4):
                    bidx[ig] = aidx[gi + ig]
            else:
                for ig in range(4):
                    aidx[gi + ig] = bidx[ig]
            for j in range(4):
                pi = bidx[j]
                if is1:
                    out[ob + 8 + 4 * ib + j] = pi & 255
                    out[ob + 40 + 4 * (ib % 4) + j] |= np.uint8(((pi >> 8) & 15) << (4 * (ib // 4)))
                    out[ob + ib] |= np.uint8((pi >> 12) << (4 + j))
                else:
                    out[ob + 4 + 8 * ib + 2 * j] = pi & 255
                    out[ob + 5 + 8 * ib + 2 * j] = (pi >> 8) & 255
            sumqx, sumq2 = _sums(vals, bidx, 8, f32(ls), xb, wb, sumqx, sumq2)
    if sumq2 > 0:
        d = sumqx / sumq2
        _put_f32(out, 0, d * f32(1.07) if is1 else d)


@njit(**_opts)
def _put_f32(out, o, v):
    u = np.float32(v).view(np.uint32)
    for k in range(4):
        out[o + k] = np.uint8((u >> np.uint32(8 * k)) & np.uint32(255))


@njit(**_opts)
def _row_iq3(x, w, imat, has_imat, cb, out, scales, qtmp, bidx, xaux):
    """quantize_row_iq3_kt_impl for one row."""
    vals, mid, coff, cmem, cval = cb
    n = x.shape[0]
    nb = n // QK_K
    out[:] = 0
    amax_row = _amax(x, 0, n)
    if amax_row == 0:
        return
    _set_weights(x, imat, has_imat, True, w)
    amax_scale = f32(0.0)
    max_scale = f32(0.0)
    for ibl in range(nb):
        for ib in range(8):
            o = QK_K * ibl + 32 * ib
            wb = w[o:o + 32]
            amax = f32(0.0)
            for j in range(32):
                xaux[j] = abs(x[o + j])
                amax = max(amax, xaux[j])
            if amax < f32(1e-16):
                scales[8 * ibl + ib] = f32(0.0)
                continue
            scale_0 = max(f32(84.0), f32(123.0) * amax / amax_row)
            best = f32(0.0)
            found = False
            for itry in range(-3, 4):
                _match(8, mid, coff, cmem, cval, amax / (scale_0 + f32(8.0) * f32(itry)), xaux, wb, bidx, 0)
                dd, score = _fit(8, vals, xaux, wb, bidx, 0)
                if score > best:
                    best = score
                    found = True
                    scales[8 * ibl + ib] = dd
                    for ig in range(4):
                        bidx[4 + ig] = bidx[ig]
            if not found:
                raise ValueError("IQ3_KT: no solution for a block (ik asserts)")
            for ig in range(4):
                for j in range(8):
                    qtmp[o + 8 * ig + j] = vals[bidx[4 + ig], j]
            a = abs(scales[8 * ibl + ib])
            if a > amax_scale:
                amax_scale = a
                max_scale = scales[8 * ibl + ib]
    d = max_scale / f32(15.0)
    best = f32(0.0)
    for itry in range(-9, 10):
        idv = _fma(f32(itry), f32(0.2), f32(15.0)) / max_scale
        sumqx = f32(0.0)
        sumq2 = f32(0.0)
        for ibl in range(nb):
            for ib in range(8):
                ls = _nint_fma(idv, scales[8 * ibl + ib])
                ls = max(0, min(15, ls))
                dl = f32(ls)
                o = QK_K * ibl + 32 * ib
                for j in range(32):            # GCC vectorizes the products: not fused
                    q = dl * qtmp[o + j]
                    sumqx += (w[o + j] * abs(x[o + j])) * q
                    sumq2 += (w[o + j] * q) * q
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    idv = f32(1.0) / d if d != 0 else f32(0.0)
    for ibl in range(nb):
        ob = 4 + 100 * ibl
        for ib in range(8):
            ls = max(0, min(15, _nint_fma(idv, scales[8 * ibl + ib])))
            out[ob + ib % 4] |= np.uint8(ls << (4 * (ib // 4)))
    _put_f32(out, 0, d)
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ibl in range(nb):
        ob = 4 + 100 * ibl
        for ib in range(8):
            o = QK_K * ibl + 32 * ib
            wb = w[o:o + 32]
            for j in range(32):
                xaux[j] = abs(x[o + j])
                if x[o + j] < 0:
                    out[ob + 68 + j] |= np.uint8(1 << ib)
            ls = (np.int32(out[ob + ib % 4]) >> (4 * (ib // 4))) & 15
            dl = d * f32(ls)
            _match(8, mid, coff, cmem, cval, dl, xaux, wb, bidx, 0)
            for j in range(4):
                pi = bidx[j]
                out[ob + 4 + 8 * ib + 2 * j] = pi & 255
                out[ob + 5 + 8 * ib + 2 * j] = (pi >> 8) & 255
            sumqx, sumq2 = _sums(vals, bidx, 8, f32(ls), xaux, wb, sumqx, sumq2)
    if sumq2 > 0:
        _put_f32(out, 0, sumqx / sumq2)


@njit(**_opts)
def _row_iq4(x, w, cb1, cb2, out, scales, bidx, xaux):
    """quantize_row_iq4_kt_impl for one row (cb1 / cb2: the codebooks without / with the
    32768 offset)."""
    v1, mid1, coff1, cmem1, cval1 = cb1
    v2, mid2, coff2, cmem2, cval2 = cb2
    n = x.shape[0]
    nb = n // QK_K
    out[:] = 0
    amax_row = _amax(x, 0, n)
    if amax_row == 0:
        return
    amax_scale = f32(0.0)
    max_scale = f32(0.0)
    for ibl in range(nb):
        ob = 4 + 128 * ibl
        for ib in range(8):
            o = QK_K * ibl + 32 * ib
            wb = w[o:o + 32]
            amax = f32(0.0)
            for j in range(32):
                xaux[j] = x[o + j]
                amax = max(amax, abs(xaux[j]))
            if amax < f32(1e-16):
                scales[8 * ibl + ib] = f32(0.0)
                continue
            scale_0 = max(f32(90.0), f32(124.0) * amax / amax_row)
            best, scales[8 * ibl + ib], _ = _try_scales(cb1, amax, scale_0, xaux, wb, bidx, f32(0.0),
                                                         scales[8 * ibl + ib])
            _match(4, mid2, coff2, cmem2, cval2, scales[8 * ibl + ib], xaux, wb, bidx, 0)
            dd, sc = _fit(4, v2, xaux, wb, bidx, 0)
            if sc > best:
                scales[8 * ibl + ib] = dd
                out[ob + 4 * ib] = 1
            best, scales[8 * ibl + ib], with_offset = _try_scales(cb2, amax, scale_0, xaux, wb, bidx, best,
                                                                   scales[8 * ibl + ib])
            if with_offset:
                out[ob + 4 * ib] = 1
            a = abs(scales[8 * ibl + ib])
            if a > amax_scale:
                amax_scale = a
                max_scale = scales[8 * ibl + ib]
    d = -max_scale / f32(64.0)
    _put_f32(out, 0, d)
    if d == 0:
        return
    idv = f32(1.0) / d
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for ibl in range(nb):
        ob = 4 + 128 * ibl
        for ib in range(8):
            o = QK_K * ibl + 32 * ib
            wb = w[o:o + 32]
            for j in range(32):
                xaux[j] = x[o + j]
            with2 = out[ob + 4 * ib] & 1
            ls = min(_nint_fma(idv, scales[8 * ibl + ib]), 63)
            out[ob + 4 * ib] = np.uint8((((ls + 64) << 1) | with2) & 255)
            dl = d * f32(ls)
            if with2:
                _match(4, mid2, coff2, cmem2, cval2, dl, xaux, wb, bidx, 0)
            else:
                _match(4, mid1, coff1, cmem1, cval1, dl, xaux, wb, bidx, 0)
            hi = np.int64(0)
            for j in range(8):
                pi = bidx[j]
                G = 8 * ib + j
                hi |= np.int64(pi >> 12) << (8 + 3 * j)
                out[ob + 32 + G] = pi & 255
                out[ob + 96 + G % 32] |= np.uint8(((pi >> 8) & 15) << (4 * (G // 32)))
            sumqx, sumq2 = _sums(v2 if with2 else v1, bidx, 4, f32(ls), xaux, wb, sumqx, sumq2)
            hi >>= 8
            out[ob + 4 * ib + 1] |= np.uint8(hi & 255)
            out[ob + 4 * ib + 2] |= np.uint8((hi >> 8) & 255)
            out[ob + 4 * ib + 3] |= np.uint8((hi >> 16) & 255)
    if sumq2 > 0:
        _put_f32(out, 0, sumqx / sumq2)


@njit(**_opts)
def _quantize_rows(x, qtype, imat, has_imat, out, cb1, cb2):
    nrows, n = x.shape
    nb = n // QK_K
    w = np.zeros(n, dtype=np.float32)
    scales = np.zeros(8 * nb, dtype=np.float32)
    aidx = np.zeros(n // 8, dtype=np.int32)
    qtmp = np.zeros(n, dtype=np.float32)
    bidx = np.zeros(16, dtype=np.int32)
    xaux = np.zeros(32, dtype=np.float32)
    for r in range(nrows):
        xr = x[r]
        orow = out[r]
        if qtype == IQ3_KT:
            _row_iq3(xr, w, imat, has_imat, cb1, orow, scales, qtmp, bidx, xaux)
            continue
        _set_weights(xr, imat, has_imat, False, w)
        if qtype == IQ4_KT:
            _row_iq4(xr, w, cb1, cb2, orow, scales, bidx, xaux)
        else:
            _row_iq12(qtype == IQ1_KT, xr, w, cb1, orow, scales, aidx, bidx)


QUANTIZE_TYPES = TYPES


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize f32 rows to a trellis type as ik_llama.cpp's ggml_quantize_chunk does.

    x: (nrows, n_per_row), or flat (one row; with an imatrix, rows of len(imatrix));
    imatrix: None or n_per_row f32 column importances.  Returns flat uint8 bytes,
    nrows * row_bytes(n_per_row).  The first call per type builds ik's codebook clusters.
    """
    ti = type_info(qtype)
    if ti.id not in TYPES:
        raise NotImplementedError(f"KT quantize: type {ti.name} not supported")
    x, im = quantizer_rows(x, imatrix, ti, QK_K)
    nrows, n = x.shape
    if im is None:
        im = np.zeros(1, dtype=np.float32)
    out = np.zeros((nrows, ti.row_bytes(n)), dtype=np.uint8)
    cb1 = codebook(ti.id).arrays()
    cb2 = codebook(ti.id, 4096 + 32768).arrays() if ti.id == IQ4_KT else cb1
    _quantize_rows(x, ti.id, im, imatrix is not None, out, cb1, cb2)
    return out.reshape(-1)
