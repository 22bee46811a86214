#!/usr/bin/env python3
"""Write tests/data/golden_kt.npz: ik_llama.cpp's bytes and decoded values for its trellis types
IQ1_KT, IQ2_KT, IQ3_KT, IQ4_KT (quant.ktquants), via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_kt.py

Contents:
* x (16, 1024) f32 weight-like rows (ik_oracle.weight_like; row 2 has an all-zero super-block,
  row 3 an all-zero sub-block and row 4 a zero group of 8 in every sub-block), im (1024,) f32
  column importances with a zero run of 32;
* xs (4, 512) f32 and ims (512,): importances that are zero on 7 of every 8 columns, so most
  points of a cluster score alike on a group and ik's tie order (its 8-lane minimum) decides;
* xv (2, 1024) f32: two Gaussian rows on which IQ3_KT's row-scale search depends on GCC's
  unfused (vectorized) sums (found among 256 random rows; a fused version differs there);
* per type T: T/q and T/q/im (16, row_bytes) uint8 = ggml_quantize_chunk(x) without / with im;
  T/qs/im (4, row_bytes) = with xs, ims; T/qv (2, row_bytes) = xv without an imatrix;
* per type T: T/raw (4, row_bytes(512)) random bytes with a sane f32 row scale, and T/deq
  (4, 512) f32 = ik's dequantize_row_<type> of them.
It prints ik's RMSE per type.
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

TYPES = ["IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"]
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_kt.npz")


def inputs(seed: int = 9100) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x, im = weight_like(rng, 16, 1024, 12)
    x[2, 256:512] = 0
    x[3, 64:96] = 0
    for b in range(0, 1024, 32):
        x[4, b + 8:b + 16] = 0
    im[160:192] = 0
    xs = (rng.standard_normal((4, 512)) * 0.02).astype(np.float32)
    ims = np.zeros(512, dtype=np.float32)
    ims[5::8] = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    r = np.random.default_rng(123)
    xv = (r.standard_normal((256, 1024)) * r.uniform(0.001, 1, (256, 1))).astype(np.float32)[[55, 157]]
    return {"x": x, "im": im, "xs": xs, "ims": ims, "xv": xv}


def random_rows(rng: np.random.Generator, name: str, rows: int, n: int) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, type_info(name).row_bytes(n)), dtype=np.uint8)
    d = (rng.standard_normal(rows) * 0.01).astype(np.float32)
    raw[:, :4] = d.view(np.uint8).reshape(rows, 4)
    return raw


def main() -> None:
    ik = IkGgml()
    data = inputs()
    x, im, xs, ims, xv = data["x"], data["im"], data["xs"], data["ims"], data["xv"]
    rng = np.random.default_rng(9200)
    for t in TYPES:
        line = []
        for key, xx, ww in (("q", x, None), ("q/im", x, im), ("qs/im", xs, ims), ("qv", xv, None)):
            raw = ik.quantize(t, xx, ww)
            data[f"{t}/{key}"] = raw
            y = ik.dequantize(t, raw, xx.shape[1])
            w = np.ones(xx.shape[1]) if ww is None else ww.astype(np.float64)
            line.append(f"{key:5s} {np.sqrt((w * (xx - y) ** 2).mean() / w.mean()):.3e}")
        raw = random_rows(rng, t, 4, 512)
        data[f"{t}/raw"] = raw
        data[f"{t}/deq"] = ik.dequantize(t, raw, 512)
        print(f"{t:7s}", "  ".join(line))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
