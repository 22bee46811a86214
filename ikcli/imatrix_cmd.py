"""`ikcli imatrix`: llama-imatrix's flags, output and `.dat` files (engine.imatrix does the work).

    ikcli imatrix -m MODEL -f TEXT [-o imatrix.dat] [-c 512] [--chunks N] [--in-file F ...]
                  [--process-output] [-lsim] [--verbosity N | -v]

The text is cut into chunks of n_ctx tokens as llama-imatrix does (n_ctx padded like its
context: to 256 with flash attention, 32 without; batches of min(-b, -c) tokens), the
perplexity of each chunk's second half is printed as it goes (`[1]x.xxxx,[2]…`, unless
--no-ppl) and every weight product's activations are accumulated.  --in-file loads existing
files first (combined call-weighted, as ik does); without -f the loaded files are just
combined and written.  --process-output also records the output tensor (--output-tensor-name);
-lsim records it too and prints ik's sorted layer / attention / ffn cosine similarities at the
end; --verbosity 2 prints one line per recorded product (-v sets verbosity 1, as in ik; the
later of the two wins).  The run ends with llama_print_timings' lines.
"""
from __future__ import annotations

import sys
import time
from typing import List, Optional

import typer

from . import common
from .errors import CliError
from .outfiles import check_output_path, remove_stale_temps, terminate_cleanly, write_error
from .sweep_bench_cmd import _Timings      # llama_print_timings' lines


def _save(col, path: str, dataset: str, verbose: bool = True) -> None:
    from engine.imatrix import ImatrixError
    try:
        with terminate_cleanly():        # SIGTERM while writing: the temporary file is removed
            col.save(path, dataset, common.log)
    except OSError as e:
        raise write_error(path, e) from None
    except ImatrixError as e:
        raise CliError(str(e)) from None
    if verbose:
        common.log(f"\nsave_imatrix: stored collected data after {col.last_call} chunks in {path}")


_VERBOSITY = "ikcli.imatrix.verbosity"


def _later_wins(ctx: typer.Context, param: typer.CallbackParam, value):
    """-v/--verbose sets verbosity 1 and --verbosity N sets N; in ik the later one on the command
    line wins.  Click runs the callbacks in command-line order, so the last one given is kept."""
    if ctx.get_parameter_source(param.name).name == "COMMANDLINE":
        ctx.meta[_VERBOSITY] = 1 if param.name == "verbose" else value
    return value


