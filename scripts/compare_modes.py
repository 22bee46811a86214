#!/usr/bin/env python3
"""Perplexity of ikcli and a reference `llama-perplexity` (ik_llama.cpp) for every DeepSeek attention
mode: -mla 0..3 x -fa on/off x KV cache type, on generated GGUF files, with the same flags for both.

    python scripts/compare_modes.py --ref /path/to/llama-perplexity [--cases ds-mla576,ds-lite576] \
        [--types f16,q8_0] [--caches f16,q8_0] [--ctx 128] [--chunks 8] [--out table.md]

Quantized V needs flash attention (both tools refuse it otherwise), so without -fa only -ctk is set.
Prints a Markdown table: model, weights, flags, ikcli PPL, reference PPL, relative difference.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare_perplexity import run  # noqa: E402
from make_test_model import write_model  # noqa: E402

CASES = {  # name: (layout, preset) — latent sizes 576/512 so that quantized caches fit whole blocks
    "ds-mla576": ("ik", "tiny-mla576"),
    "ds-lite576": ("mainline-old", "tiny-lite576"),
    "ds-v3-yarn": ("ik", "tiny-v3"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="path of the reference llama-perplexity binary")
    ap.add_argument("--cases", default="ds-mla576,ds-lite576")
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--caches", default="f16,q8_0")
    ap.add_argument("--modes", default="0,1,2,3")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default=os.path.join(os.path.dirname(HERE), "engine", "data", "shakespeare.test.txt"))
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = ["| model | weights | flags | ikcli PPL | reference PPL | diff |", "|---|---|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as d:
        for name in a.cases.split(","):
            layout, preset = CASES[name]
            for qt in a.types.split(","):
                path = write_model(os.path.join(d, f"{name}-{qt}.gguf"), "deepseek2", layout, qt, preset, seed=1)[0]
                common = ["-m", path, "-f", a.text, "-c", str(a.ctx), "--chunks", str(a.chunks), "-t", str(a.threads)]
                for mla in a.modes.split(","):
                    for fa in ("on", "off"):
                        for ct in a.caches.split(","):
                            flags = ["-mla", mla, "-fa", fa, "-ctk", ct]
                            if fa == "on":
                                flags += ["-ctv", ct]
                            try:
                                ours = run([sys.executable, "-m", "ikcli", "perplexity", *common, *flags])
                                ref = run([a.ref, *common, *flags])
                            except RuntimeError as e:
                                rows.append(f"| {name} | {qt} | `{' '.join(flags)}` | failed | | |")
                                print(rows[-1], str(e).splitlines()[-1][:200], flush=True)
                                continue
                            diff = (ours - ref) / ref
                            rows.append(f"| {name} | {qt} | `{' '.join(flags)}` | {ours:.4f} | {ref:.4f} | {100 * diff:+.3f}% |")
                            print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
