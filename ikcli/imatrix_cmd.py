"""`ikcli imatrix`: llama-imatrix's flags, output and `.dat` files (engine.imatrix does the work).

    ikcli imatrix -m MODEL -f TEXT [-o imatrix.dat] [-c 512] [--chunks N] [--in-file F ...]

The text is cut into chunks of n_ctx tokens as llama-imatrix does (n_ctx padded like its
context: to 256 with flash attention, 32 without; batches of min(-b, -c) tokens), the
perplexity of each chunk's second half is printed as it goes (`[1]x.xxxx,[2]…`, unless
--no-ppl) and every weight product's activations are accumulated.  --in-file loads existing
files first (combined call-weighted, as ik does); without -f the loaded files are just
combined and written.
"""
from __future__ import annotations

import sys
import time
from typing import List, Optional

import typer

from . import common
from .errors import CliError


def _save(col, path: str, dataset: str, verbose: bool = True) -> None:
    from engine.imatrix import ImatrixError
    try:
        col.save(path, dataset, common.log)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror}") from None
    except ImatrixError as e:
        raise CliError(str(e)) from None
    if verbose:
        common.log(f"\nsave_imatrix: stored collected data after {col.last_call} chunks in {path}")


@common.with_engine_flags
def imatrix(
    model: Optional[str] = common.ModelOpt,
    file: Optional[str] = typer.Option(None, "-f", "--file", help="text file to compute the importance matrix on"),
    out_file: str = typer.Option("imatrix.dat", "-o", "--output", "--output-file", help="output .dat file"),
    ctx_size: int = typer.Option(512, "-c", "--ctx-size", help="chunk size in tokens (0 = the model's training context)"),
    chunks: int = typer.Option(-1, "--chunks", help="max number of chunks to process (-1 = all)"),
    from_chunk: int = typer.Option(0, "--chunk", "--from-chunk", help="skip this many chunks of the text first"),
    out_freq: int = typer.Option(10, "-ofreq", "--output-frequency", help="save the imatrix every N calls"),
    save_freq: int = typer.Option(0, "--save-frequency", help="also save a copy OUT.at_N every N calls (0 = never)"),
    in_files: List[str] = typer.Option([], "--in-file", help="existing imatrix .dat to load and combine (repeatable)"),
    no_ppl: bool = typer.Option(False, "--no-ppl", help="do not compute perplexity"),
    verbosity: int = typer.Option(1, "--verbosity", help="0: quiet saves; 1: log each save"),
    batch_size: int = common.BatchOpt,
    ubatch_size: int = common.UBatchOpt,
    threads: int = common.ThreadsOpt,
    threads_batch: int = common.ThreadsBatchOpt,
    escape: bool = typer.Option(True, "-e/--no-escape", "--escape/--no-escape",
                                help="process escape sequences (\\n, \\t, \\xHH …) in the text, as llama.cpp does by default"),
    ngl: int = common.NglOpt,
    flags: "common.EngineFlags" = None,
) -> None:
    from engine.imatrix import Collector, ImatrixError

    if out_freq < 1:
        raise CliError("--output-frequency must be >= 1")
    if save_freq < 0:
        raise CliError("--save-frequency must be >= 0")
    if from_chunk < 0:
        raise CliError("--chunk must be >= 0")
    if file is None and not in_files:
        raise CliError("imatrix: nothing to do: give a text with -f (and a model with -m), or --in-file FILE to combine")
    col = Collector()
    for f in in_files:
        print(f"main : loading imatrix from '{f}'", flush=True)
        try:
            col.load(f)
        except ImatrixError as e:
            raise CliError(f"failed to load {f}: {e}") from None
    dataset = file or ""
    if file is None or len(in_files) > 1:
        print(f"main : saving combined imatrix to '{out_file}'", flush=True)
        _save(col, out_file, dataset, verbosity > 0)
    if file is None:
        return

    common.check_common(ctx_size, batch_size, ubatch_size, threads, threads_batch, ngl, flags.mla)
    if chunks == 0:
        raise CliError("--chunks must be positive (or -1 for all)")
    text = _read_text(file, escape)
    from engine.context import Context
    from engine.model import load_model

    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=0, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch)
    m = load_model(path, common.log, mla=flags.mla, overrides=cfg.tensor_overrides, repack=cfg.repack,
                   use_mmap=cfg.use_mmap)
    c = ctx_size if ctx_size > 0 else m.hp.n_ctx_train
    cfg.n_ctx = c
    cfg.n_batch = min(batch_size, c)         # llama-imatrix: n_batch = min(n_batch, n_ctx) before padding
    ctx = Context(m, cfg, common.log)
    if c > m.hp.n_ctx_train:
        common.log(f"main: warning: model was trained on only {m.hp.n_ctx_train} context tokens ({c} specified)")

    def periodic(n: int) -> None:
        if n % out_freq == 0:
            _save(col, out_file, dataset, verbosity > 0)
        if save_freq > 0 and n % save_freq == 0:
            _save(col, f"{out_file}.at_{n}", dataset, verbosity > 0)

    col.on_call = periodic
    _compute(ctx, m, col, text, chunks, from_chunk, not no_ppl)
    col.on_call = None
    _save(col, out_file, dataset, verbosity > 0)


