#!/usr/bin/env python3
"""`ikcli sweep-bench` on one model per quant type, each type's speeds as a share of the Q8_0
file's from the same run (the kernel check of the "every quant type" issue: S_TG >= 0.8x and
S_PP >= 0.5x Q8_0's).

    python scripts/bench_types.py --dir /work/models --pattern 'pure-{}.gguf' \
        --types Q8_0,Q4_0,Q4_K,Q6_K,IQ4_XS,IQ4_K,IQ2_K [-c 1024] [-t 1] [--rtr] [--out table.md] \
        [--ref PATH/llama-sweep-bench]

The files are what `llama-quantize --pure MODEL.gguf pure-TYPE.gguf TYPE` writes from the `2b`
model of make_test_model.py (DeepSeek-V3-shaped, every width a multiple of 256, a 102400-token
output matrix).  --rtr adds -rtr (the _R4 forms).  Each row: the mean S_PP and S_TG over the
sweep's rows.  --ref also runs ik_llama.cpp's sweep-bench on each file right after ikcli's (same
flags) and adds its means and ikcli / ik.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_sweep import sweep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--pattern", default="pure-{}.gguf")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K,IQ4_XS,IQ4_K,IQ2_K")
    ap.add_argument("-c", type=int, default=1024)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-t", type=int, default=1)
    ap.add_argument("--rtr", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--ref", help="ik_llama.cpp's llama-sweep-bench: run it on each file too")
    a = ap.parse_args()
    ikcli = os.path.join(os.path.dirname(sys.executable), "ikcli")
    res: dict[str, tuple[float, float]] = {}
    lines = ["| type | S_PP t/s | S_TG t/s | S_PP / Q8_0 | S_TG / Q8_0 |", "|---|---:|---:|---:|---:|"]
    if a.ref:
        lines = [lines[0] + " ik S_PP | ik S_TG | S_PP / ik | S_TG / ik |", lines[1] + "---:|---:|---:|---:|"]
    types = a.types.split(",")
    if "Q8_0" in types:                               # the reference first
        types.remove("Q8_0")
        types.insert(0, "Q8_0")
    for t in types:
        path = os.path.join(a.dir, a.pattern.format(t))
        if not os.path.exists(path):           # ds2b-pure-q8_0.gguf as well as pure-Q8_0.gguf
            path = os.path.join(a.dir, a.pattern.format(t.lower()))
        if not os.path.exists(path):
            print(f"{t}: {path} not found, skipped", file=sys.stderr)
            continue
        cmd = [ikcli, "sweep-bench", "-m", path, "-c", str(a.c), "-ub", str(a.ub), "-t", str(a.t),
               "-mla", "3", "-fa", "on"] + (["-rtr"] if a.rtr else [])
        try:
            rows = sweep(cmd)
        except RuntimeError as e:                      # e.g. a truncated file: report, go on
            print(f"{t}: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
            continue
        pp = sum(v[0] for v in rows.values()) / len(rows)
        tg = sum(v[1] for v in rows.values()) / len(rows)
        res[t] = (pp, tg)
        ref = res.get("Q8_0", (pp, tg))
        line = f"| {t}{' -rtr' if a.rtr else ''} | {pp:.1f} | {tg:.2f} | {pp / ref[0]:.2f} | {tg / ref[1]:.2f} |"
        if a.ref:
            try:
                ik = sweep([a.ref] + cmd[2:])
                ipp = sum(v[0] for v in ik.values()) / len(ik)
                itg = sum(v[1] for v in ik.values()) / len(ik)
                line += f" {ipp:.1f} | {itg:.2f} | {pp / ipp:.2f} | {tg / itg:.2f} |"
            except RuntimeError as e:
                line += " - | - | - | - |"
                print(f"{t} (ik): {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        lines.append(line)
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