@common.with_engine_flags
def imatrix(
    model: Optional[str] = common.ModelOpt,
    file: Optional[str] = typer.Option(None, "-f", "--file", help="text file to compute the importance matrix on"),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the text, given on the command line instead of -f"),
    out_file: str = typer.Option("imatrix.dat", "-o", "--output", "--output-file", help="output .dat file"),
    ctx_size: int = typer.Option(512, "-c", "--ctx-size", help="chunk size in tokens (0 = the model's training context)"),
    chunks: int = typer.Option(-1, "--chunks", help="max number of chunks to process (-1 = all)"),
    from_chunk: int = typer.Option(0, "--chunk", "--from-chunk", help="skip this many chunks of the text first"),
    out_freq: int = typer.Option(10, "-ofreq", "--output-frequency", help="save the imatrix every N calls"),
    save_freq: int = typer.Option(0, "--save-frequency", help="also save a copy OUT.at_N every N calls (0 = never)"),
    in_files: List[str] = typer.Option([], "--in-file", help="existing imatrix .dat to load and combine (repeatable)"),
    no_ppl: bool = typer.Option(False, "--no-ppl", help="do not compute perplexity"),
    process_output: bool = typer.Option(False, "--process-output", help="collect data for the output tensor too"),
    # ik's default name, engine.imatrix.OUTPUT_TENSOR (not imported here: NumPy stays out of start-up)
    output_tensor_name: str = typer.Option("output.weight", "--output-tensor-name",
                                           help="the output tensor's name (for --process-output and -lsim)"),
    lsim: bool = typer.Option(False, "-lsim", "--layer-similarity", help="collect layer similarity data"),
    verbosity: int = typer.Option(1, "--verbosity", callback=_later_wins,
                                  help="0: quiet saves; 1: log each save; 2: also a line per recorded product"),
    verbose: bool = typer.Option(False, "-v", "--verbose", callback=_later_wins, help="verbosity 1 (as ik's -v)"),
    ctx_: typer.Context = None,
    batch_size: int = common.BatchOpt,
    ubatch_size: int = common.UBatchOpt,
    threads: int = common.ThreadsOpt,
    threads_batch: int = common.ThreadsBatchOpt,
    escape: bool = typer.Option(True, "-e/--no-escape", "--escape/--no-escape",
                                help="process escape sequences (\\n, \\t, \\xHH …) in the text, as llama.cpp does by default"),
    ngl: int = common.NglOpt,
    flags: "common.EngineFlags" = None,
) -> None:
    from engine.imatrix import Collector, ImatrixError, LayerSimilarity

    verbosity = ctx_.meta.get(_VERBOSITY, 1) if ctx_ is not None else verbosity
    if out_freq < 1:
        raise CliError("--output-frequency must be >= 1")
    if save_freq < 0:
        raise CliError("--save-frequency must be >= 0")
    if from_chunk < 0:
        raise CliError("--chunk must be >= 0")
    if file is not None and prompt is not None:
        raise CliError("-f and -p both name the text: give one of them")
    has_text = file is not None or prompt is not None
    if not has_text and not in_files:
        raise CliError("imatrix: nothing to do: give a text with -f (and a model with -m), or --in-file FILE to combine")
    check_output_path(out_file)             # before any work
    remove_stale_temps(out_file, "imatrix")
    col = Collector()
    for f in in_files:
        print(f"main : loading imatrix from '{f}'", flush=True)
        try:
            col.load(f)
        except ImatrixError as e:
            msg = str(e)
            raise CliError(f"failed to load {f}: {msg[len(f) + 2:] if msg.startswith(f + ': ') else msg}") from None
    dataset = file or ""
    if not has_text or len(in_files) > 1:
        print(f"main : saving combined imatrix to '{out_file}'", flush=True)
        _save(col, out_file, dataset, verbosity > 0)
    if not has_text:
        return

    common.check_common(ctx_size, batch_size, ubatch_size, threads, threads_batch, ngl, flags.mla)
    if chunks == 0:
        raise CliError("--chunks must be positive (or -1 for all)")
    from .perplexity_cmd import _input_text      # the same reading ('-' = stdin, -p escapes, one-line errors)
    text = _input_text(file, None, escape, prompt)[0]
    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=0, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch, ngl=ngl)
    timings = _Timings(0.0)        # counts from the start of the load, as ik's context does
    m = common.load_model(path, cfg)
    c = ctx_size if ctx_size > 0 else m.hp.n_ctx_train
    cfg.n_ctx = c
    cfg.n_batch = min(batch_size, c)         # llama-imatrix: n_batch = min(n_batch, n_ctx) before padding
    ctx = common.new_context(m, cfg, flags)
    if c > m.hp.n_ctx_train:
        common.log(f"main: warning: model was trained on only {m.hp.n_ctx_train} context tokens ({c} specified)")

    def periodic(n: int) -> None:
        if n % out_freq == 0:
            _save(col, out_file, dataset, verbosity > 0)
        if save_freq > 0 and n % save_freq == 0:
            _save(col, f"{out_file}.at_{n}", dataset, verbosity > 0)

    col.on_call = periodic
    if process_output or lsim:          # ik records the output tensor for both
        col.output_name = output_tensor_name
    if lsim:
        col.lsim = LayerSimilarity(output_tensor_name)
    if verbosity > 1:
        col.trace = lambda line: sys.stdout.write(line + "\n")
    decoder = _Decoder(ctx, timings, all_rows=col.output_name is not None)
    _compute(decoder, m, col, text, chunks, from_chunk, not no_ppl)
    col.on_call = col.trace = None
    _save(col, out_file, dataset, verbosity > 0)
    if col.lsim is not None:
        sys.stdout.write("".join(line + "\n" for line in col.lsim.report()))
        sys.stdout.flush()
    timings.print()


class _Decoder:
    """The context as engine.perplexity's chunk decoding uses it, with llama_print_timings'
    counters for each decode (the first one ends ik's "load time").  all_rows: logits for every
    token, as llama-imatrix computes them (logits_all), so the output tensor sees every row; the
    caller still gets only the rows it asked for."""

    def __init__(self, ctx, timings: _Timings, all_rows: bool) -> None:
        self._ctx, self._timings, self._all_rows = ctx, timings, all_rows
        self._first = True

    def __getattr__(self, name: str):       # everything else: the context's
        return getattr(self._ctx, name)

    def decode(self, tokens, logits_from: int = 0):
        t0 = time.perf_counter()
        lg = self._ctx.decode(tokens, logits_from=0 if self._all_rows else logits_from)
        t1 = time.perf_counter()
        self._timings.add(len(tokens), t1 - t0)
        if self._first:
            self._timings.t_load = t1 - self._timings.t_start
            self._first = False
        return lg[logits_from:] if self._all_rows else lg


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
