"""Token sampling for the server: ik_llama.cpp's sampler chain (common/sampling.cpp, src/llama-sampling.cpp).

What runs, in ik's order:

    logit_bias / ignore_eos -> repetition/presence/frequency penalties, then
      temperature <= 0:  greedy, argmax of the penalized logits (nothing below applies, no randomness)
      mirostat 1 or 2:   temperature, then mirostat (v1: estimated-Zipf top-k, v2: surprise cut at mu);
                         the sampler chain below is skipped, as in ik
      otherwise:         the chain `samplers` in its order, then one draw from the softmax of what is left.

The chain's samplers and their "off" values (names as ik's request field `samplers`; letters as
--sampling-seq / a `samplers` string):

    dry          d  DRY repetition penalty           dry_multiplier == 0, dry_base < 1 or dry_penalty_last_n == 0
    top_k        k  the k most likely                top_k <= 0
    tfs_z        f  tail-free sampling               tfs_z >= 1
    typical_p    y  locally typical sampling         typical_p >= 1
    top_p        p  nucleus                          top_p >= 1
    min_p        m  prob >= min_p * max prob         min_p <= 0
    xtc          x  exclude top choices              xtc_probability <= 0 or xtc_threshold > 0.5
    top_n_sigma  n  logit >= max - n * sigma         top_n_sigma <= 0
    temperature  t  logits / temp (dynatemp: entropy-scaled temperature when dynatemp_range > 0)
    adaptive_p   w  accepted as a name; a no-op here (adaptive_target is not implemented)

The default order is ik's samplers_sequence: d k f y p m x n t w (its trailing "dist" is the draw).
A sampler left out of `samplers` does not run: without "temperature" the draw is at temperature 1,
as in ik.  Each filter keeps at least max(1, min_keep) tokens, except top_n_sigma (ik passes it no
min_keep) and mirostat.  Filters after the temperature see the tempered probabilities.

Exactly as ik (same sets, same penalties, up to float rounding: ik works in float32, this module
computes probabilities in float64):
  * the repetition / frequency / presence penalties: bit for bit (same float32 operations, checked
    against libllama's llama_sample_repetition_penalties), on the tokens ik's sampler keeps for
    them, which is only the latest token of the history (see penalty_tokens);
  * every filter's rule, its min_keep handling and its "off" switch (table above);
  * top_k / min_p / top_p / typical / tfs / xtc operate on the candidates left by the previous step;
  * mirostat v1 (m = 100, s_hat fit, k from n_vocab; a k below 1 or not finite keeps every token,
    as ik's top_k(k <= 0)) and v2, mu kept in the Sampler across tokens; mu starts at 0, as ik's
    value-initialized common_sampler (mainline llama.cpp starts it at 2 * tau; MIROSTAT_MU0 below);
  * DRY: Koboldcpp's algorithm as ik has it: sequence breakers mapped to token sequences once per
    vocabulary (a token whose text contains a breaker is a single-token breaker; a token ending in a
    breaker's prefix heads a sequence whose tail is the tokenization of the rest, at most 20 tokens;
    breakers truncated to 40 bytes), the most recent breaker bounds the repetition length, the repeat
    lengths are the Z-function of the reversed window, penalty = multiplier * base ^ (len - allowed)
    with the exponent clamped so the float cannot overflow, single-token breakers never penalized.
    The window is the last dry_penalty_last_n tokens of prompt + generated (-1: all of them), and at
    most n_vocab tokens (ik sizes DRY's context by the vocabulary).
  * dynatemp: temperature = lo + (hi - lo) * (entropy / log n) ^ exponent, lo/hi = max(0, temp -/+ range).

Deliberate differences (documented here, not silent):
  * own random streams (NumPy PCG64 seeded from params.seed), so token streams are not ik's for the
    same seed; XTC's coin comes from a second stream of that seed, drawn once per token whenever XTC is
    on, so the main stream position still depends only on the step;
  * ties anywhere (top_k, boundaries, ...) break canonically: larger value first, then the lower id
    (ik's std::sort leaves them unspecified);
  * top_n_sigma uses the true maximum logit (ik starts its running max at 0, which differs only when
    every candidate logit is negative, where ik can keep no token and abort);
  * typical: 0 * log 0 is 0 (ik's float32 softmax can underflow to p = 0 and make the entropy NaN);
  * mirostat's s_hat uses log-probability differences (no 0/0 when a float32 probability underflows);
  * a dynamic temperature of 0 means argmax among the candidates (ik divides by zero);
  * candidates are kept in ascending id order unless a ranking step sorted them (the draw walks that
    order; the distribution is the same).

DRY needs the vocabulary's token texts: pass `vocab=` to Sampler (a tokenizer with token_to_bytes(id,
special) and encode(text, add_special, parse_special), a DryVocab, or a list of token pieces), or set
`params.vocab` (not a dataclass field: never read from a request, never reported).  The mapping of
the breakers is computed once per vocabulary and breaker list and cached; without a vocabulary DRY
runs with no sequence breakers.

Every candidate selection is canonical (by value, ties broken by the lower token id) so that the same
inputs give the same token whatever the internal shortcuts, and the generators are the Sampler's own,
so concurrent requests cannot perturb each other's streams.
"""
from __future__ import annotations

import copy
import math
import secrets
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
from numba import njit

__all__ = ["SamplingParams", "Sampler", "TokenProbs", "DryVocab", "apply_penalties", "penalty_tokens",
           "newline_token", "token_probabilities", "parse_samplers", "SAMPLER_NAMES", "SAMPLER_LETTERS",
           "DEFAULT_SAMPLERS", "DEFAULT_DRY_BREAKERS"]

