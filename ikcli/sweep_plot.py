"""Reading sweep-bench results (jsonl lines or the Markdown table, e.g. a whole stderr log) and
plotting S_PP and S_TG against N_KV, one curve per run. Used by `ikcli sweep-bench --plot` and
`scripts/plot_sweep.py`; matplotlib is imported only when a plot is drawn."""
from __future__ import annotations

import json
import math
import os
import re
from typing import Iterable

from .errors import CliError

# A table row of llama-sweep-bench / ikcli sweep-bench (optionally with the --sweep-memory columns).
TABLE_ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*([\d.]+|inf|nan) \|\s*([\d.]+|inf|nan) \|"
                       r"\s*([\d.]+|inf|nan) \|\s*([\d.]+|inf|nan) \|")
_TABLE_KEYS = ("pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg")


def parse_results(text: str) -> list[dict]:
    """The result rows in a sweep-bench output: jsonl lines (`{...}`) and/or Markdown table rows.

    Any other line (load logs, headers, llama_print_timings) is ignored, so the whole stderr of a
    run can be given as is.
    """
    rows: list[dict] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{") and s.endswith("}"):
            try:
                d = json.loads(s)
            except ValueError:
                continue
            if isinstance(d, dict) and {"n_kv", "speed_pp", "speed_tg"} <= d.keys():
                rows.append(d)
            continue
        m = TABLE_ROW.match(s)
        if m:
            rows.append({k: (int(v) if k in ("pp", "tg", "n_kv") else float(v))
                         for k, v in zip(_TABLE_KEYS, m.groups())})
    return rows


def read_results(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            rows = parse_results(fh.read())
    except OSError as e:
        raise CliError(f"cannot read '{path}': {e.strerror}") from None
    if not rows:
        raise CliError(f"{path}: no sweep-bench results in it (expected jsonl lines or table rows)")
    return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _by_n_kv(rows: Iterable[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard deviation of `key` per N_KV (several runs may be concatenated in one file)."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        v = float(r[key])
        if math.isfinite(v):
            groups.setdefault(int(r["n_kv"]), []).append(v)
    xs = sorted(groups)
    stats = [_mean_std(groups[x]) for x in xs]
    return xs, [m for m, _ in stats], [s for _, s in stats]


def plot_runs(runs: list[tuple[str, list[dict]]], out: str, title: str | None = None) -> None:
    """Write a PNG (or any format matplotlib knows from the extension) with two panels, S_PP and S_TG
    against N_KV, one curve per (label, rows) run; error bars where a run repeats an N_KV."""
    try:
        import matplotlib
    except ImportError:
        raise CliError("plotting needs matplotlib, which is not installed (pip install 'ikcli[plot]' "
                       "or pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    cmap = plt.get_cmap("tab10" if len(runs) <= 10 else "rainbow")
    panels = (("speed_pp", "S_PP (t/s)", "Prompt processing", "o"),
              ("speed_tg", "S_TG (t/s)", "Token generation", "s"))
    all_x: set[int] = set()
    top = [0.0, 0.0]
    for i, (label, rows) in enumerate(runs):
        color = cmap(i % 10) if len(runs) <= 10 else cmap(i / max(1, len(runs) - 1))
        for k, (ax, (key, _, _, marker)) in enumerate(zip(axes, panels)):
            xs, ys, es = _by_n_kv(rows, key)
            all_x.update(xs)
            top[k] = max([top[k]] + [y + e for y, e in zip(ys, es)])
            ax.errorbar(xs, ys, yerr=es if any(es) else None, color=color, marker=marker, markersize=4,
                        linestyle="-", capsize=3, label=label)
    ticks = sorted(all_x)
    while len(ticks) > 16:
        ticks = ticks[::2]
    for k, (ax, (_, ylabel, name, _)) in enumerate(zip(axes, panels)):
        ax.set_xlabel("N_KV (tokens in the KV cache)")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        if ticks:
            ax.set_xticks(ticks)
            ax.tick_params(axis="x", labelrotation=45)
        ax.set_ylim(0, top[k] * 1.1 if top[k] > 0 else 1.0)
        ax.grid(True, alpha=0.4)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(title or "sweep-bench")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise CliError(f"cannot write plot '{out}': {e.strerror}") from None
    finally:
        plt.close(fig)


def default_label(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]
