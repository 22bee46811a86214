"""Numba quantizers for Q8_0, Q4_0, Q2_K .. Q6_K, IQ4_NL and IQ4_XS (with and without an imatrix).

They write the same bytes as the NumPy references (quant.reference for Q8_0 / Q4_0,
quant.kquants for the k-quants), which mirror ik_llama.cpp's ggml_quantize_chunk:

* every f32 operation of C is done in f32 in C's order (fastmath off: LLVM neither reassociates
  nor contracts), with a fused multiply-add (`_fma`, llvm.fma: one rounding, as the FMA
  instruction of ik's -march=native build) exactly where quant.kquants' *_FUSE tables say ik
  fuses one.  (quant.reference.fma32 emulates it in f64, which can round twice on exact f32
  ties; no input tried here gave a different byte.)
* nearest_int of a product, which ik's build fuses into the magic-number add, is
  fma(a, b, 1.5*2^23) - 1.5*2^23 (`_rint_prod`): the exact product rounded half to even;
* the per-group fits (make_qkx2_quants, make_qkx3_quants, make_qx_quants, make_q3_quants and
  the IQ4 fit of quantize_row_iq4_nl_impl) run on the 16 or 32 groups of a few super-blocks
  side by side (`*_lanes`: group g in column g), so that each group's sums keep C's element
  order while the loops over the groups vectorize.  C's early exits become per-group masks.

Every kernel is njit(cache=True, nogil=True): `ikcli quantize` calls `quantize` from several
threads at once.  error_model="numpy": a division by zero gives inf / nan as in C (those results
are never chosen), not an exception.

Entry point: `quantize(x, qtype, imatrix)` (rows x (nrows, n_per_row) f32) -> flat uint8 bytes;
quant.reference.quantize sends large inputs here (`fast=`).  `FAST_TYPES` the types it handles.

`seq_sum_sq_f32`: a sum of squares accumulated in f32 in element order, as a plain C loop
does it (no reassociation: fastmath off), for the whole-chunk test of quantize_row_q2_K_ref.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .f32ops import f32_bits as _f32_bits

Q8_0_ID, Q4_0_ID, Q2_K_ID, Q3_K_ID, Q4_K_ID, Q5_K_ID, Q6_K_ID, IQ4_NL_ID, IQ4_XS_ID = 8, 2, 10, 11, 12, 13, 14, 20, 23
FAST_TYPES = frozenset({Q8_0_ID, Q4_0_ID, Q2_K_ID, Q3_K_ID, Q4_K_ID, Q5_K_ID, Q6_K_ID, IQ4_NL_ID, IQ4_XS_ID})
# the types whose fast kernel also takes an imatrix (Q8_0 ignores it; Q4_0's imatrix path is legacy's)
FAST_IMATRIX_TYPES = FAST_TYPES - {Q4_0_ID}
_TYPE_SIZE = {Q8_0_ID: 34, Q4_0_ID: 18, Q2_K_ID: 84, Q3_K_ID: 110, Q4_K_ID: 144, Q5_K_ID: 176, Q6_K_ID: 210, IQ4_NL_ID: 18,
              IQ4_XS_ID: 136}
_BLOCK = {Q8_0_ID: 32, Q4_0_ID: 32, Q2_K_ID: 256, Q3_K_ID: 256, Q4_K_ID: 256, Q5_K_ID: 256, Q6_K_ID: 256, IQ4_NL_ID: 32,
          IQ4_XS_ID: 256}

_F32 = np.float32
_F64 = np.float64


# ----------------------------------------------------------------------------------------
# scalar primitives
# ----------------------------------------------------------------------------------------
@intrinsic
def _fma(typingctx, a, b, c):
    """a*b + c rounded once (f32): the FMA instruction where the CPU has one."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _bits_f32(typingctx, u):
    if u != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(inline="always", error_model="numpy")
def _f16_bits(f):
    """f32 -> IEEE half bits, round to nearest even (subnormals, overflow to inf, NaN quiet):
    the exponent-bias trick of the FP16 library that ggml's software path uses."""
    base = (abs(f) * _F32(5.192296858534828e33)) * _F32(7.703719777548943e-34)   # 2^112, 2^-110
    w = _f32_bits(f)
    shl1 = np.uint32(w + w)
    sign = w & np.uint32(0x80000000)
    bias = shl1 & np.uint32(0xFF000000)
    if bias < np.uint32(0x71000000):
        bias = np.uint32(0x71000000)
    base = _bits_f32(np.uint32((bias >> np.uint32(1)) + np.uint32(0x07800000))) + base
    bits = _f32_bits(base)
    nonsign = ((bits >> np.uint32(13)) & np.uint32(0x7C00)) + (bits & np.uint32(0x0FFF))
    if shl1 > np.uint32(0xFF000000):
        nonsign = np.uint32(0x7E00)
    return np.uint16((sign >> np.uint32(16)) | nonsign)


@njit(inline="always", error_model="numpy")
def _f16_value(h):
    """IEEE half bits -> f32 (exact)."""
    hv = np.int64(h)
    e = (hv >> 10) & 31
    m = hv & 1023
    if e == 0:
        v = _F32(m) * _F32(5.960464477539063e-08)          # 2^-24
    elif e == 31:
        v = _F32(np.inf) if m == 0 else _F32(np.nan)
    else:
        v = _F32((1024 + m) * 2.0 ** (e - 25))
    return -v if hv & 0x8000 else v


@njit(inline="always", error_model="numpy")
def _put_f16(out, o, h):
    out[o] = np.uint8(h & 255)
    out[o + 1] = np.uint8(h >> 8)


@njit(inline="always", error_model="numpy")
def _nearest_prod(a, b):
    """nearest_int(a*b) with the f32 product exact: round half to even of the f64 product."""
    return np.int64(np.rint(np.float64(a) * np.float64(b)))


@njit(inline="always", error_model="numpy")
def _nearest(v):
    """nearest_int of an f32 already rounded (half to even)."""
    return np.int64(np.rint(v))


@njit(cache=True, fastmath=False, nogil=True)
def seq_sum_sq_f32(v):
    """sum of v[i]*v[i] over a flat f32 array, each product and sum rounded to f32 in order."""
    s = np.float32(0)
    for i in range(v.shape[0]):
        s = np.float32(s + np.float32(v[i] * v[i]))
    return s


@njit(inline="always", error_model="numpy")
def _absmax(v, o, n):
    """(the largest |v[o + j]|, j < n; the signed element that has it, the first on ties)."""
    amax = _F32(0)
    mx = _F32(0)
    for j in range(n):
        a = abs(v[o + j])
        if a > amax:
            amax = a
            mx = v[o + j]
    return amax, mx


@njit(inline="always", error_model="numpy")
def _max_pos(v, o, n):
    """max(0, v[o:o + n]) (NaN never wins)."""
    m = _F32(0)
    for j in range(n):
        if v[o + j] > m:
            m = v[o + j]
    return m


@njit(inline="always", error_model="numpy")
def _pack_2bit(L, out, o):
    """The low 2 bits of the 256 levels L as Q2_K's and Q3_K's qs: 4 planes of 32 per half."""
    for n in range(2):
        for l in range(32):
            q = 0
            for k in range(4):
                q |= (L[128 * n + 32 * k + l] & 3) << (2 * k)
            out[o + 32 * n + l] = np.uint8(q)


@njit(inline="always", error_model="numpy")
def _group_wsum(W, c0, ng, sw):
    """sw[j] = the sum of the weights of group c0 + j (column of W) in element order (f32)."""
    for j in range(ng):
        s = _F32(0)
        for i in range(W.shape[0]):
            s = s + W[i, c0 + j]
        sw[j] = s


# ----------------------------------------------------------------------------------------
# Q8_0, Q4_0 (quantize_row_q8_0_ref / q4_0_ref)
# ----------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, error_model="numpy")
def _q8_0_rows(x, out):
    nb = x.shape[0] // 32
    for b in range(nb):
        o = b * 34
        d = _absmax(x, 32 * b, 32)[0] / _F32(127)
        inv = _F32(1) / d if d != _F32(0) else _F32(0)
        _put_f16(out, o, _f16_bits(d))
        for j in range(32):
            v = x[32 * b + j] * inv
            a = abs(v)
            t = np.floor(a)
            if a - t >= _F32(0.5):
                t += _F32(1)
            q = np.int64(t)
            out[o + 2 + j] = np.uint8((-q if v < 0 else q) & 255)