def _read_text(path: str, escape: bool) -> str:
    from .perplexity_cmd import _read_text as read     # the same reading ('-' = stdin, one-line errors)
    return read(path, escape)[0]


def _compute(ctx, m, col, text: str, chunks: int, from_chunk: int, compute_ppl: bool) -> None:
    import numpy as np

    from engine.imatrix import ImatrixError
    from engine.linear import observing
    from engine.perplexity import PplAccumulator, chunk_logits, plan_chunks, token_nll

    from .perplexity_cmd import _eta

    n_ctx, n_batch = ctx.n_ctx, ctx.n_batch
    common.log("compute_imatrix: tokenizing the input ..")
    t0 = time.perf_counter()
    tokens = np.asarray(m.tokenizer.encode(text, add_special=True), dtype=np.int32)
    common.log(f"compute_imatrix: tokenization took {1e3 * (time.perf_counter() - t0):g} ms")
    if from_chunk > 0:
        if (from_chunk + 2) * n_ctx >= len(tokens):
            raise CliError(f"compute_imatrix: there will be not enough tokens left after removing {from_chunk} chunks")
        common.log(f"compute_imatrix: removing initial {from_chunk} chunks ({from_chunk * n_ctx} tokens)")
        tokens = tokens[from_chunk * n_ctx:]
    if len(tokens) < 2 * n_ctx:
        raise CliError(f"compute_imatrix: you need at least {2 * n_ctx} tokens for a context of {n_ctx} tokens; "
                       f"the data file you provided tokenizes to only {len(tokens)} tokens")
    n_chunk = plan_chunks(len(tokens), n_ctx, chunks)
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    common.log(f"compute_imatrix: computing over {n_chunk} chunks with batch_size {n_batch}")
    acc = PplAccumulator()
    first = n_ctx // 2
    out = sys.stdout
    try:
        with observing(col):
            for i in range(n_chunk):
                t_start = time.perf_counter()
                chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
                if compute_ppl:
                    logits = chunk_logits(ctx, chunk, bos, n_batch)
                else:                                       # --no-ppl: no output projection at all
                    chunk_logits(ctx, chunk, bos, n_batch, logits=False)
                if i == 0:
                    _eta(time.perf_counter() - t_start, n_chunk, "compute_imatrix")
                if compute_ppl:
                    acc.add(token_nll(logits, chunk[first + 1:]))
                    out.write(f"[{i + 1}]{acc.ppl:.4f},")
                    out.flush()
    except ImatrixError as e:
        raise CliError(str(e)) from None
    out.write("\n")
    if compute_ppl:
        ppl, unc = acc.estimate()
        if unc is None:
            out.write("Unexpected negative standard deviation of log(prob)\n")
        else:
            out.write(f"Final estimate: PPL = {ppl:.4f} +/- {unc:.5f}\n")
    out.flush()
