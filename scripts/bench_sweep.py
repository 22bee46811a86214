#!/usr/bin/env python3
"""`ikcli sweep-bench` against a reference `llama-sweep-bench` (ik_llama.cpp) on the same model,
one after the other on the same machine, and the speed ratios per row.

    python scripts/bench_sweep.py --ref /path/to/llama-sweep-bench -m model.gguf \
        [-c 4096] [-ub 512] [-t 2] [--args "-mla 3 -fa on"] [--ikcli-args "-fmoe"] [--out table.md]

Without -m, a ~1B-parameter DeepSeek-shaped Q8_0 model is generated (make_test_model.py --preset 1b).
--base-tree DIR adds another ikcli checkout (e.g. a `git worktree` of an earlier commit) run the same
way just before this one, and --rounds N repeats the three runs N times (one table each): a change
measured against the tree before it and against ik in the same minutes.  --best adds a last table
of each tool's best S_PP and S_TG per row over the rounds.
Both tools print the same table; the regex below is the one a user's script would use on either.
ik_llama.cpp's common parser has no `-fmoe` (fused MoE is its default), hence the separate --ikcli-args.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+) \|$", re.M)


def sweep(cmd: list[str], cwd: str | None = None) -> dict[int, tuple[float, float]]:
    """N_KV -> (S_PP, S_TG) parsed from the tool's output (both tools print the table on stderr)."""
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    rows = {int(m.group(3)): (float(m.group(5)), float(m.group(7))) for m in ROW.finditer(r.stdout + r.stderr)}
    if r.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="path of the reference llama-sweep-bench binary")
    ap.add_argument("-m", "--model")
    ap.add_argument("--type", default="q8_0", help="weights of the generated model when -m is not given")
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--args", default="-mla 3 -fa on", help="flags given to both tools")
    ap.add_argument("--ikcli-args", default="-fmoe", help="flags given to ikcli only")
    ap.add_argument("--base-tree", help="another ikcli checkout to run before this one (python -m ikcli there)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--best", action="store_true",
                    help="with --rounds: also a table of each tool's best S_PP and S_TG per row over the rounds "
                         "(the VM's slow spells hit single rows of either tool)")
    ap.add_argument("--out")
    a = ap.parse_args()
    tables = []
    with tempfile.TemporaryDirectory() as d:
        model = a.model
        if not model:
            from make_test_model import write_model
            model = write_model(os.path.join(d, f"ds-1b-{a.type}.gguf"), "deepseek2", "ik", a.type, "1b", seed=0)[0]
        common = ["-m", model, "-c", str(a.c), "-ub", str(a.ub), "-t", str(a.t), *shlex.split(a.args)]
        ikcli = [sys.executable, "-m", "ikcli", "sweep-bench", *common, *shlex.split(a.ikcli_args)]
        runs = []
        for rnd in range(a.rounds):
            base = sweep(ikcli, cwd=a.base_tree) if a.base_tree else None
            ours = sweep(ikcli, cwd=os.path.dirname(HERE))
            ref = sweep([a.ref, *common])
            runs.append((ours, ref, base))
            tables.append(table(a, model, ours, ref, base, rnd))
        if a.best and a.rounds > 1:
            ours, ref, base = (best_rows([r[i] for r in runs]) if runs[0][i] is not None else None for i in range(3))
            tables.append(table(a, model, ours, ref, base, -1))
    text = "\n\n".join(tables)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


def best_rows(runs: list[dict]) -> dict[int, tuple[float, float]]:
    """N_KV -> (best S_PP, best S_TG) over the runs that have the row."""
    rows = set().union(*runs)
    return {n: (max(r[n][0] for r in runs if n in r), max(r[n][1] for r in runs if n in r)) for n in rows}


def table(a, model: str, ours: dict, ref: dict, base: dict | None, rnd: int) -> str:
    """One round's table (rnd -1: each tool's best per row over the rounds)."""
    b = " base S_PP | base S_TG |" if base else ""
    label = f", best of {a.rounds} rounds per row" if rnd < 0 else f", round {rnd + 1} of {a.rounds}"
    lines = [f"`{' '.join(shlex.split(a.args))}`, -c {a.c} -ub {a.ub} -t {a.t}, model {os.path.basename(model)}"
             + (label if a.rounds > 1 else "")
             + (f"; base: {a.base_tree}" if base else ""), "",
             f"| N_KV |{b} ikcli S_PP | ik S_PP | PP ratio | ikcli S_TG | ik S_TG | TG ratio |",
             "|---:|" + "---:|" * (6 + (2 if base else 0))]
    for n_kv in sorted(set(ours) & set(ref)):
        (pp, tg), (rpp, rtg) = ours[n_kv], ref[n_kv]
        bc = f" {base[n_kv][0]:.2f} | {base[n_kv][1]:.2f} |" if base and n_kv in base else (" - | - |" if base else "")
        lines.append(f"| {n_kv} |{bc} {pp:.2f} | {rpp:.2f} | {pp / rpp:.2f} | {tg:.2f} | {rtg:.2f} | {tg / rtg:.2f} |")
    first, last = min(ours), max(ours)
    lines += ["", f"ikcli TG at N_KV={last} / at N_KV={first}: {ours[last][1] / ours[first][1]:.2f}; "
              f"reference: {ref[last][1] / ref[first][1]:.2f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
