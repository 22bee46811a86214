#!/usr/bin/env python3
"""Write quant/data/iquant_grids.npz: the lattice grids of ggml's mainline i-quants (IQ1_S / IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) as int8 values, one row per grid point.

The grids are ggml's tables (the same in ik_llama.cpp and mainline); they are read here from the
gguf package's copy (gguf.quants, which decodes them from hex), so the repository holds them as
data.  The dequantization goldens (tests/data/golden_iquants.npz, made with ik_llama.cpp's own
library) check every entry that matters.

    .venv/bin/python scripts/make_iquant_grids.py
"""
from __future__ import annotations

import os

import numpy as np
from gguf import quants as gq

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quant", "data", "iquant_grids.npz")


def main() -> None:
    grids = {}
    for name in ("IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"):
        cls = getattr(gq, name)
        cls.init_grid()
        g = np.asarray(cls.grid).reshape(cls.grid_shape)
        assert np.all(g == np.round(g))
        grids[name] = g.astype(np.int8)
    np.savez_compressed(OUT, **grids)
    print(OUT, {k: v.shape for k, v in grids.items()})


if __name__ == "__main__":
    main()
