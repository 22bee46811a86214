#!/usr/bin/env python3
"""Write tests/data/golden_interleaved_iq.npz: ik_llama.cpp's bytes and values for the row-interleaved
forms of the mainline i-quants, MXFP4, Q5_0 / Q6_0 and IQ5_KS (quant.interleaved), and for its two
4-row i-quants that are not a repacking (IQ1_S_R4, IQ1_M_R4), via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_interleaved_iq.py

Contents: x (ROWS, N) f32 weight-like rows (with zero blocks and a zero-importance run, QHelper's
triggers), im (N,) f32 column importances; per type T:
    T/r        ggml_quantize_chunk(T, x[, im]) bytes, (ROWS, row_bytes); with im for the types
               whose base needs one (IQ2_XXS, IQ2_XS) and for IQ1_S_R4
    T/r/im     the same with im where T/r is without it and ik reads it
    T/plain    the base type's bytes of the same rows that T/r repacks (ik's _r4 quantizer is the
               base quantizer on QHelper's per-row weights, then repack): made row group by row
               group with those weights; the script checks repack(T/plain) == T/r
    T/deq      ik's dequantize_row_<t> of T/r (per group of 4 / 8 rows, as its to_float;
               MXFP4_R8: per row, working around an overrun in ik's, see dequantize_mxfp4_r8)
    T/rand     one group of random bytes (every field value a decoder can meet; scale fields kept
               finite), NR x row_bytes(N_RAND), and T/rand/deq its values by ik
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402
from quant import interleaved as il  # noqa: E402
from quant.types import type_info  # noqa: E402

ROWS, N, N_RAND = 8, 512, 256
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_interleaved_iq.npz")
TYPES = ["Q5_0_R4", "Q6_0_R4", "MXFP4_R8", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ3_XXS_R4", "IQ3_S_R4",
         "IQ2_S_R4", "IQ5_KS_R4"]
NEEDS_IMATRIX = {"IQ2_XXS_R4", "IQ2_XS_R4"}          # their base types' ggml_quantize_requires_imatrix
IGNORES_IMATRIX = {"MXFP4_R8"}
# not in quant.types: id, row meta bytes, bytes per 32 values
OTHER = {"IQ1_S_R4": (il.IQ1_S_R4, 2, 6), "IQ1_M_R4": (il.IQ1_M_R4, 2, 7)}


def inputs(seed: int = 5151) -> tuple[np.ndarray, np.ndarray]:
    x, im = weight_like(np.random.default_rng(seed), ROWS, N, 5)
    x[2, 32:64] = 0              # zero 32-block
    x[5, 272:288] = 0            # zero 16-block
    x[6, 256:512] = 0            # zero super-block
    im[128:160] = 0              # zero importances
    return x, im


def quantize_other(ik: IkGgml, name: str, x: np.ndarray, im: np.ndarray | None) -> np.ndarray:
    tid, meta, per32 = OTHER[name]
    nrows, n = x.shape
    out = np.zeros((nrows, meta + n // 32 * per32), dtype=np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32)
    got = ik.lib.ggml_quantize_chunk(tid, x.ctypes.data, out.ctypes.data, 0, nrows, n,
                                     None if im is None else im.ctypes.data, None)
    assert got == out.nbytes, (name, got, out.nbytes)
    return out


def dequantize_other(ik: IkGgml, name: str, raw: np.ndarray, n: int) -> np.ndarray:
    fn = getattr(ik.lib, f"dequantize_row_{name.lower()}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], n), dtype=np.float32)
    for r in range(0, raw.shape[0], 4):
        fn(raw[r].ctypes.data, out[r].ctypes.data, 4 * n)
    return out


def dequantize_mxfp4_r8(ik: IkGgml, raw: np.ndarray, n: int) -> np.ndarray:
    """ik's dequantize_row_mxfp4_r8 loops over k / 32 block columns for k = 8 n values (8 times
    too many): it reads past the group and its late writes land in the other rows.  Row 0 of a
    call only ever gets its own, correct values, so each row is decoded as row 0 of a group whose
    rows are rotated (R blocks rebuilt by repack from the unpacked rows), with the input and
    output buffers 8 times the group's size."""
    fn = ik.lib.dequantize_row_mxfp4_r8
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    nrows = raw.shape[0]
    plain = il.unpack(raw, "MXFP4_R8", nrows, n)
    out = np.empty((nrows, n), dtype=np.float32)
    for g in range(0, nrows, 8):
        for k in range(8):
            rows = plain[g + (np.arange(8) + k) % 8]
            src = np.zeros(8 * rows.size, dtype=np.uint8)
            src[:rows.size] = il.repack(rows, "MXFP4", 8, n).reshape(-1)
            y = np.zeros(8 * 8 * n, dtype=np.float32)
            fn(src.ctypes.data, y.ctypes.data, 8 * n)
            out[g + k] = y[:n]
    return out