_SEED_MAX = 2**64 - 1  # np.random.default_rng accepts any non-negative int; keep it bounded

# ik's llama_sampler_type: canonical name -> letter (common/sampling.h), in the default order
SAMPLER_LETTERS: dict[str, str] = {
    "dry": "d", "top_k": "k", "tfs_z": "f", "typical_p": "y", "top_p": "p", "min_p": "m", "xtc": "x",
    "top_n_sigma": "n", "temperature": "t", "adaptive_p": "w",
}
SAMPLER_NAMES: tuple[str, ...] = tuple(SAMPLER_LETTERS)
DEFAULT_SAMPLERS: tuple[str, ...] = SAMPLER_NAMES
_BY_LETTER = {c: n for n, c in SAMPLER_LETTERS.items()}
# ik's alternative spellings (accepted by its --samplers; accepted in requests here too)
_ALT_NAMES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "typical-p": "typical_p",
              "typical": "typical_p", "min-p": "min_p", "tfs-z": "tfs_z", "tfs": "tfs_z",
              "top-n-sigma": "top_n_sigma", "temp": "temperature", "adaptive-p": "adaptive_p"}
DEFAULT_DRY_BREAKERS: tuple[str, ...] = ("\n", ":", "\"", "*")

MIROSTAT_MU0 = 0.0          # ik's starting mu (see the module docstring)
_MIROSTAT_M = 100           # tokens mirostat v1 fits its Zipf exponent on (ik's fixed m)
_LN2 = math.log(2.0)
_DRY_MAX_BREAKER_BYTES = 40
_DRY_MAX_TAIL = 20
_FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX): DRY clamps its exponent so base^exp stays a float


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


def _in_range(name: str, v: float, lo: float, hi: float) -> None:
    if not lo <= v <= hi:
        raise ValueError(f"Sampling parameter '{name}' must be between {lo:g} and {hi:g}, got {v!r}.")


def parse_samplers(v: Any) -> tuple[str, ...]:
    """The sampler order as canonical names: a string is one letter per sampler (ik's --sampling-seq
    and a `samplers` string), a list holds names (canonical or ik's alternative spellings).  Unlike
    ik, which drops what it does not know, an unknown letter or name raises ValueError."""
    if isinstance(v, str):
        bad = [c for c in v if c not in _BY_LETTER]
        if bad:
            raise ValueError(f"Sampling parameter 'samplers': unknown sampler letter {bad[0]!r} "
                             f"(letters: {''.join(SAMPLER_LETTERS.values())}).")
        return tuple(_BY_LETTER[c] for c in v)
    if isinstance(v, (list, tuple)):
        out = []
        for name in v:
            if not isinstance(name, str):
                raise ValueError(f"Sampling parameter 'samplers' must hold sampler names, got {name!r}.")
            canon = name if name in SAMPLER_LETTERS else _ALT_NAMES.get(name)
            if canon is None:
                raise ValueError(f"Sampling parameter 'samplers': unknown sampler {name!r} "
                                 f"(names: {', '.join(SAMPLER_NAMES)}).")
            out.append(canon)
        return tuple(out)
    raise ValueError(f"Sampling parameter 'samplers' must be a list of names or a string of letters, "
                     f"got {type(v).__name__} {v!r}.")


