"""`ikcli tokenize`: llama-tokenize's flags and output (`%6d -> 'piece'` lines, or `[1, 2, 3]` with --ids)."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from .common import ModelOpt, resolve_model
from .errors import CliError


def tokenize(
    model: Optional[str] = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="read prompt from the argument"),
    file: Optional[str] = typer.Option(None, "-f", "--file", help="read prompt from a file"),
    stdin: bool = typer.Option(False, "--stdin", help="read prompt from standard input"),
    ids: bool = typer.Option(False, "--ids", help="only print numerical token IDs, as a Python-style list"),
    no_bos: bool = typer.Option(False, "--no-bos", help="never add a BOS token, even if the model normally does"),
    no_parse_special: bool = typer.Option(False, "--no-parse-special", help="do not parse control tokens"),
    show_count: bool = typer.Option(False, "--show-count", help="print the total number of tokens"),
    log_disable: bool = typer.Option(False, "--log-disable", help="accepted for compatibility (ikcli logs nothing here)"),
) -> None:
    sources = sum(x is not None and x is not False for x in (prompt, file, stdin or None))
    if sources != 1:
        raise CliError("give exactly one of -p/--prompt, -f/--file or --stdin")
    if file is not None:
        try:
            with open(file, "rb") as fh:
                text = fh.read().decode("utf-8", errors="replace")
        except OSError as e:
            raise CliError(f"could not open file '{file}' for reading: {e.strerror}") from None
    elif stdin:
        text = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    else:
        text = prompt or ""
    from engine.gguf_file import open_model_file
    from engine.tokenizer import Tokenizer

    path = resolve_model(model)
    mf = open_model_file(path)  # vocabulary only: tensor data stays untouched on disk
    tok = Tokenizer.from_metadata(mf.meta)
    toks = tok.encode(text, add_special=not no_bos, parse_special=not no_parse_special)
    out = sys.stdout
    if ids:
        out.write("[" + ", ".join(str(t) for t in toks) + "]\n")
    else:
        for t in toks:
            out.write(f"{t:6d} -> '{tok.token_to_piece(t)}'\n")
    if show_count:
        out.write(f"Total number of tokens: {len(toks)}\n")
