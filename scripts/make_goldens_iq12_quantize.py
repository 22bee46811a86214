#!/usr/bin/env python3
"""Write tests/data/golden_quantize_iq12.npz: the bytes ik_llama.cpp's ggml_quantize_chunk writes
for IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M (quant.iq12_quantize's types), via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_iq12_quantize.py

Cases (inputs x_C, importances im_C):
* "w": 64 weight-like rows of 1024 (scripts/ik_oracle.weight_like) rounded to f16 values so
  they are stored in half the space (x_w is kept as f16; the test widens it to f32), with an
  all-zero super-block, all-zero 32- and 16-value blocks, a block of tiny values and a row of
  coarsely rounded values (ties in the sorts of the split searches);
* "s": 8 f32 rows of 512 at other magnitudes (1e-9 .. 1e3 scales, values just above and
  below the per-type all-zero thresholds, uniform and heavy-tailed rows).
Keys per type T: T/C/im (with im_C) and, for the types ik quantizes without an imatrix (IQ2_S,
IQ1_M), T/C (without), each (rows, row_bytes) uint8.  Prints ik's RMSE per type and case.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402

TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
REQUIRE_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}      # ggml_quantize_requires_imatrix
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_quantize_iq12.npz")


def case_w(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x, im = weight_like(rng, 64, 1024, 16)
    x[2, 256:512] = 0                       # a whole super-block
    x[5, 32:64] = 0                         # one 32-value block (IQ2_XXS, IQ1_S)
    x[7, 16:32] = 0                         # one 16-value block (IQ2_XS, IQ2_S, IQ1_M)
    x[9, 512:528] = rng.standard_normal(16) * 2e-5
    x[11] = np.round(x[11] * 40) / 40       # many equal values
    x = x.astype(np.float16).astype(np.float32)
    return x, im.astype(np.float32)


def case_s(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = 512
    x = np.zeros((8, n), dtype=np.float32)
    x[0] = rng.standard_normal(n) * 1e-9
    x[1] = rng.standard_normal(n) * 1e3
    x[2] = rng.uniform(-1, 1, n)
    x[3] = rng.standard_t(2, n) * 0.05
    x[4] = rng.standard_normal(n) * 0.02
    x[4, 0:16] = 2e-8                       # below IQ1_M's 1e-7 block threshold
    x[4, 16:32] = 3e-7                      # above it
    x[4, 256:288] = 5e-13                   # below IQ1_S's 1e-12
    x[5] = rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))
    x[6] = np.sign(rng.standard_normal(n)) * 0.01        # all magnitudes equal
    x[7] = rng.standard_normal(n) * 0.1
    x[7, ::5] = 0
    im = np.exp(rng.uniform(-5, 5, n)).astype(np.float32)
    return x, im


def main() -> None:
    ik = IkGgml()
    rng = np.random.default_rng(20261125)
    cases = {"w": case_w(rng), "s": case_s(rng)}
    data: dict[str, np.ndarray] = {}
    for c, (x, im) in cases.items():
        data[f"x_{c}"] = x.astype(np.float16) if c == "w" else x
        data[f"im_{c}"] = im
    for t in TYPES:
        line = []
        for c, (x, im) in cases.items():
            n = x.shape[1]
            for use in (True, False):
                if not use and t in REQUIRE_IMATRIX:
                    continue
                raw = ik.quantize(t, x, im if use else None)
                data[f"{t}/{c}" + ("/im" if use else "")] = raw
                y = ik.dequantize(t, raw, n)
                w = im if use else np.ones(n, np.float32)
                rel = np.sqrt((w * (x - y) ** 2).mean() / (w * x * x).mean())
                line.append(f"{c}{'/im' if use else '   '} rel {rel:.3f}")
        print(f"{t:8s}", "  ".join(line))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
