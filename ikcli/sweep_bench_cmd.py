"""`ikcli sweep-bench`: llama-sweep-bench's flags, method and output (all on stderr, like the original).

For N_KV = 0, ub, 2*ub, ... while N_KV + ub <= n_ctx: generate TG random tokens one at a time on
top of N_KV cached tokens (S_TG), remove them, then process a ubatch of PP = ub random tokens in
one call (S_PP); that batch stays in the cache, so the next row starts ub tokens further.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Optional

import typer

from . import common
from .errors import CliError

HEADER = ("PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")
MEM_HEADER = ("RSS HWM", "VRAM delta")
DEFAULT_SEED = 1   # C's rand() without srand() starts from seed 1 as well


def _err(s: str) -> None:
    sys.stderr.write(s)
    sys.stderr.flush()


def _f32_rate(elapsed_s: float, nrep: int, n_tokens: int) -> tuple[float, float]:
    """(seconds per repetition, tokens per second) computed as the original does: whole
    microseconds, then single-precision arithmetic (so the %f digits look the same)."""
    import numpy as np
    us = np.float32(round(elapsed_s * 1e6))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = us / np.float32(1e6) / np.float32(nrep)
        speed = np.float32(n_tokens) / t
    return float(t), float(speed)


def _rss_hwm_mib() -> float:
    try:
        import resource
    except ImportError:   # Windows
        return -1.0
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1024.0 * 1024.0) if sys.platform == "darwin" else kb / 1024.0


def _fmt_mib(v: float, prec: int, missing: str) -> str:
    return missing if v < 0 else f"{v:.{prec}f}"


class _Timings:
    """llama_print_timings' counters: decode calls of one token are 'eval', larger ones 'prompt eval'."""

    def __init__(self, t_load_s: float) -> None:
        self.t_load = t_load_s
        self.reset()

    def reset(self) -> None:
        self.t_start = time.perf_counter()
        self.t_p_eval = self.t_eval = 0.0
        self.n_p_eval = self.n_eval = 0

    def add(self, n_tokens: int, seconds: float) -> None:
        if n_tokens == 1:
            self.t_eval += seconds
            self.n_eval += 1
        elif n_tokens > 1:
            self.t_p_eval += seconds
            self.n_p_eval += n_tokens

    def print(self) -> None:
        def div(a: float, b: float) -> float:
            return a / b if b else (float("nan") if a == 0 else float("inf"))
        p = "llama_print_timings"
        t_p, t_e = 1e3 * self.t_p_eval, 1e3 * self.t_eval
        n_p, n_e = self.n_p_eval, max(1, self.n_eval)
        total = 1e3 * (time.perf_counter() - self.t_start)
        _err("\n"
             f"{p}:        load time = {1e3 * self.t_load:10.2f} ms\n"
             f"{p}:      sample time = {0.0:10.2f} ms / {1:5d} runs   ({0.0:8.2f} ms per token, {float('inf'):8.2f} tokens per second)\n"
             f"{p}: prompt eval time = {t_p:10.2f} ms / {n_p:5d} tokens ({div(t_p, n_p):8.2f} ms per token, {div(1e3, t_p) * n_p:8.2f} tokens per second)\n"
             f"{p}:        eval time = {t_e:10.2f} ms / {n_e:5d} runs   ({div(t_e, n_e):8.2f} ms per token, {div(1e3, t_e) * n_e:8.2f} tokens per second)\n"
             f"{p}:       total time = {total:10.2f} ms / {n_p + n_e:5d} tokens\n")