@dataclass
class SamplingParams:
    temperature: float = 0.8      # <= 0: greedy (argmax)
    top_k: int = 40               # <= 0: off
    top_p: float = 0.95           # >= 1: off
    min_p: float = 0.05           # <= 0: off
    repeat_penalty: float = 1.0   # 1.0: off; applied to the last repeat_last_n tokens (Sampler: see penalty_tokens)
    repeat_last_n: int = 64       # 0: no penalties; -1: the whole history (Sampler: only the latest token, as ik)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1                # -1: random seed
    n_probs: int = 0              # how many top probabilities to report (0: none)
    penalize_nl: bool = False     # llama.cpp's default: the newline token keeps its logit
    ignore_eos: bool = False      # end-of-generation tokens never sampled (llama.cpp: their bias is -inf)
    logit_bias: tuple = ()        # (token id, bias) pairs added to the logits first; bias -inf: banned
    min_keep: int = 0             # every filter keeps at least max(1, min_keep) tokens
    typical_p: float = 1.0        # >= 1: off
    tfs_z: float = 1.0            # >= 1: off
    dynatemp_range: float = 0.0   # <= 0: off; else temperature in [temp - range, temp + range] by entropy
    dynatemp_exponent: float = 1.0
    mirostat: int = 0             # 0: off, 1: mirostat, 2: mirostat 2.0 (replaces the chain)
    mirostat_tau: float = 5.0     # target surprise (bits)
    mirostat_eta: float = 0.1     # learning rate
    xtc_probability: float = 0.0  # <= 0: off
    xtc_threshold: float = 1.0    # > 0.5: off (ik's default 1.0)
    top_n_sigma: float = 0.0      # <= 0: off
    dry_multiplier: float = 0.0   # 0: off
    dry_base: float = 1.75        # < 1: off
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # 0: off; -1: the whole history
    dry_sequence_breakers: tuple = DEFAULT_DRY_BREAKERS
    samplers: tuple = DEFAULT_SAMPLERS   # the chain's order (names; a string of letters is accepted)
    grammar: str = ""             # GBNF or llguidance Lark text ("": free); see engine/grammar.py
    grammar_lazy: bool = False    # llama.cpp's lazy grammar: free until one of grammar_triggers fires
    grammar_triggers: tuple = ()  # llama-server's [{"type": 0..3, "value": str, "token": id}] (engine.grammar)

    # The model's vocabulary for DRY's sequence breakers (a tokenizer, DryVocab or list of pieces).
    # Deliberately not a field: never read from a request, never compared, not in asdict().
    vocab: ClassVar[Any] = None

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
        # the samplers ik's server reads beyond the basic ones
        self.min_keep = _as_int("min_keep", self.min_keep)
        if self.min_keep < 0:
            raise ValueError(f"Sampling parameter 'min_keep' must be >= 0, got {self.min_keep!r}.")
        self.typical_p = _as_float("typical_p", self.typical_p)
        _in_range("typical_p", self.typical_p, 0.0, 1.0)
        self.tfs_z = _as_float("tfs_z", self.tfs_z)
        _in_range("tfs_z", self.tfs_z, 0.0, 1.0)
        self.dynatemp_range = _as_float("dynatemp_range", self.dynatemp_range)
        self.dynatemp_exponent = _as_float("dynatemp_exponent", self.dynatemp_exponent)
        self.mirostat = _as_int("mirostat", self.mirostat)
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"Sampling parameter 'mirostat' must be 0 (off), 1 or 2, got {self.mirostat!r}.")
        self.mirostat_tau = _as_float("mirostat_tau", self.mirostat_tau)
        self.mirostat_eta = _as_float("mirostat_eta", self.mirostat_eta)
        self.xtc_probability = _as_float("xtc_probability", self.xtc_probability)
        _in_range("xtc_probability", self.xtc_probability, 0.0, 1.0)
        self.xtc_threshold = _as_float("xtc_threshold", self.xtc_threshold)
        self.top_n_sigma = _as_float("top_n_sigma", self.top_n_sigma)
        self.dry_multiplier = _as_float("dry_multiplier", self.dry_multiplier)
        self.dry_base = _as_float("dry_base", self.dry_base)
        self.dry_allowed_length = _as_int("dry_allowed_length", self.dry_allowed_length)
        if self.dry_allowed_length < 0:
            raise ValueError(f"Sampling parameter 'dry_allowed_length' must be >= 0, got {self.dry_allowed_length!r}.")
        self.dry_penalty_last_n = _as_int("dry_penalty_last_n", self.dry_penalty_last_n)
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"Sampling parameter 'dry_penalty_last_n' must be >= -1, got {self.dry_penalty_last_n!r}.")
        brk = self.dry_sequence_breakers
        if isinstance(brk, str) or not isinstance(brk, (list, tuple)) or not all(isinstance(s, str) for s in brk):
            raise ValueError(f"Sampling parameter 'dry_sequence_breakers' must be a list of strings, got {brk!r}.")
        self.dry_sequence_breakers = tuple(brk)
        self.samplers = parse_samplers(self.samplers)
        if not isinstance(self.grammar, str):
            raise ValueError(f"Sampling parameter 'grammar' must be a string, got {type(self.grammar).__name__}.")
        if not isinstance(self.grammar_lazy, (bool, np.bool_)):
            raise ValueError(f"Sampling parameter 'grammar_lazy' must be a boolean, got {self.grammar_lazy!r}.")
        self.grammar_lazy = bool(self.grammar_lazy)
        if self.grammar_triggers:
            from .grammar import normalize_triggers    # no llguidance needed to check them
            self.grammar_triggers = normalize_triggers(self.grammar_triggers)
        else:
            self.grammar_triggers = ()

    def __deepcopy__(self, memo: dict) -> "SamplingParams":
        # the vocabulary is shared, never copied (the server deep-copies params per prompt)
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k == "vocab" else copy.deepcopy(v, memo)
        return new

    @classmethod
    def from_request(cls, body: dict) -> "SamplingParams":
        """Sampling parameters from an OpenAI / llama.cpp request body.

        Keys use the llama.cpp server names (temperature, top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, presence_penalty, frequency_penalty, seed, n_probs, min_keep, typical_p, tfs_z,
        dynatemp_range, dynatemp_exponent, mirostat, mirostat_tau, mirostat_eta, xtc_probability,
        xtc_threshold, top_n_sigma, dry_*, samplers). A JSON null means "use the default", as
        llama.cpp's json_value does; unknown keys (max_tokens, stream, ...) are ignored. Unlike
        llama.cpp, which silently falls back to the default on a wrong type, a wrong type or
        out-of-range value raises ValueError naming the field.
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


def penalty_tokens(history: Sequence[int]) -> Sequence[int]:
    """The part of history (prompt + generated so far) that ik's sampler hands to its repetition /
    frequency / presence penalties: the latest token alone (the prompt's last token for the first
    generated token, then the token generated just before).

    ik keeps these tokens in common_sampler::prev, a std::vector (common/sampling.cpp).  It starts
    empty (it is sized to n_prev only when a grammar is given), common_sampler_reset clears it, and
    common_sampler_accept removes the oldest entry, when there is one, before appending: its length
    never grows past 1 after a reset.  The server resets it once the prompt is read, then accepts
    every prompt token (examples/server/server-context.cpp), so that holds for every request.
    repeat_last_n therefore only switches the penalties off (0); any other value, -1 included,
    penalizes that one token, with count 1.  DRY keeps its own window and still sees the whole
    history.  Checked against ik's compiled common_sampler_reset / common_sampler_accept."""
    return history[-1:]