@njit(cache=True, nogil=True, error_model="numpy")
def _q4_0_rows(x, out):
    nb = x.shape[0] // 32
    for b in range(nb):
        o = b * 18
        d = _absmax(x, 32 * b, 32)[1] / _F32(-8)
        inv = _F32(1) / d if d != _F32(0) else _F32(0)
        _put_f16(out, o, _f16_bits(d))
        for j in range(16):
            q0 = min(15, np.int64(x[32 * b + j] * inv + _F32(8.5)))
            q1 = min(15, np.int64(x[32 * b + j + 16] * inv + _F32(8.5)))
            out[o + 2 + j] = np.uint8(q0 | (q1 << 4))


# ----------------------------------------------------------------------------------------
# the fits
# ----------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, error_model="numpy")
def _make_qp(x, n, nmax, w, L):
    """make_qp_quants(n, nmax, x, L, w) for x[:n] >= 0 (QP_FUSE: the mse unfused, the sums and
    their updates fused).  Writes L[:n]; returns the scale."""
    mx = _F32(0)
    for i in range(n):
        if x[i] > mx:
            mx = x[i]
    zero = mx < _F32(1e-16)
    if zero:
        mx = _F32(1)
    fn = _F32(nmax)
    iscale = fn / mx
    best_mse = _F32(0)
    for k in range(9):
        if k == 0:
            isc = iscale
        else:
            is_ = k - 5 if k <= 4 else k - 4
            isc = (_F32(0.1) * _F32(is_) + fn) / mx
        sc = _F32(1) / isc
        tot = _F32(0)
        for i in range(n):
            l = _nearest_prod(isc, x[i])
            if k > 0:
                l = min(nmax, l)
            diff = (-sc) * _F32(l) + x[i]
            tot = (w[i] * diff) * diff + tot
        if k == 0:
            best_mse = tot
        elif tot < best_mse:
            best_mse = tot
            iscale = isc
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        l = min(nmax, _nearest_prod(iscale, x[i]))
        L[i] = l
        lf = _F32(l)
        sumlx = _fma(w[i] * x[i], lf, sumlx)
        suml2 = _fma(w[i] * lf, lf, suml2)
    if zero:
        for i in range(n):
            L[i] = 0
        return _F32(0)
    for _ in range(5):
        changed = False
        for i in range(n):
            li = _F32(L[i])
            wx = w[i] * x[i]
            slx = _fma(-wx, li, sumlx)
            sl2 = _fma(-(w[i] * li), li, suml2)
            if slx > _F32(0) and sl2 > _F32(0):
                nl = min(nmax, _nearest((x[i] * sl2) / slx))
                if nl != L[i]:
                    nf = _F32(nl)
                    slx2 = _fma(wx, nf, slx)
                    sl22 = _fma(w[i] * nf, nf, sl2)
                    if (slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22:
                        L[i] = nl
                        sumlx = slx2
                        suml2 = sl22
                        changed = True
        if not changed:
            break
    return sumlx / suml2 if suml2 != _F32(0) else _F32(0)


# ----------------------------------------------------------------------------------------
# Q4_K / Q5_K
# ----------------------------------------------------------------------------------------
@njit(inline="always", error_model="numpy")
def _finish_q45_k(x, xo, L, ls, lm, d16, dmin16, five, out, o):
    """Pack the scales, requantize each sub-block with its stored scale and min (where the scale
    is non-zero; else keep L[256]) and write one Q4_K / Q5_K super-block at out[o:]."""
    nmax = 31 if five else 15
    _put_f16(out, o, d16)
    _put_f16(out, o + 2, dmin16)
    for j in range(4):
        out[o + 4 + j] = np.uint8((ls[j] | ((ls[j + 4] >> 4) << 6)) & 255)
        out[o + 8 + j] = np.uint8((lm[j] | ((lm[j + 4] >> 4) << 6)) & 255)
        out[o + 12 + j] = np.uint8(((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4)) & 255)
    df = _f16_value(d16)
    dmf = _f16_value(dmin16)
    for j in range(8):
        d = df * _F32(ls[j])
        if d != _F32(0):
            dm = dmf * _F32(lm[j])
            for i in range(32):
                q = _nearest((x[xo + 32 * j + i] + dm) / d)
                L[32 * j + i] = min(max(q, 0), nmax)
    qs = o + (48 if five else 16)
    for c in range(4):
        for i in range(32):
            a = L[64 * c + i]
            b = L[64 * c + 32 + i]
            out[qs + 32 * c + i] = np.uint8((a & 15) | ((b & 15) << 4))
    if five:
        for i in range(32):
            h = 0
            for c in range(4):
                h |= ((L[64 * c + i] >> 4) & 1) << (2 * c)
                h |= ((L[64 * c + 32 + i] >> 4) & 1) << (2 * c + 1)
            out[o + 16 + i] = np.uint8(h)


@njit(inline="always", error_model="numpy")
def _ab_minus_cd(a, b, c, d, how):
    """a*b - c*d in f32: how 0 = no FMA, 1 = fma(a, b, -(c*d)), 2 = fma(-c, d, a*b)."""
    if how == 1:
        return _fma(a, b, -(c * d))
    if how == 2:
        return _fma(-c, d, a * b)
    return a * b - c * d


_MAGIC = np.float32(12582912.0)     # 1.5 * 2^23: x + MAGIC rounds x to an integer (|x| < 2^22)


@njit(inline="always", error_model="numpy")
def _rint_prod(a, b):
    """nearest_int(a*b) as ik's build computes it, fma(a, b, MAGIC) - MAGIC: the exact product
    rounded half to even (the same as _nearest_prod for |a*b| < 2^22), as an f32."""
    return _fma(a, b, _MAGIC) - _MAGIC


@njit(cache=True, nogil=True, error_model="numpy")
def _qkx2_lanes(X, W, G, nmax, rmin, rdelta, nstep, use_mad, s0, s1, s2, L, La, scale, themin):
    """make_qkx2_quants (every a*b + c fused but the solve's three a*b - c*d, whose forms s0,
    s1, s2 are those of _ab_minus_cd) on G groups at once, group g in
    column g of X and W (n, >= G): ggml's arithmetic (quant.kquants.make_qkx2_quants with
    _QKX2_FUSED), each group's sums in element order, but the groups side by side so that the
    loops over g vectorize (a group that C would return early from, max - min < 1e-10, runs
    along with range 1 and is reset at the end).
    Writes L[:, :G] (f32 levels), scale[:G] and themin[:G] (= -min)."""
    n = X.shape[0]
    f32 = np.float32
    fnmax = f32(nmax)
    mn = np.empty(G, f32)
    mn0 = np.empty(G, f32)
    mx = np.empty(G, f32)
    sum_w = np.empty(G, f32)
    sum_x = np.empty(G, f32)
    best = np.empty(G, f32)
    isc = np.empty(G, f32)
    sl = np.empty(G, f32)
    sl2 = np.empty(G, f32)
    sxl = np.empty(G, f32)
    ts = np.empty(G, f32)
    tm = np.empty(G, f32)
    mad = np.empty(G, f32)
    ok = np.empty(G, np.bool_)
    flat = np.empty(G, np.bool_)
    better = np.empty(G, np.bool_)
    for g in range(G):
        mn[g] = X[0, g]
        mx[g] = X[0, g]
        sum_w[g] = W[0, g]
        sum_x[g] = W[0, g] * X[0, g]
    for i in range(1, n):
        for g in range(G):
            v = X[i, g]
            mn[g] = v if v < mn[g] else mn[g]
            mx[g] = v if v > mx[g] else mx[g]
            sum_w[g] = sum_w[g] + W[i, g]
            sum_x[g] = _fma(W[i, g], v, sum_x[g])
    for g in range(G):
        if mn[g] > f32(0):
            mn[g] = f32(0)
        mn0[g] = mn[g]
        r = mx[g] - mn[g]
        flat[g] = r < f32(1e-10)
        if flat[g]:
            r = f32(1)
        iscale = fnmax / r
        isc[g] = iscale
        scale[g] = f32(1) / iscale
        best[g] = f32(0)
    for i in range(n):
        for g in range(G):
            l = min(max(_rint_prod(isc[g], X[i, g] - mn[g]), f32(0)), fnmax)
            L[i, g] = l
            diff = _fma(scale[g], l, mn[g]) - X[i, g]
            best[g] = _fma(W[i, g], abs(diff) if use_mad else diff * diff, best[g])
    for is_ in range(nstep + 1):
        num = _fma(rdelta, f32(is_), rmin) + fnmax
        for g in range(G):
            r = mx[g] - mn[g]
            if flat[g]:
                r = f32(1)
            isc[g] = num / r
            sl[g] = f32(0)
            sl2[g] = f32(0)
            sxl[g] = f32(0)
        for i in range(n):
            for g in range(G):
                l = min(max(_rint_prod(isc[g], X[i, g] - mn[g]), f32(0)), fnmax)
                La[i, g] = l
                wl = W[i, g] * l
                sl[g] = sl[g] + wl
                sl2[g] = _fma(wl, l, sl2[g])
                sxl[g] = _fma(wl, X[i, g], sxl[g])
        for g in range(G):
            D = _ab_minus_cd(sum_w[g], sl2[g], sl[g], sl[g], s0)
            ok[g] = D > f32(0)
            t_s = _ab_minus_cd(sum_w[g], sxl[g], sum_x[g], sl[g], s1) / D
            t_m = _ab_minus_cd(sl2[g], sum_x[g], sl[g], sxl[g], s2) / D
            if t_m > f32(0):
                t_m = f32(0)
                t_s = sxl[g] / sl2[g] if sl2[g] != f32(0) else sxl[g]
            ts[g] = t_s
            tm[g] = t_m
            mad[g] = f32(0)
        for i in range(n):
            for g in range(G):
                diff = _fma(ts[g], La[i, g], tm[g]) - X[i, g]
                mad[g] = _fma(W[i, g], abs(diff) if use_mad else diff * diff, mad[g])
        anyb = False
        for g in range(G):
            b = ok[g] and mad[g] < best[g]
            better[g] = b
            if b:
                anyb = True
                best[g] = mad[g]
                scale[g] = ts[g]
                mn[g] = tm[g]
        if anyb:
            for i in range(n):
                for g in range(G):
                    if better[g]:
                        L[i, g] = La[i, g]
    for g in range(G):
        if flat[g]:
            scale[g] = f32(0)
            themin[g] = -mn0[g]
            for i in range(n):
                L[i, g] = f32(0)
        else:
            themin[g] = -mn[g]


@njit(cache=True, nogil=True, error_model="numpy")
def _q45_k_rows(x, five, out):
    """quantize_row_q4_K_ref / q5_K_ref over the flat f32 x (a multiple of 256 values); four
    super-blocks (32 groups) go through the fit side by side."""
    nb = x.shape[0] // 256
    size = 176 if five else 144
    nmax = 31 if five else 15
    rmin = _F32(-0.5) if five else _F32(-1.0)
    nstep = 15 if five else 20
    SB = 4
    X = np.zeros((32, 8 * SB), _F32)
    W = np.zeros((32, 8 * SB), _F32)
    Lf = np.zeros((32, 8 * SB), _F32)
    La = np.zeros((32, 8 * SB), _F32)
    scales = np.zeros(8 * SB, _F32)
    mins = np.zeros(8 * SB, _F32)
    s2 = np.zeros(8 * SB, _F32)
    L = np.zeros(256, np.int64)
    ls = np.zeros(8, np.int64)
    lm = np.zeros(8, np.int64)
    for b0 in range(0, nb, SB):
        nsb = min(SB, nb - b0)
        G = 8 * nsb
        base = 256 * b0
        for g in range(G):
            for i in range(32):
                X[i, g] = x[base + 32 * g + i]
        for g in range(G):
            s2[g] = _F32(0)
        for i in range(32):
            for g in range(G):
                s2[g] = _fma(X[i, g], X[i, g], s2[g])
        for g in range(G):
            s2[g] = _F32(math.sqrt(s2[g] / _F32(32)))
        for i in range(32):
            for g in range(G):
                W[i, g] = s2[g] + abs(X[i, g])
        _qkx2_lanes(X, W, G, nmax, rmin, _F32(0.1), nstep, False, 1, 1, 1, Lf, La, scales, mins)
        for sb in range(nsb):
            g0 = 8 * sb
            max_scale = _max_pos(scales, g0, 8)
            max_min = _max_pos(mins, g0, 8)
            inv_scale = _F32(63) / max_scale if max_scale > _F32(0) else _F32(0)
            inv_min = _F32(63) / max_min if max_min > _F32(0) else _F32(0)
            for j in range(8):
                ls[j] = min(63, _nearest_prod(inv_scale, scales[g0 + j]) & 255)
                lm[j] = min(63, _nearest_prod(inv_min, mins[g0 + j]) & 255)
                for i in range(32):
                    L[32 * j + i] = np.int64(Lf[i, g0 + j])
            d16 = _f16_bits(max_scale / _F32(63))
            dmin16 = _f16_bits(max_min / _F32(63))
            _finish_q45_k(x, base + 256 * sb, L, ls, lm, d16, dmin16, five, out, (b0 + sb) * size)


@njit(inline="always", error_model="numpy")
def _imatrix_weights(x, xo, qw, n, mult, w):
    """w[:n] = qw * sqrt(sigma2 + x^2) for x[xo:xo + n], sigma2 = mult * sum(x^2) / n (the sum
    unfused, the inner x*x + sigma2 fused); qw the imatrix (n_per_row values), read from the
    offset xo modulo its length."""
    q = qw[xo % qw.shape[0]:]
    s = _F32(0)
    for i in range(n):
        s = x[xo + i] * x[xo + i] + s
    sigma2 = (mult * s) / _F32(n)
    for i in range(n):
        w[i] = q[i] * _F32(math.sqrt(_fma(x[xo + i], x[xo + i], sigma2)))


@njit(inline="always", error_model="numpy")
def _to_lanes(x, xo, w, ng, gs, X, W, c0):
    """The ng groups of gs values at x[xo:] (and their weights w[:ng * gs]) as the columns
    c0 .. c0 + ng - 1 of X and W: element i of group j at [i, c0 + j]."""
    for j in range(ng):
        for i in range(gs):
            X[i, c0 + j] = x[xo + gs * j + i]
            W[i, c0 + j] = w[gs * j + i]


@njit(cache=True, nogil=True, error_model="numpy")
def _qkx3_lanes(X, W, G, nmax, rmin, rdelta, nstep, L, La, scale, themin):
    """make_qkx3_quants (sums in f64) on G groups side by side (group g in column g of X, W):
    the arithmetic of quant.kquants.make_qkx3_quants, vectorized over the groups.  Writes L[:, :G] (f32 levels),
    scale[:G] and themin[:G] (= -min)."""
    n = X.shape[0]
    f32 = np.float32
    f64 = np.float64
    fnmax = f32(nmax)
    mn = np.empty(G, f32)
    mx = np.empty(G, f32)
    sum_w = np.empty(G, f64)
    sum_x = np.empty(G, f64)
    sum_x2 = np.empty(G, f64)
    best = np.empty(G, f64)
    isc = np.empty(G, f32)
    sl = np.empty(G, f64)
    sl2 = np.empty(G, f64)
    sxl = np.empty(G, f64)
    better = np.empty(G, np.bool_)
    flat = np.empty(G, np.bool_)
    active = np.empty(G, np.bool_)
    beff = np.empty(G, f32)
    bj = np.empty(G, np.int64)
    bdir = np.empty(G, np.int64)
    last_j = np.empty(G, np.int64)
    last_dir = np.empty(G, np.int64)
    for g in range(G):
        mn[g] = X[0, g]
        mx[g] = X[0, g]
        wd = f64(W[0, g])
        xd = f64(X[0, g])
        sum_w[g] = wd
        sum_x[g] = wd * xd
        sum_x2[g] = wd * xd * xd
    for i in range(1, n):
        for g in range(G):
            v = X[i, g]
            mn[g] = v if v < mn[g] else mn[g]
            mx[g] = v if v > mx[g] else mx[g]
            wd = f64(W[i, g])
            xd = f64(v)
            sum_w[g] = sum_w[g] + wd
            sum_x[g] = sum_x[g] + wd * xd
            sum_x2[g] = sum_x2[g] + wd * xd * xd
    for g in range(G):
        if mn[g] > f32(0):
            mn[g] = f32(0)
        r = mx[g] - mn[g]
        flat[g] = r < f32(1e-10)
        if flat[g]:
            r = f32(1)
        iscale = fnmax / r
        isc[g] = iscale
        scale[g] = f32(1) / iscale
        themin[g] = -mn[g]                    # the flat groups keep it
        best[g] = 0.0
    for i in range(n):
        for g in range(G):
            l = min(max(_rint_prod(isc[g], X[i, g] - mn[g]), f32(0)), fnmax)
            L[i, g] = l
            diff = f64(scale[g]) * f64(l) + f64(mn[g]) - f64(X[i, g])
            best[g] = best[g] + f64(W[i, g]) * (diff * diff)
    for is_ in range(nstep + 1):
        num = _fma(rdelta, f32(is_), rmin) + fnmax
        for g in range(G):
            r = mx[g] - mn[g]
            if flat[g]:
                r = f32(1)
            isc[g] = num / r
            sl[g] = 0.0
            sl2[g] = 0.0
            sxl[g] = 0.0
        for i in range(n):
            for g in range(G):
                l = min(max(_rint_prod(isc[g], X[i, g] - mn[g]), f32(0)), fnmax)
                La[i, g] = l
                wl = f64(W[i, g]) * f64(l)
                sl[g] = sl[g] + wl
                sl2[g] = sl2[g] + wl * f64(l)
                sxl[g] = sxl[g] + wl * f64(X[i, g])
        anyb = False
        for g in range(G):
            D = sum_w[g] * sl2[g] - sl[g] * sl[g]
            b = False
            if D > 0 and not flat[g]:
                ts = (sum_w[g] * sxl[g] - sum_x[g] * sl[g]) / D
                tm = (sl2[g] * sum_x[g] - sl[g] * sxl[g]) / D
                if tm > 0:
                    tm = 0.0
                    ts = sxl[g] / sl2[g] if sl2[g] != 0 else sxl[g]
                mad = (sum_x2[g] - 2 * ts * sxl[g] - 2 * tm * sum_x[g] + 2 * ts * tm * sl[g]
                       + ts * ts * sl2[g] + tm * tm * sum_w[g])
                if mad < best[g]:
                    b = True
                    best[g] = mad
                    scale[g] = f32(ts)
                    mn[g] = f32(tm)
            better[g] = b
            anyb = anyb or b
        if anyb:
            for i in range(n):
                for g in range(G):
                    if better[g]:
                        L[i, g] = La[i, g]
    # greedy: move the element farthest from its level one step while the fit improves
    for g in range(G):
        sl[g] = 0.0
        sl2[g] = 0.0
        sxl[g] = 0.0
    for i in range(n):
        for g in range(G):
            wl = f64(W[i, g]) * f64(L[i, g])
            sl[g] = sl[g] + wl
            sl2[g] = sl2[g] + wl * f64(L[i, g])
            sxl[g] = sxl[g] + wl * f64(X[i, g])
    for g in range(G):
        sd = f64(scale[g])
        md = f64(mn[g])
        best[g] = (2 * sd * sxl[g] + 2 * md * sum_x[g] - 2 * sd * md * sl[g] - sd * sd * sl2[g]
                   - md * md * sum_w[g])
        last_j[g] = -1
        last_dir[g] = 0
        active[g] = not flat[g]
    for _ in range(nmax * n):
        anya = False
        for g in range(G):
            anya = anya or active[g]
            beff[g] = f32(0)
            bj[g] = 0
            bdir[g] = -1
        if not anya:
            break
        for i in range(n):
            for g in range(G):
                gv = (X[i, g] - scale[g] * L[i, g]) - mn[g]
                e = f32(0)
                d = -1
                if gv > f32(0) and L[i, g] < fnmax:
                    e = gv
                    d = 1
                elif gv < f32(0) and L[i, g] > f32(0):
                    e = -gv
                if e > beff[g]:
                    beff[g] = e
                    bj[g] = i
                    bdir[g] = d
        for g in range(G):
            if not active[g]:
                continue
            j = bj[g]
            dr = bdir[g]
            if not beff[g] > f32(0) or (j == last_j[g] and dr == -last_dir[g]):
                active[g] = False
                continue
            wj = f64(W[j, g])
            lj = np.int64(L[j, g])
            nsl = sl[g] + wj * dr
            nsl2 = sl2[g] + wj * (2 * lj * dr + 1)
            nsxl = sxl[g] + wj * f64(X[j, g]) * dr
            D = sum_w[g] * nsl2 - nsl * nsl
            if not D > 0:
                active[g] = False
                continue
            ts = (sum_w[g] * nsxl - sum_x[g] * nsl) / D
            tm = (nsl2 * sum_x[g] - nsl * nsxl) / D
            if tm > 0:
                tm = 0.0
                ts = nsxl / nsl2
            score = (2 * ts * nsxl + 2 * tm * sum_x[g] - 2 * ts * tm * nsl - ts * ts * nsl2
                     - tm * tm * sum_w[g])
            if not (ts >= 0 and score > best[g]):
                active[g] = False
                continue
            sl[g] = nsl
            sl2[g] = nsl2
            sxl[g] = nsxl
            best[g] = score
            scale[g] = f32(ts)
            mn[g] = f32(tm)
            L[j, g] = f32(lj + dr)
            last_j[g] = j
            last_dir[g] = dr
    for g in range(G):
        if flat[g]:
            scale[g] = f32(0)
            for i in range(n):
                L[i, g] = f32(0)
        else:
            themin[g] = -mn[g]


@njit(cache=True, nogil=True, error_model="numpy")
def _q45_k_rows_im(x, qw, five, out):
    """quantize_row_q4_K_impl / q5_K_impl; qw the imatrix (n_per_row values, read at the offset
    in x modulo its length); four
    super-blocks (32 groups) go through the fit side by side."""
    nb = x.shape[0] // 256
    size = 176 if five else 144
    nmax = 31 if five else 15
    SB = 4
    X = np.zeros((32, 8 * SB), _F32)
    W = np.zeros((32, 8 * SB), _F32)
    Lf = np.zeros((32, 8 * SB), _F32)
    La = np.zeros((32, 8 * SB), _F32)
    scales = np.zeros(8 * SB, _F32)
    mins = np.zeros(8 * SB, _F32)
    w = np.zeros(256, _F32)
    sw = np.zeros(8, _F32)
    L = np.zeros(256, np.int64)
    ls = np.zeros(8, np.int64)
    lm = np.zeros(8, np.int64)
    for b0 in range(0, nb, SB):
        nsb = min(SB, nb - b0)
        G = 8 * nsb
        base = 256 * b0
        for sb in range(nsb):
            xo = base + 256 * sb
            _imatrix_weights(x, xo, qw, 256, _F32(2.0), w)
            for j in range(8):
                for i in range(32):
                    X[i, 8 * sb + j] = x[xo + 32 * j + i]
                    W[i, 8 * sb + j] = w[32 * j + i]
        _qkx3_lanes(X, W, G, nmax, _F32(-0.9), _F32(0.05), 36, Lf, La, scales, mins)
        for sb in range(nsb):
            g0 = 8 * sb
            _group_wsum(W, g0, 8, sw)
            for j in range(8):
                for i in range(32):
                    L[32 * j + i] = np.int64(Lf[i, g0 + j])
            dblk = _make_qp(scales[g0:g0 + 8], 8, 63, sw, ls)
            mblk = _make_qp(mins[g0:g0 + 8], 8, 63, sw, lm)
            if five:
                for j in range(8):
                    ls[j] = min(ls[j], 63)
                    lm[j] = min(lm[j], 63)
            _finish_q45_k(x, base + 256 * sb, L, ls, lm, _f16_bits(dblk), _f16_bits(mblk), five, out,
                          (b0 + sb) * size)


# ----------------------------------------------------------------------------------------
# Q6_K
# ----------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, error_model="numpy")
def _qx_lanes(X, W, G, nmax, L, scale):
    """make_qx_quants(rmse_type 1, weights W) with QX_FUSE_Q6K on G groups side by side (group
    g in column g of X, W (n, >= G)): the arithmetic of quant.kquants.make_qx_quants,
    vectorized over the groups.
    Writes L[:, :G] (f32 levels 0..2*nmax-1) and scale[:G]."""
    n = X.shape[0]
    f32 = np.float32
    fn = f32(nmax)
    amax = np.empty(G, f32)
    mx = np.empty(G, f32)
    sumlx = np.empty(G, f32)
    suml2 = np.empty(G, f32)
    best = np.empty(G, f32)
    isc = np.empty(G, f32)
    sx = np.empty(G, f32)
    s2 = np.empty(G, f32)
    bag = np.empty(G, f32)
    bgv = np.empty(G, f32)
    bj = np.empty(G, np.int64)
    better = np.empty(G, np.bool_)
    active = np.empty(G, np.bool_)
    for g in range(G):
        amax[g] = f32(0)
        mx[g] = f32(0)
        sumlx[g] = f32(0)
        suml2[g] = f32(0)
    for i in range(n):
        for g in range(G):
            a = abs(X[i, g])
            if a > amax[g]:
                amax[g] = a
                mx[g] = X[i, g]
    for g in range(G):
        active[g] = not amax[g] < f32(1e-15)
        if not active[g]:
            mx[g] = f32(1)
        isc[g] = -fn / mx[g]
    for i in range(n):
        for g in range(G):
            l = min(max(_rint_prod(isc[g], X[i, g]), -fn), fn - f32(1))
            L[i, g] = l + fn
            sumlx[g] = _fma(W[i, g] * X[i, g], l, sumlx[g])
            suml2[g] = _fma(W[i, g] * l, l, suml2[g])
    for g in range(G):
        scale[g] = sumlx[g] / suml2[g] if suml2[g] != f32(0) else f32(0)
        best[g] = scale[g] * sumlx[g]
    for is_ in range(-9, 10):
        num = f32(0.1) * f32(is_)
        for k in range(2):
            for g in range(G):
                isc[g] = -(num + fn) / mx[g] if k == 0 else (num + (fn - f32(1))) / mx[g]
                sx[g] = f32(0)
                s2[g] = f32(0)
            for i in range(n):
                for g in range(G):
                    lf = min(max(_rint_prod(isc[g], X[i, g]), -fn), fn - f32(1))
                    sx[g] = sx[g] + (W[i, g] * X[i, g]) * lf
                    s2[g] = s2[g] + (W[i, g] * lf) * lf
            anyb = False
            for g in range(G):
                b = s2[g] > f32(0) and sx[g] * sx[g] > best[g] * s2[g]
                better[g] = b
                if b:
                    anyb = True
                    scale[g] = sx[g] / s2[g]
                    best[g] = scale[g] * sx[g]
                    sumlx[g] = sx[g]
                    suml2[g] = s2[g]
            if anyb:
                for i in range(n):
                    for g in range(G):
                        if better[g]:
                            L[i, g] = min(max(_rint_prod(isc[g], X[i, g]), -fn), fn - f32(1)) + fn
    # greedy: in each group move the element with the largest gradient one step while it helps
    for _ in range(n * (2 * nmax - 1)):
        anya = False
        for g in range(G):
            anya = anya or active[g]
            bag[g] = f32(0)
            bgv[g] = f32(0)
            bj[g] = -1
        if not anya:
            break
        for i in range(n):
            for g in range(G):
                l = L[i, g] - fn
                gr = (scale[g] * W[i, g]) * ((-scale[g]) * l + X[i, g])
                can = (gr > f32(0) and l < fn - f32(1)) or (gr < f32(0) and l > -fn)
                ag = abs(gr) if can else f32(0)
                if ag > bag[g]:
                    bag[g] = ag
                    bj[g] = i
                    bgv[g] = gr
        for g in range(G):
            if not active[g]:
                continue
            j = bj[g]
            if j < 0:
                active[g] = False
                continue
            lj = L[j, g] - fn
            wj = W[j, g]
            xj = X[j, g]
            if bgv[g] > f32(0):
                nsx = wj * xj + sumlx[g]
                ns2 = wj * (f32(2) * lj + f32(1)) + suml2[g]
            else:
                nsx = (-wj) * xj + sumlx[g]
                ns2 = (-wj) * (f32(2) * lj - f32(1)) + suml2[g]
            if ns2 > f32(0) and nsx * nsx > best[g] * ns2:
                sumlx[g] = nsx
                suml2[g] = ns2
                scale[g] = nsx / ns2
                best[g] = scale[g] * nsx
                L[j, g] += f32(1) if bgv[g] > f32(0) else f32(-1)
            else:
                active[g] = False
    for g in range(G):
        if amax[g] < f32(1e-15):
            scale[g] = f32(0)
            for i in range(n):
                L[i, g] = f32(0)


@njit(cache=True, nogil=True, error_model="numpy")
def _q6_k_rows(x, qw, use_qw, out):
    """quantize_row_q6_K_ref (use_qw False: weights x^2) / q6_K_impl (qw: the imatrix, n_per_row
    values read at the offset in x modulo its length); two super-blocks (32 groups of 16) go through the fit side by side."""
    nb = x.shape[0] // 256
    SB = 2
    X = np.zeros((16, 16 * SB), _F32)
    W = np.zeros((16, 16 * SB), _F32)
    Lf = np.zeros((16, 16 * SB), _F32)
    sc_all = np.zeros(16 * SB, _F32)
    L = np.zeros(256, np.int64)
    for b0 in range(0, nb, SB):
        nsb = min(SB, nb - b0)
        G = 16 * nsb
        base = 256 * b0
        for g in range(G):
            r = (base + 16 * g) % qw.shape[0]
            for i in range(16):
                v = x[base + 16 * g + i]
                X[i, g] = v
                W[i, g] = qw[r + i] if use_qw else v * v
        _qx_lanes(X, W, G, 32, Lf, sc_all)
        for sb in range(nsb):
            xo = base + 256 * sb
            o = 210 * (b0 + sb)
            scales = sc_all[16 * sb:16 * sb + 16]
            amax, mx = _absmax(scales, 0, 16)
            if amax < _F32(1e-15):
                for k in range(210):
                    out[o + k] = 0
                continue
            for j in range(16):
                for i in range(16):
                    L[16 * j + i] = np.int64(Lf[i, 16 * sb + j])
            iscale = _F32(-128) / mx
            d16 = _f16_bits(_F32(1) / iscale)
            df = _f16_value(d16)
            for j in range(16):
                q = min(127, _nearest_prod(iscale, scales[j]))
                out[o + 192 + j] = np.uint8(q & 255)
                dl = df * _F32(q)
                if dl != _F32(0):
                    for i in range(16):
                        v = _nearest(x[xo + 16 * j + i] / dl)
                        L[16 * j + i] = min(max(v, -32), 31) + 32
            _put_f16(out, o + 208, d16)
            for n in range(2):
                for i in range(32):
                    l0 = L[128 * n + i]
                    l1 = L[128 * n + 32 + i]
                    l2 = L[128 * n + 64 + i]
                    l3 = L[128 * n + 96 + i]
                    out[o + 64 * n + i] = np.uint8((l0 & 15) | ((l2 & 15) << 4))
                    out[o + 64 * n + 32 + i] = np.uint8((l1 & 15) | ((l3 & 15) << 4))
                    out[o + 128 + 32 * n + i] = np.uint8((l0 >> 4) | ((l1 >> 4) << 2) | ((l2 >> 4) << 4) | ((l3 >> 4) << 6))


# ----------------------------------------------------------------------------------------
# Q2_K
# ----------------------------------------------------------------------------------------
@njit(inline="always", error_model="numpy")
def _pack_q2_k(L, sc, d16, dmin16, out, o):
    for j in range(16):
        out[o + j] = np.uint8(sc[j] & 255)
    _pack_2bit(L, out, o + 16)
    _put_f16(out, o + 80, d16)
    _put_f16(out, o + 82, dmin16)


@njit(cache=True, nogil=True, error_model="numpy")
def _q2_k_rows(x, out):
    """quantize_row_q2_K_ref over all of the flat f32 x at once (its ternary test spans the
    chunk); else make_qkx2_quants (weights |x|, use_mad, QKX2_FUSE_Q2K's solve) on two
    super-blocks (32 groups of 16) side by side."""
    nb = x.shape[0] // 256
    L = np.zeros(256, np.int64)
    sc = np.zeros(16, np.int64)
    mx = _F32(0)
    for i in range(x.shape[0]):
        a = abs(x[i])
        mx = a if a > mx else mx
    half = _F32(0.5) * mx
    mse0 = _F32(0)
    mse = _F32(0)
    for i in range(x.shape[0]):
        v = x[i]
        lt = -1 if v < -half else (0 if v < half else 1)
        dv = v - mx * _F32(lt)
        mse0 = mse0 + v * v
        mse = mse + dv * dv
    if mse < _F32(0.1) * mse0:                      # ternary: every weight -mx, 0 or mx
        m16 = _f16_bits(mx)
        for j in range(16):
            sc[j] = 1 | (1 << 4)
        for b in range(nb):
            for i in range(256):
                v = x[256 * b + i]
                L[i] = 0 if v < -half else (1 if v < half else 2)
            _pack_q2_k(L, sc, m16, m16, out, 84 * b)
        return
    SB = 2
    X = np.zeros((16, 16 * SB), _F32)
    W = np.zeros((16, 16 * SB), _F32)
    Lf = np.zeros((16, 16 * SB), _F32)
    La = np.zeros((16, 16 * SB), _F32)
    scales = np.zeros(16 * SB, _F32)
    mins = np.zeros(16 * SB, _F32)
    for b0 in range(0, nb, SB):
        nsb = min(SB, nb - b0)
        G = 16 * nsb
        base = 256 * b0
        for g in range(G):
            for i in range(16):
                v = x[base + 16 * g + i]
                X[i, g] = v
                W[i, g] = abs(v)
        _qkx2_lanes(X, W, G, 3, _F32(-0.5), _F32(0.1), 15, True, 1, 2, 1, Lf, La, scales, mins)
        for s_ in range(nsb):
            g0 = 16 * s_
            xo = base + 256 * s_
            max_scale = _max_pos(scales, g0, 16)
            max_min = _max_pos(mins, g0, 16)
            isc = _F32(15) / max_scale if max_scale > _F32(0) else _F32(0)
            imn = _F32(15) / max_min if max_min > _F32(0) else _F32(0)
            d16 = _f16_bits(max_scale / _F32(15) if max_scale > _F32(0) else _F32(0))
            dmin16 = _f16_bits(max_min / _F32(15) if max_min > _F32(0) else _F32(0))
            df = _f16_value(d16)
            dmf = _f16_value(dmin16)
            for j in range(16):
                ls = _nearest_prod(isc, scales[g0 + j]) if max_scale > _F32(0) else 0
                lm = _nearest_prod(imn, mins[g0 + j]) if max_min > _F32(0) else 0
                scj = (ls | (lm << 4)) & 255
                sc[j] = scj
                d = df * _F32(scj & 15)
                dm = dmf * _F32(scj >> 4)
                for i in range(16):
                    if d != _F32(0):
                        L[16 * j + i] = min(max(_nearest((x[xo + 16 * j + i] + dm) / d), 0), 3)
                    else:
                        L[16 * j + i] = np.int64(Lf[i, g0 + j])
            _pack_q2_k(L, sc, d16, dmin16, out, 84 * (b0 + s_))


@njit(cache=True, nogil=True, error_model="numpy")
def _q2_k_rows_im(x, qw, out):
    """quantize_row_q2_K_impl; qw the imatrix (n_per_row values, read at the offset in x modulo
    its length); two super-blocks (32 groups of 16) through make_qkx3_quants side by side."""
    nb = x.shape[0] // 256
    SB = 2
    X = np.zeros((16, 16 * SB), _F32)
    W = np.zeros((16, 16 * SB), _F32)
    Lf = np.zeros((16, 16 * SB), _F32)
    La = np.zeros((16, 16 * SB), _F32)
    scales = np.zeros(16 * SB, _F32)
    mins = np.zeros(16 * SB, _F32)
    w = np.zeros(256, _F32)
    sw = np.zeros(16, _F32)
    L = np.zeros(256, np.int64)
    sc = np.zeros(16, np.int64)
    ls = np.zeros(16, np.int64)
    lm = np.zeros(16, np.int64)
    for b0 in range(0, nb, SB):
        nsb = min(SB, nb - b0)
        G = 16 * nsb
        base = 256 * b0
        for s_ in range(nsb):
            xo = base + 256 * s_
            _imatrix_weights(x, xo, qw, 256, _F32(0.75), w)
            _to_lanes(x, xo, w, 16, 16, X, W, 16 * s_)
        _qkx3_lanes(X, W, G, 3, _F32(-0.9), _F32(0.05), 36, Lf, La, scales, mins)
        for s_ in range(nsb):
            g0 = 16 * s_
            xo = base + 256 * s_
            _group_wsum(W, g0, 16, sw)
            dm = _make_qp(scales[g0:g0 + 16], 16, 15, sw, ls)
            mm = _make_qp(mins[g0:g0 + 16], 16, 15, sw, lm)
            for j in range(16):
                d = dm * _F32(ls[j])
                m = mm * _F32(lm[j])
                idv = _F32(1) / d if d != _F32(0) else _F32(0)
                for i in range(16):
                    L[16 * j + i] = min(max(_nearest_prod(x[xo + 16 * j + i] + m, idv), 0), 3)
                sc[j] = (ls[j] | (lm[j] << 4)) & 255
            _pack_q2_k(L, sc, _f16_bits(dm), _f16_bits(mm), out, 84 * (b0 + s_))


# ----------------------------------------------------------------------------------------
# Q3_K
# ----------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, error_model="numpy")
def _q3_lanes(X, G, nmax, L, scale):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) with Q3_FUSE (every a*b + c fused) on G
    groups side by side (group g in column g of X): writes L[:, :G] (f32 levels 0..2*nmax-1)
    and scale[:G]."""
    n = X.shape[0]
    f32 = np.float32
    fn = f32(nmax)
    amax = np.empty(G, f32)
    mx = np.empty(G, f32)
    sumlx = np.empty(G, f32)
    suml2 = np.empty(G, f32)
    active = np.empty(G, np.bool_)
    changed = np.empty(G, np.bool_)
    for g in range(G):
        amax[g] = f32(0)
        mx[g] = f32(0)
        sumlx[g] = f32(0)
        suml2[g] = f32(0)
    for i in range(n):
        for g in range(G):
            a = abs(X[i, g])
            if a > amax[g]:
                amax[g] = a
                mx[g] = X[i, g]
    for g in range(G):
        active[g] = not amax[g] < f32(1e-15)
        if not active[g]:
            mx[g] = f32(1)
        mx[g] = -fn / mx[g]                       # now the iscale
    for i in range(n):
        for g in range(G):
            x = X[i, g]
            l = min(max(_rint_prod(mx[g], x), -fn), fn - f32(1))
            L[i, g] = l
            w = x * x
            sumlx[g] = _fma(w * x, l, sumlx[g])
            suml2[g] = _fma(w * l, l, suml2[g])
    for _ in range(5):
        anya = False
        for g in range(G):
            anya = anya or active[g]
            changed[g] = False
        if not anya:
            break
        for i in range(n):
            for g in range(G):
                x = X[i, g]
                w = x * x
                wx = w * x
                li = L[i, g]
                slx = _fma(-wx, li, sumlx[g])
                sl2 = _fma(-(w * li), li, suml2[g])
                nl = min(max(_nearest((x * sl2) / (slx if slx > f32(0) else f32(1))), -nmax), nmax - 1)
                nf = f32(nl)
                if active[g] and slx > f32(0) and nf != li:
                    slx2 = _fma(wx, nf, slx)
                    sl22 = _fma(w * nf, nf, sl2)
                    if sl22 > f32(0) and (slx2 * slx2) * suml2[g] > (sumlx[g] * sumlx[g]) * sl22:
                        L[i, g] = nf
                        sumlx[g] = slx2
                        suml2[g] = sl22
                        changed[g] = True
        for g in range(G):
            active[g] = active[g] and changed[g]
    for g in range(G):
        if amax[g] < f32(1e-15):
            scale[g] = f32(0)
            for i in range(n):
                L[i, g] = f32(0)
        else:
            scale[g] = sumlx[g] / suml2[g] if suml2[g] != f32(0) else f32(0)
            for i in range(n):
                L[i, g] = L[i, g] + fn


@njit(cache=True, nogil=True, error_model="numpy")
def _q3_k_rows(x, qw, use_qw, out):
    """quantize_row_q3_K_ref (use_qw False) / q3_K_impl (qw: the imatrix, n_per_row values read
    at the offset in x modulo its length); two super-blocks (32 groups of 16) side by side."""
    nb = x.shape[0] // 256
    SB = 2
    X = np.zeros((16, 16 * SB), _F32)
    W = np.zeros((16, 16 * SB), _F32)
    Lf = np.zeros((16, 16 * SB), _F32)
    sc_all = np.zeros(16 * SB, _F32)
    X2 = np.zeros((16, SB), _F32)
    W2 = np.zeros((16, SB), _F32)
    L2 = np.zeros((16, SB), _F32)
    dblk = np.zeros(SB, _F32)
    w = np.zeros(256, _F32)
    L = np.zeros(256, np.int64)
    ls = np.zeros(16, np.int64)
    for b0 in range(0, nb, SB):
        nsb = min(SB, nb - b0)
        G = 16 * nsb
        base = 256 * b0
        for sb in range(nsb):
            xo = base + 256 * sb
            if use_qw:
                _imatrix_weights(x, xo, qw, 256, _F32(2.0), w)
            _to_lanes(x, xo, w, 16, 16, X, W, 16 * sb)
        if use_qw:
            _qx_lanes(X, W, G, 4, Lf, sc_all)
            for sb in range(nsb):
                _group_wsum(W, 16 * sb, 16, w)
                for j in range(16):
                    X2[j, sb] = sc_all[16 * sb + j]
                    W2[j, sb] = w[j]
            _qx_lanes(X2, W2, nsb, 32, L2, dblk)
        else:
            _q3_lanes(X, G, 4, Lf, sc_all)
        for sb in range(nsb):
            xo = base + 256 * sb
            o = 110 * (b0 + sb)
            if use_qw:
                d16 = _f16_bits(dblk[sb])
                for j in range(16):
                    ls[j] = np.int64(L2[j, sb])
            else:
                mxs = _absmax(sc_all, 16 * sb, 16)[1]
                if mxs != _F32(0):
                    iscale = _F32(-32) / mxs
                    d16 = _f16_bits(_F32(1) / iscale)
                    for j in range(16):
                        ls[j] = min(max(_nearest_prod(iscale, sc_all[16 * sb + j]), -32), 31) + 32
                else:
                    d16 = _f16_bits(_F32(0))
                    for j in range(16):
                        ls[j] = 0
            df = _f16_value(d16)
            for j in range(16):
                d = df * _F32(ls[j] - 32)
                for i in range(16):
                    if d != _F32(0):
                        L[16 * j + i] = min(max(_nearest(x[xo + 16 * j + i] / d), -4), 3) + 4
                    else:
                        L[16 * j + i] = np.int64(Lf[i, 16 * sb + j])
            for k in range(12):
                out[o + 96 + k] = 0
            for j in range(8):
                out[o + 96 + j] = np.uint8(((ls[j] & 15) | ((ls[j + 8] & 15) << 4)) & 255)
            for j in range(16):
                out[o + 96 + 8 + j % 4] |= np.uint8(((ls[j] >> 4) << (2 * (j // 4))) & 255)
            for l in range(32):
                h = 0
                for m in range(8):
                    if L[32 * m + l] > 3:
                        h |= 1 << m
                out[o + l] = np.uint8(h)
            _pack_2bit(L, out, o + 32)
            _put_f16(out, o + 108, d16)


# ----------------------------------------------------------------------------------------
# IQ4_NL / IQ4_XS (quantize_row_iq4_nl_impl, ntry 7)
# ----------------------------------------------------------------------------------------
# kvalues_iq4nl, the 16 levels of IQ4_NL / IQ4_XS
_KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


@njit(inline="always", error_model="numpy")
def _iq4_level(al):
    """(index, value) of the IQ4_NL level nearest to the f32 al, ties to the upper level, NaN
    -> level 0: best_index_iq4nl's table lookup and its f32 test `al - kv[a] < kv[b] - al` on an
    ambiguous bucket give the same as that test made for each adjacent pair of levels, counted
    (checked on every f32 in [-130, 130] once, and near every midpoint in
    tests/test_quantize_fast.py), which vectorizes."""
    kv = _KV
    idx = np.int32(0)
    q = kv[0]
    for k in range(15):
        up = al - kv[k] >= kv[k + 1] - al
        idx += np.int32(1) if up else np.int32(0)
        q = kv[k + 1] if up else q
    if al != al:
        idx = np.int32(0)
        q = kv[0]
    return idx, q


@njit(cache=True, nogil=True, error_model="numpy")
def _iq4_lanes(X, W, G, ntry, L, dout):
    """The per-block fit of quantize_row_iq4_nl_impl (IQ4_FUSE: every a*b + c fused) on G
    blocks of 32 side by side (block g in column g of X, W): writes L[:, :G] (level indices)
    and dout[:G] (the block scales; 0 for an all-zero block)."""
    n = X.shape[0]
    f32 = np.float32
    kv = _KV
    mx = np.empty(G, f32)
    amax = np.empty(G, f32)
    idv = np.empty(G, f32)
    sqx = np.empty(G, f32)
    sq2 = np.empty(G, f32)
    best = np.empty(G, f32)
    d = np.empty(G, f32)
    sumqx = np.empty(G, f32)
    sumq2 = np.empty(G, f32)
    better = np.empty(G, np.bool_)
    active = np.empty(G, np.bool_)
    mstep = np.empty(G, f32)
    bj = np.empty(G, np.int64)
    bdir = np.empty(G, np.int64)
    for g in range(G):
        amax[g] = f32(0)
        mx[g] = f32(0)
    for i in range(n):
        for g in range(G):
            a = abs(X[i, g])
            if a > amax[g]:
                amax[g] = a
                mx[g] = X[i, g]
    for g in range(G):
        active[g] = not amax[g] < f32(1e-15)
        if not active[g]:
            mx[g] = f32(1)
        d[g] = (-mx[g]) / f32(-127)
        idv[g] = f32(1) / d[g]
        sumqx[g] = f32(0)
        sumq2[g] = f32(0)
    for i in range(n):
        for g in range(G):
            l, q = _iq4_level(idv[g] * X[i, g])
            L[i, g] = l
            wq = W[i, g] * q
            sumqx[g] = _fma(wq, X[i, g], sumqx[g])
            sumq2[g] = _fma(wq, q, sumq2[g])
    for g in range(G):
        d[g] = sumqx[g] / sumq2[g]
        best[g] = d[g] * sumqx[g]
    for itry in range(-ntry, ntry + 1):
        for k in range(2):
            v0 = -127 if k == 0 else 113
            for g in range(G):
                idv[g] = f32(itry + v0) / mx[g]
                sqx[g] = f32(0)
                sq2[g] = f32(0)
            for i in range(n):
                for g in range(G):
                    q = _iq4_level(idv[g] * X[i, g])[1]
                    wq = W[i, g] * q
                    sqx[g] = _fma(wq, X[i, g], sqx[g])
                    sq2[g] = _fma(wq, q, sq2[g])
            anyb = False
            for g in range(G):
                b = sq2[g] > f32(0) and sqx[g] * sqx[g] > best[g] * sq2[g]
                better[g] = b
                if b:
                    anyb = True
                    d[g] = sqx[g] / sq2[g]
                    best[g] = d[g] * sqx[g]
                    sumqx[g] = sqx[g]
                    sumq2[g] = sq2[g]
            if anyb:
                for i in range(n):
                    for g in range(G):
                        if better[g]:
                            L[i, g] = _iq4_level(idv[g] * X[i, g])[0]
    # greedy: step the element whose gradient reaches the next level first, while it helps
    for _ in range(32 * n):
        anya = False
        for g in range(G):
            anya = anya or active[g]
            mstep[g] = f32(np.inf)
            bj[g] = -1
            bdir[g] = 0
        if not anya:
            break
        for i in range(n):
            for g in range(G):
                li = np.int64(L[i, g])
                v = kv[li]
                gr = (d[g] * W[i, g]) * _fma(-d[g], v, X[i, g])
                if gr > f32(0) and li < 15:
                    st = (kv[li + 1] - v) / gr
                    if st < mstep[g]:
                        mstep[g] = st
                        bj[g] = i
                        bdir[g] = 1
                elif gr < f32(0) and li > 0:
                    st = (kv[li - 1] - v) / gr
                    if st < mstep[g]:
                        mstep[g] = st
                        bj[g] = i
                        bdir[g] = -1
        for g in range(G):
            if not active[g]:
                continue
            j = bj[g]
            if j < 0:
                active[g] = False
                continue
            lj = np.int64(L[j, g])
            ln = lj + bdir[g]
            wj = W[j, g]
            dv = kv[ln] - kv[lj]
            dv2 = kv[ln] * kv[ln] - kv[lj] * kv[lj]
            nsx = _fma(wj * X[j, g], dv, sumqx[g])
            ns2 = _fma(wj, dv2, sumq2[g])
            if ns2 > f32(0) and nsx * nsx > best[g] * ns2:
                sumqx[g] = nsx
                sumq2[g] = ns2
                d[g] = nsx / ns2
                best[g] = d[g] * sumqx[g]
                L[j, g] = f32(ln)
            else:
                active[g] = False
    for g in range(G):
        dout[g] = f32(0) if amax[g] < f32(1e-15) else d[g]


@njit(cache=True, nogil=True, error_model="numpy")
def _iq4_rows(x, qw, use_qw, xs, out):
    """quantize_iq4_xs (xs) / quantize_iq4_nl over the flat f32 x; qw the imatrix (use_qw;
    n_per_row values read at the offset in x modulo its length) or unused (weights x^2).  32 blocks of 32 go through the fit side by side."""
    sbs = 256 if xs else 32
    nblk = sbs // 32
    size = 136 if xs else 18
    nsbt = x.shape[0] // sbs
    GB = 32
    spb = GB // nblk                                # super-blocks per batch
    X = np.zeros((32, GB), _F32)
    W = np.zeros((32, GB), _F32)
    Lf = np.zeros((32, GB), _F32)
    dall = np.zeros(GB, _F32)
    w = np.zeros(256, _F32)
    for s0 in range(0, nsbt, spb):
        nsb = min(spb, nsbt - s0)
        G = nsb * nblk
        for sb in range(nsb):
            xo = (s0 + sb) * sbs
            if use_qw:
                _imatrix_weights(x, xo, qw, sbs, _F32(2.0), w)
            else:
                for i in range(sbs):
                    w[i] = x[xo + i] * x[xo + i]
            _to_lanes(x, xo, w, nblk, 32, X, W, nblk * sb)
        _iq4_lanes(X, W, G, 7, Lf, dall)
        for sb in range(nsb):
            xo = (s0 + sb) * sbs
            o = (s0 + sb) * size
            g0 = nblk * sb
            if xs:
                mxs = _absmax(dall, g0, 8)[1]
                dsb = (-mxs) / _F32(32)
                idsb = _F32(1) / dsb if dsb != _F32(0) else _F32(0)
                _put_f16(out, o, _f16_bits(dsb))
                sh = 0
                for j in range(8):
                    ls = min(max(_nearest_prod(idsb, dall[g0 + j]), -32), 31)
                    dl = dsb * _F32(ls)
                    idl = _F32(1) / dl if dl != _F32(0) else _F32(0)
                    for i in range(16):
                        lo = _iq4_level(idl * x[xo + 32 * j + i])[0]
                        hi = _iq4_level(idl * x[xo + 32 * j + 16 + i])[0]
                        out[o + 8 + 16 * j + i] = np.uint8(lo | (hi << 4))
                    l = ls + 32
                    if j % 2 == 0:
                        out[o + 4 + j // 2] = np.uint8(l & 15)
                    else:
                        out[o + 4 + j // 2] |= np.uint8((l & 15) << 4)
                    sh |= (l >> 4) << (2 * j)
                out[o + 2] = np.uint8(sh & 255)
                out[o + 3] = np.uint8(sh >> 8)
            else:
                dd = dall[g0]
                _put_f16(out, o, _f16_bits(dd))
                idd = _F32(1) / dd if dd != _F32(0) else _F32(0)
                for i in range(16):
                    lo = _iq4_level(idd * x[xo + i])[0]
                    hi = _iq4_level(idd * x[xo + 16 + i])[0]
                    out[o + 2 + i] = np.uint8(lo | (hi << 4))


# ----------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------
def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows x (nrows, n_per_row) f32 -> the flat bytes of qtype (one of FAST_TYPES), the same as
    quant.reference.quantize's NumPy references write (imatrix: None or (n_per_row,) f32;
    Q8_0 ignores it; Q4_0 with an imatrix is not here).  Releases the GIL while it runs."""
    if qtype not in FAST_TYPES:
        raise NotImplementedError(f"kquants_fast: type {qtype} not supported")
    x = np.ascontiguousarray(x, dtype=_F32)
    x = x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)
    nrows, n = x.shape
    bs = _BLOCK[qtype]
    if n % bs:
        raise ValueError(f"{n} values per row is not a multiple of the block size {bs}")
    flat = x.reshape(-1)
    out = np.empty(flat.size // bs * _TYPE_SIZE[qtype], np.uint8)
    if qtype == Q8_0_ID:
        _q8_0_rows(flat, out)
        return out
    if qtype == Q4_0_ID:
        if imatrix is not None:
            raise NotImplementedError("kquants_fast: Q4_0 with an imatrix is not supported")
        _q4_0_rows(flat, out)
        return out
    qw = None
    if imatrix is not None:
        im = np.ascontiguousarray(imatrix, dtype=_F32).reshape(-1)
        if im.size != n:
            raise ValueError(f"imatrix has {im.size} values but the rows have {n} columns")
        qw = im                       # the kernels read it at (offset in x) % n_per_row
    if qtype == Q6_K_ID:
        _q6_k_rows(flat, qw if qw is not None else flat, qw is not None, out)
    elif qtype == Q2_K_ID:
        if qw is None:
            _q2_k_rows(flat, out)
        else:
            _q2_k_rows_im(flat, qw, out)
    elif qtype == Q3_K_ID:
        _q3_k_rows(flat, qw if qw is not None else flat, qw is not None, out)
    elif qtype in (IQ4_NL_ID, IQ4_XS_ID):
        _iq4_rows(flat, qw if qw is not None else flat, qw is not None, qtype == IQ4_XS_ID, out)
    else:
        five = qtype == Q5_K_ID
        if qw is None:
            _q45_k_rows(flat, five, out)
        else:
            _q45_k_rows_im(flat, qw, five, out)
    return out
