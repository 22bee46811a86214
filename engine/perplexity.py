"""Perplexity and KL-divergence over a token stream, with llama-perplexity's method.

Chunks of n_ctx tokens, the first token of each chunk replaced by BOS (when the model adds one),
the KV cache cleared per chunk, and only the second half of each chunk scored: logits at
positions first..n_ctx-2 (first = n_ctx/2) predict tokens first+1..n_ctx-1.

Base log-probabilities for KL-divergence are stored in llama-perplexity's file layout:
"_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk·n_ctx], then per
scored token nv = 2·ceil(n_vocab/2)+4 uint16: float32 scale, float32 min_log_prob, and n_vocab
16-bit codes of (logit - min_logit)/scale (min_logit clamped to max_logit - 24).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

import numpy as np

MAGIC = b"_logits_"


def n_scored(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def decode_batched(ctx, toks: np.ndarray, n_batch: int, logits_from: int = 0) -> np.ndarray:
    """Append toks to the cache in batches of n_batch (as llama_decode calls); logits (float32)
    of toks[logits_from:] only, so batches before logits_from skip the output projection."""
    parts = []
    for s in range(0, len(toks), n_batch):
        e = min(len(toks), s + n_batch)
        lg = ctx.decode(toks[s:e], logits_from=min(max(logits_from - s, 0), e - s))
        if len(lg):
            parts.append(lg)
    if not parts:
        return np.empty((0, ctx.model.n_vocab), dtype=np.float32)
    return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def chunk_logits(ctx, chunk: np.ndarray, bos_id: int | None, n_batch: int, logits: bool = True) -> np.ndarray | None:
    """Logits (n_scored, n_vocab) for one chunk; the cache is cleared first.  logits=False: the
    same batches with no output rows at all (no output projection; imatrix --no-ppl), None."""
    n_ctx = len(chunk)
    first = n_ctx // 2
    toks = chunk.astype(np.int32).copy()
    if bos_id is not None:
        toks[0] = bos_id
    ctx.clear()
    out = decode_batched(ctx, toks, n_batch, first if logits else n_ctx)
    return out[: n_ctx - 1 - first] if logits else None


def strided_nll(ctx, window: np.ndarray, stride: int, n_batch: int) -> np.ndarray:
    """llama-perplexity --ppl-stride: NLL of the last `stride` tokens of one window evaluated
    from an empty cache.  ik_llama.cpp writes BOS into the window only after decoding it, so the
    window's own first token is what the model sees; so here."""
    n = len(window)
    ctx.clear()
    rows = decode_batched(ctx, window.astype(np.int32), n_batch, n - stride - 1)
    return token_nll(rows[:stride], window[n - stride:])


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1, keepdims=True)
    z = (logits - m).astype(np.float64)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of targets[i] under logits[i] (float64)."""
    lp = log_softmax_rows(logits)
    return -lp[np.arange(len(targets)), targets]


@dataclass
class PplAccumulator:
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, v: np.ndarray) -> None:
        self.nll += float(v.sum())
        self.nll2 += float((v * v).sum())
        self.count += len(v)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def mean_spread(self) -> tuple[float, float]:
        """Mean NLL and its standard error, as --ppl-output-type 1 prints them (ik prints the raw
        variance when it is not positive)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return mean, (math.sqrt(var / (self.count - 1)) if var > 0 else var)

    def estimate(self) -> tuple[float, float | None]:
        """Final PPL and its uncertainty (None when the variance comes out non-positive)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        ppl = math.exp(mean)
        if var <= 0:
            return ppl, None
        return ppl, math.sqrt(var / (self.count - 1)) * ppl


def tokens_needed(n_ctx: int) -> int:
    return 2 * n_ctx


def plan_chunks(n_tokens: int, n_ctx: int, n_chunks: int) -> int:
    n_max = n_tokens // n_ctx
    return n_max if n_chunks < 0 else min(n_chunks, n_max)


# ---- base log-probabilities file -------------------------------------------------------------

def nv_of(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def compress_log_probs(logits: np.ndarray) -> np.ndarray:
    """uint16 rows (n, nv) in llama-perplexity's layout (see module doc)."""
    n, n_vocab = logits.shape
    lg = logits.astype(np.float32)
    mx = lg.max(axis=1)
    mn = np.maximum(lg.min(axis=1), mx - np.float32(24))
    lse = np.log(np.exp((lg - mx[:, None]).astype(np.float64)).sum(axis=1)).astype(np.float32)
    min_lp = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n, nv_of(n_vocab)), dtype=np.uint16)
    head = np.stack([scale, min_lp], axis=1).astype(np.float32).view(np.uint16)   # (n, 4)
    out[:, :4] = head
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = np.rint((lg - mn[:, None]) * inv[:, None]).astype(np.float32)
    q = np.where(lg > mn[:, None], q, 0)
    out[:, 4:4 + n_vocab] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