def newline_token(tokenizer: Any) -> int | None:
    """The token ik's penalties leave alone unless penalize_nl (llama_token_nl, its vocabulary's
    linefeed id), or None.  SentencePiece vocabularies: the byte token <0x0A>, else a token that is
    "\\n" itself (so not what encoding "\\n" gives, which starts with the space prefix); others: the
    first token of "\\n" encoded without specials.  Checked against libllama's llama_token_nl on
    llama.cpp's vocab-only GGUFs (llama-spm, phi-3, baichuan, 14 BPE ones) and the demo model."""
    try:
        if getattr(tokenizer, "type", None) == "spm":
            t2i = tokenizer.token_to_id
            tok = t2i.get("<0x0A>", t2i.get("\n"))
            return None if tok is None else int(tok)
        ids = list(tokenizer.encode("\n", add_special=False))
    except Exception:       # a tokenizer that cannot encode it: nothing to protect
        return None
    return int(ids[0]) if ids else None


def _sanitize(x: np.ndarray) -> np.ndarray:
    # NaN logits would poison argmax/softmax; treat them as masked tokens
    if np.isnan(x).any():
        x = np.where(np.isnan(x), np.float32(-np.inf), x)
    return x


def _top_m(vals: np.ndarray, m: int, exact: bool) -> np.ndarray:
    """Positions of the m largest values, ranked (value descending, then position ascending: the
    lower id when the positions are in id order). exact=False keeps all ties at the boundary (the
    set may exceed m); exact=True keeps exactly m, preferring lower positions among boundary ties."""
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
    # pos is ascending, so a stable sort on -value breaks ties by the lower position
    return pos[np.argsort(-vals[pos], kind="stable")]


def _scaled(vals: np.ndarray, temp: float) -> np.ndarray:
    """(logit - max) / temp in float64: the log of the unnormalized probabilities at temp.
    temp 0 is the limit (the maxima share everything), temp inf the uniform distribution."""
    v = vals.astype(np.float64)
    mx = v.max()
    if 0.0 < temp < math.inf:
        return (v - mx) / temp
    if temp <= 0.0:
        return np.where(v == mx, 0.0, -np.inf)
    return np.zeros_like(v)


def _softmax(vals: np.ndarray, temp: float) -> np.ndarray:
    q = np.exp(_scaled(vals, temp))
    return q / q.sum()


def _log_softmax(vals: np.ndarray, temp: float) -> np.ndarray:
    s = _scaled(vals, temp)
    return s - math.log(float(np.exp(s).sum()))


def _mass_prefix(key: np.ndarray, w: np.ndarray, z: float, p: float, keep_min: int,
                 strict: bool, ranked: bool) -> np.ndarray:
    """Positions, ranked by key (largest first), of the shortest prefix whose mass sum(w)/z reaches p
    (> p when strict) and that holds at least keep_min tokens; all of them if none does.
    ranked: key is already in that order. Otherwise the prefix is searched among the largest 256,
    then 8x more, ... which avoids sorting the vocab."""
    n = key.shape[0]
    need = min(keep_min, n)
    m = n if ranked else min(n, max(Sampler._TOP_P_FIRST, need))
    while True:
        pos = np.arange(n) if ranked else _top_m(key, m, exact=False)
        cum = np.cumsum(w[pos]) / z
        hit = np.flatnonzero(cum > p) if strict else np.flatnonzero(cum >= p)
        if hit.shape[0] > 0:
            cut = max(int(hit[0]) + 1, need)
            if cut <= pos.shape[0]:
                return pos[:cut]
        if pos.shape[0] >= n:
            return pos
        m = min(n, m * 8)


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
# DRY: the vocabulary's sequence breakers and the repeat lengths
# ---------------------------------------------------------------------------------------------

@dataclass
class _Breakers:
    """Sequence breakers as tokens: head token -> tails (token tuples following the head; () for a
    token that contains a whole breaker)."""
    tails: dict[int, list[tuple[int, ...]]]
    heads: np.ndarray        # sorted head ids
    single: np.ndarray       # sorted ids of single-token breakers (never penalized)


_NO_BREAKERS = _Breakers({}, np.zeros(0, np.int64), np.zeros(0, np.int64))


