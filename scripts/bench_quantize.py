#!/usr/bin/env python3
"""Quantize throughput: `ikcli quantize` against ik_llama.cpp's `llama-quantize`, same threads.

    python scripts/bench_quantize.py [-m MODEL.gguf] [--threads 2] [--repeats 2] [--types q8_0,q4_K,iq4_k,iq2_k]

Both run `--pure IN OUT TYPE NTHREADS`, one after the other, each `--repeats` times; the best wall
time of each is kept (the machine may be shared and noisy).  Prints a markdown table of seconds,
MB/s (the input file's MB, 1e6 bytes, per second) and the speed ratio ikcli / ik (> 1: ikcli is
faster).  With --check, also the share of tensor bytes that are identical in the two outputs.

Without -m the input is a DeepSeek-shaped F16 model of a few hundred MB (scripts/make_test_model.py's
`1b` preset with 2 layers), written once to --workdir.  A type that ikcli cannot produce yet is
skipped, with a line that says so.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

IK_QUANTIZE = "/work/ik_build/bin/llama-quantize"


def default_model(workdir: str) -> str:
    path = os.path.join(workdir, "bench-quantize-1b-2l-f16.gguf")
    if not os.path.exists(path):
        from make_test_model import write_model
        print(f"writing {path} ...", file=sys.stderr)
        tmp = path + ".tmp.gguf"
        write_model(tmp, "deepseek2", "ik", "f16", "1b", 0, 1, n_layer=2)
        os.replace(tmp, path)
    return path


def can_produce(name: str) -> bool:
    from ikcli.quantize_cmd import _can_produce
    from quant.types import type_info
    try:
        return _can_produce(type_info(name).id)
    except KeyError:
        return False


def timed(cmd: list[str], log: str) -> float:
    """Wall seconds of cmd (stdout and stderr to `log`); raises with the log's tail on failure."""
    with open(log, "w") as f:
        t = time.perf_counter()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        dt = time.perf_counter() - t
    if r.returncode != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{tail}")
    return dt


def same_share(a: str, b: str) -> float:
    """Share of tensor data bytes identical between two GGUF files with the same tensors."""
    import numpy as np
    from engine.gguf_file import open_model_file     # knows ik's own type ids, unlike gguf's reader
    ta, tb = open_model_file(a).tensors, open_model_file(b).tensors
    same = tot = 0
    for name, t in ta.items():
        u = tb.get(name)
        x = t.raw.view(np.ndarray).view(np.uint8).reshape(-1)
        tot += x.size
        if u is None or u.qtype != t.qtype:
            continue
        y = u.raw.view(np.ndarray).view(np.uint8).reshape(-1)
        if y.size == x.size:
            same += int((x == y).sum())
    return same / max(tot, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="F16 / F32 GGUF to quantize (default: a generated 1b-preset, 2-layer model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--types", default="q8_0,q4_K,iq4_k,iq2_k")
    ap.add_argument("--ik", default=IK_QUANTIZE, help="llama-quantize binary")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the generated model and the outputs go")
    ap.add_argument("--check", action="store_true", help="also compare the two outputs' tensor bytes")
    a = ap.parse_args()
    if not os.path.exists(a.ik):
        raise SystemExit(f"llama-quantize not found at {a.ik}")
    model = a.model or default_model(a.workdir)
    if not os.path.exists(model):
        raise SystemExit(f"model not found: {model}")
    mb = os.path.getsize(model) / 1e6
    out_ik = os.path.join(a.workdir, f"bench-quantize-ik-{os.getpid()}.gguf")
    out_py = os.path.join(a.workdir, f"bench-quantize-ikcli-{os.getpid()}.gguf")
    log = os.path.join(a.workdir, f"bench-quantize-{os.getpid()}.log")
    rows = []
    try:
        for name in [t.strip() for t in a.types.split(",") if t.strip()]:
            if not can_produce(name):
                print(f"skipping {name}: ikcli cannot produce it yet", file=sys.stderr)
                continue
            py_cmd = [sys.executable, "-m", "ikcli", "quantize", "--pure", model, out_py, name, str(a.threads)]
            ik_cmd = [a.ik, "--pure", model, out_ik, name, str(a.threads)]
            best_py = best_ik = float("inf")
            for r in range(a.repeats):
                best_py = min(best_py, timed(py_cmd, log))
                best_ik = min(best_ik, timed(ik_cmd, log))
                print(f"{name} run {r + 1}: ikcli {best_py:.2f} s, ik {best_ik:.2f} s (best so far)", file=sys.stderr)
            share = same_share(out_py, out_ik) if a.check else None
            rows.append((name, best_py, best_ik, share))
    finally:
        for p in (out_py, out_ik, log):
            if os.path.exists(p):
                os.unlink(p)
    print(f"\nInput: {model} ({mb:.1f} MB), {a.threads} threads, best of {a.repeats}\n")
    head = "| type | ikcli s | ik s | ikcli MB/s | ik MB/s | speed ikcli/ik |"
    sep = "|---|---:|---:|---:|---:|---:|"
    if a.check:
        head += " identical bytes |"
        sep += "---:|"
    print(head)
    print(sep)
    for name, tp, ti, share in rows:
        line = f"| {name} | {tp:.2f} | {ti:.2f} | {mb / tp:.1f} | {mb / ti:.1f} | {ti / tp:.2f} |"
        if a.check:
            line += f" {100 * share:.2f}% |"
        print(line)


if __name__ == "__main__":
    main()
