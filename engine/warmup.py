"""The warm-up run before any timed work: ik's (BOS and EOS decoded), one token on top and a
batch of 64, then all forgotten; plus every weight type's kernels run once, so that Numba's compilation — minutes on a fresh install, a
few seconds from its cache — happens here, announced, and not inside the first timed pass
(whose time the ETA extrapolates).

Whether a run will compile is read from a small record kept beside Numba's cache: the weight
types warmed since the kernels' sources last changed, and how long compiling took then.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np

from quant.types import type_info

_ROOT = Path(__file__).resolve().parent.parent
_SOURCES = ("quant", "engine")
_MODEL_KEY = "(model)"          # the attention / MoE / norm kernels every model runs
_BATCH = 128                    # tokens of the batch pass: DeepSeek's prompt attention path (>= 128) and
#                                products past quant.gemm.SMALL_WORK
_FIRST_GUESS_S = 30.0           # no timing recorded here yet: the 2-core test VM's cold figure (README)


def sources_key() -> str:
    """Changes whenever a kernel source (any module of quant/ or engine/: quant.numba_stamp's
    digest), Numba or the CPU changes, i.e. whenever Numba's cache would miss."""
    from importlib.metadata import version      # not `import numba`: ikcli --help computes this too
    from quant.numba_stamp import sources_digest
    h = hashlib.sha1(f"{version('numba')}|{platform.machine()}|{platform.processor()}".encode())
    h.update(sources_digest(_SOURCES).encode())
    return h.hexdigest()[:16]


def _record_path() -> Path:
    base = os.environ.get("NUMBA_CACHE_DIR")
    if base:
        return Path(base) / "ikcli-warm.json"
    local = _ROOT / "quant" / "__pycache__"
    if os.access(local if local.exists() else local.parent, os.W_OK):
        return local / "ikcli-warm.json"
    return Path.home() / ".cache" / "ikcli" / "ikcli-warm.json"


def _load_record(key: str) -> dict:
    try:
        rec = json.loads(_record_path().read_text())
    except (OSError, ValueError):
        return {"key": key, "warm": [], "seconds": {}}
    if rec.get("key") != key:       # sources changed: nothing is warm, keep the timings as a guess
        return {"key": key, "warm": [], "seconds": rec.get("seconds", {})}
    return rec


def _save_record(rec: dict) -> None:
    path = _record_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)
    except OSError:
        pass                         # a read-only install: the notice just shows again


_announced: list[float] = []     # when first_run_notice spoke (perf_counter), for the closing line


def first_run_notice(log: Callable[[str], None]) -> None:
    """Before a model loads: one line when this code has never been warmed here (loading compiles
    too, before warm_up can name the types)."""
    rec = _load_record(sources_key())
    if _MODEL_KEY not in rec["warm"]:
        secs = rec["seconds"]
        guess = sum(secs.values()) if secs else _FIRST_GUESS_S
        log(f"ikcli: first run of these kernels here: compiling them as the model loads and warms up, "
            f"~{guess:.0f} s (a later run loads them from Numba's cache)")
        _announced[:] = [time.perf_counter()]


def warm_up(ctx, log: Callable[[str], None]) -> float:
    """Run ctx's model once on every path a run takes and leave the cache empty; seconds spent.
    Logs one line before (when kernels will be compiled: which, and about how long) and one after."""
    from quant.matmul import compile_kernels

    m = ctx.model
    names = {qt: type_info(qt).name for qt in m.matrix_types}
    key = sources_key()
    rec = _load_record(key)
    cold = [n for n in [_MODEL_KEY, *sorted(names.values())] if n not in rec["warm"]]
    if cold and not _announced:
        secs = rec["seconds"]
        known = all(n in secs for n in cold)
        guess = sum(secs.get(n, 0.0) for n in cold) if known else _FIRST_GUESS_S
        types = ", ".join(n for n in cold if n != _MODEL_KEY) or "the model's"
        log(f"warmup: compiling kernels for {types} (first run only; a later run loads them from the cache): "
            f"~{guess:.0f} s")
    t0 = time.perf_counter()
    spent = {}
    for qt, w in m.matrix_types.items():
        t = time.perf_counter()
        compile_kernels(w)
        spent[names[qt]] = time.perf_counter() - t
    t = time.perf_counter()
    tok = m.tokenizer
    bos = getattr(tok, "bos_id", None)
    eos = getattr(tok, "eos_id", None)
    first = [x if x is not None else 0 for x in (bos, eos)]
    n_batch = min(ctx.n_ubatch, ctx.n_ctx // len(ctx.caches) - 3, _BATCH)    # one slot's cells
    ctx.clear()
    ctx.decode(np.array(first, dtype=np.int32))        # ik's warm-up: BOS, EOS
    ctx.decode(np.array(first[:1], dtype=np.int32))    # the one-token (generation) path
    if n_batch > 2:                                    # big products (threaded BLAS), DeepSeek's prompt path
        ctx.decode(np.arange(n_batch, dtype=np.int32) % m.n_vocab)
    ctx.clear()
    spent[_MODEL_KEY] = time.perf_counter() - t
    total = time.perf_counter() - t0
    if cold:
        since = time.perf_counter() - (_announced[0] if _announced else t0)
        _announced.clear()
        log(f"warmup: kernels ready in {since:.1f} s (cached for the next runs)")
        rec["warm"] = sorted(set(rec["warm"]) | set(spent))
        rec["seconds"].update({n: round(s, 1) for n, s in spent.items() if n in cold})
        if _MODEL_KEY in cold:   # what loading compiled before the warm-up counts with the model's kernels
            rec["seconds"][_MODEL_KEY] = round(rec["seconds"][_MODEL_KEY] + since - total, 1)
        _save_record(rec)
    return total