class DryVocab:
    """The vocabulary as DRY's sequence breakers need it: each token's text as bytes (what ik's
    single-token detokenize gives) and, optionally, a tokenizer for the part of a breaker that
    continues past a token (without one, only tokens containing a whole breaker count).

    Build it once per model (DryVocab.of(tokenizer) caches one per tokenizer object); breaker lists
    are mapped once each and cached here."""

    def __init__(self, pieces: Sequence[bytes | str], encode: Callable[[str], Sequence[int]] | None = None) -> None:
        self.pieces = [p if isinstance(p, bytes) else str(p).encode("utf-8") for p in pieces]
        self.encode = encode
        lens = np.fromiter((len(p) for p in self.pieces), dtype=np.int64, count=len(self.pieces))
        self._blob = np.frombuffer(b"".join(self.pieces), dtype=np.uint8)
        self._starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if lens.size else lens
        self._tables: dict[tuple[str, ...], _Breakers] = {}

    _cache: ClassVar["weakref.WeakKeyDictionary[Any, DryVocab]"] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, vocab: Any) -> "DryVocab | None":
        """vocab: a DryVocab, a tokenizer (token_to_bytes(id, special), n_vocab, optionally encode(text,
        add_special, parse_special) and add_space_prefix), or a sequence of token pieces."""
        if vocab is None or isinstance(vocab, DryVocab):
            return vocab
        if hasattr(vocab, "token_to_bytes"):
            try:
                hit = cls._cache.get(vocab)
            except TypeError:            # not weak-referenceable: no caching
                hit = None
            if hit is not None:
                return hit
            strip = bool(getattr(vocab, "add_space_prefix", False))
            pieces = []
            for i in range(int(vocab.n_vocab)):
                b = vocab.token_to_bytes(i, True)
                # llama.cpp's detokenize of a lone token drops one leading space on SPM-style vocabs
                pieces.append(b[1:] if strip and b[:1] == b" " else b)
            enc = getattr(vocab, "encode", None)
            encode = (lambda s: enc(s, add_special=False, parse_special=False)) if enc is not None else None
            dv = cls(pieces, encode)
            try:
                cls._cache[vocab] = dv
            except TypeError:
                pass
            return dv
        return cls(list(vocab))

    def breakers(self, seqs: Sequence[str]) -> _Breakers:
        key = tuple(seqs)
        hit = self._tables.get(key)
        if hit is None:
            hit = self._tables[key] = self._map(key)
        return hit

    def _map(self, seqs: tuple[str, ...]) -> _Breakers:
        tails: dict[int, list[tuple[int, ...]]] = {}

        def add(tok: int, tail: tuple[int, ...]) -> None:
            lst = tails.setdefault(tok, [])
            if tail not in lst:
                lst.append(tail)

        for s in seqs:
            b = s.encode("utf-8")[:_DRY_MAX_BREAKER_BYTES]
            if not b:
                continue
            # only tokens holding the breaker's first byte can contain it or end in a prefix of it
            where = np.flatnonzero(self._blob == b[0])
            toks = np.unique(np.searchsorted(self._starts, where, side="right") - 1)
            for t in toks.tolist():
                w = self.pieces[t]
                if b in w:
                    add(t, ())
                    continue
                pos = w.find(b[:1])
                while pos != -1:
                    rest = w[pos:]
                    if b.startswith(rest):          # the token ends with the first len(rest) bytes
                        tail = self._tail(b[len(rest):])
                        if tail is not None:
                            add(t, tail)
                    pos = w.find(b[:1], pos + 1)
        heads = np.array(sorted(tails), dtype=np.int64)
        single = np.array(sorted(t for t, lst in tails.items() if () in lst), dtype=np.int64)
        return _Breakers(tails, heads, single)

    def _tail(self, rest: bytes) -> tuple[int, ...] | None:
        if self.encode is None:
            return None
        try:
            text = rest.decode("utf-8")     # a breaker cut inside a character: that overlap is skipped
            ids = [int(i) for i in self.encode(text)]
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: no such sequence
            return None
        return tuple(ids[:_DRY_MAX_TAIL]) if ids else None


@njit(cache=True, nogil=True)
def _z_function(r: np.ndarray) -> np.ndarray:
    """z[k] = length of the longest common prefix of r and r[k:] (z[0] = 0), in O(len(r))."""
    n = r.shape[0]
    z = np.zeros(n, dtype=np.int64)
    lo = 0
    hi = 0          # [lo, hi): the rightmost window found equal to a prefix of r
    for k in range(1, n):
        m = 0
        if k < hi:
            m = min(hi - k, z[k - lo])
        while k + m < n and r[m] == r[k + m]:
            m += 1
        z[k] = m
        if k + m > hi:
            lo = k
            hi = k + m
    return z


# ---------------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------------

class _Cands:
    """The candidates while the chain runs: ids (None: the whole vocab in id order), their logits
    (float32, without the temperature), the temperature applied so far, and whether they are ranked
    (value descending, ties by lower id) or in ascending id order."""
    __slots__ = ("ids", "vals", "ranked", "temp")

    def __init__(self, ids: np.ndarray | None, vals: np.ndarray) -> None:
        self.ids, self.vals, self.ranked, self.temp = ids, vals, False, 1.0

    @property
    def n(self) -> int:
        return self.vals.shape[0]

    def keep(self, pos: np.ndarray, ranked: bool | None = None) -> None:
        """Keep the candidates at pos: ascending positions keep the current order; positions from a
        ranking step pass ranked=True."""
        self.ids = pos if self.ids is None else self.ids[pos]
        self.vals = self.vals[pos]
        if ranked is not None:
            self.ranked = ranked

    def id_array(self) -> np.ndarray:
        return np.arange(self.n) if self.ids is None else self.ids


