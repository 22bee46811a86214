#!/usr/bin/env python3
"""Both directions of the quantization contract, per type, on one f16 model:

* ikcli quantizes (`ikcli quantize --pure IN OUT TYPE`), then both tools compute perplexity on
  ikcli's file;
* the reference tool (ik_llama.cpp's llama-quantize) quantizes, then both tools compute
  perplexity on its file.

    python scripts/compare_quantized.py --ref-bin /path/to/ik_build/bin [-m f16.gguf] \
        [--types q4_0,q4_k,iq4_k_r4,...] [--imatrix F.dat] [--ctx 128] [--chunks 8] [--out table.md]

--imatrix and --quant-args (e.g. "--token-embedding-type q8_0": ik aborts on a very-low-bit
token_embd, which has no imatrix entry) are passed to both quantizers.

Without -m, the `small256` DeepSeek-shaped model of make_test_model.py (256-wide matrices, so
every 256-block type applies) is generated.  Prints a Markdown table with the four perplexities
and the relative differences ikcli vs reference on each file.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FINAL = re.compile(r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = (\d+\.\d+) \+/- (\d+\.\d+)")
TYPES = ("q4_0,q4_1,q5_0,q5_1,q6_0,q8_0,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_nl,iq4_xs,iq2_k,iq3_k,iq4_k,iq5_k,"
         "iq6_k,iq4_ks,iq4_kss,iq2_ks,q4_0_r8,q8_0_r8,q2_k_r4,q3_k_r4,q4_k_r4,q5_k_r4,q6_k_r4,iq4_nl_r4,"
         "iq4_xs_r8,iq2_k_r4,iq3_k_r4,iq4_k_r4,iq5_k_r4,iq4_ks_r4")
IKCLI = [sys.executable, "-m", "ikcli"]


def run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def ppl(cmd: list[str]) -> float | None:
    try:
        m = FINAL.search(run(cmd))
    except RuntimeError as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return None
    return float(m.group(1)) if m else None


def rel(a: float | None, b: float | None) -> str:
    return f"{100 * (a - b) / b:+.2f}%" if a is not None and b is not None else "-"


def fmt(v: float | None) -> str:
    return f"{v:.4f}" if v is not None else "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref-bin", required=True, help="folder with the reference llama-quantize and llama-perplexity")
    ap.add_argument("-m", "--model")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--imatrix", help="importance matrix (.dat) for both quantizers")
    ap.add_argument("--quant-args", default="", help="more arguments for both quantizers")
    ap.add_argument("--text", default=os.path.join(HERE, "..", "..", "shared", "corpus", "shakespeare.test.txt"))
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="cmpq-")
    src = a.model
    if not src:
        from make_test_model import write_model
        src = write_model(os.path.join(tmp, "f16.gguf"), "deepseek2", "ik", "f16", "small256", 0, 1)[0]
    pp = ["-f", a.text, "-c", str(a.ctx), "--chunks", str(a.chunks), "-t", str(a.threads)]
    rows = ["| type | ikcli file: ikcli | ikcli file: ref | diff | ref file: ikcli | ref file: ref | diff |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for t in a.types.split(","):
        mine, theirs = os.path.join(tmp, f"ikcli-{t}.gguf"), os.path.join(tmp, f"ref-{t}.gguf")
        res = []
        for tool, out in ((IKCLI + ["quantize"], mine), ([os.path.join(a.ref_bin, "llama-quantize")], theirs)):
            try:
                run(tool + ["--pure"] + (["--imatrix", a.imatrix] if a.imatrix else []) + a.quant_args.split()
                    + [src, out, t, str(a.threads)])
            except RuntimeError as e:
                print(str(e).splitlines()[0], file=sys.stderr)
                res += [None, None]
                continue
            res.append(ppl(IKCLI + ["perplexity", "-m", out] + pp))
            res.append(ppl([os.path.join(a.ref_bin, "llama-perplexity"), "-m", out] + pp))
        rows.append(f"| {t} | {fmt(res[0])} | {fmt(res[1])} | {rel(res[0], res[1])} | {fmt(res[2])} | "
                    f"{fmt(res[3])} | {rel(res[2], res[3])} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(f"\nmodel {os.path.basename(src)}, -c {a.ctx} --chunks {a.chunks}, --pure\n\n{table}")
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