@common.with_engine_flags
def sweep_bench(
    model: Optional[str] = common.ModelOpt,
    ctx_size: int = typer.Option(0, "-c", "--ctx-size", help="size of the prompt context; the sweep covers it (default: 0 = the model's training context)"),
    batch_size: int = common.BatchOpt,
    ubatch_size: Optional[int] = typer.Option(None, "-ub", "--ubatch-size", help="physical maximum batch size = PP, the tokens of each row (default: 512; the embedded demo model, trained on 256 tokens: 64)"),
    threads: int = common.ThreadsOpt,
    threads_batch: int = common.ThreadsBatchOpt,
    n_predict: int = typer.Option(-1, "-n", "--n-predict", "--predict", help="TG: tokens generated per row (default: -1 = ubatch/4)"),
    nrep: int = typer.Option(1, "-nrep", "--n-repetitions", help="number of repetitions for each context size (applied to the first row, as in llama-sweep-bench)"),
    sweep_stride: int = typer.Option(1, "--sweep-stride", help="measure every Nth sweep row (the others still fill the KV cache)"),
    sweep_memory: bool = typer.Option(False, "--sweep-memory", help="report RSS high-water (MiB) and VRAM delta (always n/a: no GPU) columns"),
    mini: bool = typer.Option(False, "--minilog", help="leave the loader's long listings (metadata, model printout, buffers) out of the log"),
    warmup_batch: bool = typer.Option(False, "-wb", "--warmup-batch", help="run a warmup batch of ubatch tokens before measurement"),
    output_format: str = typer.Option("md", "--output-format", help="md (= table, default) or jsonl"),
    plot: Optional[str] = typer.Option(None, "--plot", help="after the run, write a PNG of S_PP and S_TG against N_KV to this file (needs matplotlib)"),
    seed: int = typer.Option(DEFAULT_SEED, "-s", "--seed", help=f"seed of the random prompt/generation tokens (default: {DEFAULT_SEED}, fixed so runs are reproducible; -1 = a random seed)"),
    ngl: int = typer.Option(-1, "-ngl", "--gpu-layers", "--n-gpu-layers", help="number of layers to store in VRAM (-1: ik's default, none)"),
    flags: "common.EngineFlags" = None,
) -> None:
    fmt = output_format.strip().lower()
    if fmt not in ("md", "table", "jsonl"):
        raise CliError(f"invalid value '{output_format}' for --output-format: use md (or table) or jsonl")
    jsonl = fmt == "jsonl"
    if ubatch_size is None:
        ubatch_size = 64 if model is None else 512
    common.check_common(ctx_size, batch_size, ubatch_size, threads, threads_batch, 0 if ngl == -1 else ngl, flags.mla)
    nrep = max(1, nrep)
    stride = max(1, sweep_stride)
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib, which is not installed (pip install 'ikcli[plot]' or pip install matplotlib)")
    if plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(plot))):
        raise CliError(f"--plot {plot}: the folder {os.path.dirname(os.path.abspath(plot))} does not exist")

    import numpy as np

    common.minilog(mini)
    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch, seed=seed, ngl=max(ngl, 0))
    t0 = time.perf_counter()
    m = common.load_model(path, cfg)
    t_load = time.perf_counter() - t0
    if ctx_size > m.hp.n_ctx_train:
        common.log(f"warning: model was trained on only {m.hp.n_ctx_train} context tokens ({ctx_size} specified)")
    ctx = common.new_context(m, cfg, flags)

    n_kv_max = ctx.n_ctx
    pp = ubatch_size
    tg = n_predict if n_predict > 0 else ubatch_size // 4
    rows_kv = list(range(0, n_kv_max - pp + 1, pp))
    if not rows_kv:
        raise CliError(f"no sweep row fits: the context has {n_kv_max} cells (-c {ctx_size}, padded) but each row "
                       f"processes a ubatch of {pp} tokens; use a larger -c or a smaller -ub")
    measured = [kv for i, kv in enumerate(rows_kv) if i % stride == 0]
    if measured[-1] + tg > n_kv_max:
        raise CliError(f"-n {tg} too large: generating {tg} tokens at N_KV = {measured[-1]} overflows the context "
                       f"of {n_kv_max} cells; use -n <= {n_kv_max - measured[-1]} or a larger -c")

    n_vocab = m.n_vocab
    rng = np.random.default_rng(None if seed < 0 else seed)

    def rand_tokens(n: int) -> np.ndarray:
        return rng.integers(0, n_vocab, size=n, dtype=np.int32)

    timings = _Timings(t_load)

    def decode(tokens: np.ndarray) -> None:
        t = time.perf_counter()
        ctx.decode(tokens, logits_from=len(tokens) - 1)   # only the last token's logits, as the original
        timings.add(len(tokens), time.perf_counter() - t)

    n_threads, n_threads_batch = cfg.threads(batch=False), cfg.threads(batch=True)
    flash = int(cfg.flash_attn)
    if not jsonl:
        _err(f"\nmain: n_kv_max = {n_kv_max}, n_batch = {batch_size}, n_ubatch = {ubatch_size}, flash_attn = {flash}, "
             f"n_gpu_layers = {ngl}, n_threads = {n_threads}, n_threads_batch = {n_threads_batch}\n\n")
        head = "|%6s | %6s | %6s | %8s | %8s | %8s | %8s |" % HEADER
        sep = "|%6s-|-%6s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|" % ("-" * 6, "-" * 6, "-" * 6, "-" * 8, "-" * 8, "-" * 8, "-" * 8)
        if sweep_memory:
            head += " %10s | %10s |" % MEM_HEADER
            sep += "-%10s-|-%10s-|" % ("-" * 10, "-" * 10)
        _err(head + "\n" + sep + "\n")

    if warmup_batch:
        ctx.clear()
        decode(rand_tokens(ubatch_size))
    ctx.clear()
    timings.reset()

    results: list[dict] = []
    for i_loop, n_kv in enumerate(rows_kv):
        measure = i_loop % stride == 0
        reps = nrep if measure and i_loop < 1 else 1

        # token generation on top of n_kv cached tokens
        if measure:
            t_start = time.perf_counter()
            for _ in range(reps):
                ctx.seq_rm(n_kv, -1)
                for tok in rand_tokens(tg):
                    decode(np.array([tok], dtype=np.int32))
            t_tg_s = time.perf_counter() - t_start
        else:
            rand_tokens(tg)   # keep the token stream aligned with a stride-1 sweep

        # prompt processing of one ubatch; it stays in the cache for the next row
        t_start = time.perf_counter()
        for _ in range(reps):
            ctx.seq_rm(n_kv, -1)
            decode(rand_tokens(pp))
        t_pp_s = time.perf_counter() - t_start
        if not measure:
            continue

        t_pp, speed_pp = _f32_rate(t_pp_s, reps, pp)
        t_tg, speed_tg = _f32_rate(t_tg_s, reps, tg)
        rss = _rss_hwm_mib() if sweep_memory else -1.0
        vram = -1.0
        results.append({"pp": pp, "tg": tg, "n_kv": n_kv, "t_pp": t_pp, "speed_pp": speed_pp,
                        "t_tg": t_tg, "speed_tg": speed_tg})
        if jsonl:
            line = (f'{{"n_kv_max": {n_kv_max}, "n_batch": {batch_size}, "n_ubatch": {ubatch_size}, '
                    f'"flash_attn": {flash}, "n_gpu_layers": {ngl}, "n_threads": {n_threads}, '
                    f'"n_threads_batch": {n_threads_batch}, "pp": {pp}, "tg": {tg}, "n_kv": {n_kv}, '
                    f'"t_pp": {t_pp:f}, "speed_pp": {speed_pp:f}, "t_tg": {t_tg:f}, "speed_tg": {speed_tg:f}')
            if sweep_memory:
                line += f', "rss_hwm_mib": {_fmt_mib(rss, 3, "null")}, "vram_delta_mib": {_fmt_mib(vram, 3, "null")}'
            _err(line + " }\n")
        else:
            line = f"|{pp:6d} | {tg:6d} | {n_kv:6d} | {t_pp:8.3f} | {speed_pp:8.2f} | {t_tg:8.3f} | {speed_tg:8.2f} |"
            if sweep_memory:
                line += f" {_fmt_mib(rss, 1, 'n/a'):>10s} | {_fmt_mib(vram, 1, 'n/a'):>10s} |"
            _err(line + "\n")

    timings.print()

    if plot is not None:
        from .sweep_plot import default_label, plot_runs
        label = default_label(path)
        plot_runs([(label, results)], plot,
                  title=f"sweep-bench: {label}, n_ubatch = {ubatch_size}, flash_attn = {flash}, "
                        f"n_threads = {n_threads}/{n_threads_batch}")
        common.log(f"main: plot written to {plot}")