def plain_like_r(ik: IkGgml, name: str, x: np.ndarray, im: np.ndarray | None) -> np.ndarray:
    """The base type's bytes that ik's _r4 quantizer repacks: QHelper's per-row weights where ik
    uses QHelper (quant.interleaved._qhelper_groups mirrors it), else the imatrix as given."""
    t = type_info(name)
    if im is None or t.id not in il._QHELPER_BLOCK:
        return ik.quantize(t.base, x, im)
    out = np.zeros((x.shape[0], type_info(t.base).row_bytes(x.shape[1])), dtype=np.uint8)
    for rows, w in il._qhelper_groups(x, im, il._QHELPER_BLOCK[t.id]):
        out[rows] = ik.quantize(t.base, x[rows], w)
    return out


def random_group(rng: np.random.Generator, name: str) -> np.ndarray:
    """One group of random bytes with finite scales: f16 d[I] at the start of every R block (the
    mainline i-quant, Q5_0 and Q6_0 forms), the f16 / f32 row scales of the group header
    (IQ1_S_R4, IQ1_M_R4 / IQ5_KS_R4), MXFP4's exponents kept in 100..140."""
    if name in OTHER:
        _, meta, per32 = OTHER[name]
        raw = rng.integers(0, 256, (4, meta + N_RAND // 32 * per32), dtype=np.uint8)
        flat = raw.reshape(-1)
        flat[0:8] = rng.uniform(-0.01, 0.01, 4).astype(np.float16).view(np.uint8)
        return raw
    ti = type_info(name)
    nr = ti.interleave
    raw = rng.integers(0, 256, (nr, ti.row_bytes(N_RAND)), dtype=np.uint8)
    flat = raw.reshape(-1)
    blocks = flat[nr * ti.row_meta:].reshape(-1, nr * ti.type_size)
    if name == "IQ5_KS_R4":
        flat[0:16] = rng.uniform(-0.01, 0.01, 4).astype(np.float32).view(np.uint8)
    elif name == "MXFP4_R8":
        blocks[:, 0:8] = rng.integers(100, 141, (blocks.shape[0], 8), dtype=np.uint8)
    else:
        d = rng.uniform(-0.01, 0.01, (blocks.shape[0], nr)).astype(np.float16)
        blocks[:, 0:2 * nr] = d.view(np.uint8).reshape(blocks.shape[0], -1)
    return raw


def main() -> None:
    ik = IkGgml()
    x, im = inputs()
    rng = np.random.default_rng(77)
    data: dict[str, np.ndarray] = {"x": x, "im": im}
    for name in TYPES:
        t = type_info(name)
        w = im if name in NEEDS_IMATRIX else None
        r = ik.quantize(name, x, w)
        data[f"{name}/r"] = r
        if w is None and name not in IGNORES_IMATRIX:
            data[f"{name}/r/im"] = ik.quantize(name, x, im)
        plain = plain_like_r(ik, name, x, w)
        ok = np.array_equal(il.repack(plain, t.base, ROWS, N), r)
        data[f"{name}/plain"] = plain
        deq = (lambda raw, n: dequantize_mxfp4_r8(ik, raw, n)) if name == "MXFP4_R8" else \
            (lambda raw, n, name=name: ik.dequantize(name, raw, n))
        y = deq(r, N)
        data[f"{name}/deq"] = y
        rnd = random_group(rng, name)
        data[f"{name}/rand"] = rnd
        data[f"{name}/rand/deq"] = deq(rnd, N_RAND)
        print(f"{name:11s} rmse {float(np.sqrt(((x - y) ** 2).mean())):.5f}  repack(plain) == r: {ok}")
    for name in OTHER:
        r = quantize_other(ik, name, x, im if name == "IQ1_S_R4" else None)
        data[f"{name}/r"] = r
        if name == "IQ1_M_R4":
            data[f"{name}/r/im"] = quantize_other(ik, name, x, im)
        y = dequantize_other(ik, name, r, N)
        data[f"{name}/deq"] = y
        if name == "IQ1_M_R4":
            data[f"{name}/r/im/deq"] = dequantize_other(ik, name, data[f"{name}/r/im"], N)
        rnd = random_group(rng, name)
        data[f"{name}/rand"] = rnd
        data[f"{name}/rand/deq"] = dequantize_other(ik, name, rnd, N_RAND)
        print(f"{name:11s} rmse {float(np.sqrt(((x - y) ** 2).mean())):.5f}")
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