class Sampler:
    """Stateful sampler for one generation: owns its random generators (seeded from params.seed,
    or from a fresh random 32-bit seed when it is -1; the seed used is in .seed) and mirostat's mu.

    vocab: the model's vocabulary for DRY's sequence breakers (see DryVocab.of); default params.vocab.
    The server passes the tokenizer: the breakers are mapped once per tokenizer, not per request.

    params.grammar (GBNF / llguidance Lark) constrains the output: .grammar is then this generation's
    engine.grammar.GrammarMatcher, built on vocab (a tokenizer); with params.grammar_lazy it masks
    nothing until one of params.grammar_triggers fires.  Its mask is applied first, to the
    biased and penalized logits, before greedy / mirostat / the chain.  llama.cpp first samples
    without it and, only when that token breaks the grammar, resamples with the grammar applied
    first; this always applies it first: the same token under greedy, and under sampling the
    distribution llama.cpp's resampling draws from (a deliberate difference: no token is favoured
    for having been valid unconstrained).  sample() advances the matcher with the token drawn.  When the mask leaves nothing (a finished grammar with
    ignore_eos, or logit_bias banning every allowed token) sample() returns an end-of-generation token."""

    # first guess at how many tokens top_p / typical need when nothing bounds the candidate set;
    # grown 8x until the mass is reached, which avoids sorting the vocab
    _TOP_P_FIRST = 256

    def __init__(self, params: SamplingParams, n_vocab: int, nl_token: int | None = None,
                 eog_ids: Sequence[int] = (), vocab: Any = None) -> None:
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
        # XTC's coin: a stream of its own, so XTC does not shift the draws of the main one
        self.xtc_rng = np.random.default_rng([self.seed, 0x585443])
        self.last_probs: TokenProbs | None = None  # filled by sample() when params.n_probs > 0
        self.mirostat_mu: float = MIROSTAT_MU0
        self._keep_min = max(1, params.min_keep)
        self._ops = self._compile()
        self._xtc_coin = (params.mirostat == 0 and params.xtc_probability < 1.0
                          and any(op == self._op_xtc for op in self._ops))
        self.grammar = None
        if params.grammar:
            from .grammar import GrammarMatcher, TokenVocab
            src = vocab if vocab is not None else params.vocab
            if src is None or not hasattr(src, "token_to_bytes"):
                raise ValueError("a grammar needs the model's tokenizer (Sampler(vocab=tokenizer))")
            self.grammar = GrammarMatcher(params.grammar, TokenVocab.of(src, self.n_vocab),
                                          params.grammar_lazy, params.grammar_triggers)
        self._dry_breakers = _NO_BREAKERS
        if params.mirostat == 0 and any(op == self._op_dry for op in self._ops):
            dv = DryVocab.of(vocab if vocab is not None else params.vocab)
            if dv is not None:
                self._dry_breakers = dv.breakers(params.dry_sequence_breakers)

    def _compile(self) -> list[Callable]:
        """The chain's steps that can change anything, in order; top_p directly followed by min_p runs
        as one step (min_p first: the same set, without sorting what min_p drops)."""
        p = self.params
        active = {
            "dry": p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0,
            "top_k": p.top_k > 0, "tfs_z": p.tfs_z < 1.0, "typical_p": p.typical_p < 1.0,
            "top_p": p.top_p < 1.0, "min_p": p.min_p > 0.0,
            "xtc": p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5, "top_n_sigma": p.top_n_sigma > 0.0,
            "temperature": True, "adaptive_p": False,
        }
        step = {"dry": self._op_dry, "top_k": self._op_top_k, "tfs_z": self._op_tfs, "typical_p": self._op_typical,
                "top_p": self._op_top_p, "min_p": self._op_min_p, "xtc": self._op_xtc,
                "top_n_sigma": self._op_top_n_sigma, "temperature": self._op_temperature}
        names = [s for s in p.samplers if active[s]]
        ops: list[Callable] = []
        i = 0
        while i < len(names):
            if names[i] == "top_p" and i + 1 < len(names) and names[i + 1] == "min_p":
                ops.append(self._op_top_p_min_p)
                i += 2
            else:
                ops.append(step[names[i]])
                i += 1
        return ops

    # -- the filtered distribution -------------------------------------------------------------

    def distribution(self, logits: np.ndarray, history: Sequence[int],
                     xtc_fires: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Token ids kept by the chain (mirostat: its cut at the current mu), and their probabilities
        after temperature, most likely first (ties: lower id first). This is the distribution sample()
        draws from when temperature > 0; xtc_fires says how XTC's coin falls (when XTC is on and
        xtc_probability < 1). Changes no state. Empty arrays when every logit is masked (-inf / NaN)."""
        x = self._penalized(logits, history)
        if self.grammar is not None:
            x = self.grammar.apply(x)
        if self.params.mirostat:
            ids, probs, _ = self._mirostat(x)
            order = np.lexsort((ids, -probs)) if ids.shape[0] else ids
            return ids[order], probs[order]
        return self._chain(x, history, xtc_fires, ordered_out=True)

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        arr = np.asarray(logits)
        if arr.ndim != 1 or arr.shape[0] != self.n_vocab:
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {arr.shape}.")
        if self.bias_ids.size:
            arr = np.array(arr, dtype=np.float32)
            arr[self.bias_ids] += self.bias_vals
        return _sanitize(apply_penalties(arr, penalty_tokens(history), self.params, self.nl_token))

    @staticmethod
    def _candidates(x: np.ndarray) -> _Cands | None:
        if np.isfinite(x).all():
            return _Cands(None, x)
        if np.isposinf(x).any():
            # +inf logits would make softmax NaN: they win outright and share the mass equally
            ids = np.flatnonzero(np.isposinf(x))
            return _Cands(ids, np.zeros(ids.shape[0], dtype=np.float32))
        # masked (-inf) tokens have zero probability in llama.cpp too; drop them up front
        ids = np.flatnonzero(np.isfinite(x))
        return _Cands(ids, x[ids]) if ids.shape[0] else None

    def _chain(self, x: np.ndarray, history: Sequence[int], xtc_fires: bool,
               ordered_out: bool) -> tuple[np.ndarray, np.ndarray]:
        """Kept token ids and probabilities; ranked when ordered_out or when a step ranked them,
        otherwise in ascending id order (canonical either way, and it spares sorting the whole vocab
        when every filter is off)."""
        c = self._candidates(x)
        if c is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        for op in self._ops:
            op(c, history, xtc_fires)
        ids = c.id_array()
        vals = c.vals
        if ordered_out and not c.ranked:
            pos = np.argsort(-vals, kind="stable")       # ids ascending -> ties by lower id
            ids, vals = ids[pos], vals[pos]
        return ids, _softmax(vals, c.temp)

    # -- the chain's steps (each keeps at least one candidate) ------------------------------------

    def _op_top_k(self, c: _Cands, history, xtc_fires) -> None:
        k = max(self.params.top_k, self._keep_min)
        if k < c.n:
            c.keep(_top_m(c.vals, k, exact=True), ranked=True)

    def _op_top_p(self, c: _Cands, history, xtc_fires) -> None:
        w = np.exp(_scaled(c.vals, c.temp))       # top_p normalizes over every candidate left
        pos = _mass_prefix(c.vals, w, float(w.sum()), self.params.top_p, self._keep_min, False, c.ranked)
        c.keep(pos, ranked=True)

    def _min_p_thresh(self, c: _Cands) -> np.float32:
        # prob >= min_p * max prob  <=>  logit >= max + temp * log(min_p)
        return np.float32(c.vals.max()) + np.float32(c.temp * math.log(self.params.min_p))

    def _op_min_p(self, c: _Cands, history, xtc_fires) -> None:
        keep = np.flatnonzero(c.vals >= self._min_p_thresh(c))     # the max always passes
        if keep.shape[0] >= self._keep_min:
            if keep.shape[0] < c.n:
                c.keep(keep)
        elif self._keep_min < c.n:
            c.keep(_top_m(c.vals, self._keep_min, exact=True), ranked=True)

    def _op_top_p_min_p(self, c: _Cands, history, xtc_fires) -> None:
        # top_p then min_p keep prefixes of the same ranking: the result is the shorter one, and
        # min_keep applies to both, so search top_p's prefix among the top max(n_min_p, min_keep)
        w = np.exp(_scaled(c.vals, c.temp))
        z = float(w.sum())                        # top_p's normalizer: before min_p
        keep = np.flatnonzero(c.vals >= self._min_p_thresh(c))
        if keep.shape[0] < self._keep_min:
            keep = np.sort(_top_m(c.vals, self._keep_min, exact=True))
        pos = _mass_prefix(c.vals[keep], w[keep], z, self.params.top_p, self._keep_min, False, c.ranked)
        c.keep(keep[pos], ranked=True)

    def _op_typical(self, c: _Cands, history, xtc_fires) -> None:
        lp = _log_softmax(c.vals, c.temp)
        prob = np.exp(lp)
        ent = -float(np.sum(prob * np.where(prob > 0, lp, 0.0)))
        score = np.abs(-lp - ent)                 # how far each token's surprise is from the entropy
        pos = _mass_prefix(-score, prob, 1.0, self.params.typical_p, self._keep_min, True, False)
        c.keep(np.sort(pos))

    def _op_tfs(self, c: _Cands, history, xtc_fires) -> None:
        n = c.n
        if n <= 2:
            return
        # the curve needs every sorted value, but only the kept prefix needs its token ids
        sv = c.vals if c.ranked else np.sort(c.vals)[::-1]
        prob = _softmax(sv, c.temp)
        d2 = np.abs(np.diff(prob, 2))             # |second derivative| of the sorted probabilities
        s = float(d2.sum())
        d2 = d2 / s if s > 1e-6 else np.full(n - 2, 1.0 / (n - 2))
        hit = np.flatnonzero((np.cumsum(d2) > self.params.tfs_z) & (np.arange(n - 2) >= self._keep_min))
        if hit.shape[0]:
            last = int(hit[0])
            c.keep(np.arange(last) if c.ranked else _top_m(c.vals, last, exact=True), ranked=True)

    def _op_xtc(self, c: _Cands, history, xtc_fires) -> None:
        p = self.params
        if c.n < 2 or (p.xtc_probability < 1.0 and not xtc_fires):
            return
        above = np.flatnonzero(_softmax(c.vals, c.temp) >= p.xtc_threshold)
        last = above.shape[0] - 1                  # ik's pos_last: the least likely token above it stays
        if last > 0 and c.n - last >= self._keep_min:
            ranked = above[_top_m(c.vals[above], above.shape[0], exact=True)]
            keep = np.ones(c.n, dtype=bool)
            keep[ranked[:-1]] = False
            c.keep(np.flatnonzero(keep))

    def _op_top_n_sigma(self, c: _Cands, history, xtc_fires) -> None:
        n = c.n
        if n < 4:
            return
        v = c.vals.astype(np.float64)
        mean = float(v.sum()) / n
        var = float((v * v).sum()) / n - mean * mean
        if var <= 0.0:
            return
        # on the tempered logits both the max and sigma scale by 1/temp: the same cut
        thresh = np.float32(c.vals.max()) - np.float32(self.params.top_n_sigma) * np.float32(math.sqrt(var))
        keep = np.flatnonzero(c.vals >= thresh)
        if keep.shape[0] < n:
            c.keep(keep)

    def _op_temperature(self, c: _Cands, history, xtc_fires) -> None:
        p = self.params
        if p.dynatemp_range <= 0.0:
            c.temp *= p.temperature
            return
        n = c.n
        if n <= 1:
            return
        lo = max(0.0, p.temperature - p.dynatemp_range)
        hi = max(0.0, p.temperature + p.dynatemp_range)
        prob = _softmax(c.vals, c.temp)
        nz = prob[prob > 0]
        ent = -float(np.sum(nz * np.log(nz)))
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            dyn = lo + (hi - lo) * float(np.power(np.float64(ent / math.log(n)), p.dynatemp_exponent))
        c.temp *= dyn

    def _op_dry(self, c: _Cands, history, xtc_fires) -> None:
        p = self.params
        allowed = p.dry_allowed_length
        n_hist = len(history)
        last_n = n_hist if p.dry_penalty_last_n < 0 else min(n_hist, p.dry_penalty_last_n)
        last_n = min(last_n, self.n_vocab)
        if last_n <= allowed:
            return
        # the window, newest token first
        r = np.asarray(history[n_hist - last_n:], dtype=np.int64).reshape(-1)[::-1].copy()
        # the most recent complete sequence breaker bounds how long a repetition can be
        rep_limit = last_n
        brk = self._dry_breakers
        if brk.heads.shape[0]:
            for i in np.flatnonzero(np.isin(r, brk.heads)).tolist():
                longest = -1
                for tail in brk.tails[int(r[i])]:
                    k = len(tail)
                    if longest < k <= i and all(int(r[i - 1 - j]) == tail[j] for j in range(k)):
                        longest = k
                if longest >= 0:
                    rep_limit = i - longest
                    break
        if rep_limit < allowed:
            return
        # z[k]: how many tokens before the k-th newest repeat the newest ones; the token after that
        # earlier occurrence (r[k-1]) would extend the repetition to z[k] + 1
        lens = np.minimum(_z_function(r), rep_limit)
        ks = np.flatnonzero(lens[1:] >= allowed) + 1
        if ks.shape[0] == 0:
            return
        toks, lens = r[ks - 1], lens[ks]
        order = np.lexsort((lens, toks))          # per token the longest, last in its group
        toks, lens = toks[order], lens[order]
        last = np.append(toks[1:] != toks[:-1], True)
        toks, lens = toks[last], lens[last]
        ok = (toks >= 0) & (toks < self.n_vocab)
        if brk.single.shape[0]:
            ok &= ~np.isin(toks, brk.single)
        toks, lens = toks[ok], lens[ok]
        if toks.shape[0] == 0:
            return
        base = float(np.float32(p.dry_base))      # ik keeps these as float
        exp = lens - allowed
        if base > 1.000001:
            max_exp = int(_FLOAT_MAX_LOG / math.log(base))
            if max_exp > 0:
                exp = np.minimum(exp, max_exp)
        pen = float(np.float32(p.dry_multiplier)) * np.power(base, exp.astype(np.float64))
        if c.ids is None:
            pos, pen_at = toks, pen
        else:
            sorter = np.argsort(c.ids) if c.ranked else None
            j = np.searchsorted(c.ids, toks, sorter=sorter)
            j = np.minimum(j, c.n - 1)
            at = j if sorter is None else sorter[j]
            hit = c.ids[at] == toks
            pos, pen_at = at[hit], pen[hit]
            if pos.shape[0] == 0:
                return
        v = c.vals.copy()                          # may be the caller's logits
        v[pos] = (v[pos].astype(np.float64) - pen_at).astype(np.float32)
        c.vals = v
        if c.ranked:                               # the values moved: back to id order
            back = np.argsort(c.ids, kind="stable")
            c.keep(back, ranked=False)

    # -- mirostat ------------------------------------------------------------------------------

    def _mirostat(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids, probabilities) mirostat draws from at the current mu, and for v1 the log-probabilities
        of those ids before the cut (v1's surprise is measured on them; v2's on the renormalized ones)."""
        p = self.params
        c = self._candidates(x)
        if c is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), None
        lp = _log_softmax(c.vals, p.temperature)
        mu = self.mirostat_mu
        if p.mirostat == 2:
            keep = np.flatnonzero(-lp / _LN2 <= mu)   # surprise <= mu: a prefix of the ranking
            if keep.shape[0] == 0:
                keep = _top_m(c.vals, 1, exact=True)
            c.keep(keep)
            q = np.exp(lp[keep] - lp[keep].max())
            return c.id_array(), q / q.sum(), None
        n = c.n
        top = _top_m(c.vals, min(_MIROSTAT_M, n), exact=True)
        lpt = lp[top]
        m = min(_MIROSTAT_M - 1, n - 1)
        i = np.arange(m, dtype=np.float64)
        t = np.log((i + 2) / (i + 1))
        b = lpt[:m] - lpt[1:m + 1]
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            s_hat = np.float64(np.dot(t, b)) / np.float64(np.dot(t, t))
            eps = s_hat - 1.0
            k = np.power(eps * np.power(2.0, mu) / (1.0 - np.power(np.float64(self.n_vocab), -eps)), 1.0 / s_hat)
        # ik: top_k(int(k)); k <= 0 (and a k that is no int) keeps every candidate
        if math.isfinite(k) and 1.0 <= k < n:
            pos = _top_m(c.vals, int(k), exact=True)
        else:
            pos = _top_m(c.vals, n, exact=True)
        lpk = lp[pos]
        c.keep(pos, ranked=True)
        q = _softmax(c.vals, p.temperature)
        return c.id_array(), q, lpk

    # -- drawing -------------------------------------------------------------------------------

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Next token for logits of shape (n_vocab,); history = prompt + generated tokens so far
        (DRY reads its window of it; the penalties only its last token, as ik: penalty_tokens)."""
        p = self.params
        x = self._penalized(logits, history)
        g = self.grammar
        if g is not None:
            x = g.apply(x)
        if g is not None and not (x > -math.inf).any() and g.fallback_token() is not None:
            tok = g.fallback_token()          # nothing the grammar allows is left: end the generation
        elif p.temperature <= 0.0:
            tok = int(np.argmax(x))                      # first maximum, like max_element
        else:
            lp_full = None
            if p.mirostat:
                ids, probs, lp_full = self._mirostat(x)
            else:
                fires = True
                if self._xtc_coin:
                    fires = float(self.xtc_rng.random()) <= p.xtc_probability
                ids, probs = self._chain(x, history, fires, ordered_out=False)
            if ids.shape[0] == 0:
                # everything masked: nothing is valid, fall back to a deterministic in-range token
                tok = int(np.argmax(x))
            else:
                # always one draw per token, so the stream position depends only on the step
                u = self.rng.random()
                cdf = np.cumsum(probs)
                j = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), ids.shape[0] - 1)
                tok = int(ids[j])
                if p.mirostat:
                    lpj = lp_full[j] if lp_full is not None else math.log(probs[j] / cdf[-1])
                    surprise = -lpj / _LN2
                    self.mirostat_mu -= p.mirostat_eta * (surprise - p.mirostat_tau)
        if g is not None:
            g.accept(tok)
        if p.n_probs > 0:
            self.last_probs = token_probabilities(logits, tok, p.n_probs)
        return tok
