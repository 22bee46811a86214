#!/usr/bin/env python3
"""Write tests/data/golden_iq1_r4.npz: the bytes ik_llama.cpp's ggml_quantize_chunk writes for
IQ1_S_R4 (219) and IQ1_M_R4 (229) (quant.iq1_r4_quantize's types), without and with an imatrix.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_iq1_r4.py

IQ1_M_R4 has no quant.types entry, so ggml_quantize_chunk is called here directly (through
scripts/ik_oracle.py's library handle) rather than with IkGgml.quantize.
Cases (inputs x_C, importances im_C, f32):
* "w": 8 weight-like rows of 1024 (scripts/ik_oracle.weight_like) with an all-zero 32-value
  block, an all-zero first / second half of 16 (IQ1_M_R4 skips the half), a block of tiny values
  (sum of squares below 1e-14) and importances that are zero on 32 columns (the imatrix fallback
  of both types) and on 16 (IQ1_M_R4's per-half fallback);
* "g": 4 Gaussian rows of 256 with outliers, one row all zeros (row scale 0), one at 1e3;
* "h": 16 rows of 512 (4 groups) with random all-zero halves, so IQ1_M_R4's kept shift of a
  skipped half carries across blocks, rows and groups (row 0's first block is never skipped:
  ik's shift1 / shift2 start uninitialized, and a garbage one indexes past its masks[4]).
Keys: T/C and T/C/im for T in IQ1_S_R4, IQ1_M_R4: (rows, row_bytes) uint8.  Prints the relative
RMSE of ik's decoded values (ik's dequantize_row_*) per type and case.
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

TYPES = {"IQ1_S_R4": (219, 6), "IQ1_M_R4": (229, 7)}     # id, bytes per row per 32 values
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_iq1_r4.npz")


def row_bytes(name: str, n: int) -> int:
    return 2 + n // 32 * TYPES[name][1]


def ik_quantize(ik: IkGgml, name: str, x: np.ndarray, im: np.ndarray | None) -> np.ndarray:
    tid = TYPES[name][0]
    x = np.ascontiguousarray(x, dtype=np.float32)
    nrows, n = x.shape
    out = np.zeros((nrows, row_bytes(name, n)), dtype=np.uint8)
    ik.lib.ggml_quantize_init(tid)
    got = ik.lib.ggml_quantize_chunk(tid, x.ctypes.data, out.ctypes.data, 0, nrows, n,
                                     None if im is None else im.ctypes.data, None)
    if got != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {out.nbytes}")
    return out


def ik_dequantize(ik: IkGgml, name: str, raw: np.ndarray, n: int) -> np.ndarray:
    fn = getattr(ik.lib, f"dequantize_row_{name.lower()}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], n), dtype=np.float32)
    for r in range(0, raw.shape[0], 4):
        fn(raw[r].ctypes.data, out[r].ctypes.data, 4 * n)
    return out


def case_w(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x, im = weight_like(rng, 8, 1024, 16)
    x[2, 64:96] = 0                          # whole block
    x[3, 128:144] = 0                        # first half
    x[5, 400:416] = 0                        # second half
    x[6, 512:544] *= 1e-7                    # sum of squares < 1e-14
    im[256:288] = 0                          # IQ1_S_R4 fallback (and both halves of IQ1_M_R4)
    im[608:624] = 0                          # IQ1_M_R4 first-half fallback
    im[656:672] = 0                          # second half (its double compare)
    return x, im


def case_g(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = 256
    x = rng.standard_normal((4, n)).astype(np.float32)
    x[0, rng.choice(n, 6, replace=False)] *= 8
    x[1] = 0
    x[2] *= 1e3
    x[3] = np.round(x[3] * 2) / 2            # ties in the sorts
    im = np.exp(rng.uniform(-4, 4, n)).astype(np.float32)
    return x, im


def case_h(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = 512
    x = (rng.standard_normal((16, n)) * 0.02).astype(np.float32)
    for r in range(16):
        for h in rng.choice(n // 16, 6, replace=False):
            if r or h > 1:                   # not row 0's first block: it sets ik's shifts
                x[r, 16 * h:16 * h + 16] = 0
    im = rng.gamma(0.7, 1.0, n).astype(np.float32)
    return x, im


def main() -> None:
    ik = IkGgml()
    rng = np.random.default_rng(20261219)
    cases = {"w": case_w(rng), "g": case_g(rng), "h": case_h(rng)}
    data: dict[str, np.ndarray] = {}
    for c, (x, im) in cases.items():
        data[f"x_{c}"] = x
        data[f"im_{c}"] = im
    for t in TYPES:
        line = []
        for c, (x, im) in cases.items():
            n = x.shape[1]
            for use in (False, True):
                raw = ik_quantize(ik, t, x, im if use else None)
                key = f"{t}/{c}" + ("/im" if use else "")
                data[key] = raw
                y = ik_dequantize(ik, t, raw, n)
                w = im if use else np.ones(n, np.float32)
                rel = np.sqrt((w * (x - y) ** 2).sum() / (w * x * x).sum())
                line.append(f"{c}{'/im' if use else '   '} rel {rel:.3f}")
        print(f"{t:8s}", "  ".join(line), flush=True)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
