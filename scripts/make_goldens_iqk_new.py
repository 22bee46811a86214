#!/usr/bin/env python3
"""Write tests/data/golden_iqk_new.npz: ik_llama.cpp's bytes and values for its newer IQK types
IQ3_KS, IQ5_KS and IQ2_KL (quant.iqk decodes them, quant.iqk_quantize quantizes them), via
scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_iqk_new.py

Contents:
* x (ROWS, N) f32 weight-like rows (scripts/ik_oracle.weight_like; row 2 has an all-zero
  super-block, row 4 an all-zero 32-value sub-block, row 5 is all zero), im (N,) f32 column
  importances with a zero run (ik gives such a block the weights 1e-9);
* per type T: T/q and T/q/im, ggml_quantize_chunk's bytes of x without and with im,
  (ROWS, row_bytes) uint8;
* per type T: T/raw, random bytes (DEC_ROWS rows of DEC_N values; the row scale replaced by a
  finite one, every other bit pattern is a valid block) and T/y, what dequantize_row_<type>
  makes of them, (DEC_ROWS, DEC_N) f32.
It also prints ik's RMSE per type (importance-weighted with im).
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402
from quant.types import type_info  # noqa: E402

TYPES = ["IQ3_KS", "IQ5_KS", "IQ2_KL"]
ROWS, N = 32, 1024
DEC_ROWS, DEC_N = 8, 512
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_iqk_new.npz")


def inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    x, im = weight_like(np.random.default_rng(seed), ROWS, N, 8)
    x[2, :256] = 0
    x[4, 32:64] = 0
    x[5] = 0
    im[64:96] = 0
    return x, im


def random_rows(rng: np.random.Generator, name: str) -> np.ndarray:
    """Random bytes with a finite row scale (f16 or f32, either sign, one row's scale 0)."""
    ti = type_info(name)
    raw = rng.integers(0, 256, (DEC_ROWS, ti.row_bytes(DEC_N)), dtype=np.uint8)
    d = (rng.standard_normal(DEC_ROWS) * 0.01).astype(np.float32)
    d[3] = 0
    if ti.row_meta == 4:
        raw[:, :4] = d.view(np.uint8).reshape(-1, 4)
    else:
        raw[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw


def main() -> None:
    ik = IkGgml()
    x, im = inputs(9100)
    data: dict[str, np.ndarray] = {"x": x, "im": im}
    rng = np.random.default_rng(9101)
    for t in TYPES:
        line = []
        for use in (False, True):
            raw = ik.quantize(t, x, im if use else None)
            data[f"{t}/q" + ("/im" if use else "")] = raw
            y = ik.dequantize(t, raw, N)
            w = im.astype(np.float64) if use else np.ones(N)
            line.append(f"{'imatrix' if use else 'plain'} {np.sqrt((w * (x - y) ** 2).mean() / w.mean()):.4e}")
        raw = random_rows(rng, t)
        data[f"{t}/raw"], data[f"{t}/y"] = raw, ik.dequantize(t, raw, DEC_N)
        print(f"{t:7s}", "  ".join(line))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
