#!/usr/bin/env python3
"""Write tests/data/golden_iquants.npz: rows quantized by ik_llama.cpp and their values as its
dequantize_row_<type> decodes them, for the mainline i-quants (quant.iquants) and MXFP4, plus
blocks of random bytes (every field value, not only what a quantizer writes) decoded by ik.

    IK_GGML_LIB=/path/to/ik_build/ggml/src/libggml.so python scripts/make_goldens_iquants.py

Keys per type NAME: NAME_raw (rows, row_bytes) uint8 and NAME_deq (rows, N) float32, rows 0-3
the quantizer's (the importance rows of make_goldens_mainline.rows with its imatrix; the low-bit
types need one), rows 4-7 random bytes with the f16 scale fields set to finite values.  For the
quantizer goldens (ik's exact bytes), `x` (4, N) and `imatrix` are the inputs, and NAME_plain the
bytes without an imatrix for the types ik quantizes without one.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml  # noqa: E402
from make_goldens_mainline import source  # noqa: E402
from quant.types import type_info  # noqa: E402

TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "MXFP4"]
N = 512
REQUIRE_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}      # ggml_quantize_requires_imatrix
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_iquants.npz")
# byte offsets of f16 block scales, to keep random blocks finite (IQ1_M: the scale nibbles)
F16_AT = {"IQ2_XXS": 0, "IQ2_XS": 0, "IQ2_S": 0, "IQ3_XXS": 0, "IQ3_S": 0, "IQ1_S": 0}


def inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = np.zeros((4, N), dtype=np.float32)
    x[0] = rng.standard_normal(N) * 0.02
    x[0, rng.choice(N, 4, replace=False)] = 0.2
    x[1] = rng.standard_t(3, N) * 0.5
    x[2] = rng.standard_normal(N) * 1e-4
    x[3] = (rng.standard_normal(N) * rng.uniform(0.01, 1.0)).astype(np.float32)
    im = (rng.uniform(0.01, 10.0, N) ** 2).astype(np.float32)
    return x, im


def random_rows(rng: np.random.Generator, name: str) -> np.ndarray:
    ti = type_info(name)
    raw = rng.integers(0, 256, (4, ti.row_bytes(N)), dtype=np.uint8)
    blocks = raw.reshape(4, -1, ti.type_size)
    if name in F16_AT:
        d = rng.uniform(-0.01, 0.01, blocks.shape[:2]).astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        blocks[:, :, F16_AT[name]:F16_AT[name] + 2] = d
    elif name == "IQ1_M":       # top nibble of each scale word: keep the f16 exponent finite
        blocks[:, :, 55] &= 0x3F
    return raw


def main() -> None:
    ik = IkGgml()
    rng = np.random.default_rng(20261124)
    x, im = inputs(rng)
    data: dict[str, np.ndarray] = {"n": np.array(N), "source": np.array(source()), "imatrix": im, "x": x}
    for name in TYPES:
        q = ik.quantize(name, x, imatrix=im)
        raw = np.concatenate([q, random_rows(rng, name)])
        deq = ik.dequantize(name, raw, N)
        data[f"{name}_raw"] = raw
        data[f"{name}_deq"] = deq
        if name not in REQUIRE_IMATRIX:
            data[f"{name}_plain"] = ik.quantize(name, x)
        err = np.sqrt(((deq[:4] - x) ** 2).mean(axis=1) / (x ** 2).mean(axis=1))
        print(f"{name:8s} raw {raw.shape} relative rmse {np.array2string(err, precision=3)}")
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
