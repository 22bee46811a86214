"""`ikcli perplexity`: llama-perplexity's flags and output, including KL-divergence mode."""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Optional

import typer

from . import common
from .errors import CliError


def _read_text(path: Optional[str], escape: bool) -> tuple[str, str]:
    from .textio import prompt_from_file
    if path is None:
        from .defaults import demo_text
        path = demo_text()
        common.log(f"perplexity: no -f given, using the bundled text {path}")
    if path == "-":
        return prompt_from_file(sys.stdin.buffer.read().decode("utf-8", errors="replace"), escape), "<stdin>"
    try:
        with open(path, "rb") as fh:
            return prompt_from_file(fh.read().decode("utf-8", errors="replace"), escape), path
    except OSError as e:
        raise CliError(f"cannot read text file '{path}': {e.strerror}") from None


class _Progress:
    """A transient progress bar on stderr (only when it is a terminal: logs stay clean)."""

    def __init__(self, total: int, what: str) -> None:
        self.bar = None
        if sys.stderr.isatty() and total > 1:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
            self.bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(what, total=total)

    def advance(self) -> None:
        if self.bar:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def _eta(t_pass: float, n_pass: int, who: str = "perplexity") -> None:
    total = int(t_pass * n_pass)
    msg = f"{who}: {t_pass:.2f} seconds per pass - ETA "
    if total >= 3600:
        msg += f"{total // 3600} hours "
        total %= 3600
    common.log(msg + f"{total / 60.0:.2f} minutes")


