#!/usr/bin/env python3
"""Write tests/data/golden_mainline.npz: rows quantized by ik_llama.cpp and their values as
ik_llama.cpp's dequantize_row_<type> decodes them, for the mainline types that
quant/legacy.py and quant/kquants.py decode (Q4_1 Q5_0 Q5_1 IQ4_NL Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_XS).

    IK_GGML_LIB=/path/to/ik_build/ggml/src/libggml.so python scripts/make_goldens_mainline.py

Keys per type NAME: NAME_raw (rows, row_bytes) uint8 and NAME_deq (rows, N) float32; `n` is
N, `source` says where the data came from.  Rows (N = 512 each):
  0  Gaussian weights (sigma 0.02) with a few outliers of +-10 sigma
  1  all zeros (zero scales)
  2  heavy-tailed (Student t, 3 degrees of freedom), wider scale
  3  tiny values (sigma 1e-4: f16 subnormal scales)
  4, 5  Gaussian rows quantized with random importance weights (the imatrix code paths)
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml  # noqa: E402

TYPES = ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
N = 512
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_mainline.npz")


def rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(plain rows, imatrix rows, imatrix) as f32."""
    x = np.zeros((4, N), dtype=np.float32)
    x[0] = rng.standard_normal(N) * 0.02
    idx = rng.choice(N, 4, replace=False)
    x[0, idx] = rng.choice([-1.0, 1.0], 4) * 0.2
    x[2] = rng.standard_t(3, N) * 0.5
    x[3] = rng.standard_normal(N) * 1e-4
    xi = (rng.standard_normal((2, N)) * rng.uniform(0.01, 1.0, (2, 1))).astype(np.float32)
    im = rng.uniform(0.01, 10.0, N).astype(np.float32) ** 2
    return x.astype(np.float32), xi, im


def source() -> str:
    lib = os.environ.get("IK_GGML_LIB", "")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(lib)))), "ik_src")
    try:
        rev = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = ""
    return f"ik_llama.cpp {rev or '(unknown commit)'}: ggml_quantize_chunk + dequantize_row_*"


def main() -> None:
    ik = IkGgml()
    rng = np.random.default_rng(20240601)
    x, xi, im = rows(rng)
    data: dict[str, np.ndarray] = {"n": np.array(N), "source": np.array(source())}
    for name in TYPES:
        raw = np.concatenate([ik.quantize(name, x), ik.quantize(name, xi, imatrix=im)])
        deq = ik.dequantize(name, raw, N)
        data[f"{name}_raw"] = raw
        data[f"{name}_deq"] = deq
        err = np.sqrt(((deq - np.concatenate([x, xi])) ** 2).mean(axis=1) / (np.concatenate([x, xi]) ** 2).mean(axis=1).clip(1e-30))
        print(f"{name:7s} raw {raw.shape} relative rmse per row {np.array2string(err, precision=3)}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
