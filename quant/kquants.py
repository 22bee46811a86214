"""Decoding of the 256-weight super-block types Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS.

Layouts (ggml-common.h of ik_llama.cpp, same as mainline ggml; f16 little-endian), byte
offsets within a super-block, and the value of weight i:

    Q2_K    84 bytes   scales[16] @0, qs[64] @16, f16 d @80, f16 dmin @82
            16 sub-blocks of 16; sub-block s = 8n + 2j + k (n: half of 128, j: 2-bit plane,
            k: which 16 of the 32 bytes); q = (qs[32n + 16k + l] >> 2j) & 3,
            x = d*(scales[s] & 15) * q - dmin*(scales[s] >> 4)
    Q3_K    110 bytes  hmask[32] @0, qs[64] @32, scales[12] @96 (16 x 6 bits), f16 d @108
            sub-blocks as Q2_K; q = ((qs[..] >> 2j) & 3) - 4 unless bit 4n + j of
            hmask[16k + l] is set; x = d * (scale[s] - 32) * q
    Q4_K    144 bytes  f16 d @0, f16 dmin @2, scales[12] @4 (8 x (6-bit scale, 6-bit min)),
            qs[128] @16; 8 sub-blocks of 32: sub-block s takes the (s & 1) nibble of
            qs[32*(s >> 1) + l]; x = d*sc[s] * q - dmin*m[s]
    Q5_K    176 bytes  as Q4_K plus qh[32] @16 (bit s of qh[l] is the 5th bit), qs[128] @48
    Q6_K    210 bytes  ql[128] @0, qh[64] @128, int8 scales[16] @192, f16 d @208
            sub-block s = 8n + 2Q + k: low 4 bits = nibble (Q >> 1) of ql[64n + 32(Q & 1) + 16k + l],
            high 2 bits = (qh[32n + 16k + l] >> 2Q) & 3; x = d*scales[s] * (q - 32)
    IQ4_XS  136 bytes  f16 d @0, uint16 scales_h @2, scales_l[4] @4, qs[128] @8; 8 blocks of 32,
            6-bit scale ls = nibble of scales_l | 2 bits of scales_h << 4;
            x = d*(ls - 32) * KVALUES_IQ4NL[nibble]  (low nibbles: weights 0..15, high 16..31)

Weight i of a super-block lies in sub-block i // 16 (Q2_K, Q3_K, Q6_K) or i // 32 (the rest).

Bit-exactness: all products are exact in f32 (f16 scale: 11 significant bits; 6-8 bit
sub-scale; quant of at most 7 bits; never more than 24 bits together), so the only rounding
is the final `- min` of Q2_K/Q4_K/Q5_K.  The FMA that ik_llama.cpp's -march=native build
makes of `dl*q - ml` therefore gives the same bits as NumPy's (and gguf.quants') separate
multiply and subtract.

`dequantize` is the NumPy reference; `decode_row_kquants` the Numba decoder with the
calling convention of quant.kernels.decode_row (without its qk argument).
"""
from __future__ import annotations

import numpy as np
from numba import njit

# quant.kernels as a module, its attributes looked up when numba compiles (not at import):
# kernels may import this module in turn, in either order
from quant import kernels as _kernels
from quant.reference import _blocks, f16_field as _f16, fma32 as _fma32, raw_bytes
from quant.types import type_info

Q2_K_ID, Q3_K_ID, Q4_K_ID, Q5_K_ID, Q6_K_ID, IQ4_XS_ID = 10, 11, 12, 13, 14, 23
KQUANT_TYPES = frozenset({Q2_K_ID, Q3_K_ID, Q4_K_ID, Q5_K_ID, Q6_K_ID, IQ4_XS_ID})
QK_K = 256

# kvalues_iq4nl, the levels IQ4_XS shares with IQ4_NL (the same table as quant.legacy's; kept
# here too so that neither module needs the other at import, whatever the import order)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_KV_F32 = KVALUES_IQ4NL.astype(np.float32)


# ----------------------------------------------------------------------------------------
# NumPy reference
# ----------------------------------------------------------------------------------------
def _shifted(v: np.ndarray, shifts, mask: int) -> np.ndarray:
    """v (nb, ..., m) -> (nb, ..., len(shifts), m): (v >> shift) & mask for each shift."""
    s = np.asarray(shifts, dtype=np.uint8).reshape(-1, 1)
    return (v[..., None, :] >> s) & np.uint8(mask)


