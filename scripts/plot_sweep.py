#!/usr/bin/env python3
"""Overlay sweep-bench runs: S_PP and S_TG against N_KV, one curve per file, two panels.

    python scripts/plot_sweep.py run-a.jsonl run-b.jsonl -o compare.png [--labels "q8_0,iq4_k"] [--title T]

Each FILE may hold `--output-format jsonl` lines or the Markdown table, from `ikcli sweep-bench`
or ik_llama.cpp's `llama-sweep-bench` (a whole stderr log is fine: other lines are skipped).
Several runs concatenated in one file are averaged per N_KV, with the spread as error bars.
Needs matplotlib (`pip install 'ikcli[plot]'`).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ikcli.errors import CliError  # noqa: E402
from ikcli.sweep_plot import default_label, plot_runs, read_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plot and compare sweep-bench results (S_PP, S_TG vs N_KV).")
    ap.add_argument("files", nargs="+", metavar="FILE", help="sweep-bench output: jsonl lines or the Markdown table")
    ap.add_argument("-o", "--output", default="sweep-bench.png", help="image to write (default: sweep-bench.png)")
    ap.add_argument("--labels", help="comma-separated legend labels, one per FILE (default: the file names)")
    ap.add_argument("--title", help="figure title")
    args = ap.parse_args(argv)
    labels = [default_label(f) for f in args.files]
    if args.labels is not None:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(args.files):
            ap.error(f"--labels has {len(labels)} labels for {len(args.files)} files")
    try:
        runs = [(lab, read_results(f)) for lab, f in zip(labels, args.files)]
        plot_runs(runs, args.output, title=args.title)
    except (CliError, ValueError) as e:
        print(f"plot_sweep: error: {e}", file=sys.stderr)
        return 1
    print(f"plot_sweep: wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
