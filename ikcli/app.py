"""The `ikcli` command: a Typer app with one module per subcommand, errors as one line."""
from __future__ import annotations

import os
import sys

import typer

from . import perplexity_cmd, tokenize_cmd
from . import sweep_bench_cmd
from . import server_cmd
from . import quantize_cmd
from . import imatrix_cmd

app = typer.Typer(
    name="ikcli",
    help="ik_llama.cpp's tools in Python: run DeepSeek / LLaMA GGUF models on the CPU.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("perplexity", help="Perplexity (and KL-divergence) of a model over a text, llama-perplexity style.")(
    perplexity_cmd.perplexity)
app.command("tokenize", help="Tokenize a text with a model's tokenizer, llama-tokenize style.")(tokenize_cmd.tokenize)
app.command("sweep-bench", help="PP and TG speed across the context (N_KV = 0, ub, 2*ub, ...), llama-sweep-bench style.")(
    sweep_bench_cmd.sweep_bench)
app.command("server", help="An HTTP server with llama-server's API (OpenAI chat/completions, /completion, /tokenize ...).")(
    server_cmd.server)
app.command("quantize", help="Quantize a GGUF model (TYPE by name or number), llama-quantize style.")(
    quantize_cmd.quantize)
app.command("imatrix", help="Importance matrix (mean squared activations per weight column), llama-imatrix style.")(
    imatrix_cmd.imatrix)


def _declared(command) -> dict[str, int]:
    """A click command's option spellings -> number of values they take."""
    out = {"-h": 0, "--help": 0}
    for p in command.params:
        if p.param_type_name != "option":
            continue
        n = 0 if p.is_flag or p.count else p.nargs
        for o in list(p.opts) + list(p.secondary_opts):
            out[o] = n
    return out


def _checked_argv(cmd, args: list[str], normalize) -> list[str]:
    """args with the subcommand's flags checked and rewritten (ikcli.common.normalize_argv)."""
    k = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if k is None or args[k] not in cmd.commands:
        return normalize(args)
    sub = args[k]
    return args[:k + 1] + normalize(args[k + 1:], _declared(cmd.commands[sub]), sub)


def _versioned_numba_cache() -> None:
    """Numba re-checks a cached kernel only against its own source file, not against the kernels
    it calls from other modules, so after an update a stale copy could run.  Unless
    NUMBA_CACHE_DIR is set (or IKCLI_NUMBA_CACHE=source, which keeps Numba's default beside the
    sources: the test suite), each version of the kernel sources gets its own cache directory,
    and those of other versions are removed."""
    if os.environ.get("NUMBA_CACHE_DIR") or os.environ.get("IKCLI_NUMBA_CACHE") == "source":
        return
    import shutil
    import time
    from pathlib import Path

    from engine.warmup import sources_key
    key = sources_key()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ikcli" / "numba"
    try:
        (base / key).mkdir(parents=True, exist_ok=True)
        os.utime(base / key)    # in use: kept
        for old in base.iterdir():
            if old.name != key and old.is_dir() and time.time() - old.stat().st_mtime > 2 * 86400:
                shutil.rmtree(old, ignore_errors=True)
    except OSError:
        return                  # no writable home: Numba's default (beside the sources)
    os.environ["NUMBA_CACHE_DIR"] = str(base / key)      # read when Numba is first imported
    numba = sys.modules.get("numba")                        # (not for `ikcli --help`: no import here)
    if numba is not None:
        numba.config.CACHE_DIR = str(base / key)


def main(argv: list[str] | None = None) -> None:
    if argv is None:            # a command run (the tests call main(argv) in their own process)
        _versioned_numba_cache()
    try:  # recent Typer vendors Click
        from typer import _click as click
    except ImportError:  # pragma: no cover - older Typer depends on Click
        import click

    from .common import normalize_argv
    args = sys.argv[1:] if argv is None else list(argv)
    cmd = typer.main.get_command(app)
    try:
        args = _checked_argv(cmd, args, normalize_argv)
        rc = cmd.main(args=args, prog_name="ikcli", standalone_mode=False)
        if isinstance(rc, int) and rc == 130:    # Typer returns 130 for Ctrl-C outside standalone mode
            print("ikcli: interrupted", file=sys.stderr)
            sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("ikcli: interrupted", file=sys.stderr)
        sys.exit(130)
    except click.ClickException as e:
        msg = e.format_message()
        if not msg:  # bare `ikcli`: the help was shown
            sys.exit(0)
        print(f"ikcli: error: {msg}", file=sys.stderr)
        sys.exit(e.exit_code if e.exit_code else 2)
    except KeyboardInterrupt:
        print("ikcli: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # one line for anything the engine raises about the user's input
        from .errors import describe
        print(f"ikcli: error: {describe(e)}", file=sys.stderr)
        sys.exit(1)
