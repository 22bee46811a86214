"""Token sampling for the server, following llama.cpp's default sampler chain.

Order, as in ik_llama.cpp common/sampling.cpp (penalties in llama_sampling_prepare, then the
default samplers_sequence with DRY/TFS/typical/XTC/top-n-sigma disabled):

    repetition/presence/frequency penalties -> top_k -> top_p -> min_p -> temperature -> softmax -> draw

temperature <= 0 is greedy: argmax of the penalized logits, no randomness (llama.cpp uses
max_element for temp == 0 and the first sorted entry for temp < 0; both are the argmax).

Every candidate selection here is canonical (by value, ties broken by the lower token id) so that
the same inputs give the same token whatever the internal shortcuts, and the generator is the
Sampler's own, so concurrent requests cannot perturb each other's streams.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np

__all__ = ["SamplingParams", "Sampler", "TokenProbs", "apply_penalties", "token_probabilities"]

_SEED_MAX = 2**64 - 1  # np.random.default_rng accepts any non-negative int; keep it bounded


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    # bool is a subclass of int in Python, but `"top_k": true` is a client bug, not a number
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _as_float(name: str, v: Any) -> float:
    if not _is_number(v):
        raise ValueError(f"Sampling parameter '{name}' must be a number, got {type(v).__name__} {v!r}.")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"Sampling parameter '{name}' must be a finite number, got {v!r}.")
    return f


def _as_int(name: str, v: Any) -> int:
    if not _is_number(v):
        raise ValueError(f"Sampling parameter '{name}' must be an integer, got {type(v).__name__} {v!r}.")
    if isinstance(v, (float, np.floating)):
        # JSON encoders sometimes write 40 as 40.0; accept that, reject 1.5 / nan / inf
        if not math.isfinite(v) or not float(v).is_integer():
            raise ValueError(f"Sampling parameter '{name}' must be an integer, got {v!r}.")
    return int(v)


@dataclass
class SamplingParams:
    temperature: float = 0.8      # <= 0: greedy (argmax)
    top_k: int = 40               # <= 0: off
    top_p: float = 0.95           # >= 1: off
    min_p: float = 0.05           # <= 0: off
    repeat_penalty: float = 1.0   # 1.0: off; applied to the last repeat_last_n tokens
    repeat_last_n: int = 64       # 0: no penalties; -1: the whole history
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1                # -1: random seed
    n_probs: int = 0              # how many top probabilities to report (0: none)
    penalize_nl: bool = False     # llama.cpp's default: the newline token keeps its logit
    ignore_eos: bool = False      # end-of-generation tokens never sampled (llama.cpp: their bias is -inf)
    logit_bias: tuple = ()        # (token id, bias) pairs added to the logits first; bias -inf: banned

    def __post_init__(self) -> None:
        # Validate here too, so parameters built from CLI flags get the same checks as requests.
        self.temperature = _as_float("temperature", self.temperature)
        self.top_k = _as_int("top_k", self.top_k)
        self.top_p = _as_float("top_p", self.top_p)
        self.min_p = _as_float("min_p", self.min_p)
        self.repeat_penalty = _as_float("repeat_penalty", self.repeat_penalty)
        self.repeat_last_n = _as_int("repeat_last_n", self.repeat_last_n)
        self.presence_penalty = _as_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _as_float("frequency_penalty", self.frequency_penalty)
        self.seed = _as_int("seed", self.seed)
        self.n_probs = _as_int("n_probs", self.n_probs)
        if not isinstance(self.penalize_nl, (bool, np.bool_)):
            raise ValueError(f"Sampling parameter 'penalize_nl' must be a boolean, got {self.penalize_nl!r}.")
        self.penalize_nl = bool(self.penalize_nl)
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"Sampling parameter 'top_p' must be between 0 and 1, got {self.top_p!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"Sampling parameter 'min_p' must be between 0 and 1, got {self.min_p!r}.")
        if self.repeat_penalty <= 0.0:
            # llama.cpp would divide by zero / flip signs; 1.0 is the documented "off" value
            raise ValueError(f"Sampling parameter 'repeat_penalty' must be > 0 (1.0 disables it), "
                             f"got {self.repeat_penalty!r}.")
        if self.repeat_last_n < -1:
            raise ValueError(f"Sampling parameter 'repeat_last_n' must be >= -1, got {self.repeat_last_n!r}.")
        if not -1 <= self.seed <= _SEED_MAX:
            raise ValueError(f"Sampling parameter 'seed' must be -1 (random) or between 0 and 2**64-1, "
                             f"got {self.seed!r}.")
        if self.n_probs < 0:
            raise ValueError(f"Sampling parameter 'n_probs' must be >= 0, got {self.n_probs!r}.")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"Sampling parameter 'ignore_eos' must be a boolean, got {self.ignore_eos!r}.")
        self.ignore_eos = bool(self.ignore_eos)
        try:
            self.logit_bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise ValueError("Sampling parameter 'logit_bias' must be (token id, bias) pairs.") from None

    @classmethod
    def from_request(cls, body: dict) -> "SamplingParams":
        """Sampling parameters from an OpenAI / llama.cpp request body.

        Keys use the llama.cpp server names (temperature, top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, presence_penalty, frequency_penalty, seed, n_probs). A JSON null means
        "use the default", as llama.cpp's json_value does; unknown keys (max_tokens, stream, ...)
        are ignored. Unlike llama.cpp, which silently falls back to the default on a wrong type,
        a wrong type or out-of-range value raises ValueError naming the field.
        """
        if not isinstance(body, dict):
            raise ValueError(f"Request body must be a JSON object, got {type(body).__name__}.")
        kw = {f.name: body[f.name] for f in fields(cls) if body.get(f.name) is not None}
        return cls(**kw)


# ---------------------------------------------------------------------------------------------
# pieces of the chain (public so they can be tested and reused)
# ---------------------------------------------------------------------------------------------

def apply_penalties(logits: np.ndarray, history: Sequence[int], params: SamplingParams,
                    nl_token: int | None = None) -> np.ndarray:
    """logits (as float32) with llama.cpp's repetition penalties applied; the input is never
    modified (it is returned as is when no penalty applies, to spare a copy of the vocab).

    For each distinct token t among the last repeat_last_n tokens of history (count c):
    logit /= repeat_penalty if logit > 0 else logit *= repeat_penalty (so the penalty always
    lowers the token), then logit -= c * frequency_penalty + presence_penalty.
    Token ids outside [0, n_vocab) in history are ignored rather than crashing the request.
    nl_token: the vocabulary's newline token, whose logit is left as it was unless
    params.penalize_nl (llama.cpp's sampling does the same).
    """
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    n = params.repeat_last_n
    if n == 0 or (params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0
                  and params.presence_penalty == 0.0):
        return x
    recent = history if n < 0 else history[-n:] if len(history) > n else history
    if len(recent) == 0:
        return x
    toks = np.asarray(recent, dtype=np.int64).reshape(-1)
    toks = toks[(toks >= 0) & (toks < x.shape[0])]
    if toks.size == 0:
        return x
    x = x.copy()
    ids, counts = np.unique(toks, return_counts=True)
    v = x[ids]
    rp = np.float32(params.repeat_penalty)
    v = np.where(v <= 0, v * rp, v / rp)
    v = v - (counts.astype(np.float32) * np.float32(params.frequency_penalty)
             + np.float32(params.presence_penalty))
    nl_keep = nl_token is not None and not params.penalize_nl and 0 <= nl_token < x.shape[0]
    nl_logit = x[nl_token] if nl_keep else None
    x[ids] = v.astype(np.float32)
    if nl_keep:
        x[nl_token] = nl_logit
    return x


def _sanitize(x: np.ndarray) -> np.ndarray:
    # NaN logits would poison argmax/softmax; treat them as masked tokens
    if np.isnan(x).any():
        x = np.where(np.isnan(x), np.float32(-np.inf), x)
    return x


def _top_m(vals: np.ndarray, m: int, exact: bool) -> np.ndarray:
    """Positions (into vals, whose tokens are in ascending id order) of the m largest values, canonically ordered
    (value descending, then id ascending). exact=False keeps all ties at the boundary (the set
    may exceed m); exact=True keeps exactly m, preferring lower ids among boundary ties."""
    n = vals.shape[0]
    if m >= n:
        pos = np.arange(n)
    else:
        kth = np.partition(vals, n - m)[n - m]           # m-th largest value, O(n)
        if exact:
            above = np.flatnonzero(vals > kth)
            ties = np.flatnonzero(vals == kth)[: m - above.shape[0]]
            pos = np.sort(np.concatenate([above, ties]))
        else:
            pos = np.flatnonzero(vals >= kth)
    # pos is ascending in id, so a stable sort on -value breaks ties by the lower id
    return pos[np.argsort(-vals[pos], kind="stable")]


@dataclass
class TokenProbs:
    """Probability report for one sampled token (llama.cpp's n_probs output)."""
    token: int
    prob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, prob), most likely first


def token_probabilities(logits: np.ndarray, token: int, n: int) -> TokenProbs:
    """Softmax of the raw logits (before penalties and filters: llama.cpp's default report,
    post_sampling_probs = false): the sampled token's probability and the top n tokens."""
    x = _sanitize(np.asarray(logits, dtype=np.float32).reshape(-1))
    mx = float(np.max(x))
    if math.isinf(mx):
        # all masked, or +inf tokens: share the mass among the maximal tokens
        e = (x == mx).astype(np.float32)
    else:
        e = np.exp(x - np.float32(mx))                  # float32 like llama.cpp; sum in float64
    s = float(e.sum(dtype=np.float64))
    inv = 1.0 / s if s > 0 else 0.0
    n = min(max(int(n), 0), x.shape[0])
    top: list[tuple[int, float]] = []
    if n > 0:
        pos = _top_m(x, n, exact=True)                  # rank by logit: same order, no underflow ties
        top = [(int(i), float(e[i]) * inv) for i in pos]
    return TokenProbs(token=int(token), prob=float(e[token]) * inv, top=top)


# ---------------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------------

class Sampler:
    """Stateful sampler for one generation: owns its random generator (seeded from params.seed,
    or from a fresh random 32-bit seed when it is -1; the seed used is in .seed)."""

    # first guess at how many tokens top_p needs when nothing bounds the candidate set;
    # grown 8x until the cumulative probability reaches p, which avoids sorting the vocab
    _TOP_P_FIRST = 256

    def __init__(self, params: SamplingParams, n_vocab: int, nl_token: int | None = None,
                 eog_ids: Sequence[int] = ()) -> None:
        """eog_ids: the end-of-generation tokens, which params.ignore_eos bans."""
        if int(n_vocab) <= 0:
            raise ValueError(f"n_vocab must be positive, got {n_vocab!r}.")
        self.params = params
        self.n_vocab = int(n_vocab)
        # logit bias first in the chain, as llama.cpp's: ignore_eos is a -inf bias on every EOG token
        bias = dict(params.logit_bias)
        if params.ignore_eos:
            bias.update({int(t): -math.inf for t in eog_ids})
        bad = [t for t in bias if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"Sampling parameter 'logit_bias': token id {bad[0]} out of range [0, {self.n_vocab}).")
        self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.bias_vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.nl_token = nl_token      # newline token (not penalized unless params.penalize_nl)
        self.seed: int = params.seed if params.seed != -1 else secrets.randbits(32)
        self.rng = np.random.default_rng(self.seed)
        self.last_probs: TokenProbs | None = None  # filled by sample() when params.n_probs > 0

    # -- the filtered distribution -------------------------------------------------------------

    def distribution(self, logits: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids kept by penalties -> top_k -> top_p -> min_p, and their probabilities after
        temperature, most likely first (ties: lower id first). This is the distribution sample()
        draws from when temperature > 0 (whatever the temperature, the kept set is the same).
        Empty arrays when every logit is masked (-inf / NaN)."""
        x = self._penalized(logits, history)
        return self._filter(x, ordered_out=True)

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        arr = np.asarray(logits)
        if arr.ndim != 1 or arr.shape[0] != self.n_vocab:
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {arr.shape}.")
        if self.bias_ids.size:
            arr = np.array(arr, dtype=np.float32)
            arr[self.bias_ids] += self.bias_vals
        return _sanitize(apply_penalties(arr, history, self.params, self.nl_token))

    def _filter(self, x: np.ndarray, ordered_out: bool) -> tuple[np.ndarray, np.ndarray]:
        """Kept token ids and probabilities; sorted (value desc, id asc) when ordered_out or when
        a filter already sorted them, otherwise in ascending id order (canonical either way,
        and it spares sorting the whole vocab when every filter is off)."""
        p = self.params
        # ids is None while the candidates are the whole vocab in id order (spares an arange)
        ids: np.ndarray | None
        if np.isfinite(x).all():
            ids, vals = None, x
        elif np.isposinf(x).any():
            # +inf logits would make softmax NaN: they win outright and share the mass equally
            ids = np.flatnonzero(np.isposinf(x))
            vals = np.zeros(ids.shape[0], dtype=np.float32)
        else:
            # masked (-inf) tokens have zero probability in llama.cpp too; drop them up front
            ids = np.flatnonzero(np.isfinite(x))
            vals = x[ids]
            if ids.shape[0] == 0:
                return ids, np.zeros(0, dtype=np.float64)

        def take(pos: np.ndarray) -> np.ndarray:
            return pos if ids is None else ids[pos]

        # top_k: exactly k candidates (llama.cpp keeps k, min_keep = 1); order canonical
        ordered = False
        if 0 < p.top_k < vals.shape[0]:
            pos = _top_m(vals, p.top_k, exact=True)
            ids, vals = take(pos), vals[pos]
            ordered = True

        vmax = vals.max()
        # llama.cpp's top_p normalizes over every candidate left after top_k, at temperature 1
        w = np.exp(vals.astype(np.float64) - float(vmax))
        z = float(w.sum())

        # min_p keeps logit >= max + log(min_p) (prob >= min_p * max prob). It runs after top_p, but
        # both keep a prefix of the sorted candidates, so the final set is the shorter prefix:
        # applying min_p first only shrinks what top_p has to sort.
        if p.min_p > 0.0:
            thresh = np.float32(vmax) + np.float32(math.log(p.min_p))
            keep = np.flatnonzero(vals >= thresh)       # max always passes; keeps the order
            if keep.shape[0] < vals.shape[0]:
                ids, vals, w = take(keep), vals[keep], w[keep]

        if p.top_p < 1.0:
            n = vals.shape[0]
            m = n if ordered else min(n, self._TOP_P_FIRST)
            while True:
                pos = np.arange(n) if ordered else _top_m(vals, m, exact=False)
                cum = np.cumsum(w[pos]) / z
                hit = np.flatnonzero(cum >= p.top_p)
                if hit.shape[0] > 0 or pos.shape[0] >= n:
                    # smallest prefix whose mass reaches p (at least one token); else keep all
                    cut = int(hit[0]) + 1 if hit.shape[0] > 0 else pos.shape[0]
                    pos = pos[:cut]
                    break
                m = min(n, m * 8)
            ids, vals = take(pos), vals[pos]
            ordered = True

        if ids is None:
            ids = np.arange(vals.shape[0])
        if ordered_out and not ordered:
            pos = np.argsort(-vals, kind="stable")       # ids ascending -> ties by lower id
            ids, vals = ids[pos], vals[pos]

        # temperature, then softmax in float64 (the shift keeps tiny temperatures finite)
        t = p.temperature if p.temperature > 0 else 1.0
        q = np.exp((vals.astype(np.float64) - float(vals.max())) / t)
        return ids, q / q.sum()

    # -- drawing -------------------------------------------------------------------------------

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Next token for logits of shape (n_vocab,); history = prompt + generated tokens so far."""
        x = self._penalized(logits, history)
        if self.params.temperature <= 0.0:
            tok = int(np.argmax(x))                      # first maximum, like max_element
        else:
            ids, probs = self._filter(x, ordered_out=False)
            if ids.shape[0] == 0:
                # everything masked: nothing is valid, fall back to a deterministic in-range token
                tok = int(np.argmax(x))
            else:
                # always one draw per token, so the stream position depends only on the step
                u = self.rng.random()
                cdf = np.cumsum(probs)
                j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
                tok = int(ids[min(j, ids.shape[0] - 1)])
        if self.params.n_probs > 0:
            self.last_probs = token_probabilities(logits, tok, self.params.n_probs)
        return tok
