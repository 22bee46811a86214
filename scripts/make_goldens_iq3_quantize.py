#!/usr/bin/env python3
"""Write tests/data/golden_quantize_iq3.npz: the bytes ik_llama.cpp's ggml_quantize_chunk writes
for IQ3_XXS and IQ3_S, without and with an importance matrix, via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_iq3_quantize.py

Contents: x (ROWS, N) f32 weight-like rows (ik_oracle.weight_like) with edge cases in the first
rows, im (N,) f32 column importances with a zero run; per type T: T/plain and T/im,
(ROWS, row_bytes) uint8.  The edge cases: an all-zero super-block, all-zero 32-value groups
at the start, middle and end of a super-block (IQ3_S then writes later groups one slot
early), a group below IQ3_XXS's 1e-8 cut-off, a group of values whose squares underflow
(zero weights without an imatrix), rows at 1e-3 and 1e3 scale; the zero importance run
(columns 96..127) makes a group where no trial scale wins, with an imatrix.  carry_x (8, 256)
with carry_im: in every other row the first group has no winning trial scale either (its only
important column is 0), so IQ3_XXS reuses the levels it chose last in the row before; T/carry
are ik's bytes with carry_im (ik aborts on such a row quantized alone: its state is then
uninitialized stack).
It also prints ik's (importance-weighted) RMSE per type.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402

TYPES = ["IQ3_XXS", "IQ3_S"]
ROWS, N = 64, 1024
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_quantize_iq3.npz")


def inputs(seed: int = 3303) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x, im = weight_like(rng, ROWS, N, 8)
    x[2, 256:512] = 0                                   # a whole super-block
    x[3, 64:96] = 0                                     # a group in the middle
    x[4, 0:32] = 0                                      # first and last group of a block
    x[4, 224:256] = 0
    x[5, 512:544] = rng.uniform(-5e-9, 5e-9, 32)        # below GROUP_MAX_EPS_IQ3_XXS
    x[6, 608:640] = rng.standard_normal(32) * 1e-30     # x*x underflows to 0
    x[7] *= 1e-3
    x[8] *= 1e3
    im[96:128] = 0
    return x.astype(np.float32), im.astype(np.float32)


def carry_inputs(seed: int = 3304) -> tuple[np.ndarray, np.ndarray]:
    x, im = weight_like(np.random.default_rng(seed), 8, 256, 2)
    im[0:32] = 0
    im[5] = 1.0
    x[1::2, 5] = 0
    return x.astype(np.float32), im.astype(np.float32)


def main() -> None:
    ik = IkGgml()
    x, im = inputs()
    cx, cim = carry_inputs()
    data: dict[str, np.ndarray] = {"x": x, "im": im, "carry_x": cx, "carry_im": cim}
    for t in TYPES:
        line = []
        for use in (False, True):
            raw = ik.quantize(t, x, im if use else None)
            data[f"{t}/{'im' if use else 'plain'}"] = raw
            y = ik.dequantize(t, raw, N)
            w = im if use else np.ones(N, np.float32)
            line.append(f"{'imatrix' if use else 'plain'} {np.sqrt((w * (x - y) ** 2).mean() / w.mean()):.4e}")
        data[f"{t}/carry"] = ik.quantize(t, cx, cim)
        print(f"{t:8s}", "  ".join(line))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
