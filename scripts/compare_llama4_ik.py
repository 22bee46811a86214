#!/usr/bin/env python3
"""Chunk-by-chunk perplexity of a llama4 file in ik_llama.cpp's llama-perplexity and in ikcli, as
is and with ik's two departures from Llama-4 reproduced (so that the rest of the model is compared):

* ik (8337e4cd3) sends the RoPE layers through its shared attention builder, which never applies
  llama4's q/k L2 norm (the norm sits in the other branch, under `use_rope`, so it never runs);
* after a MoE block it adds the RMS-normed FFN input instead of the residual stream (its MoE call
  gets the normed tensor with `add_input`; the residual add after it is commented out) -- the
  same as README's footnote on llama's Mixtral-style MoE.

    python scripts/compare_llama4_ik.py --ref PATH/TO/llama-perplexity [-c 128] [--chunks 8] \
        [--args "-fa off"] FILE.gguf [FILE2.gguf ...]

    python scripts/compare_llama4_ik.py --emulate ARGS...     # `ikcli ARGS` with ik's departures

The emulation patches engine.arch.llama's module-level rms_norm / moe_ffn (a check, not a mode of
the engine): the last RMSNorm before a MoE call is the FFN norm, whose input is the residual.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from compare_perplexity import run  # noqa: E402


def emulate(argv: list[str]) -> None:
    """Run `ikcli argv` with ik's q/k-norm-less RoPE layers and normed-input MoE residual."""
    sys.path.insert(0, ROOT)
    import engine.arch.llama as llama
    import engine.arch.llama4 as llama4
    last = {}
    rms_norm, moe_ffn, init = llama.rms_norm, llama.moe_ffn, llama4.Llama4Arch.__init__

    def rms(x, w, eps):
        last["x"] = x
        return rms_norm(x, w, eps)

    def moe(h, *a, **k):                    # the forward adds x: x + (moe + h - x) = h + moe
        return moe_ffn(h, *a, **k) + h - last["x"]

    def no_norm(self, *a, **k):
        init(self, *a, **k)
        self.kq_norm = False

    llama.rms_norm, llama.moe_ffn, llama4.Llama4Arch.__init__ = rms, moe, no_norm
    from ikcli.app import main as ikcli_main
    ikcli_main(argv)


def chunk_values(cmd: list[str]) -> list[float]:
    """The running perplexity after each chunk (compare_perplexity's parser)."""
    return run(cmd)[1]


def main() -> None:
    if sys.argv[1:2] == ["--emulate"]:
        return emulate(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="ik_llama.cpp's llama-perplexity")
    ap.add_argument("-c", "--ctx", default="128")
    ap.add_argument("--chunks", default="8")
    ap.add_argument("-t", "--threads", default="1")
    ap.add_argument("--args", default="-fa off", help="flags for both tools")
    ap.add_argument("--text", default=os.path.join(ROOT, "engine", "data", "shakespeare.test.txt"))
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    print("| file | tool | chunk values | largest chunk diff | final diff |\n|---|---|---|---:|---:|")
    for f in a.files:
        common = ["-m", f, "-f", a.text, "-c", a.ctx, "--chunks", a.chunks, "-t", a.threads, *shlex.split(a.args)]
        ik = chunk_values([a.ref, *common])
        print(f"| {os.path.basename(f)} | ik | {' '.join(f'{v:.2f}' for v in ik)} | | |", flush=True)
        for name, pre in (("ikcli", ["-m", "ikcli"]), ("ikcli, ik's departures", [__file__, "--emulate"])):
            ours = chunk_values([sys.executable, *pre, "perplexity", *common])
            d = [100 * (x - y) / y for x, y in zip(ours, ik)]
            print(f"| | {name} | {' '.join(f'{v:.2f}' for v in ours)} | {max(d, key=abs):+.3f}% | {d[-1]:+.3f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