def _planes_2bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K qs (nb, 64) -> (nb, 16, 16) 2-bit quants in weight order (sub-block, l)."""
    nb = qs.shape[0]
    return _shifted(qs.reshape(nb, 2, 32), [0, 2, 4, 6], 3).reshape(nb, 16, 16)


def q3_k_scales(sc: np.ndarray) -> np.ndarray:
    """(nb, 12) packed bytes -> (nb, 16) 6-bit scales 0..63: the low 4 bits of scale i are
    nibble i // 8 of byte i % 8, the high 2 bits are bits 2*(i // 4) of byte 8 + i % 4."""
    i = np.arange(16)
    lo = (sc[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 15
    hi = (sc[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return lo | (hi << 4)


def k4_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K (nb, 12) packed bytes -> (scales, mins), each (nb, 8) 6-bit values
    (get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in the nibbles of
    byte j + 4 with their top 2 bits from the top of bytes j - 4 and j."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, mins


def dequantize(raw: np.ndarray, qtype: int, n: int) -> np.ndarray:
    """The first `n` values (a multiple of 256) of the flat bytes `raw` of a k-quant / IQ4_XS, as f32."""
    ti = type_info(qtype)
    if ti.id not in KQUANT_TYPES:
        raise ValueError(f"{ti.name} is not a k-quant type ({sorted(KQUANT_TYPES)})")
    b = raw_bytes(raw, qtype, n).reshape(-1, ti.type_size)
    nb = b.shape[0]
    f32 = np.float32

    if ti.id == Q2_K_ID:
        sc = b[:, 0:16]
        d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
        dl = d * (sc & 15).astype(f32)                      # (nb, 16), exact
        ml = dmin * (sc >> 4).astype(f32)
        q = _planes_2bit(b[:, 16:80]).astype(f32)           # (nb, 16, 16)
        y = dl[..., None] * q - ml[..., None]
    elif ti.id == Q3_K_ID:
        d = _f16(b[:, 108:110])
        dl = d * (q3_k_scales(b[:, 96:108]).astype(f32) - 32)
        low = _planes_2bit(b[:, 32:96]).astype(np.int8)     # (nb, 16, 16)
        # bit 4n + j of hmask[16k + l] for sub-block 8n + 2j + k
        hbit = _shifted(b[:, 0:32].reshape(nb, 1, 32), range(8), 1).reshape(nb, 16, 16).astype(np.int8)
        q = (low - 4 * (1 - hbit)).astype(f32)
        y = dl[..., None] * q
    elif ti.id in (Q4_K_ID, Q5_K_ID):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        scales, mins = k4_scales_mins(b[:, 4:16])
        dl = d * scales.astype(f32)                         # (nb, 8)
        ml = dmin * mins.astype(f32)
        qs = b[:, 16:144] if ti.id == Q4_K_ID else b[:, 48:176]
        q = _shifted(qs.reshape(nb, 4, 32), [0, 4], 15).reshape(nb, 8, 32)
        if ti.id == Q5_K_ID:
            q = q | (_shifted(b[:, 16:48], range(8), 1) << 4)     # bit s of qh[l]
        y = dl[..., None] * q.astype(f32) - ml[..., None]
    elif ti.id == Q6_K_ID:
        d = _f16(b[:, 208:210])
        dl = d * b[:, 192:208].view(np.int8).astype(f32)    # (nb, 16)
        # low nibbles: (n, ql half, nibble, l) -> (n, quarter Q = 2*nibble + half, l)
        low = _shifted(b[:, 0:128].reshape(nb, 2, 2, 32), [0, 4], 15).transpose(0, 1, 3, 2, 4).reshape(nb, 2, 4, 32)
        high = _shifted(b[:, 128:192].reshape(nb, 2, 32), [0, 2, 4, 6], 3)   # (nb, 2, 4, 32)
        q = ((low | (high << 4)).astype(f32) - 32).reshape(nb, 16, 16)
        y = dl[..., None] * q
    else:  # IQ4_XS
        d = _f16(b[:, 0:2])
        sh = b[:, 2:4].copy().view(np.uint16)               # (nb, 1)
        ib = np.arange(8)
        lo = (b[:, 4 + ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15
        hi = (sh >> (2 * ib).astype(np.uint16)) & 3
        dl = d * ((lo | (hi << 4)).astype(f32) - 32)        # (nb, 8)
        qs = b[:, 8:136].reshape(nb, 8, 16)
        q = np.concatenate([qs & 15, qs >> 4], axis=2)       # (nb, 8, 32)
        y = dl[..., None] * _KV_F32[q]
    return y.reshape(-1)


# ----------------------------------------------------------------------------------------
# Numba decoder
# ----------------------------------------------------------------------------------------
@njit(cache=True, fastmath=True, nogil=True)
def decode_row_kquants(buf, qtype, base, cols, lut, y):
    """Write the `cols` values (a multiple of 256) of the row at byte `base` of `buf` into y[:cols].

    buf: flat read-only uint8 array; lut: quant.kernels.F16_TO_F32 (it must be that 65536-entry
    table).  The sub-block lengths (16, 32) are derived from lut's run-time length, not
    written as constants: with constant trip counts LLVM unrolls the inner loops into scalar
    code instead of vectorizing them (1.8-2.5x slower for Q2_K, Q3_K, Q4_K, Q6_K).  IQ4_XS is
    the exception, see there.  A trailing partial super-block of cols is not decoded.
    """
    s16 = lut.shape[0] >> 12      # 65536 >> 12 = 16
    s32 = 2 * s16
    s256 = 16 * s16
    nb = cols // s256
    if qtype == Q2_K_ID:
        for b in range(nb):
            o = base + b * 84
            d = _kernels._f16_at(buf, o + 80, lut)
            dmin = _kernels._f16_at(buf, o + 82, lut)
            for s in range(s16):
                sc = np.int32(buf[o + s])
                dl = d * np.float32(sc & 15)
                ml = dmin * np.float32(sc >> 4)
                shift = np.int32(2 * ((s >> 1) & 3))
                qo = o + 16 + 32 * (s >> 3) + 16 * (s & 1)
                qv = buf[qo:qo + s16]
                yv = y[b * s256 + s * s16:b * s256 + s * s16 + s16]
                for l in range(s16):
                    yv[l] = dl * np.float32((np.int32(qv[l]) >> shift) & 3) - ml
    elif qtype == Q3_K_ID:
        for b in range(nb):
            o = base + b * 110
            d = _kernels._f16_at(buf, o + 108, lut)
            for s in range(s16):
                lo = (np.int32(buf[o + 96 + (s & 7)]) >> (4 * (s >> 3))) & 15
                hi = (np.int32(buf[o + 104 + (s & 3)]) >> (2 * (s >> 2))) & 3
                dl = d * np.float32((lo | (hi << 4)) - 32)
                j = (s >> 1) & 3
                shift = np.int32(2 * j)
                mbit = np.int32(4 * (s >> 3) + j)
                qo = o + 32 + 32 * (s >> 3) + 16 * (s & 1)
                ho = o + 16 * (s & 1)
                qv = buf[qo:qo + s16]
                hv = buf[ho:ho + s16]
                yv = y[b * s256 + s * s16:b * s256 + s * s16 + s16]
                for l in range(s16):
                    q = ((np.int32(qv[l]) >> shift) & 3) - 4 + 4 * ((np.int32(hv[l]) >> mbit) & 1)
                    yv[l] = dl * np.float32(q)
    elif qtype == Q4_K_ID or qtype == Q5_K_ID:
        five = qtype == Q5_K_ID
        size = 176 if five else 144
        qs0 = 48 if five else 16
        for b in range(nb):
            o = base + b * size
            d = _kernels._f16_at(buf, o, lut)
            dmin = _kernels._f16_at(buf, o + 2, lut)
            hv = buf[o + 16:o + 16 + s32]
            for s in range(8):
                if s < 4:
                    sc = np.int32(buf[o + 4 + s]) & 63
                    m = np.int32(buf[o + 8 + s]) & 63
                else:
                    sc = (np.int32(buf[o + 8 + s]) & 15) | ((np.int32(buf[o + s]) >> 6) << 4)
                    m = (np.int32(buf[o + 8 + s]) >> 4) | ((np.int32(buf[o + 4 + s]) >> 6) << 4)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(m)
                shift = np.int32(4 * (s & 1))
                qo = o + qs0 + 32 * (s >> 1)
                qv = buf[qo:qo + s32]
                yv = y[b * s256 + s * s32:b * s256 + s * s32 + s32]
                if five:
                    for l in range(s32):
                        q = ((np.int32(qv[l]) >> shift) & 15) | (((np.int32(hv[l]) >> s) & 1) << 4)
                        yv[l] = dl * np.float32(q) - ml
                else:
                    for l in range(s32):
                        yv[l] = dl * np.float32((np.int32(qv[l]) >> shift) & 15) - ml
    elif qtype == Q6_K_ID:
        sv = buf.view(np.int8)
        for b in range(nb):
            o = base + b * 210
            d = _kernels._f16_at(buf, o + 208, lut)
            for s in range(s16):
                dl = d * np.float32(sv[o + 192 + s])
                n = s >> 3
                quarter = (s >> 1) & 3
                k = s & 1
                lshift = np.int32(4 * (quarter >> 1))
                hshift = np.int32(2 * quarter)
                qo = o + 64 * n + 32 * (quarter & 1) + 16 * k
                ho = o + 128 + 32 * n + 16 * k
                qv = buf[qo:qo + s16]
                hv = buf[ho:ho + s16]
                yv = y[b * s256 + s * s16:b * s256 + s * s16 + s16]
                for l in range(s16):
                    q = (((np.int32(qv[l]) >> lshift) & 15) | (((np.int32(hv[l]) >> hshift) & 3) << 4)) - 32
                    yv[l] = dl * np.float32(q)
    elif qtype == IQ4_XS_ID:
        kv = _KV_F32
        for b in range(nb):
            o = base + b * 136
            d = _kernels._f16_at(buf, o, lut)
            sh = np.int32(buf[o + 2]) | (np.int32(buf[o + 3]) << 8)
            for ib in range(8):
                ls = ((np.int32(buf[o + 4 + (ib >> 1)]) >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
                dl = d * np.float32(ls - 32)
                # constant trip count on purpose (see decode_row_legacy's IQ4_NL): unrolled
                # scalar table lookups beat vector gathers here
                qo = o + 8 + 16 * ib
                qv = buf[qo:qo + 16]
                lo = y[b * 256 + ib * 32:b * 256 + ib * 32 + 16]
                hi = y[b * 256 + ib * 32 + 16:b * 256 + ib * 32 + 32]
                for j in range(16):
                    v = np.int32(qv[j])
                    lo[j] = dl * kv[v & 15]
                    hi[j] = dl * kv[v >> 4]
    else:
        raise ValueError("decode_row_kquants: unsupported type")


# ----------------------------------------------------------------------------------------
# NumPy reference quantizers (no importance matrix): the bytes of ggml's quantize_row_*_ref
# ----------------------------------------------------------------------------------------
# Everything is vectorized over the groups (sub-blocks) of all super-blocks at once; the
# per-element sums of ggml run as Python loops over the 16 / 32 elements of a group, in C's
# order, so that every f32 rounding happens as in C.
#
# ik_llama.cpp is built with -O3 -march=native in GNU C: GCC contracts `a*b + c` into one
# fused multiply-add, and inlines nearest_int(a*b) = (a*b + 12582912.f) into an FMA too, so
# nearest_int of a product rounds the *exact* product (half to even).  Both are reproduced in
# f64, where the product of two f32 is exact; `_fma32`'s f64 sum then f32 rounding differs from
# one rounding only on exact f32 ties, which practically never occur.
_F32, _F64 = np.float32, np.float64
GROUP_MAX_EPS = np.float32(1e-15)


def _mul_add(a, b, c) -> np.ndarray:
    """a*b + c with two f32 roundings (where ik's build does not fuse)."""
    return (np.asarray(a, _F32) * np.asarray(b, _F32) + np.asarray(c, _F32)).astype(_F32)




def _nearest_prod(a, b) -> np.ndarray:
    """nearest_int(a*b) with the product fused into the magic add: round-half-even of a*b exactly."""
    return np.rint(np.asarray(a, _F64) * np.asarray(b, _F64)).astype(np.int32)


def _nearest(v) -> np.ndarray:
    """nearest_int(v) of an already rounded f32 v."""
    return np.rint(np.asarray(v, _F32)).astype(np.int32)


def _div0(a, b) -> np.ndarray:
    """a / b in f32 where b != 0, else 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, (a / np.where(b != 0, b, 1)), 0).astype(_F32)


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(G, n) -> (amax, the signed element of largest magnitude, the first one on ties)."""
    i = np.abs(x).argmax(axis=1)[:, None]
    v = np.take_along_axis(x, i, axis=1)[:, 0]
    return np.abs(v), v


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) over the rows of x (G, n):
    returns (scale (G,) f32, L (G, n) int32 in 0..2*nmax-1)."""
    G, n = x.shape
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, _F32(1), mx).astype(_F32)
    w = (x * x).astype(_F32)                       # weights x^2
    wx = (w * x).astype(_F32)

    def trial(iscale, op):
        l = np.clip(_nearest_prod(iscale[:, None], x), -nmax, nmax - 1)
        lf = l.astype(_F32)
        wl = (w * lf).astype(_F32)
        sumlx = np.zeros(G, _F32)
        suml2 = np.zeros(G, _F32)
        for i in range(n):
            sumlx = op(wx[:, i], lf[:, i], sumlx)
            suml2 = op(wl[:, i], lf[:, i], suml2)
        return l, sumlx, suml2

    iscale = (_F32(-nmax) / mx).astype(_F32)
    l, sumlx, suml2 = trial(iscale, _fma32)   # found against ik: only this first pass is fused
    scale = _div0(sumlx, suml2)
    best = (scale * sumlx).astype(_F32)
    L = l + nmax
    for is_ in range(-9, 10):
        for base, sign in ((nmax, -1), (nmax - 1, 1)):
            num = _mul_add(_F32(0.1), _F32(is_), _F32(base))
            iscale = ((-num if sign < 0 else num) / mx).astype(_F32)
            l, sx, s2 = trial(iscale, _mul_add)
            ok = (s2 > 0) & ((sx * sx).astype(_F32) > (best * s2).astype(_F32))
            if ok.any():
                L = np.where(ok[:, None], l + nmax, L)
                sc_new = _div0(sx, s2)
                scale = np.where(ok, sc_new, scale)
                best = np.where(ok, (sc_new * sx).astype(_F32), best)
                sumlx = np.where(ok, sx, sumlx)
                suml2 = np.where(ok, s2, suml2)
    # greedy refinement: move the element with the largest gradient by one step while it helps
    active = ~zero
    rows = np.arange(G)
    for _ in range(n * (2 * nmax - 1)):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        xs, ws, Ls, sc = x[idx], w[idx], L[idx] - nmax, scale[idx]
        lf = Ls.astype(_F32)
        g = ((sc[:, None] * ws).astype(_F32) * _mul_add(-sc[:, None], lf, xs)).astype(_F32)
        can = ((g > 0) & (Ls < nmax - 1)) | ((g < 0) & (Ls > -nmax))
        ag = np.where(can, np.abs(g), _F32(0))
        bj = ag.argmax(axis=1)
        r = np.arange(idx.size)
        found = ag[r, bj] > 0
        gm = g[r, bj]
        wj, xj, lj = ws[r, bj], xs[r, bj], Ls[r, bj]
        up = gm > 0
        nsx = np.where(up, _mul_add(wj, xj, sumlx[idx]), _mul_add(-wj, xj, sumlx[idx]))
        ns2 = np.where(up, _mul_add(wj, _F32(1) * (2 * lj + 1), suml2[idx]), _mul_add(-wj, (2 * lj - 1), suml2[idx]))
        acc = found & (ns2 > 0) & ((nsx * nsx).astype(_F32) > (best[idx] * ns2).astype(_F32))
        ia = idx[acc]
        sumlx[ia], suml2[ia] = nsx[acc], ns2[acc]
        scale[ia] = (nsx[acc] / ns2[acc]).astype(_F32)
        best[ia] = (scale[ia] * sumlx[ia]).astype(_F32)
        L[ia, bj[acc]] = np.where(up[acc], lj[acc] + 1, lj[acc] - 1) + nmax
        active[idx[~acc]] = False
    del rows
    scale = np.where(zero, _F32(0), scale).astype(_F32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def _quantize_q6_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    xg = b.reshape(nb * 16, 16)
    scales, L = make_qx_quants_rmse1(xg, 32)
    scales = scales.reshape(nb, 16)
    L = L.reshape(nb, 16, 16)
    amax, mxs = _first_absmax(scales)
    zero = amax < GROUP_MAX_EPS
    mxs = np.where(zero, _F32(1), mxs).astype(_F32)
    iscale = (_F32(-128) / mxs).astype(_F32)
    d16 = (_F32(1) / iscale).astype(np.float16)
    qsc = np.minimum(127, _nearest_prod(iscale[:, None], scales))      # (nb, 16)
    dl = (d16.astype(_F32)[:, None] * qsc.astype(_F32)).astype(_F32)   # (nb, 16)
    xs = b.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(_nearest((xs / np.where(dl == 0, 1, dl)[..., None]).astype(_F32)), -32, 31) + 32
    L = np.where((dl != 0)[..., None], q, L).reshape(nb, 2, 4, 32)     # (n, Q, l)
    ql = np.empty((nb, 2, 2, 32), np.uint8)
    ql[:, :, 0] = (L[:, :, 0] & 15) | ((L[:, :, 2] & 15) << 4)
    ql[:, :, 1] = (L[:, :, 1] & 15) | ((L[:, :, 3] & 15) << 4)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6))
    out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64).astype(np.uint8),
                          qsc.astype(np.int8).view(np.uint8), d16.reshape(nb, 1).view(np.uint8)], axis=1)
    out[zero] = 0
    return out.astype(np.uint8)


# which a*b + c of make_qkx2_quants ik's build fuses (found against ik's bytes)
_QKX2_FUSED = {"sum_x2": True, "sum_x": True, "mad0": True, "diff0": True, "step": True,
               "sums": True, "mad": True, "diff": True, "near": True}


def _qkx2_op(key):
    return _fma32 if _QKX2_FUSED[key] else _mul_add


def make_qkx2_quants(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants(n, nmax, x, weights, ..., use_mad=false) over the rows of x (G, n)
    with the weights of quantize_row_q4_K/q5_K_ref (sqrt(mean x^2) + |x|).
    Returns (scale (G,), the_min (G,) = -min, L (G, n) int32 in 0..nmax)."""
    G, n = x.shape
    f32 = _F32
    sum_x2 = np.zeros(G, f32)
    op = _qkx2_op("sum_x2")
    for i in range(n):
        sum_x2 = op(x[:, i], x[:, i], sum_x2)
    av_x = np.sqrt((sum_x2 / f32(n)).astype(f32)).astype(f32)
    w = (av_x[:, None] + np.abs(x)).astype(f32)
    mn = x.min(axis=1)
    mx = x.max(axis=1)
    sum_w = w[:, 0].copy()
    sum_x = (sum_w * x[:, 0]).astype(f32)
    op = _qkx2_op("sum_x")
    for i in range(1, n):
        sum_w = (sum_w + w[:, i]).astype(f32)
        sum_x = op(w[:, i], x[:, i], sum_x)
    mn = np.minimum(mn, f32(0))
    rng = (mx - mn).astype(f32)
    flat = rng < f32(1e-10)
    rng = np.where(flat, f32(1), rng).astype(f32)
    xm = (x - mn[:, None]).astype(f32)
    near = _nearest_prod if _QKX2_FUSED["near"] else (lambda a, b: _nearest((a * b).astype(f32)))

    def mad_of(scale, mins, Lf, dop, mop):
        diff = (dop(scale[:, None], Lf, mins[:, None]) - x).astype(f32)
        diff = (diff * diff).astype(f32)
        tot = np.zeros(G, f32)
        for i in range(n):
            tot = mop(w[:, i], diff[:, i], tot)
        return tot

    iscale = (f32(nmax) / rng).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    L = np.clip(near(iscale[:, None], xm), 0, nmax)
    best_mad = mad_of(scale, mn, L.astype(f32), _qkx2_op("diff0"), _qkx2_op("mad0"))
    sop = _qkx2_op("sums")
    for is_ in range(nstep + 1):
        num = (_qkx2_op("step")(f32(rdelta), f32(is_), f32(rmin)) + f32(nmax)).astype(f32)
        # as in C, `min` (and so max - min) is the best fit's min once one has been taken
        rng = np.where(flat, f32(1), (mx - mn).astype(f32)).astype(f32)
        xm = (x - mn[:, None]).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            isc = (num / rng).astype(f32)
        La = np.clip(near(isc[:, None], xm), 0, nmax)
        lf = La.astype(f32)
        wl = (w * lf).astype(f32)
        sum_l = np.zeros(G, f32)
        sum_l2 = np.zeros(G, f32)
        sum_xl = np.zeros(G, f32)
        for i in range(n):
            sum_l = (sum_l + wl[:, i]).astype(f32)
            sum_l2 = sop(wl[:, i], lf[:, i], sum_l2)
            sum_xl = sop(wl[:, i], x[:, i], sum_xl)
        D = (sop(sum_w, sum_l2, -(sum_l * sum_l).astype(f32)))
        ok = D > 0
        Ds = np.where(ok, D, f32(1)).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = (sop(sum_w, sum_xl, -(sum_x * sum_l).astype(f32)) / Ds).astype(f32)
            tm = (sop(sum_l2, sum_x, -(sum_l * sum_xl).astype(f32)) / Ds).astype(f32)
            pos = tm > 0
            tm = np.where(pos, f32(0), tm).astype(f32)
            ts = np.where(pos, (sum_xl / np.where(sum_l2 != 0, sum_l2, f32(1))).astype(f32), ts).astype(f32)
        mad = mad_of(ts, tm, lf, _qkx2_op("diff"), _qkx2_op("mad"))
        better = ok & (mad < best_mad)
        L = np.where(better[:, None], La, L)
        best_mad = np.where(better, mad, best_mad)
        scale = np.where(better, ts, scale)
        mn = np.where(better, tm, mn)
    L = np.where(flat[:, None], 0, L)
    scale = np.where(flat, f32(0), scale).astype(f32)
    return scale, (-mn).astype(f32), L


def _quantize_q45_k(b: np.ndarray, five: bool) -> np.ndarray:
    nb = b.shape[0]
    f32 = _F32
    nmax = 31 if five else 15
    scales, mins, L = (make_qkx2_quants(b.reshape(nb * 8, 32), 31, -0.5, 0.1, 15) if five
                       else make_qkx2_quants(b.reshape(nb * 8, 32), 15, -1.0, 0.1, 20))
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
    ls = np.minimum(63, _nearest_prod(inv_scale[:, None], scales) & 255)
    lm = np.minimum(63, _nearest_prod(inv_min[:, None], mins) & 255)
    d16 = (max_scale / f32(63)).astype(f32).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(f32).astype(np.float16)
    sc = np.zeros((nb, 12), np.int32)
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    d = (d16.astype(f32)[:, None] * ls.astype(f32)).astype(f32)
    dm = (dmin16.astype(f32)[:, None] * lm.astype(f32)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (b.reshape(nb, 8, 32) + dm[..., None]).astype(f32) / np.where(d == 0, f32(1), d)[..., None]
    q = np.clip(_nearest(q.astype(f32)), 0, nmax)
    L = np.where((d != 0)[..., None], q, L).reshape(nb, 4, 2, 32)
    lo = L & 15
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    parts = [d16.reshape(nb, 1).view(np.uint8), dmin16.reshape(nb, 1).view(np.uint8), sc.astype(np.uint8)]
    if five:
        hb = (L >> 4) & 1                                   # (nb, chunk c, half h, j) -> bit 2c + h of qh[j]
        sh = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, :, :, None]
        parts.append((hb << sh).sum(axis=(1, 2)).astype(np.uint8))
    parts.append(qs.astype(np.uint8))
    return np.concatenate(parts, axis=1)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """f32 values (any shape, C order, a multiple of 256) -> the flat bytes that ik_llama.cpp's
    ggml_quantize_chunk writes without an imatrix (quantize_row_<type>_ref)."""
    ti = type_info(qtype)
    b = _blocks(x, QK_K)
    if ti.id == Q6_K_ID:
        out = _quantize_q6_k(b)
    elif ti.id in (Q4_K_ID, Q5_K_ID):
        out = _quantize_q45_k(b, ti.id == Q5_K_ID)
    else:
        raise NotImplementedError(f"k-quant quantize: type {ti.name} not supported")
    assert out.shape == (b.shape[0], ti.type_size)
    return out.reshape(-1)
