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
def _f16(b: np.ndarray) -> np.ndarray:
    """(nb, 2) bytes -> (nb, 1) f32 of the little-endian f16 they hold."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


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
    nbytes = ti.row_bytes(n)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size < nbytes:
        raise ValueError(f"{raw.size} bytes is less than the {nbytes} needed for {n} {ti.name} values")
    b = raw[:nbytes].reshape(-1, ti.type_size)
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
