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

`quantize` is the NumPy reference quantizer of Q2_K ... Q6_K and IQ4_XS: the bytes of
ik_llama.cpp's ggml_quantize_chunk without an importance matrix (quantize_row_<type>_ref; for
IQ4_XS quantize_row_iq4_nl_impl) and with one (quantize_row_<type>_impl).  The fitting helpers
(make_qx_quants, make_q3_quants, make_qkx2/3_quants, make_qp_quants, the IQ4 fit) are shared
with quant.legacy.  Which a*b + c ik's build fuses into an FMA was found per call site against
ik's bytes (the *_FUSE dicts).  Bit-exact on the golden data except Q4_K without imatrix and Q2_K
with one (rounding-order ties, see tests/test_quantize_mainline.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .kquants_fast import seq_sum_sq_f32
from .numeric import blocks as _blocks, f16_at, f16_field as _f16, fma32 as _fma32, raw_bytes
from .types import type_info

Q2_K_ID, Q3_K_ID, Q4_K_ID, Q5_K_ID, Q6_K_ID, IQ4_XS_ID = 10, 11, 12, 13, 14, 23
TYPES = frozenset({Q2_K_ID, Q3_K_ID, Q4_K_ID, Q5_K_ID, Q6_K_ID, IQ4_XS_ID})
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
    if ti.id not in TYPES:
        raise ValueError(f"{ti.name} is not a k-quant type ({sorted(TYPES)})")
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
            d = f16_at(buf, o + 80, lut)
            dmin = f16_at(buf, o + 82, lut)
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
            d = f16_at(buf, o + 108, lut)
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
            d = f16_at(buf, o, lut)
            dmin = f16_at(buf, o + 2, lut)
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
            d = f16_at(buf, o + 208, lut)
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
            d = f16_at(buf, o, lut)
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


# Which `a*b + c` of make_qx_quants ik's build fuses into an FMA depends on the call site
# (GCC specializes the static function per caller and vectorizes some of its loops: a
# vectorized in-order reduction multiplies in vector registers and adds lane by lane, unfused).
# Keys: first = the sums of the first pass, num = 0.1*is + nmax, scan = the sums of the 2x19
# trial scales, g = x - scale*l of the greedy gradient, upd = the greedy updates of the sums.
QX_FUSE_Q6K = {"first": True, "num": False, "scan": False, "g": False, "upd": False}
QX_FUSE_Q6K_IM = dict(QX_FUSE_Q6K)
QX_FUSE_LEGACY = dict(QX_FUSE_Q6K)     # Q4_0 / Q5_0 / Q6_0 (quantize_row_q*_0_impl)


def _op(fused: bool):
    return _fma32 if fused else _mul_add


def _sums_lx_l2(wx: np.ndarray, w: np.ndarray, L: np.ndarray, op) -> tuple[np.ndarray, np.ndarray]:
    """(sum w*x*l, sum w*l^2) over the rows (G, n) in element order, each a*b + c done by op
    (fused or not) with the f32 products w*x (wx) and w*l rounded first."""
    sumlx = np.zeros(L.shape[0], _F32)
    suml2 = np.zeros(L.shape[0], _F32)
    for i in range(L.shape[1]):
        lf = L[:, i].astype(_F32)
        sumlx = op(wx[:, i], lf, sumlx)
        suml2 = op((w[:, i] * lf).astype(_F32), lf, suml2)
    return sumlx, suml2


def _refine_L(x, w, wx, L, sumlx, suml2, active, lo, hi, rm, add, sl2_first: bool):
    """The do_rmse passes of make_q3_quants / make_qp_quants (at most 5, in place on L (G, n)):
    each element in turn takes its own least-squares level nearest(x * sl2 / slx), clipped to
    lo..hi (lo None: no lower bound), where that raises sumlx^2 / suml2.  The sums without the
    element are taken off with rm, the new level's added with add.  sl2_first: qp's order (skip
    the element unless sl2 > 0 before the change); else q3's (require suml2 > 0 after it).
    Rows not `active` are left as they are; returns (sumlx, suml2)."""
    G, n = x.shape
    f32 = _F32
    active = active.copy()
    for _ in range(5):
        changed = np.zeros(G, bool)
        for i in range(n):
            li = L[:, i].astype(f32)
            slx = rm(-wx[:, i], li, sumlx)
            sl2 = rm(-(w[:, i] * li).astype(f32), li, suml2)
            ok = active & (slx > 0)
            if sl2_first:
                ok &= sl2 > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                nl = _nearest(((x[:, i] * sl2).astype(f32) / np.where(ok, slx, f32(1))).astype(f32))
            nl = np.clip(nl, lo, hi)
            cand = ok & (nl != L[:, i])
            nf = nl.astype(f32)
            slx2 = add(wx[:, i], nf, slx)
            sl22 = add((w[:, i] * nf).astype(f32), nf, sl2)
            acc = cand & (((slx2 * slx2).astype(f32) * suml2).astype(f32)
                          > ((sumlx * sumlx).astype(f32) * sl22).astype(f32))
            if not sl2_first:
                acc &= sl22 > 0
            L[:, i] = np.where(acc, nl, L[:, i])
            sumlx = np.where(acc, slx2, sumlx)
            suml2 = np.where(acc, sl22, suml2)
            changed |= acc
        active &= changed
        if not active.any():
            break
    return sumlx, suml2


def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray | None = None,
                   fuse: dict = QX_FUSE_Q6K) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw) over the rows of x (G, n), with
    weights w (G, n) (qw) or x^2 (w None).  Returns (scale (G,) f32, L (G, n) int32 in 0..2*nmax-1)."""
    G, n = x.shape
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, _F32(1), mx).astype(_F32)
    w = (x * x).astype(_F32) if w is None else np.asarray(w, _F32)
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

    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = (_F32(-nmax) / mx).astype(_F32)
    l, sumlx, suml2 = trial(iscale, _op(fuse["first"]))
    scale = _div0(sumlx, suml2)
    best = (scale * sumlx).astype(_F32)
    L = l + nmax
    scan, numop = _op(fuse["scan"]), _op(fuse["num"])
    for is_ in range(-9, 10):
        for base, sign in ((nmax, -1), (nmax - 1, 1)):
            num = numop(_F32(0.1), _F32(is_), _F32(base))
            iscale = ((-num if sign < 0 else num) / mx).astype(_F32)
            l, sx, s2 = trial(iscale, scan)
            ok = (s2 > 0) & ((sx * sx).astype(_F32) > (best * s2).astype(_F32))
            if ok.any():
                L = np.where(ok[:, None], l + nmax, L)
                sc_new = _div0(sx, s2)
                scale = np.where(ok, sc_new, scale)
                best = np.where(ok, (sc_new * sx).astype(_F32), best)
                sumlx = np.where(ok, sx, sumlx)
                suml2 = np.where(ok, s2, suml2)
    # greedy refinement: move the element with the largest gradient by one step while it helps
    gop, uop = _op(fuse["g"]), _op(fuse["upd"])
    active = ~zero
    for _ in range(n * (2 * nmax - 1)):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        xs, ws, Ls, sc = x[idx], w[idx], L[idx] - nmax, scale[idx]
        lf = Ls.astype(_F32)
        g = ((sc[:, None] * ws).astype(_F32) * gop(-sc[:, None], lf, xs)).astype(_F32)
        can = ((g > 0) & (Ls < nmax - 1)) | ((g < 0) & (Ls > -nmax))
        ag = np.where(can, np.abs(g), _F32(0))
        bj = ag.argmax(axis=1)
        r = np.arange(idx.size)
        found = ag[r, bj] > 0
        gm = g[r, bj]
        wj, xj, lj = ws[r, bj], xs[r, bj], Ls[r, bj]
        up = gm > 0
        nsx = np.where(up, uop(wj, xj, sumlx[idx]), uop(-wj, xj, sumlx[idx]))
        ns2 = np.where(up, uop(wj, (2 * lj + 1).astype(_F32), suml2[idx]),
                       uop(-wj, (2 * lj - 1).astype(_F32), suml2[idx]))
        acc = found & (ns2 > 0) & ((nsx * nsx).astype(_F32) > (best[idx] * ns2).astype(_F32))
        ia = idx[acc]
        sumlx[ia], suml2[ia] = nsx[acc], ns2[acc]
        scale[ia] = (nsx[acc] / ns2[acc]).astype(_F32)
        best[ia] = (scale[ia] * sumlx[ia]).astype(_F32)
        L[ia, bj[acc]] = np.where(up[acc], lj[acc] + 1, lj[acc] - 1) + nmax
        active[idx[~acc]] = False
    scale = np.where(zero, _F32(0), scale).astype(_F32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) as Q6_K's quantize_row_q6_K_ref calls it."""
    return make_qx_quants(x, nmax, None, QX_FUSE_Q6K)


