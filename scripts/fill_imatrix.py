#!/usr/bin/env python3
"""Complete a llama-imatrix .dat for a random test model: entries llama-imatrix skipped (MoE
tensors whose router left more than 5 % of the experts without tokens) are added with value 1 for
every column (uniform importance), sized like the same tensor of another layer, or as given
(NAME=SIZE: tensors llama-imatrix does not record in the mode it ran, e.g. attn_v_b).  Only for making
benchmark / test files of very-low-bit types (IQ1_S, IQ2_XXS, IQ2_XS), which need an entry for
every tensor; a real model's imatrix needs no such thing.

    python scripts/fill_imatrix.py IN.dat OUT.dat blk.1.ffn_down_exps.weight [blk.0.attn_v_b.weight=512 ...]
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.imatrix import read_dat, write_dat  # noqa: E402


def main() -> None:
    src, dst, *names = sys.argv[1:]
    dat = read_dat(src)
    have = {n: (c, v) for n, c, v in dat.entries}
    entries = list(dat.entries)
    ncall0 = dat.entries[0][1] if dat.entries else 1
    for spec in names:
        name, _, size = spec.partition("=")
        if size:
            entries.append((name, ncall0, np.full(int(size), float(ncall0), np.float32)))
            print(f"added {name}: {size} values")
            continue
        kind = re.sub(r"^blk\.\d+\.", "", name)
        like = next((n for n in have if re.sub(r"^blk\.\d+\.", "", n) == kind), None)
        if like is None:
            raise SystemExit(f"no entry like {name} to size it from")
        ncall, vals = have[like]
        entries.append((name, ncall, np.full(vals.size, float(ncall), np.float32)))
        print(f"added {name}: {vals.size} values (sized like {like})")
    write_dat(dst, entries, dat.last_call, dat.dataset)


if __name__ == "__main__":
    main()