@common.with_engine_flags
def perplexity(
    model: Optional[str] = common.ModelOpt,
    file: Optional[str] = typer.Option(None, "-f", "--file", help="text file to evaluate ('-' for stdin). Default: bundled Shakespeare slice"),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", help="chunk size in tokens (default 512 as in llama-perplexity; the embedded demo model uses its training context)"),
    batch_size: int = common.BatchOpt,
    ubatch_size: int = common.UBatchOpt,
    threads: int = common.ThreadsOpt,
    threads_batch: int = common.ThreadsBatchOpt,
    seed: int = typer.Option(-1, "-s", "--seed", help="accepted like llama-perplexity's; perplexity does not sample, so it changes nothing"),
    chunks: int = typer.Option(-1, "--chunks", help="max number of chunks to process (-1 = all)"),
    kl_base: Optional[str] = typer.Option(None, "--kl-divergence-base", help="file of base-model log-probabilities: written, or read with --kl-divergence"),
    kl: bool = typer.Option(False, "--kl-divergence", help="compare against the base log-probabilities of --kl-divergence-base"),
    escape: bool = typer.Option(True, "-e/--no-escape", "--escape/--no-escape",
                                help="process escape sequences (\\n, \\t, \\xHH …) in the text, as llama.cpp does by default"),
    ngl: int = common.NglOpt,
    flags: "common.EngineFlags" = None,
) -> None:
    if ctx_size is None:
        ctx_size = 0 if model is None else 512  # the demo model is evaluated at its trained context
    common.check_common(ctx_size, batch_size, ubatch_size, threads, threads_batch, ngl, flags.mla)
    if kl and not kl_base:
        raise CliError("--kl-divergence needs --kl-divergence-base FILE (the base model's log-probabilities)")
    if ctx_size == 1:
        raise CliError("-c/--ctx-size must be at least 2 for perplexity")
    from engine.context import Context
    from engine.model import load_model

    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=0, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch, seed=seed)
    base = None
    if kl:
        from engine.perplexity import open_base_logits
        if not os.path.exists(kl_base):
            raise CliError(f"{kl_base}: no such file (write it first with --kl-divergence-base alone)")
        base = open_base_logits(kl_base)
        ctx_size = base.n_ctx
    n_ctx = ctx_size if ctx_size > 0 else 0
    m = load_model(path, common.log, mla=flags.mla, overrides=cfg.tensor_overrides, repack=cfg.repack,
                   use_mmap=cfg.use_mmap)
    if n_ctx == 0:
        n_ctx = m.hp.n_ctx_train
    if n_ctx > m.hp.n_ctx_train:
        common.log(f"warning: model was trained on only {m.hp.n_ctx_train} context tokens ({n_ctx} specified)")
    n_seq = max(1, batch_size // n_ctx)
    n_batch = min(batch_size, n_seq * n_ctx)
    cfg.n_ctx, cfg.n_batch = n_seq * n_ctx, n_batch     # llama-perplexity's context: n_seq chunks
    ctx = Context(m, cfg, common.log)
    if base is not None:
        try:
            _kl_divergence(ctx, m, base, n_batch)
        finally:
            base.fh.close()
    else:
        _perplexity(ctx, m, file, escape, n_ctx, n_batch, n_seq, chunks, kl_base)


def _perplexity(ctx, m, file, escape: bool, n_ctx: int, n_batch: int, n_seq: int, chunks: int, kl_base: Optional[str]) -> None:
    import numpy as np

    from engine.perplexity import BaseLogitsWriter, PplAccumulator, chunk_logits, plan_chunks, token_nll

    text, name = _read_text(file, escape)
    common.log("perplexity: tokenizing the input ..")
    t0 = time.perf_counter()
    tokens = np.asarray(m.tokenizer.encode(text, add_special=True), dtype=np.int32)
    common.log(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t0):g} ms")
    if len(tokens) < 2 * n_ctx:
        raise CliError(f"perplexity: you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                       f"{n_ctx}; {name} tokenizes to only {len(tokens)} tokens (use a longer text or a smaller -c)")
    n_chunk = plan_chunks(len(tokens), n_ctx, chunks)
    if n_chunk < 1:
        raise CliError("--chunks must be positive (or -1 for all)")
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    common.log(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, batch_size={n_batch}, n_seq={n_seq}")
    writer = None
    tmp = None
    if kl_base:
        tmp = kl_base + ".tmp"
        fh = open(tmp, "wb")
        writer = BaseLogitsWriter(fh, n_ctx, m.n_vocab, n_chunk, tokens)
        common.log(f"perplexity: saving all logits to {kl_base}")
    acc = PplAccumulator()
    first = n_ctx // 2
    bar = _Progress(n_chunk, "perplexity")
    try:
        for i in range(n_chunk):
            t_start = time.perf_counter()
            chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
            logits = chunk_logits(ctx, chunk, bos, n_batch)
            if i == 0:
                _eta(time.perf_counter() - t_start, n_chunk)
            acc.add(token_nll(logits, chunk[first + 1:]))
            if writer:
                writer.add_chunk(logits)
            sys.stdout.write(f"[{i + 1}]{acc.ppl:.4f},")
            sys.stdout.flush()
            bar.advance()
    except BaseException:
        bar.close()
        if writer:
            writer.fh.close()
            os.unlink(tmp)
        raise
    bar.close()
    if writer:
        writer.fh.close()
        os.replace(tmp, kl_base)
    sys.stdout.write("\n")
    ppl, unc = acc.estimate()
    if unc is None:
        sys.stdout.write("Unexpected negative standard deviation of log(prob)\n")
    else:
        sys.stdout.write(f"Final estimate: PPL over {n_chunk} chunks for n_ctx={n_ctx} = {ppl:.4f} +/- {unc:.5f}\n")
    sys.stdout.flush()


def _kl_divergence(ctx, m, base, n_batch: int) -> None:
    import numpy as np

    from engine.perplexity import KldAccumulator, chunk_logits

    if base.n_vocab != m.n_vocab:
        raise CliError(f"{base.path}: inconsistent vocabulary ({base.n_vocab} vs {m.n_vocab})")
    n_ctx = base.n_ctx
    first = n_ctx // 2
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    acc = KldAccumulator()
    out = sys.stdout
    bar = _Progress(base.n_chunk, "kl-divergence")
    try:
        for i, rows in enumerate(base.chunks()):
            t_start = time.perf_counter()
            chunk = base.tokens[i * n_ctx:(i + 1) * n_ctx]
            logits = chunk_logits(ctx, chunk, bos, n_batch)
            if i == 0:
                _eta(time.perf_counter() - t_start, base.n_chunk)
                out.write("\nchunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                          "              Δp RMS            Same top p\n")
            acc.add(logits, rows, chunk[first + 1:].astype(np.int64))
            out.write(_kl_row(i + 1, acc) + "\n")
            out.flush()
            bar.advance()
    finally:
        bar.close()
    out.write("\n")
    if acc.count < 100:
        return
    _kl_summary(acc, out)


def _stats(acc):
    mu = acc.mean_unc
    lp = mu(acc.sum_nll, acc.sum_nll2, acc.count)
    lb = mu(acc.sum_nll_base, acc.sum_nll_base2, acc.count)
    cov = acc.cov()
    ratio = lp[0] - lb[0]
    ratio_unc = math.sqrt(max(lp[1] ** 2 + lb[1] ** 2 - 2.0 * cov, 0.0))
    return lp, lb, cov, ratio, ratio_unc


def _kl_row(i: int, acc) -> str:
    mu = acc.mean_unc
    lp, lb, cov, ratio, ratio_unc = _stats(acc)
    ppl = math.exp(lp[0])
    kld = mu(acc.sum_kld, acc.sum_kld2, acc.count)
    mse = mu(acc.sum_p_diff2, acc.sum_p_diff4, acc.count)
    rms = math.sqrt(mse[0])
    rms_unc = 0.5 / rms * mse[1] if rms > 0 else 0.0
    top = acc.n_same_top / acc.count
    top_unc = math.sqrt(top * (1 - top) / (acc.count - 1)) if acc.count > 1 else 0.0
    return (f"{i:4d}    {ppl:9.4f} ± {ppl * lp[1]:9.4f}    {ratio:10.5f} ± {ratio_unc:10.5f}"
            f"    {kld[0]:10.5f} ± {kld[1]:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
            f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")


def _percentile(values, fraction: float) -> float:
    if fraction <= 0:
        return values[0]
    if fraction >= 1:
        return values[-1]
    p = fraction * (len(values) - 1)
    ip = int(p)
    p -= ip
    return (1 - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)]


def _median(v) -> float:
    n = len(v)
    return 0.5 * (v[n // 2] + v[n // 2 - 1]) if n % 2 == 0 else v[n // 2]


def _quantile_lines(w, name: str, v, upper, lower, fmt) -> None:
    """Maximum, upper percentiles, median, lower percentiles, minimum: llama-perplexity's block."""
    w(f"Maximum {name}:{fmt(v[-1])}\n")
    for f in upper:
        w(f"{100 * f:4.1f}%   {name}:{fmt(_percentile(v, f))}\n")
    w(f"Median  {name}:{fmt(_median(v))}\n")
    for f in lower:
        w(f"{100 * f:4.1f}%   {name}:{fmt(_percentile(v, f))}\n")
    w(f"Minimum {name}:{fmt(v[0])}\n")


def _kl_summary(acc, out) -> None:
    mu = acc.mean_unc
    lp, lb, cov, ratio, ratio_unc = _stats(acc)
    ppl, ppl_unc = math.exp(lp[0]), math.exp(lp[0]) * lp[1]
    pb, pb_unc = math.exp(lb[0]), math.exp(lb[0]) * lb[1]
    w = out.write
    w("====== Perplexity statistics ======\n")
    w(f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}\n")
    w(f"Mean PPL(base)                : {pb:10.6f} ± {pb_unc:10.6f}\n")
    cor = cov / (lp[1] * lb[1]) if lp[1] * lb[1] > 0 else 0.0
    w(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * cor:6.2f}%\n")
    w(f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}\n")
    r = math.exp(ratio)
    w(f"Mean PPL(Q)/PPL(base)         : {r:10.6f} ± {r * ratio_unc:10.6f}\n")
    ppl_cov = ppl * pb * cov
    dunc = math.sqrt(max(ppl_unc ** 2 + pb_unc ** 2 - 2.0 * ppl_cov, 0.0))
    w(f"Mean PPL(Q)-PPL(base)         : {ppl - pb:10.6f} ± {dunc:10.6f}\n\n")
    w("====== KL divergence statistics ======\n")
    kld = mu(acc.sum_kld, acc.sum_kld2, acc.count)
    kv = sorted(acc.kld_values)
    w(f"Mean    KLD: {kld[0]:10.6f} ± {kld[1]:10.6f}\n")
    _quantile_lines(w, "KLD", kv, (.999, .99, .95, .9), (.1, .05, .01, .001), lambda v: f" {v:10.6f}")
    w("\n")
    w("====== Token probability statistics ======\n")
    pd = mu(acc.sum_p_diff, acc.sum_p_diff2, acc.count)
    pv = sorted(acc.p_diff_values)
    w(f"Mean    Δp: {100 * pd[0]:6.3f} ± {100 * pd[1]:5.3f} %\n")
    _quantile_lines(w, "Δp", pv, (.999, .99, .95, .9, .75), (.25, .1, .05, .01, .001), lambda v: f" {100 * v:6.3f}%")
    mse = mu(acc.sum_p_diff2, acc.sum_p_diff4, acc.count)
    rms = math.sqrt(mse[0])
    w(f"RMS Δp    : {100 * rms:6.3f} ± {100 * (0.5 / rms * mse[1] if rms > 0 else 0):5.3f} %\n")
    top = acc.n_same_top / acc.count
    w(f"Same top p: {100 * top:6.3f} ± {100 * math.sqrt(top * (1 - top) / (acc.count - 1)):5.3f} %\n")