def _quantize_q6_k(b: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Super-blocks b (nb, 256) -> Q6_K bytes; qw (nb, 256): the imatrix weights, used as they are
    (quantize_row_q6_K_impl passes them straight to make_qx_quants), or None."""
    nb = b.shape[0]
    xg = b.reshape(nb * 16, 16)
    if qw is None:
        scales, L = make_qx_quants_rmse1(xg, 32)
    else:
        scales, L = make_qx_quants(xg, 32, qw.reshape(nb * 16, 16), QX_FUSE_Q6K_IM)
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
               "sums": True, "solve": True, "mad": True, "diff": True, "near": True}
# quantize_row_q2_K_ref's call (use_mad, weights |x|) is compiled differently (found against ik)
QKX2_FUSE_Q2K = dict(_QKX2_FUSED, solve=(1, 2, 1))


def _ab_minus_cd(a, b, c, d, how: int) -> np.ndarray:
    """a*b - c*d in f32: how 0 = no FMA, 1 = fma(a, b, -(c*d)), 2 = fma(-c, d, a*b)."""
    if how == 1:
        return _fma32(a, b, -(c * d).astype(_F32))
    if how == 2:
        return _fma32(-c, d, (a * b).astype(_F32))
    return ((a * b).astype(_F32) - (c * d).astype(_F32)).astype(_F32)


def make_qkx2_quants(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     weights: np.ndarray | None = None, use_mad: bool = False, fuse: dict | None = None):
    """ggml's make_qkx2_quants(n, nmax, x, weights, ..., use_mad=false) over the rows of x (G, n)
    with the weights of quantize_row_q4_K/q5_K_ref (sqrt(mean x^2) + |x|).
    Returns (scale (G,), the_min (G,) = -min, L (G, n) int32 in 0..nmax)."""
    G, n = x.shape
    f32 = _F32
    fz = _QKX2_FUSED if fuse is None else fuse

    def _qkx2_op(key):
        return _fma32 if fz[key] else _mul_add

    if weights is None:
        sum_x2 = np.zeros(G, f32)
        op = _qkx2_op("sum_x2")
        for i in range(n):
            sum_x2 = op(x[:, i], x[:, i], sum_x2)
        av_x = np.sqrt((sum_x2 / f32(n)).astype(f32)).astype(f32)
        w = (av_x[:, None] + np.abs(x)).astype(f32)
    else:
        w = np.asarray(weights, f32)
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
    near = _nearest_prod if fz["near"] else (lambda a, b: _nearest((a * b).astype(f32)))

    def mad_of(scale, mins, Lf, dop, mop):
        diff = (dop(scale[:, None], Lf, mins[:, None]) - x).astype(f32)
        diff = np.abs(diff) if use_mad else (diff * diff).astype(f32)
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
        sv = fz["solve"]
        sv = (1, 1, 1) if sv is True else (0, 0, 0) if sv is False else sv
        D = _ab_minus_cd(sum_w, sum_l2, sum_l, sum_l, sv[0])
        ok = D > 0
        Ds = np.where(ok, D, f32(1)).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = (_ab_minus_cd(sum_w, sum_xl, sum_x, sum_l, sv[1]) / Ds).astype(f32)
            tm = (_ab_minus_cd(sum_l2, sum_x, sum_l, sum_xl, sv[2]) / Ds).astype(f32)
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
    return _finish_q45_k(b, L, ls, lm, d16, dmin16, five)


def _finish_q45_k(b, L, ls, lm, d16, dmin16, five: bool) -> np.ndarray:
    """Pack the 6-bit scales / mins, requantize each sub-block with its stored scale and min
    (where the scale is non-zero; else keep L (nb, 8, 32)), and lay out the Q4_K / Q5_K bytes."""
    nb = b.shape[0]
    f32 = _F32
    nmax = 31 if five else 15
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


# ----------------------------------------------------------------------------------------
# The imatrix fits: make_qkx3_quants (sums in f64) and make_qp_quants (the super-block scales)
# ----------------------------------------------------------------------------------------
QKX3_FUSE = {"step": True}


def _level_sums(wd: np.ndarray, L: np.ndarray, xd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: sum w*l, sum w*l*l, sum w*l*x, accumulated element by element in f64 (ggml's order)."""
    sum_l = np.zeros(L.shape[0])
    sum_l2 = np.zeros(L.shape[0])
    sum_xl = np.zeros(L.shape[0])
    for i in range(L.shape[1]):
        wl = wd[:, i] * L[:, i]
        sum_l = sum_l + wl
        sum_l2 = sum_l2 + wl * L[:, i]
        sum_xl = sum_xl + wl * xd[:, i]
    return sum_l, sum_l2, sum_xl


def make_qkx3_quants(x: np.ndarray, nmax: int, w: np.ndarray, rmin: float, rdelta: float,
                     nstep: int, fuse: dict = QKX3_FUSE):
    """ggml's make_qkx3_quants(n, nmax, x, weights, ..., use_mad=false) over the rows of x (G, n):
    (scale (G,) f32, the_min (G,) f32 = -min, L (G, n) int32 in 0..nmax)."""
    G, n = x.shape
    f32, f64 = _F32, _F64
    xd, wd = x.astype(f64), w.astype(f64)
    mn, mx = x.min(axis=1), x.max(axis=1)
    sum_w = wd[:, 0].copy()
    sum_x = sum_w * xd[:, 0]
    sum_x2 = sum_w * xd[:, 0] * xd[:, 0]
    for i in range(1, n):
        sum_w = sum_w + wd[:, i]
        sum_x = sum_x + wd[:, i] * xd[:, i]
        sum_x2 = sum_x2 + wd[:, i] * xd[:, i] * xd[:, i]
    mn = np.minimum(mn, f32(0)).astype(f32)
    flat = (mx - mn).astype(f32) < f32(1e-10)
    rng = np.where(flat, f32(1), (mx - mn).astype(f32)).astype(f32)
    iscale = (f32(nmax) / rng).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    L = np.clip(_nearest_prod(iscale[:, None], (x - mn[:, None]).astype(f32)), 0, nmax)
    diff = scale.astype(f64)[:, None] * L + mn.astype(f64)[:, None] - xd
    diff = diff * diff
    best_mad = np.zeros(G)
    for i in range(n):
        best_mad = best_mad + wd[:, i] * diff[:, i]
    step = _op(fuse["step"])
    for is_ in range(nstep + 1):
        num = (step(f32(rdelta), f32(is_), f32(rmin)) + f32(nmax)).astype(f32)
        rng = np.where(flat, f32(1), (mx - mn).astype(f32)).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            isc = (num / rng).astype(f32)
        La = np.clip(_nearest_prod(isc[:, None], (x - mn[:, None]).astype(f32)), 0, nmax)
        sum_l, sum_l2, sum_xl = _level_sums(wd, La, xd)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = (sum_w * sum_xl - sum_x * sum_l) / Ds
            tm = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
            pos = tm > 0
            tm = np.where(pos, 0.0, tm)
            ts = np.where(pos, sum_xl / np.where(sum_l2 != 0, sum_l2, 1.0), ts)
        mad = (sum_x2 - 2 * ts * sum_xl - 2 * tm * sum_x + 2 * ts * tm * sum_l
               + ts * ts * sum_l2 + tm * tm * sum_w)
        better = ok & ~flat & (mad < best_mad)
        L = np.where(better[:, None], La, L)
        best_mad = np.where(better, mad, best_mad)
        scale = np.where(better, ts.astype(f32), scale).astype(f32)
        mn = np.where(better, tm.astype(f32), mn).astype(f32)
    # greedy: move the element farthest from its level by one step while the fit improves
    sum_l, sum_l2, sum_xl = _level_sums(wd, L, xd)
    sd, md = scale.astype(f64), mn.astype(f64)
    best = 2 * sd * sum_xl + 2 * md * sum_x - 2 * sd * md * sum_l - sd * sd * sum_l2 - md * md * sum_w
    last_j = np.full(G, -1)
    last_dir = np.zeros(G, np.int64)
    active = ~flat
    for _ in range(nmax * n):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        xs, Ls = x[idx], L[idx]
        g = ((xs - (scale[idx, None] * Ls.astype(f32)).astype(f32)).astype(f32) - mn[idx, None]).astype(f32)
        cu = (g > 0) & (Ls < nmax)
        cd = (g < 0) & (Ls > 0)
        eff = np.where(cu, g, np.where(cd, -g, f32(0))).astype(f32)
        bj = eff.argmax(axis=1)
        r = np.arange(idx.size)
        found = eff[r, bj] > 0
        dirn = np.where(cu[r, bj], 1, -1)
        stop = ~found | ((bj == last_j[idx]) & (dirn == -last_dir[idx]))
        wj = wd[idx, bj]
        lj = Ls[r, bj]
        nsl = sum_l[idx] + wj * dirn
        nsl2 = sum_l2[idx] + wj * (2 * lj * dirn + 1)
        nsxl = sum_xl[idx] + wj * xd[idx, bj] * dirn
        sw_, sx_ = sum_w[idx], sum_x[idx]
        D = sw_ * nsl2 - nsl * nsl
        Ds = np.where(D > 0, D, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = (sw_ * nsxl - sx_ * nsl) / Ds
            tm = (nsl2 * sx_ - nsl * nsxl) / Ds
            pos = tm > 0
            tm = np.where(pos, 0.0, tm)
            ts = np.where(pos, nsxl / nsl2, ts)
        score = 2 * ts * nsxl + 2 * tm * sx_ - 2 * ts * tm * nsl - ts * ts * nsl2 - tm * tm * sw_
        acc = ~stop & (D > 0) & (ts >= 0) & (score > best[idx])
        ia = idx[acc]
        sum_l[ia], sum_l2[ia], sum_xl[ia] = nsl[acc], nsl2[acc], nsxl[acc]
        best[ia] = score[acc]
        scale[ia] = ts[acc].astype(f32)
        mn[ia] = tm[acc].astype(f32)
        L[ia, bj[acc]] = lj[acc] + dirn[acc]
        last_j[ia], last_dir[ia] = bj[acc], dirn[acc]
        active[idx[~acc]] = False
    L = np.where(flat[:, None], 0, L)
    scale = np.where(flat, f32(0), scale).astype(f32)
    return scale, (-mn).astype(f32), L


QP_FUSE = {"mse": False, "sums": True, "rm": True}


def make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray, fuse: dict = QP_FUSE):
    """ggml's make_qp_quants(n, nmax, x, L, quant_weights) over the rows of x (G, n) (x >= 0):
    (scale (G,) f32, L (G, n) int32 in 0..nmax)."""
    G, n = x.shape
    f32 = _F32
    mx = np.maximum(x.max(axis=1), f32(0))
    zero = mx < f32(1e-16)
    mxs = np.where(zero, f32(1), mx).astype(f32)
    iscale = (f32(nmax) / mxs).astype(f32)
    mop, op, rm = _op(fuse["mse"]), _op(fuse["sums"]), _op(fuse["rm"])

    def mse_of(isc, clamp):
        l = _nearest_prod(isc[:, None], x)
        if clamp:
            l = np.minimum(nmax, l)
        sc = (f32(1) / isc).astype(f32)
        diff = mop(-sc[:, None], l.astype(f32), x)
        wd = (w * diff).astype(f32)
        tot = np.zeros(G, f32)
        for i in range(n):
            tot = mop(wd[:, i], diff[:, i], tot)
        return tot

    best_mse = mse_of(iscale, False)
    for is_ in (-4, -3, -2, -1, 1, 2, 3, 4):
        isc = ((f32(0.1) * f32(is_) + f32(nmax)).astype(f32) / mxs).astype(f32)
        mse = mse_of(isc, True)
        better = mse < best_mse
        best_mse = np.where(better, mse, best_mse)
        iscale = np.where(better, isc, iscale).astype(f32)
    L = np.minimum(nmax, _nearest_prod(iscale[:, None], x))
    wx = (w * x).astype(f32)
    sumlx, suml2 = _sums_lx_l2(wx, w, L, op)
    sumlx, suml2 = _refine_L(x, w, wx, L, sumlx, suml2, ~zero, None, nmax, rm, op, True)
    scale = np.where(zero, f32(0), _div0(sumlx, suml2)).astype(f32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def _quantize_q45_k_im(b: np.ndarray, qw: np.ndarray, five: bool) -> np.ndarray:
    """quantize_row_q4_K_impl / q5_K_impl with an imatrix."""
    nb = b.shape[0]
    nmax = 31 if five else 15
    w = imatrix_weights(b, qw, 2.0, False, True).reshape(nb * 8, 32)
    sw = np.zeros(nb * 8, _F32)
    for l in range(32):
        sw = (sw + w[:, l]).astype(_F32)
    scales, mins, L = make_qkx3_quants(b.reshape(nb * 8, 32), nmax, w, -0.9, 0.05, 36)
    sw = sw.reshape(nb, 8)
    dblk, ls = make_qp_quants(scales.reshape(nb, 8), 63, sw)
    mblk, lm = make_qp_quants(mins.reshape(nb, 8), 63, sw)
    if five:
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    return _finish_q45_k(b, L.reshape(nb, 8, 32), ls, lm, dblk.astype(np.float16), mblk.astype(np.float16), five)


def _pack_q2_k(L: np.ndarray, sc: np.ndarray, d16: np.ndarray, dmin16: np.ndarray) -> np.ndarray:
    nb = L.shape[0]
    Lr = L.reshape(nb, 2, 4, 32)
    qs = (Lr[:, :, 0] | (Lr[:, :, 1] << 2) | (Lr[:, :, 2] << 4) | (Lr[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([sc.astype(np.uint8), qs.astype(np.uint8), d16.reshape(nb, 1).view(np.uint8),
                           dmin16.reshape(nb, 1).view(np.uint8)], axis=1)


def _quantize_q2_k(b: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref over all of b (nb, 256) at once (its ternary test spans the chunk)."""
    nb = b.shape[0]
    f32 = _F32
    mx = np.abs(b).max()
    half = (f32(0.5) * mx).astype(f32)
    lt = np.where(b < -half, -1, np.where(b < half, 0, 1))
    flat = b.reshape(-1)
    diff = (flat - (mx * lt.reshape(-1).astype(f32)).astype(f32)).astype(f32)
    # two sequential f32 sums over the whole chunk: accumulate in order
    mse0 = np.float32(_seq_sum_sq(flat))
    mse = np.float32(_seq_sum_sq(diff))
    if mse < (f32(0.1) * mse0).astype(f32):
        L = (lt + 1).astype(np.int32)
        sc = np.full((nb, 16), 1 | (1 << 4), np.int32)
        m16 = np.full(nb, mx, f32).astype(np.float16)
        return _pack_q2_k(L, sc, m16, m16)
    scales, mins, L = make_qkx2_quants(b.reshape(nb * 16, 16), 3, -0.5, 0.1, 15,
                                       weights=np.abs(b).reshape(nb * 16, 16), use_mad=True, fuse=QKX2_FUSE_Q2K)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    with np.errstate(divide="ignore"):
        isc = np.where(max_scale > 0, f32(15) / max_scale, f32(0)).astype(f32)
        imn = np.where(max_min > 0, f32(15) / max_min, f32(0)).astype(f32)
    ls = np.where(max_scale[:, None] > 0, _nearest_prod(isc[:, None], scales), 0)
    lm = np.where(max_min[:, None] > 0, _nearest_prod(imn[:, None], mins), 0)
    d16 = np.where(max_scale > 0, (max_scale / f32(15)).astype(f32), f32(0)).astype(np.float16)
    dmin16 = np.where(max_min > 0, (max_min / f32(15)).astype(f32), f32(0)).astype(np.float16)
    sc = (ls | (lm << 4)) & 255
    d = (d16.astype(f32)[:, None] * (sc & 15).astype(f32)).astype(f32)
    dm = (dmin16.astype(f32)[:, None] * (sc >> 4).astype(f32)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = ((b.reshape(nb, 16, 16) + dm[..., None]).astype(f32) / np.where(d == 0, f32(1), d)[..., None]).astype(f32)
    q = np.clip(_nearest(q), 0, 3)
    L = np.where((d != 0)[..., None], q, L.reshape(nb, 16, 16)).reshape(nb, 256)
    return _pack_q2_k(L, sc, d16, dmin16)


def _seq_sum_sq(v: np.ndarray) -> float:
    """sum of v^2 in element order in f32 (a Python-level loop over chunks of the running sum)."""
    return seq_sum_sq_f32(np.ascontiguousarray(v, _F32))


def _quantize_q2_k_im(b: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_impl with an imatrix."""
    nb = b.shape[0]
    f32 = _F32
    w = imatrix_weights(b, qw, 0.75, False, True).reshape(nb * 16, 16)
    sw = np.zeros(nb * 16, f32)
    for l in range(16):
        sw = (sw + w[:, l]).astype(f32)
    scales, mins, L = make_qkx3_quants(b.reshape(nb * 16, 16), 3, w, -0.9, 0.05, 36)
    sw = sw.reshape(nb, 16)
    dm, ls = make_qp_quants(scales.reshape(nb, 16), 15, sw)
    mm, lm = make_qp_quants(mins.reshape(nb, 16), 15, sw)
    d = (dm[:, None] * ls.astype(f32)).astype(f32)
    m = (mm[:, None] * lm.astype(f32)).astype(f32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
    q = np.clip(_nearest_prod((b.reshape(nb, 16, 16) + m[..., None]).astype(f32), idv[..., None]), 0, 3)
    sc = (ls | (lm << 4)) & 255
    return _pack_q2_k(q.reshape(nb, 256), sc, dm.astype(np.float16), mm.astype(np.float16))


def sum_sq(x: np.ndarray, fused: bool = False) -> np.ndarray:
    """sum of x[:, j]^2 over the rows of x (R, m), in element order (f32; FMA or not)."""
    op = _op(fused)
    s = np.zeros(x.shape[0], _F32)
    for j in range(x.shape[1]):
        s = op(x[:, j], x[:, j], s)
    return s


def imatrix_weights(x: np.ndarray, qw: np.ndarray, mult: float = 1.0, fused_sum: bool = False,
                    fused_sigma: bool = True) -> np.ndarray:
    """qw * sqrt(sigma2 + x^2) for each set of values x (R, m) (a row or a super-block), where
    sigma2 = mult * sum(x^2) / m; qw (R, m) the importance weights of the same columns."""
    sigma2 = ((_F32(mult) * sum_sq(x, fused_sum)).astype(_F32) / _F32(x.shape[1])).astype(_F32)
    inner = _op(fused_sigma)(x, x, sigma2[:, None])
    return (qw * np.sqrt(inner).astype(_F32)).astype(_F32)


# ----------------------------------------------------------------------------------------
# IQ4_NL / IQ4_XS (quantize_row_iq4_nl_impl with ntry = 7, as ggml_quantize_chunk calls it)
# ----------------------------------------------------------------------------------------
# the nearest-level lookup of best_index_iq4nl: entry ix = trunc(x) + 127; < 16: that level,
# >= 16: between levels t-16 and t-15
_IQ4NL_INDEX = np.array(
    [0] * 11 + [16, 16] + [1] * 20 + [17, 17] + [2] * 18 + [18] + [3] * 16 + [19] + [4] * 14 + [20]
    + [5] * 12 + [21, 21] + [6] * 11 + [22] + [7] * 10 + [23, 23] + [8] * 10 + [24] + [9] * 11 + [25]
    + [10] * 11 + [26, 26] + [11] * 12 + [27, 27] + [12] * 14 + [28] + [13] * 17 + [29] + [14] * 21
    + [30] + [15] * 12, dtype=np.int32)
assert _IQ4NL_INDEX.size == 241
_KV_I32 = KVALUES_IQ4NL.astype(np.int32)


def best_index_iq4nl(al: np.ndarray) -> np.ndarray:
    """Index of the IQ4_NL level nearest to each f32 in al (ties to the upper level)."""
    al = np.asarray(al, _F32)
    ix = np.trunc(np.clip(al, -1e6, 1e6)).astype(np.int32) + 127
    lo, hi = ix < 0, ix >= 241
    t = _IQ4NL_INDEX[np.clip(ix, 0, 240)]
    a = np.clip(t - 16, 0, 15)
    b = np.clip(t - 15, 0, 15)
    pick_a = (al - _KV_F32[a]).astype(_F32) < (_KV_F32[b] - al).astype(_F32)
    r = np.where(t < 16, t, np.where(pick_a, a, b))
    return np.where(lo, 0, np.where(hi, 15, r)).astype(np.int32)


IQ4_FUSE = {"sums": True, "g": True, "upd": True}


def _iq4_blocks(xb: np.ndarray, w: np.ndarray, ntry: int = 7, fuse: dict = IQ4_FUSE):
    """The per-block part of quantize_row_iq4_nl_impl for blocks xb (G, 32) with weights w:
    returns (scale d (G,) f32, L (G, 32) level indices)."""
    G, n = xb.shape
    op, gop, uop = _op(fuse["sums"]), _op(fuse["g"]), _op(fuse["upd"])
    amax, mx = _first_absmax(xb)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, _F32(1), mx).astype(_F32)

    def trial(id_):
        L = best_index_iq4nl((id_[:, None] * xb).astype(_F32))
        q = _KV_F32[L]
        wq = (w * q).astype(_F32)
        sqx = np.zeros(G, _F32)
        sq2 = np.zeros(G, _F32)
        for j in range(n):
            sqx = op(wq[:, j], xb[:, j], sqx)
            sq2 = op(wq[:, j], q[:, j], sq2)
        return L, sqx, sq2

    d = (-mx / _F32(-127)).astype(_F32)
    L, sumqx, sumq2 = trial((_F32(1) / d).astype(_F32))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = (sumqx / sumq2).astype(_F32)
    best = (d * sumqx).astype(_F32)
    for itry in range(-ntry, ntry + 1):
        for v0 in (-127, 113):
            id_ = (_F32(itry + v0) / mx).astype(_F32)
            La, sx, s2 = trial(id_)
            ok = (s2 > 0) & ((sx * sx).astype(_F32) > (best * s2).astype(_F32))
            if ok.any():
                dn = _div0(sx, s2)
                d = np.where(ok, dn, d).astype(_F32)
                best = np.where(ok, (dn * sx).astype(_F32), best)
                sumqx = np.where(ok, sx, sumqx)
                sumq2 = np.where(ok, s2, sumq2)
                L = np.where(ok[:, None], La, L)
    # greedy: step the element whose gradient reaches the next level first, while it helps
    active = ~zero
    for _ in range(32 * n):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        xs, ws, Ls, dd = xb[idx], w[idx], L[idx], d[idx]
        v = _KV_F32[Ls]
        g = ((dd[:, None] * ws).astype(_F32) * gop(-dd[:, None], v, xs)).astype(_F32)
        vup = _KV_F32[np.minimum(Ls + 1, 15)]
        vdn = _KV_F32[np.maximum(Ls - 1, 0)]
        with np.errstate(divide="ignore", invalid="ignore"):
            sup = ((vup - v).astype(_F32) / g).astype(_F32)
            sdn = ((vdn - v).astype(_F32) / g).astype(_F32)
        cu = (g > 0) & (Ls < 15)
        cd = (g < 0) & (Ls > 0)
        step = np.where(cu, sup, np.where(cd, sdn, np.inf)).astype(_F32)
        bj = step.argmin(axis=1)
        r = np.arange(idx.size)
        found = np.isfinite(step[r, bj]) | (cu[r, bj] | cd[r, bj])
        found &= step[r, bj] < np.inf
        dirn = np.where(cu[r, bj], 1, -1)
        lj = Ls[r, bj]
        ln = np.clip(lj + dirn, 0, 15)
        wj, xj = ws[r, bj], xs[r, bj]
        dv = (_KV_I32[ln] - _KV_I32[lj]).astype(_F32)
        dv2 = (_KV_I32[ln] * _KV_I32[ln] - _KV_I32[lj] * _KV_I32[lj]).astype(_F32)
        nsx = uop((wj * xj).astype(_F32), dv, sumqx[idx])
        ns2 = uop(wj, dv2, sumq2[idx])
        acc = found & (ns2 > 0) & ((nsx * nsx).astype(_F32) > (best[idx] * ns2).astype(_F32))
        ia = idx[acc]
        sumqx[ia], sumq2[ia] = nsx[acc], ns2[acc]
        d[ia] = (nsx[acc] / ns2[acc]).astype(_F32)
        best[ia] = (d[ia] * sumqx[ia]).astype(_F32)
        L[ia, bj[acc]] = ln[acc]
        active[idx[~acc]] = False
    d = np.where(zero, _F32(0), d).astype(_F32)
    return d, L


def quantize_iq4(x: np.ndarray, qw: np.ndarray | None, xs: bool, fuse: dict = IQ4_FUSE,
                 fused_sum: bool = False, fused_sigma: bool = True) -> np.ndarray:
    """Rows x (nrows, n) f32 and imatrix qw (n,) or None -> IQ4_XS (xs) or IQ4_NL bytes (nrows*row_bytes,)."""
    sbs = QK_K if xs else 32
    sb = np.ascontiguousarray(x, _F32).reshape(-1, sbs)                 # super-blocks
    ns = sb.shape[0]
    if qw is None:
        w = (sb * sb).astype(_F32)
    else:
        qwb = np.broadcast_to(np.asarray(qw, _F32).reshape(1, -1), x.shape).reshape(-1, sbs)
        w = imatrix_weights(sb, qwb, 2.0, fused_sum, fused_sigma)
    d, L = _iq4_blocks(sb.reshape(-1, 32), w.reshape(-1, 32), 7, fuse)
    nblk = sbs // 32
    d = d.reshape(ns, nblk)
    L = L.reshape(ns, nblk, 32)
    if not xs:
        with np.errstate(divide="ignore"):
            idv = np.where(d[:, 0] != 0, _F32(1) / d[:, 0], _F32(0)).astype(_F32)
        L = best_index_iq4nl((idv[:, None] * sb).astype(_F32)).reshape(ns, 1, 32)
        hdr = [d[:, 0].astype(np.float16).reshape(ns, 1).view(np.uint8)]
    else:
        amax, mxs = _first_absmax(d)
        dsb = (-mxs / _F32(32)).astype(_F32)
        with np.errstate(divide="ignore"):
            idsb = np.where(dsb != 0, _F32(1) / dsb, _F32(0)).astype(_F32)
        ls = np.clip(_nearest_prod(idsb[:, None], d), -32, 31)
        dl = (dsb[:, None] * ls.astype(_F32)).astype(_F32)
        with np.errstate(divide="ignore"):
            idl = np.where(dl != 0, _F32(1) / dl, _F32(0)).astype(_F32)
        L = best_index_iq4nl((idl[..., None] * sb.reshape(ns, nblk, 32)).astype(_F32))
        l = ls + 32
        sl = (l[:, 0::2] & 15) | ((l[:, 1::2] & 15) << 4)
        sh = ((l >> 4) << (2 * np.arange(8))[None, :]).sum(axis=1).astype(np.uint16)
        hdr = [dsb.astype(np.float16).reshape(ns, 1).view(np.uint8), sh.reshape(ns, 1).view(np.uint8),
               sl.astype(np.uint8)]
    qs = (L[..., :16] | (L[..., 16:] << 4)).astype(np.uint8).reshape(ns, -1)
    return np.concatenate(hdr + [qs], axis=1).reshape(-1)


# ----------------------------------------------------------------------------------------
# Q3_K
# ----------------------------------------------------------------------------------------
Q3_FUSE = {"first": True, "rm": True, "add": True}


def make_q3_quants(x: np.ndarray, nmax: int, fuse: dict = Q3_FUSE) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants(n, nmax, x, L, do_rmse=true) over the rows of x (G, n):
    (scale (G,) f32, L (G, n) int32 in 0..2*nmax-1)."""
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, _F32(1), mx).astype(_F32)
    iscale = (_F32(-nmax) / mx).astype(_F32)
    L = np.clip(_nearest_prod(iscale[:, None], x), -nmax, nmax - 1)
    w = (x * x).astype(_F32)
    wx = (w * x).astype(_F32)
    op, rm, add = _op(fuse["first"]), _op(fuse["rm"]), _op(fuse["add"])
    sumlx, suml2 = _sums_lx_l2(wx, w, L, op)
    sumlx, suml2 = _refine_L(x, w, wx, L, sumlx, suml2, ~zero, -nmax, nmax - 1, rm, add, False)
    scale = np.where(zero, _F32(0), _div0(sumlx, suml2)).astype(_F32)
    L = np.where(zero[:, None], 0, L + nmax)
    return scale, L


def _pack_q3_k(L: np.ndarray, ls: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """L (nb, 256) 0..7, ls (nb, 16) 6-bit scales (0..63), d16 (nb,) f16 -> Q3_K bytes (nb, 110)."""
    nb = L.shape[0]
    sc = np.zeros((nb, 12), np.int32)
    sc[:, 0:8] = (ls[:, 0:8] & 15) | ((ls[:, 8:16] & 15) << 4)
    hi = ls >> 4
    for j in range(16):
        sc[:, 8 + j % 4] |= hi[:, j] << (2 * (j // 4))
    Lr = L.reshape(nb, 8, 32)
    hm = (((Lr > 3).astype(np.int32)) << np.arange(8)[None, :, None]).sum(axis=1)     # (nb, 32)
    low = (L & 3).reshape(nb, 2, 4, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([hm.astype(np.uint8), qs.astype(np.uint8), sc.astype(np.uint8),
                           d16.reshape(nb, 1).view(np.uint8)], axis=1)


def _q3_final_L(b: np.ndarray, L: np.ndarray, ls: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """Requantize each sub-block of 16 with its stored scale d*(ls-32) (where that is non-zero)."""
    nb = b.shape[0]
    d = (d16.astype(_F32)[:, None] * (ls - 32).astype(_F32)).astype(_F32)   # (nb, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (b.reshape(nb, 16, 16) / np.where(d == 0, _F32(1), d)[..., None]).astype(_F32)
    q = np.clip(_nearest(q), -4, 3) + 4
    return np.where((d != 0)[..., None], q, L.reshape(nb, 16, 16)).reshape(nb, 256)


def _quantize_q3_k(b: np.ndarray, qw: np.ndarray | None = None, fuse_sum: bool = False,
                   fuse_sig: bool = True, fuse1: dict | None = None, fuse2: dict | None = None) -> np.ndarray:
    nb = b.shape[0]
    xg = b.reshape(nb * 16, 16)
    if qw is None:                                   # quantize_row_q3_K_ref
        scales, L = make_q3_quants(xg, 4)
        scales = scales.reshape(nb, 16)
        amax, mxs = _first_absmax(scales)
        nz = mxs != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(nz, _F32(-32) / np.where(nz, mxs, _F32(1)), _F32(0)).astype(_F32)
            d16 = np.where(nz, _F32(1) / np.where(nz, iscale, _F32(1)), _F32(0)).astype(_F32).astype(np.float16)
        ls = np.where(nz[:, None], np.clip(_nearest_prod(iscale[:, None], scales), -32, 31) + 32, 0)
    else:                                            # quantize_row_q3_K_impl
        w = imatrix_weights(b, qw, 2.0, fuse_sum, fuse_sig).reshape(nb * 16, 16)
        sw = np.zeros(nb * 16, _F32)
        for l in range(16):
            sw = (sw + w[:, l]).astype(_F32)
        scales, L = make_qx_quants(xg, 4, w, fuse1 or QX_FUSE_Q3K_1)
        dblk, ls = make_qx_quants(scales.reshape(nb, 16), 32, sw.reshape(nb, 16), fuse2 or QX_FUSE_Q3K_2)
        d16 = dblk.astype(np.float16)
    L = _q3_final_L(b, L.reshape(nb, 256), ls, d16)
    return _pack_q3_k(L, ls, d16)


QX_FUSE_Q3K_1 = dict(QX_FUSE_Q6K)
QX_FUSE_Q3K_2 = dict(QX_FUSE_Q6K)


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows x (nrows, n_per_row) f32 (n_per_row a multiple of 256; any other shape is taken as
    one row) -> the flat bytes that ik_llama.cpp's ggml_quantize_chunk writes, without an
    importance matrix (quantize_row_<type>_ref; IQ4_XS: quantize_iq4_xs) or with one (imatrix:
    (n_per_row,) f32, the same weights for every row; quantize_row_<type>_impl)."""
    ti = type_info(qtype)
    x = np.ascontiguousarray(x, dtype=_F32)
    x = x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)
    b = _blocks(x, QK_K)
    qw = None
    if imatrix is not None:
        qw = np.broadcast_to(np.asarray(imatrix, _F32).reshape(1, -1), x.shape).reshape(-1, QK_K)
    if ti.id == Q6_K_ID:
        out = _quantize_q6_k(b, qw)
    elif ti.id in (Q4_K_ID, Q5_K_ID):
        out = _quantize_q45_k(b, ti.id == Q5_K_ID) if qw is None else _quantize_q45_k_im(b, qw, ti.id == Q5_K_ID)
    elif ti.id == Q3_K_ID:
        out = _quantize_q3_k(b, qw)
    elif ti.id == Q2_K_ID:
        out = _quantize_q2_k(b) if qw is None else _quantize_q2_k_im(b, qw)
    elif ti.id == IQ4_XS_ID:
        out = quantize_iq4(x, imatrix, True).reshape(b.shape[0], -1)
    else:
        raise NotImplementedError(f"k-quant quantize: type {ti.name} not supported")
    assert out.shape == (b.shape[0], ti.type_size)
    return out.reshape(-1)


def quantize_row(x: np.ndarray, qtype: int) -> np.ndarray:
    """f32 values (any shape, C order, a multiple of 256) as one row -> ggml's
    quantize_row_<type>_ref bytes (the same as `quantize` without an imatrix)."""
    return quantize(np.asarray(x, np.float32).reshape(1, -1), qtype)
