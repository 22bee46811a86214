"""Embeddings as llama.cpp computes them: the normed final hidden states of a prompt's tokens
(Context.decode(..., embeddings=True), RunOptions.embeddings) pooled into one vector per prompt,
then normalized as common_embd_normalize does.

Pooling types, by llama.cpp's numbers (the GGUF key `<arch>.pooling_type`): 0 none (one vector per
token, not normalized), 1 mean, 2 cls (the first token), 3 last (the last token), 4 rank (a
reranker's classification head: not implemented).  A model without the key gets none, as
llama.cpp's context does for an unspecified type.
"""
from __future__ import annotations

import numpy as np

POOLING_TYPES = ("none", "mean", "cls", "last", "rank")
SUPPORTED_POOLING = ("none", "mean", "cls", "last")


def model_pooling(meta: dict, arch: str) -> str:
    """The pooling type a GGUF asks for (`<arch>.pooling_type`), "none" without one (-1, llama.cpp's
    unspecified, counts as absent).  ValueError for a number outside llama.cpp's enum."""
    v = meta.get(f"{arch}.pooling_type")
    if v is None:
        return "none"
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{arch}.pooling_type: expected an integer, got {v!r}") from None
    if n == -1:
        return "none"
    if not 0 <= n < len(POOLING_TYPES):
        raise ValueError(f"{arch}.pooling_type: unknown pooling type {n}")
    return POOLING_TYPES[n]


def pooled_rows(pooling: str, n_prompt: int, start: int, n: int) -> np.ndarray:
    """Which of the prompt tokens [start, start + n) (read in one batch) the pooling needs, as
    offsets from `start`: all of them for none / mean, the first prompt token for cls, the last for
    last (only those are kept: a long prompt read in several batches holds at most one row)."""
    if pooling in ("none", "mean"):
        return np.arange(n, dtype=np.int64)
    want = 0 if pooling == "cls" else n_prompt - 1
    return np.array([want - start] if start <= want < start + n else [], dtype=np.int64)


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """The pooled embedding(s) of one prompt from the rows pooled_rows kept, in prompt order:
    (n_tokens, n_embd) for none, (1, n_embd) otherwise."""
    h = np.asarray(hidden, dtype=np.float32)
    if pooling == "none":
        return h
    if pooling == "mean":     # summed in double: a long prompt's mean does not drift
        return (h.sum(axis=0, dtype=np.float64) / max(len(h), 1)).astype(np.float32)[None, :]
    if pooling in ("cls", "last"):
        return h[:1] if pooling == "cls" else h[-1:]
    raise ValueError(f"pooling type '{pooling}' is not supported")


def normalize(v: np.ndarray, embd_norm: int = 2) -> np.ndarray:
    """common_embd_normalize: -1 none, 0 max absolute scaled to the int16 range, 2 Euclidean,
    any other p the p-norm (1: taxicab); sums in double, a zero (or non-finite) norm gives zeros."""
    x = np.asarray(v, dtype=np.float32)
    a = np.abs(x.astype(np.float64))
    with np.errstate(all="ignore"):     # odd p (negative, huge) must not warn: the norm guards it
        if embd_norm == -1:
            s = 1.0
        elif embd_norm == 0:
            s = (float(a.max()) if a.size else 0.0) / 32760.0
        elif embd_norm == 2:
            s = float(np.sqrt(np.sum(a * a)))
        else:
            s = float(np.sum(a ** embd_norm) ** (1.0 / embd_norm))
    scale = np.float32(1.0 / s) if s > 0.0 and np.isfinite(s) else np.float32(0.0)
    return x * scale