def decode_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """Base log-probabilities (n, n_vocab) float32 from compressed rows."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    scale, min_lp = head[:, 0], head[:, 1]
    return (scale[:, None] * rows[:, 4:4 + n_vocab].astype(np.float32) + min_lp[:, None]).astype(np.float32)


class BaseLogitsWriter:
    def __init__(self, fh: BinaryIO, n_ctx: int, n_vocab: int, n_chunk: int, tokens: np.ndarray) -> None:
        self.fh = fh
        fh.write(MAGIC)
        fh.write(struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        fh.write(tokens[: n_chunk * n_ctx].astype("<i4").tobytes())

    def add_chunk(self, logits: np.ndarray) -> None:
        self.fh.write(compress_log_probs(logits).astype("<u2").tobytes())


@dataclass
class BaseLogits:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    fh: BinaryIO
    path: str

    def chunks(self) -> Iterator[np.ndarray]:
        n = n_scored(self.n_ctx) * nv_of(self.n_vocab)
        for i in range(self.n_chunk):
            buf = self.fh.read(n * 2)
            if len(buf) != n * 2:
                raise ValueError(f"{self.path}: truncated: failed reading log-probs for chunk {i}")
            yield np.frombuffer(buf, dtype="<u2").reshape(n_scored(self.n_ctx), nv_of(self.n_vocab))


def open_base_logits(path: str) -> BaseLogits:
    fh = open(path, "rb")
    if fh.read(8) != MAGIC:
        fh.close()
        raise ValueError(f"{path} does not look like a file containing log-probabilities")
    hdr = fh.read(12)
    if len(hdr) != 12:
        fh.close()
        raise ValueError(f"{path}: truncated header")
    n_ctx, n_vocab, n_chunk = struct.unpack("<iii", hdr)
    if n_ctx <= 1 or n_vocab <= 0 or n_chunk <= 0:
        fh.close()
        raise ValueError(f"{path}: bad header (n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk})")
    raw = fh.read(4 * n_ctx * n_chunk)
    if len(raw) != 4 * n_ctx * n_chunk:
        fh.close()
        raise ValueError(f"{path}: failed reading evaluation tokens (file truncated)")
    return BaseLogits(n_ctx, n_vocab, n_chunk, np.frombuffer(raw, dtype="<i4").copy(), fh, path)


@dataclass
class KldAccumulator:
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list = field(default_factory=list)
    p_diff_values: list = field(default_factory=list)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        n, n_vocab = logits.shape
        lp = log_softmax_rows(logits)
        idx = np.arange(n)
        nll = -lp[idx, targets]
        base_lp = decode_log_probs(base_rows, n_vocab).astype(np.float64)
        nll_base = -base_lp[idx, targets]
        # KL(base || Q) over the tokens the base gives non-negligible probability
        keep = base_lp > -16.0
        kld = np.where(keep, np.exp(base_lp) * (base_lp - lp), 0.0).sum(axis=1)
        same = np.argmax(logits, axis=1) == np.argmax(base_lp, axis=1)
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        self.sum_nll += nll.sum()
        self.sum_nll2 += (nll * nll).sum()
        self.sum_nll_base += nll_base.sum()
        self.sum_nll_base2 += (nll_base * nll_base).sum()
        self.sum_nll_nll_base += (nll * nll_base).sum()
        self.sum_kld += kld.sum()
        self.sum_kld2 += (kld * kld).sum()
        self.sum_p_diff += p_diff.sum()
        self.sum_p_diff2 += (p_diff ** 2).sum()
        self.sum_p_diff4 += (p_diff ** 4).sum()
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        self.n_same_top += int(same.sum())
        self.count += n
        self.kld_values.extend(kld.tolist())
        self.p_diff_values.extend(p_diff.tolist())

    @staticmethod
    def mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
        if n < 1:
            return 0.0, 0.0
        f = s / n
        df = s2 / n - f * f
        return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)

    def cov(self) -> float:
        n = self.count
        if n < 10:
            return 0.0
        return (self.sum_nll_nll_base / n - (self.sum_nll / n) * (self.sum_nll_base / n)) / (n - 1)


def count_nonfinite(logits: np.ndarray) -> int:
    """NaN / infinite values among the logits (0 for a healthy model)."""
    return int(logits.size - np.count_nonzero(np.isfinite(logits)))
