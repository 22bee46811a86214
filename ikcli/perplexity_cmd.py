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
    from .textio import decode_utf8
    if path == "-":
        return prompt_from_file(decode_utf8(sys.stdin.buffer.read(), "<stdin>", common.log), escape), "<stdin>"
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise CliError(f"cannot read text file '{path}': {e.strerror}") from None
    return prompt_from_file(decode_utf8(data, path, common.log), escape), path


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


def _chunk_logits(ctx, chunk, bos, n_batch: int, i: int):
    """The chunk's logits; NaN / inf in the model's computation stops the run at this chunk."""
    from engine.perplexity import chunk_logits
    try:
        logits = chunk_logits(ctx, chunk, bos, n_batch)
    except FloatingPointError as e:
        sys.stdout.write("\n")
        raise CliError(f"chunk {i + 1}: {e} (damaged weights? --check-tensors validates them at load)") from None
    _check_logits(logits, i)
    return logits


def _check_logits(logits, i: int) -> None:
    """A NaN / inf logit stops the run at its chunk with a reason, instead of `PPL = nan`."""
    from engine.perplexity import count_nonfinite
    bad = count_nonfinite(logits)
    if bad:
        sys.stdout.write("\n")
        raise CliError(f"chunk {i + 1}: the model produced {bad} NaN or infinite logits (damaged weights? "
                       f"--check-tensors validates them at load)")


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
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the text to evaluate, given on the command line instead of -f"),
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
    binary_file: Optional[str] = typer.Option(None, "-bf", "--binary-file", help="input read as is (no escape processing, final newline kept): the --multiple-choice task files"),
    ppl_stride: int = typer.Option(0, "--ppl-stride", help="strided perplexity: windows of the context size moved by N tokens, the last N tokens of each scored (0 = chunks)"),
    ppl_output_type: int = typer.Option(0, "--ppl-output-type", help="0: [i]ppl, ... on one line; 1: one line per chunk (tokens before it, ppl[, mean NLL, its uncertainty])"),
    hellaswag: bool = typer.Option(False, "--hellaswag", help="HellaSwag score (acc_norm) over random tasks of the -f file (6 lines per task)"),
    hellaswag_tasks: int = typer.Option(400, "--hellaswag-tasks", help="number of HellaSwag tasks to use"),
    winogrande: bool = typer.Option(False, "--winogrande", help="Winogrande score over the tasks of the -f CSV file"),
    winogrande_tasks: int = typer.Option(0, "--winogrande-tasks", help="number of random Winogrande tasks to use (0 = all)"),
    multiple_choice: bool = typer.Option(False, "--multiple-choice", help="multiple-choice score (ARC, MMLU, TruthfulQA, ...) over the tasks of ik_llama.cpp's binary file (-bf or -f)"),
    multiple_choice_tasks: int = typer.Option(0, "--multiple-choice-tasks", help="number of random multiple-choice tasks to use (0 = all)"),
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
    if sum(x is not None for x in (file, binary_file, prompt)) > 1:
        raise CliError("-f, -bf and -p each name the input: give one of them")
    if ppl_output_type not in (0, 1):
        raise CliError(f"--ppl-output-type must be 0 or 1, not {ppl_output_type}")
    # the first of these modes wins, as in llama-perplexity
    task = "hellaswag" if hellaswag else "winogrande" if winogrande else "multiple-choice" if multiple_choice else None
    task_input = _task_input(task, file, binary_file, escape, prompt) if task else None

    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=0, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch, seed=seed, ngl=ngl)
    base = None
    if kl and not task:
        from engine.perplexity import open_base_logits
        if not os.path.exists(kl_base):
            raise CliError(f"{kl_base}: no such file (write it first with --kl-divergence-base alone)")
        base = open_base_logits(kl_base)
        ctx_size = base.n_ctx
    n_ctx = ctx_size if ctx_size > 0 else 0
    m = common.load_model(path, cfg)
    if n_ctx == 0:
        n_ctx = m.hp.n_ctx_train
    if n_ctx > m.hp.n_ctx_train:
        common.log(f"warning: model was trained on only {m.hp.n_ctx_train} context tokens ({n_ctx} specified)")
    if task:        # one context of n_ctx cells shared by the sequences of the tasks
        n_seq, n_batch = 1, min(batch_size, n_ctx)
    else:
        n_seq = max(1, batch_size // n_ctx)
        n_batch = min(batch_size, n_seq * n_ctx)
    cfg.n_ctx, cfg.n_batch = n_seq * n_ctx, n_batch     # llama-perplexity's context: n_seq chunks
    if ppl_stride > 0:
        common.log(f"Will perform strided perplexity calculation -> adjusting context size from {cfg.n_ctx} "
                   f"to {cfg.n_ctx + ppl_stride // 2}")
        cfg.n_ctx += ppl_stride // 2
    ctx = common.new_context(m, cfg, flags)
    if task:
        n_pick = {"hellaswag": hellaswag_tasks, "winogrande": winogrande_tasks,
                  "multiple-choice": multiple_choice_tasks}[task]
        _TASKS[task](ctx, m, task_input, n_pick if n_pick >= 0 else 2 ** 63, n_batch)  # ik: a size_t
    elif base is not None:
        try:
            _kl_divergence(ctx, m, base, n_batch)
        finally:
            base.fh.close()
    elif ppl_stride > 0:
        if kl_base:
            common.log("perplexity: --kl-divergence-base is not used with --ppl-stride (no logits are saved)")
        _strided(ctx, m, _input_text(file, binary_file, escape, prompt), ppl_stride, n_batch, chunks, ppl_output_type)
    else:
        _perplexity(ctx, m, _input_text(file, binary_file, escape, prompt), n_ctx, n_batch, n_seq, chunks, kl_base,
                    ppl_output_type)


def _input_text(file: Optional[str], binary_file: Optional[str], escape: bool,
                prompt: Optional[str] = None) -> tuple[str, str]:
    """The text and its name: -p with its escapes processed, -bf as is, -f as llama.cpp reads it
    (see _read_text)."""
    if prompt is not None:
        from .textio import process_escapes
        return (process_escapes(prompt) if escape else prompt), "the -p text"
    if binary_file is None:
        return _read_text(file, escape)
    return _read_bytes(binary_file).decode("utf-8", errors="replace"), binary_file


def _read_bytes(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise CliError(f"cannot read task file '{path}': {e.strerror}") from None
    common.log(f"Read {len(data)} bytes from binary file {path}")
    return data


def _task_input(task: str, file: Optional[str], binary_file: Optional[str], escape: bool,
                prompt: Optional[str] = None) -> str | bytes:
    """Read before the model loads, so that a missing file fails at once.  Multiple-choice files
    are binary: read as is from -f too (ik's -f would process escapes in them)."""
    if file is None and binary_file is None and prompt is None:
        raise CliError(f"--{task} needs a task file: -f FILE")
    if task == "multiple-choice" and prompt is None:
        return _read_bytes(binary_file if binary_file is not None else file)
    text = _input_text(file, binary_file, escape, prompt)[0]
    return text.encode("utf-8") if task == "multiple-choice" else text


def _c_float(v: float, spec: str) -> str:
    """printf's %f of v: glibc prints the NaN of 0/0 on x86 as -nan."""
    if math.isnan(v):
        width = spec.split(".")[0]
        return format("-nan", ">" + width if width else "")
    return format(v, spec)


def _task_error(who: str, e: Exception) -> CliError:
    return CliError(f"{who}: {e}")


def _check_fit(who: str, i: int, seqs, n_ctx: int) -> None:
    from engine.task_scores import required_tokens
    need = required_tokens(seqs)
    if need > n_ctx:
        raise CliError(f"{who} : task {i} does not fit in the context window ({need} tokens, n_ctx = {n_ctx}; "
                       "use a larger -c)")


def _hellaswag(ctx, m, text: str, n_pick: int, n_batch: int) -> None:
    from engine.task_scores import TaskFileError, ending_scores, hellaswag_tasks

    who = "hellaswag_score"
    try:
        n_total, tasks = hellaswag_tasks(text, n_pick)
    except TaskFileError as e:
        raise _task_error(who, e) from None
    common.log(f"{who} : loaded {n_total} tasks from prompt.")
    if not tasks:
        raise CliError(f"{who} : no tasks to evaluate ({n_total} in the file, --hellaswag-tasks {n_pick})")
    common.log(f"================================= is_spm = {int(m.tokenizer.type == 'spm')}")
    common.log(f"{who} : selecting {len(tasks)} randomized tasks.")
    enc = m.tokenizer.encode
    seqs = [[enc(t.context + " " + e, add_special=True) for e in t.endings] for t in tasks]
    for i, s in enumerate(seqs):
        _check_fit(who, i, s, ctx.n_ctx)
    common.log(f"{who} : calculating hellaswag score over selected tasks.")
    out = sys.stdout
    out.write("\ntask\tacc_norm\n")
    n_right = 0
    bar = _Progress(len(tasks), "hellaswag")
    try:
        for i, (t, s) in enumerate(zip(tasks, seqs)):
            n_right += int(ending_scores(ctx, s, n_batch).argmax()) == t.gold    # first maximum, as ik
            out.write(f"{i + 1}\t{n_right / (i + 1) * 100.0:.8f}\n")
            out.flush()
            bar.advance()
    finally:
        bar.close()
    out.write("\n")


def _winogrande(ctx, m, text: str, n_pick: int, n_batch: int) -> None:
    from engine.task_scores import accuracy, pick_tasks, winogrande_scores, winogrande_tasks

    who = "winogrande_score"
    out = sys.stdout
    data = winogrande_tasks(text, lambda msg: out.write(msg + "\n"))
    if not data:
        raise CliError(f"{who}: no tasks")
    common.log(f"{who} : loaded {len(data)} tasks from prompt.")
    if 0 < n_pick < len(data):
        common.log(f"{who} : selecting {n_pick} random tasks")
        data = [data[i] for i in pick_tasks(len(data), n_pick)]
    common.log(f"{who} : tokenizing selected tasks")
    enc = m.tokenizer.encode
    seqs = [[enc(t.first + c + t.second, add_special=True) for c in t.choices] for t in data]
    n_base = [[len(enc(t.first + c, add_special=True)) for c in t.choices] for t in data]
    for i, s in enumerate(seqs):
        _check_fit(who, i, s, ctx.n_ctx)
    common.log(f"{who} : calculating winogrande score over selected tasks.")
    n_right = 0
    bar = _Progress(len(data), "winogrande")
    try:
        for i, t in enumerate(data):
            s1, s2 = winogrande_scores(ctx, seqs[i], n_base[i], n_batch)
            result = 1 if s1 > s2 else 2
            n_right += result == t.answer
            out.write(f"{i + 1}\t{100.0 * n_right / (i + 1):.4f}\t{_c_float(s1, '10.6f')}  {_c_float(s2, '10.6f')}"
                      f"  {result}  {t.answer}\n")
            out.flush()
            bar.advance()
    finally:
        bar.close()
    out.write("\n")
    if len(data) >= 100:        # ik prints no final score for fewer tasks
        p, sigma = accuracy(n_right, len(data))
        out.write(f"Final Winogrande score({len(data)} tasks): {_c_float(p, '.4f')} +/- {_c_float(sigma, '.4f')}\n")


def _dots(n: int) -> str:
    """ik's progress dots: one per max(n/100, 1) tasks."""
    return "." * (n // max(n // 100, 1))


def _multiple_choice(ctx, m, data: bytes, n_pick: int, n_batch: int) -> None:
    from engine.task_scores import TaskFileError, accuracy, check_choice_task, choice_task_count, choice_tasks, \
        ending_scores

    who = "multiple_choice_score"
    out = sys.stdout
    try:
        n_task = choice_task_count(data)
    except TaskFileError:
        raise CliError(f"{who}: no tasks") from None
    out.write(f"{who}: there are {n_task} tasks in prompt\n")
    try:
        tasks = choice_tasks(data, n_pick)
    except TaskFileError as e:
        raise _task_error(who, e) from None
    if len(tasks) == n_task:
        out.write(f"{who}: reading tasks{_dots(n_task)}done\n")
    else:
        out.write(f"{who}: selecting {n_pick} random tasks from {n_task} tasks available\n")
    for t in tasks:
        try:
            check_choice_task(t)
        except TaskFileError as e:
            raise _task_error("multiple_choice_prepare_one_task", e) from None
    enc = m.tokenizer.encode
    seqs = [[enc(t.question + " " + a, add_special=True) for a in t.answers] for t in tasks]
    out.write(f"{who}: preparing task data{'...' if len(tasks) > 500 else _dots(len(tasks))}done\n")
    for i, s in enumerate(seqs):
        _check_fit(who, i, s, ctx.n_ctx)
    out.write(f"{who} : calculating TruthfulQA score over {len(tasks)} tasks.\n")
    out.write("\ntask\tacc_norm\n")
    n_right = n_answers = 0
    bar = _Progress(len(tasks), "multiple-choice")
    try:
        for i, (t, s) in enumerate(zip(tasks, seqs)):
            n_right += t.labels[int(ending_scores(ctx, s, n_batch).argmax())] == 1
            n_answers += len(t.answers)
            out.write(f"{i + 1}\t{100.0 * n_right / (i + 1):.8f}\n")
            out.flush()
            bar.advance()
    finally:
        bar.close()
    p, sigma = accuracy(n_right, len(tasks))
    out.write(f"\n Final result: {_c_float(p, '.4f')} +/- {_c_float(sigma, '.4f')}\n")
    p, sigma = accuracy(len(tasks), n_answers, len(tasks))      # by chance: one right answer per task
    out.write(f"Random chance: {_c_float(p, '.4f')} +/- {_c_float(sigma, '.4f')}\n\n")


_TASKS = {"hellaswag": _hellaswag, "winogrande": _winogrande, "multiple-choice": _multiple_choice}


def _strided(ctx, m, text_name: tuple[str, str], stride: int, n_batch: int, chunks: int, output_type: int) -> None:
    """llama-perplexity's perplexity_v2: windows of the context's size, `stride` tokens apart."""
    import numpy as np

    from engine.perplexity import PplAccumulator, strided_nll

    who = "perplexity_v2"
    text, name = text_name
    common.log(f"{who}: tokenizing the input ..")
    tokens = np.asarray(m.tokenizer.encode(text, add_special=True), dtype=np.int32)
    n_ctx = ctx.n_ctx           # ik uses the (padded) context size itself as the window
    if len(tokens) < 2 * n_ctx:
        raise CliError(f"{who}: you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                       f"{n_ctx}; {name} tokenizes to only {len(tokens)} tokens (use a longer text or a smaller -c)")
    common.log(f"{who}: have {len(tokens)} tokens. Calculation chunk = {n_ctx}")
    if stride >= n_ctx:
        raise CliError(f"{who}: --ppl-stride {stride} must be smaller than the context size {n_ctx}")
    n_max = (len(tokens) - n_ctx + stride - 1) // stride
    n_chunk = n_max if chunks < 0 else min(chunks, n_max)
    if n_chunk < 1:
        raise CliError("--chunks must be positive (or -1 for all)")
    common.log(f"{who}: calculating perplexity over {n_chunk} chunks, batch_size={n_batch}")
    acc = PplAccumulator()
    bar = _Progress(n_chunk, "perplexity")
    try:
        for i in range(n_chunk):
            t_start = time.perf_counter()
            acc.add(strided_nll(ctx, tokens[i * stride:i * stride + n_ctx], stride, n_batch))
            if i == 0:
                _eta(time.perf_counter() - t_start, n_chunk, who)
            sys.stdout.write(f"[{i + 1}]{acc.ppl:.4f}," if output_type == 0 else f"{i * stride:8d}  {acc.ppl:.4f}\n")
            sys.stdout.flush()
            bar.advance()
    finally:
        bar.close()
    sys.stdout.write("\n")     # ik's strided mode prints no final estimate


def _perplexity(ctx, m, text_name: tuple[str, str], n_ctx: int, n_batch: int, n_seq: int, chunks: int,
                kl_base: Optional[str], output_type: int = 0) -> None:
    import numpy as np

    from engine.perplexity import BaseLogitsWriter, PplAccumulator, plan_chunks, token_nll

    text, name = text_name
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
            logits = _chunk_logits(ctx, chunk, bos, n_batch, i)
            if i == 0:
                _eta(time.perf_counter() - t_start, n_chunk)
            acc.add(token_nll(logits, chunk[first + 1:]))
            if writer:
                writer.add_chunk(logits)
            sys.stdout.write(f"[{i + 1}]{acc.ppl:.4f}," if output_type == 0 else _ppl_line(acc, i - i % n_seq, n_ctx))
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


def _ppl_line(acc, i_batch: int, n_ctx: int) -> str:
    """--ppl-output-type 1: tokens before the chunk's batch of n_seq chunks (ik prints the
    batch's start for each of its chunks), PPL so far, mean NLL and its uncertainty."""
    mean, spread = acc.mean_spread()
    return f"{i_batch * n_ctx:8d}  {acc.ppl:.4f}  {mean:4f}  {spread:4f}\n"


def _kl_divergence(ctx, m, base, n_batch: int) -> None:
    import numpy as np

    from engine.perplexity import KldAccumulator

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
            logits = _chunk_logits(ctx, chunk, bos, n_batch, i)
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
