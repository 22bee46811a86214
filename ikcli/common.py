"""Flags shared by the tools, with llama.cpp's spellings, and their translation to an engine config."""
from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from .errors import CliError

ModelOpt = typer.Option(None, "-m", "--model", help="model path (GGUF; first part of a split model). Default: embedded demo model")
BatchOpt = typer.Option(2048, "-b", "--batch-size", help="logical maximum batch size")
UBatchOpt = typer.Option(512, "-ub", "--ubatch-size", help="physical maximum batch size")
ThreadsOpt = typer.Option(0, "-t", "--threads", help="number of threads to use during generation (0 = all cores)")
ThreadsBatchOpt = typer.Option(0, "-tb", "--threads-batch", help="threads for batch and prompt processing (default: same as --threads)")
NglOpt = typer.Option(0, "-ngl", "--gpu-layers", "--n-gpu-layers", help="number of layers to store in VRAM")
MlaOpt = typer.Option(0, "-mla", "--mla-use", help="DeepSeek attention mode (only 0 is available in this version)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_model(model: Optional[str]) -> str:
    if model:
        return model
    from .defaults import demo_model
    path = demo_model()
    if not os.path.exists(path):
        raise CliError("no -m given and the embedded demo model is missing from this installation")
    return path


def check_common(n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int, n_threads_batch: int, ngl: int, mla: int) -> None:
    if n_ctx < 0:
        raise CliError(f"-c/--ctx-size must be >= 0 (got {n_ctx})")
    if n_batch < 1 or n_ubatch < 1:
        raise CliError("-b/--batch-size and -ub/--ubatch-size must be >= 1")
    if n_threads < 0 or n_threads_batch < 0:
        raise CliError("-t/-tb must be >= 0")
    if mla not in (0, 1, 2, 3):
        raise CliError(f"-mla must be 0, 1, 2 or 3 (got {mla})")
    if mla != 0:
        raise CliError(f"-mla {mla} is not available in this version of ikcli yet; use -mla 0")
    if ngl != 0:
        log("warning: not compiled with GPU offload support, --gpu-layers option will be ignored")
        log("warning: see the README for the CUDA status of ikcli")
