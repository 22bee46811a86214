"""Serving: parallel slots sharing one model, continuous batching, streamed token events.

`-c` is split across `--parallel N` slots (each slot has its own KV cache of n_ctx / N
cells, as llama.cpp's server does).  Requests wait in a FIFO queue until a slot is free.
One engine thread runs the loop: every step builds one micro-batch from all busy slots —
the next token of each generating slot plus prompt tokens of slots still reading their
prompt — and runs a single forward pass over it (matmuls over all tokens, attention per
slot), then samples one token for every slot whose logits came out.  So slots are decoded
together, not one after another.

Results leave the engine thread through the job's `on_event` callback: text is released
only when it is valid UTF-8 and cannot be the start of a stop string.

A slot keeps its cache after a request.  A new request goes to the free slot whose cached
tokens share the longest prefix with its prompt, and only the rest of the prompt is read
(multi-turn chat re-sends the whole conversation each turn).  Prefixes shorter than
PROMPT_REUSE_MIN tokens are not reused: re-reading them costs less than one batch step, and
it keeps short requests independent of what the slot served before.

Slot actions (llama-server's POST /slots/{id}?action=erase|save|restore) run on the engine thread
between steps, and wait while their slot is busy (ik defers them the same way).  A save file is an
.npz (written to exactly the name given): the slot's cached token ids, the cells' positions and,
for every layer, the valid cells of each of its cache stores (K, V, kv^T) in their stored type, so a
restore puts back the very bytes and the next request reuses the prefix exactly.

A job whose params carry a grammar (SamplingParams.grammar) gets its own grammar matcher in its
slot's Sampler (constrained and free jobs share a batch); when the grammar is complete the job ends
as if an end-of-generation token had been sampled (stop, stop_type "eos").

A job may name its slot (Job.want_slot, llama-server's id_slot): it waits in the queue while that
slot is busy and the jobs behind it go on (ik defers it).  A job with banned strings (Job.ban,
engine.banned) holds its newest tokens back; a banned string among them rewinds the slot (answer,
KV cache, grammar) to the token it starts in, which is then drawn again with a bias against it.

Embedding jobs (submit_embedding) read their prompt through a slot like any other (no prefix reuse:
the pooling needs every token's state) in batches of embedding jobs only, whose forward pass returns
the normed final hidden states (RunOptions.embeddings) of the rows the pooling needs; when both
kinds are busy the batches alternate.  The final event carries the pooled, normalized vector.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from .arch.common import Segment, UBatch
from .config import EngineConfig
from .context import set_threads
from .embeddings import normalize, pool, pooled_rows
from .kv_cache import TransposedStore
from .model import Log, Model
from .sampling import Sampler, SamplingParams, newline_token

PROMPT_REUSE_MIN = 16
SLOT_FILE_FORMAT = "ikcli-slot-1"


class SlotError(Exception):
    """A slot action that cannot be done (llama-server answers it 400 invalid_request_error)."""


@dataclass
class Timings:
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


@dataclass
class Event:
    text: str                     # text added since the previous event
    token: int | None
    done: bool
    finish_reason: str | None     # "stop" | "length" | "cancelled" on the final event
    stopping_word: str
    n_prompt: int
    n_generated: int
    timings: Timings | None = None
    probs: list = field(default_factory=list)   # TokenProbs of the tokens since the previous event (n_probs > 0)
    truncated: bool = False       # the context was shifted (tokens dropped) during this generation
    embedding: np.ndarray | None = None   # an embedding job's result (final event): engine.embeddings.pool's rows
    tokens: list = field(default_factory=list)   # the generated token ids since the previous event


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    n_predict: int
    stop: list[str]
    on_event: Callable[[Event], None]
    id_slot: int = -1
    cancelled: bool = False
    cache_prompt: bool = True        # reuse a slot's cached prefix (llama.cpp's cache_prompt)
    id_task: int = -1
    # control tokens written out as text (llama.cpp's preserved_tokens: tool-call markers such as
    # gpt-oss's <|call|> or Kimi-K2's <|tool_calls_section_begin|>, which the parser must see)
    preserved_tokens: frozenset = frozenset()
    n_keep: int = 0                  # context shift: tokens kept at the start (-1: the whole prompt)
    n_discard: int = 0               # ... tokens dropped per shift (0: half of what follows n_keep)
    truncated: bool = False          # the prompt was cut to fit the slot (context shift)
    want_slot: int = -1              # llama-server's id_slot: run in that slot (waits while it is busy)
    ban: object = None               # engine.banned.BanSpec: banned strings (tokens held back, rewinds)
    embedding: bool = False          # an embedding job (submit_embedding): no sampling, a pooled vector
    embd_normalize: int = 2          # ... normalized as common_embd_normalize (-1 none, 0, 1, 2, p)

    def cancel(self) -> None:
        """Thread-safe: the engine frees the slot at its next step and sends a final event."""
        self.cancelled = True


@dataclass
class _Slot:
    id: int
    cache: object
    job: Job | None = None
    sampler: Sampler | None = None
    n_fed: int = 0                                  # prompt tokens already in the cache
    n_reused: int = 0                               # ... of which came from the previous request
    cached: list[int] = field(default_factory=list) # the tokens whose K/V the cache holds, in order
    generated: list[int] = field(default_factory=list)
    pending: int | None = None                      # sampled, not yet in the cache
    history: list[int] = field(default_factory=list)  # prompt + generated, for the penalties
    text: str = ""                                  # generated text decoded so far
    tail: bytearray = field(default_factory=bytearray)  # bytes of an unfinished UTF-8 character
    probs: list = field(default_factory=list)       # TokenProbs not yet sent (n_probs > 0)
    n_sent: int = 0                                 # characters of the text already sent
    n_tok_sent: int = 0                             # generated tokens already sent (Event.tokens)
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    last: Job | None = None                         # the latest job, kept for /slots
    stop_kind: str = ""                             # how it ended: "eos" | "word" | "limit" | ""
    truncated: bool = False                         # the context was shifted during this job
    shift_keep: int = 0                             # ... cells before its first gap (reusable as they are)
    stop_word: str = ""
    # banned strings (engine.banned): per generated token the (text length, undecoded bytes) after it,
    # its bytes, its TokenProbs while held; tokens held back; bans by answer position; rewinds in a
    # row; tokens rewound in all (they count towards n_predict, as ik's n_decoded)
    ban_marks: list = field(default_factory=list)
    ban_pieces: list = field(default_factory=list)
    ban_probs: list = field(default_factory=list)
    n_held: int = 0
    ban_at: dict = field(default_factory=dict)
    ban_rewinds: int = 0
    n_rewound: int = 0
    hidden: list = field(default_factory=list)      # an embedding job's kept hidden-state rows so far


class ServingEngine:
    def __init__(self, model: Model, cfg: EngineConfig, n_parallel: int, log: Log, ctx=None,
                 ctx_shift: bool = True, pooling: str = "none") -> None:
        """ctx: the Context of n_parallel caches to serve from (default: a new one); ctx_shift
        (llama-server's --context-shift, on by default in ik): a generation that fills its slot's
        context drops tokens after n_keep and goes on, instead of stopping; pooling: how embedding
        jobs pool their tokens' hidden states (engine.embeddings: none, mean, cls, last)."""
        from .context import Context
        from .embeddings import SUPPORTED_POOLING
        if n_parallel < 1:
            raise ValueError("--parallel must be >= 1")
        if pooling not in SUPPORTED_POOLING:
            raise ValueError(f"pooling type '{pooling}' is not supported (supported: {', '.join(SUPPORTED_POOLING)})")
        self.pooling = pooling
        self._embd_turn = False     # embedding and completion slots take turns at the batches
        self.model, self.cfg, self.log = model, cfg, log
        self.n_parallel = n_parallel
        if ctx is None:
            ctx = Context(model, cfg, log, n_seq=n_parallel)     # the slots' caches, run options, logs
        self.n_ctx_slot = ctx.n_ctx // n_parallel
        self.opts = ctx.opts
        self.embd_opts = replace(ctx.opts, embeddings=True)    # batches of embedding jobs: hidden states out
        self.n_batch = ctx.n_batch
        self.n_ubatch = ctx.n_ubatch
        self.slots = [_Slot(i, c) for i, c in enumerate(ctx.caches)]
        self.queue: collections.deque[Job] = collections.deque()
        self.actions: list[tuple] = []     # (slot, function, Future): slot actions waiting their turn
        self.n_tasks = 0
        # llama-server's /metrics counters: totals, and a bucket since the last metrics() call
        self.totals = {"n_prompt": 0, "t_prompt_ms": 0.0, "n_predicted": 0, "t_predicted_ms": 0.0}
        self.bucket = dict(self.totals)
        self.cv = threading.Condition()
        self.thread: threading.Thread | None = None
        self.running = False
        self.ctx_shift = ctx_shift and hasattr(model.arch, "shift_keys")
        if ctx_shift and not self.ctx_shift:
            log("ctx_shift is not supported by this model's KV cache, it will be disabled")
        log(f"srv init: {n_parallel} slots, n_ctx_slot = {self.n_ctx_slot}")

    # ---- public, any thread ---------------------------------------------------------------
    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="ikcli-engine", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        with self.cv:
            self.running = False
            self.cv.notify_all()
        if self.thread:
            self.thread.join(timeout=30)

    def submit(self, prompt: list[int], params: SamplingParams, n_predict: int, stop: list[str],
               on_event: Callable[[Event], None], cache_prompt: bool = True,
               preserved_tokens: list[int] | None = None, n_keep: int = 0, n_discard: int = 0,
               id_slot: int = -1, ban: object = None) -> Job:
        """id_slot: llama-server's id_slot (-1: the free slot with the longest cached prefix; else that
        slot, waiting while it is busy); ban: an engine.banned.BanSpec."""
        prompt = self._checked_prompt(prompt)
        if not -1 <= int(id_slot) < self.n_parallel:
            raise ValueError("Invalid slot ID")
        truncated = False
        if len(prompt) >= self.n_ctx_slot and self.ctx_shift:
            prompt, truncated = self._truncated_prompt(prompt, int(n_keep), int(n_discard)), True
        if len(prompt) >= self.n_ctx_slot:      # a generated token needs a cell after the prompt
            self._too_long(prompt)
        return self._enqueue(Job(prompt, params, int(n_predict), [s for s in stop if s], on_event,
                                 cache_prompt=bool(cache_prompt),
                                 preserved_tokens=frozenset(int(t) for t in preserved_tokens or ()),
                                 n_keep=int(n_keep), n_discard=int(n_discard), truncated=truncated,
                                 want_slot=int(id_slot), ban=ban))

    def submit_embedding(self, prompt: list[int], on_event: Callable[[Event], None], embd_normalize: int = 2) -> Job:
        """An embedding job: the prompt is read through a slot like a completion's (batched with the
        other slots' prompts, never with generating tokens: llama.cpp switches a whole batch to
        embeddings), then one final Event carries Event.embedding, the prompt's hidden states pooled
        as self.pooling says (one row per token for none, not normalized; else one row normalized
        with embd_normalize).  ValueError for an empty prompt, a bad token id or a prompt longer
        than a slot (no truncation: it would change the vector)."""
        prompt = self._checked_prompt(prompt)
        if len(prompt) > self.n_ctx_slot:       # no token follows an embedding job's prompt
            self._too_long(prompt)
        return self._enqueue(Job(prompt, SamplingParams(), 0, [], on_event, cache_prompt=False, embedding=True,
                                 embd_normalize=int(embd_normalize)))

    def _checked_prompt(self, prompt: list[int]) -> list[int]:
        """The prompt as ints; ValueError when it is empty or holds an id outside the vocabulary."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if t < 0 or t >= self.model.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.model.n_vocab})")
        return prompt

    def _too_long(self, prompt: list[int]) -> None:
        raise ValueError(f"the prompt has {len(prompt)} tokens, more than the slot's context of "
                         f"{self.n_ctx_slot} tokens allows (-c {self.n_ctx_slot * self.n_parallel} "
                         f"split over {self.n_parallel} slots)")

    def _enqueue(self, job: Job) -> Job:
        with self.cv:
            job.id_task, self.n_tasks = self.n_tasks, self.n_tasks + 1
            self.queue.append(job)
            self.cv.notify_all()
        return job

    def _bos(self, prompt: list[int]) -> int:
        """1 when the prompt starts with the BOS the tokenizer adds (ik counts n_keep after it)."""
        tk = self.model.tokenizer
        return int(bool(prompt) and getattr(tk, "add_bos", False) and prompt[0] == getattr(tk, "bos_id", None))

    def _truncated_prompt(self, prompt: list[int], n_keep: int, n_discard: int) -> list[int]:
        """ik's prompt truncation under context shift: keep the first n_keep tokens (+1 for a BOS;
        n_keep -1 counts as 0 here, as in ik) and drop blocks of n_discard (default: half of what
        the slot holds after them) after them until the prompt fits."""
        keep = max(0, n_keep + self._bos(prompt))
        step = n_discard if n_discard > 0 else (self.n_ctx_slot - keep) // 2
        if step <= 0 or keep >= self.n_ctx_slot:
            return prompt
        gone = 0
        while len(prompt) - gone >= self.n_ctx_slot:
            gone += step
        return prompt[:keep] + prompt[keep + gone:]

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return self.model.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.tokenizer.decode([int(t) for t in tokens])

    def slots_info(self) -> list[dict]:
        """Each slot as llama-server's /slots shows it (a snapshot; the HTTP layer formats `params`,
        the latest job's SamplingParams, into the generation settings)."""
        out = []
        for s in self.slots:
            job = s.job or s.last
            busy = s.job is not None
            n_dec = len(s.generated)
            n_pred = job.n_predict if job is not None else -1
            out.append({
                "id": s.id, "id_task": job.id_task if job is not None else -1, "n_ctx": self.n_ctx_slot,
                "is_processing": busy, "state": int(busy),
                "params": job.params if job is not None else None,
                "n_predict": n_pred, "stop": list(job.stop) if job is not None else [],
                "prompt_tokens": list(job.prompt) if job is not None else [],
                "n_cached": len(s.cached),
                "next_token": {"has_next_token": busy, "n_remain": n_pred - n_dec if n_pred >= 0 else -1,
                               "n_decoded": n_dec, "stopped_eos": s.stop_kind == "eos",
                               "stopped_word": s.stop_kind == "word", "stopped_limit": s.stop_kind == "limit",
                               "stopping_word": s.stop_word},
            })
        return out

    # ---- slot actions (llama-server's /slots/{id}?action=...) ------------------------------
    def slot_action(self, id_slot: int, action: str, path: str = "") -> concurrent.futures.Future:
        """Queue erase / save / restore of slot id_slot (path: the save file) for the engine thread,
        which runs it once the slot is idle.  The future's result is the action's counts; SlotError
        for a bad slot id, an unreadable file or a file that does not fit the slot."""
        fn = {"erase": self._erase, "save": self._save, "restore": self._restore}[action]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not isinstance(id_slot, int) or not 0 <= id_slot < self.n_parallel:
            fut.set_exception(SlotError("Invalid slot ID"))
            return fut
        with self.cv:
            if not self.running:
                fut.set_exception(SlotError("the server is stopping"))
                return fut
            self.actions.append((self.slots[id_slot], lambda s: fn(s, path) if path else fn(s), fut))
            self.cv.notify_all()
        return fut

    def _run_actions(self, ready: list[tuple]) -> None:
        for s, fn, fut in ready:
            try:
                fut.set_result(fn(s))
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine keeps serving
                fut.set_exception(e if isinstance(e, SlotError) else SlotError(f"{type(e).__name__}: {e}"))

    @staticmethod
    def _erase(s: _Slot) -> dict:
        n = len(s.cached)
        s.cache.clear()
        s.cached.clear()
        return {"n_erased": n}

    @staticmethod
    def _stores(cache) -> list[tuple[str, object]]:
        return [(f"layer{i}.{j}", st) for i, L in enumerate(cache.layers) for j, st in enumerate(L.stores())]

    def _save(self, s: _Slot, path: str) -> dict:
        t0 = time.perf_counter()
        c, n = s.cache, len(s.cached)
        if c.n != n:    # cells and token list always move together; a mismatch would save garbage
            raise SlotError(f"slot {s.id}: the cache holds {c.n} cells for {n} cached tokens")
        arrays = {"format": np.array(SLOT_FILE_FORMAT), "tokens": np.asarray(s.cached, dtype=np.int32),
                  "pos": c.pos[:n].copy()}
        for name, st in self._stores(c):
            arrays[name] = st.data[:, :n] if isinstance(st, TransposedStore) else st.data[:n]
        try:
            with open(path, "wb") as fh:        # a file object: np.savez would add ".npz" to a name
                np.savez(fh, **arrays)
            size = os.path.getsize(path)
        except OSError as e:
            raise SlotError(f"failed to save the slot to '{path}': {e.strerror}") from None
        return {"n_saved": n, "n_written": size, "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}

    def _restore(self, s: _Slot, path: str) -> dict:
        t0 = time.perf_counter()
        bad = SlotError("Unable to restore slot, no available space in KV cache or invalid slot save file")
        c = s.cache
        try:
            size = os.path.getsize(path)
            with np.load(path, allow_pickle=False) as z:
                if "format" not in z.files or str(z["format"]) != SLOT_FILE_FORMAT:
                    raise bad
                tokens, pos = z["tokens"], z["pos"]
                n = len(tokens)
                stores = self._stores(c)
                if (n > c.n_ctx or pos.shape != (n,) or len(z.files) != 3 + len(stores)
                        or any(int(t) < 0 or int(t) >= self.model.n_vocab for t in tokens)):
                    raise bad
                rows = {}
                for name, st in stores:
                    a = z[name] if name in z.files else None
                    want = (st.data.shape[0], n) if isinstance(st, TransposedStore) else (n,) + st.data.shape[1:]
                    if a is None or a.dtype != st.data.dtype or a.shape != want:
                        raise bad
                    rows[name] = a
        except SlotError:
            raise
        except Exception:  # noqa: BLE001 - missing, unreadable or not an npz: ik's one message
            raise bad from None
        c.clear()
        for name, st in stores:
            if isinstance(st, TransposedStore):
                st.data[:, :n] = rows[name]
            else:
                st.data[:n] = rows[name]
        c.pos[:n] = pos
        c.n = n
        s.cached = [int(t) for t in tokens]
        return {"n_restored": n, "n_read": size, "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    def metrics(self, reset_bucket: bool = True) -> dict:
        """The counters of llama-server's /metrics: totals, the bucket since the previous call (for
        its throughput gauges), the KV cells in use, requests processing and waiting."""
        out = {"totals": dict(self.totals), "bucket": dict(self.bucket),
               "kv_cells_used": sum(sl.cache.n for sl in self.slots),
               "processing": sum(1 for sl in self.slots if sl.job is not None), "deferred": self.queued()}
        if reset_bucket:
            self.bucket = {k: 0 for k in self.bucket}
        return out

    def queued(self) -> int:
        return len(self.queue)

    # ---- engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while self.running and not self.queue and not self.actions and not any(s.job for s in self.slots):
                    self.cv.wait()
                if not self.running:
                    for s in self.slots:
                        if s.job:
                            self._finish(s, "cancelled")
                    while self.queue:
                        self._refuse(self.queue.popleft())
                    for _, _, fut in self.actions:
                        fut.set_exception(SlotError("the server is stopping"))
                    self.actions.clear()
                    return
                # slot actions go first, each once its slot is idle (as ik defers them)
                ready = [a for a in self.actions if a[0].job is None]
                self.actions = [a for a in self.actions if a[0].job is not None]
            if ready:
                self._run_actions(ready)
                continue
            with self.cv:
                starting = []
                free = [s for s in self.slots if s.job is None]
                deferred: list[Job] = []
                while free and self.queue:
                    job = self.queue.popleft()
                    if job.want_slot >= 0:       # id_slot: that slot or wait (ik defers the task)
                        s = next((x for x in free if x.id == job.want_slot), None)
                        if s is None:
                            deferred.append(job)
                            continue
                    else:
                        # an embedding job reuses no prefix: it takes the slot with the least cache to lose
                        s = max(free, key=lambda s: ((-len(s.cached) if job.embedding else self._reusable(s, job.prompt)),
                                                     -s.id))
                    free.remove(s)
                    starting.append((s, job))
                self.queue.extendleft(reversed(deferred))     # they keep their place in the queue
            try:
                for s, job in starting:
                    self._assign(s, job)
                self._step()
            except Exception as e:  # a bug must not kill the server: end the jobs, keep serving
                self.log(f"srv  error: {type(e).__name__}: {e}")
                for s in self.slots:
                    if s.job:
                        self._finish(s, "cancelled")

    def _embedding_turn(self, busy: list[_Slot]) -> bool:
        """Whether this step's batch is an embedding one: a batch is all embedding jobs or none (the
        forward pass returns hidden states or logits); with both kinds busy they alternate, so
        neither starves the other (ik runs generating slots first and defers embedding prompts)."""
        kinds = {s.job.embedding for s in busy}
        if len(kinds) == 1:
            return kinds.pop()
        self._embd_turn = not self._embd_turn
        return self._embd_turn

    def _pooled(self, s: _Slot) -> np.ndarray:
        """An embedding job's result from the hidden-state rows its slot kept: pooled, and unless
        the pooling is none (per-token rows, as ik leaves them) normalized."""
        h = np.concatenate(s.hidden) if s.hidden else np.zeros((0, self.model.hp.n_embd), np.float32)
        s.hidden = []
        v = pool(h, self.pooling)
        return v if self.pooling == "none" else normalize(v[0], s.job.embd_normalize)[None, :]

    def _refuse(self, job: Job) -> None:
        try:
            job.on_event(Event("", None, True, "cancelled", "", len(job.prompt), 0, Timings(0, 0.0, 0, 0.0)))
        except Exception:
            pass

    @staticmethod
    def _reusable(s: _Slot, prompt: list[int]) -> int:
        """Cached tokens of slot s a prompt can keep: the common prefix, leaving >= 1 token to read
        (its logits are needed), or 0 below PROMPT_REUSE_MIN."""
        n = 0
        for a, b in zip(s.cached, prompt[:-1]):
            if a != b:
                break
            n += 1
        return n if n >= PROMPT_REUSE_MIN else 0

    def _nl_token(self) -> int | None:
        """The vocabulary's newline token as ik's llama_token_nl (sampling.newline_token), or None."""
        if not hasattr(self, "_nl"):
            self._nl = newline_token(self.model.tokenizer)
        return self._nl

    def _assign(self, s: _Slot, job: Job) -> None:
        try:
            # the tokenizer is the grammar's vocabulary (each job's matcher is its own parse state)
            sampler = None if job.embedding else Sampler(
                job.params, self.model.n_vocab, self._nl_token(), getattr(self.model.tokenizer, "eog_ids", ()),
                vocab=self.model.tokenizer if getattr(job.params, "grammar", "") else None)
        except ValueError as e:     # e.g. a grammar that does not compile: only this job fails
            self.log(f"srv  error: task {job.id_task}: {e}")
            self._refuse(job)
            return
        s.job, s.last, job.id_slot = job, job, s.id
        s.stop_kind, s.stop_word = "", ""
        s.sampler = sampler
        keep = self._reusable(s, job.prompt) if job.cache_prompt else 0
        if s.truncated:         # cells after a shift's gap were computed with the dropped tokens in view
            keep = min(keep, s.shift_keep)
        s.truncated = False
        if keep:
            s.cache.seq_rm(keep)
        else:
            s.cache.clear()
        del s.cached[keep:]
        s.n_fed, s.n_reused, s.generated, s.pending = keep, keep, [], None
        s.history, s.text, s.tail, s.n_sent, s.probs = list(job.prompt), "", bytearray(), 0, []
        s.n_tok_sent = 0
        s.hidden = []
        s.ban_marks, s.ban_pieces, s.ban_probs, s.n_held, s.ban_at = [], [], [], 0, {}
        s.ban_rewinds = s.n_rewound = 0
        s.t_start = time.perf_counter()
        s.t_prompt_done = 0.0

    def _step(self) -> None:
        for s in self.slots:
            if s.job is not None and s.job.cancelled:
                self._finish(s, "cancelled")
        busy = [s for s in self.slots if s.job is not None]
        if not busy:
            return
        embd = self._embedding_turn(busy)
        busy = [s for s in busy if s.job.embedding == embd]
        # generating slots first (one token each), then prompt chunks while the batch has room
        tokens, pos, segs, wants = [], [], [], []
        budget = self.n_ubatch
        for s in sorted(busy, key=lambda s: s.pending is None):
            if s.pending is not None:
                take = [s.pending]
            else:
                take = s.job.prompt[s.n_fed:s.n_fed + max(budget, 0)]
            if not take:
                continue
            p0 = s.cache.next_pos()
            cell0 = s.cache.reserve(np.arange(p0, p0 + len(take), dtype=np.int32))
            t0 = len(tokens)
            tokens += take
            pos += range(p0, p0 + len(take))
            segs.append(Segment(s.cache, cell0, t0, len(tokens)))
            done_prompt = s.pending is not None or s.n_fed + len(take) == len(s.job.prompt)
            wants.append((s, len(tokens) - 1 if done_prompt else -1, len(take)))
            budget -= len(take)
            if budget <= 0:
                break
        if embd:    # the rows each slot's pooling needs (engine.embeddings.pooled_rows)
            kept = [sg.t0 + pooled_rows(self.pooling, len(s.job.prompt), s.n_fed, n)
                    for (s, _, n), sg in zip(wants, segs)]
            out_rows = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
        else:
            out_rows = np.array([w[1] for w in wants if w[1] >= 0], dtype=np.int64)
        ub = UBatch(np.asarray(tokens, dtype=np.int32), np.asarray(pos, dtype=np.int32), out_rows, 0, segs)
        set_threads(self.cfg.threads(batch=len(tokens) > 1))
        try:
            logits = self.model.arch.forward(ub, None, self.embd_opts if embd else self.opts)
        except BaseException:
            for sg in segs:
                sg.cache.n = sg.cell0
            raise
        now = time.perf_counter()
        li = 0
        for i, (s, row, n) in enumerate(wants):
            if s.pending is not None:
                s.cached.append(s.pending)
                s.pending = None
            else:
                s.cached += s.job.prompt[s.n_fed:s.n_fed + n]
                s.n_fed += n
            if embd:
                s.hidden.append(logits[li:li + len(kept[i])])
                li += len(kept[i])
                if s.n_fed == len(s.job.prompt):
                    self._finish(s, "stop")
                continue
            if row < 0:
                continue
            lg = logits[li]
            li += 1
            if not s.t_prompt_done:
                s.t_prompt_done = now
            self._on_logits(s, lg)

    def _on_logits(self, s: _Slot, logits: np.ndarray) -> None:
        job = s.job
        if job.n_predict == 0:                  # llama.cpp: read the prompt, generate nothing
            self._finish(s, "length")
            return
        bans = s.ban_at.get(len(s.generated)) if job.ban is not None else None
        if bans:        # banned strings: tokens banned at this position of the answer (ik adds the bias)
            logits = np.array(logits, dtype=np.float32)
            logits[list(bans)] += np.float32(job.ban.bias)
        tok = s.sampler.sample(logits, s.history)
        tk = self.model.tokenizer
        if tk.is_eog(tok):
            self._finish(s, "stop")
            return
        s.generated.append(tok)
        s.history.append(tok)
        if s.sampler.last_probs is not None:
            (s.ban_probs if job.ban is not None else s.probs).append(s.sampler.last_probs)
        # decode only the new bytes (a whole-text decode per token would be quadratic)
        piece = tk.token_to_bytes(tok, special=tok in s.job.preserved_tokens)
        s.tail += piece
        cut = self._utf8_cut(s.tail)
        s.text += bytes(s.tail[:cut]).decode("utf-8", errors="replace")
        del s.tail[:cut]
        text = s.text
        if job.ban is not None:
            if self._ban_check(s, piece):
                return          # rewound: the slot reads the token before the ban again
            text = text[:s.ban_marks[-s.n_held - 1][0]] if s.n_held < len(s.ban_marks) else ""
        # a stop string ends the job; text that might start one is held back
        for w in job.stop:
            i = text.find(w, max(0, s.n_sent - len(w)))
            if i >= 0:
                self._emit(s, text[s.n_sent:i], tok, False)
                self._finish(s, "stop", w)
                return
        hold = max((k for w in job.stop for k in range(1, len(w)) if text.endswith(w[:k])), default=0)
        upto = len(text) - hold
        self._emit(s, text[s.n_sent:upto], tok, False)
        if len(s.generated) + s.n_rewound >= job.n_predict >= 0:
            self._finish(s, "length")
            return
        if job.n_predict < 0 and len(job.prompt) + len(s.generated) >= self.model.hp.n_ctx_train > 0:
            # ik: no token limit and context shift would let an EOS-less answer run forever
            s.truncated = True
            self._finish(s, "length")
            return
        if s.cache.n + 1 >= self.n_ctx_slot and not (self.ctx_shift and self._shift(s)):
            self._finish(s, "length")
            return
        if s.sampler.grammar is not None and s.sampler.grammar.is_stopped():
            # the grammar is complete: only an end-of-generation token could follow, so stop as if it
            # had been sampled (llama.cpp runs one more step to sample it; the answer is the same)
            self._finish(s, "stop")
            return
        s.pending = tok

    def _ban_check(self, s: _Slot, piece: bytes) -> bool:
        """Banned strings (engine.banned), after the token just appended: look for a ban in the held
        tokens' text; rewind to it (True), else let the oldest held token out once the buffer is full."""
        ban = s.job.ban
        s.ban_marks.append((len(s.text), bytes(s.tail)))
        s.ban_pieces.append(bytes(piece))
        s.n_held += 1
        held = s.ban_pieces[-s.n_held:]
        at = ban.find(b"".join(held))
        if at >= 0 and ban.may_rewind(s.ban_rewinds):
            end = 0
            for i, p in enumerate(held):          # the held token the match starts in
                end += len(p)
                if at < end:
                    break
            if self._rewind(s, len(s.generated) - s.n_held + i):
                return True
        if s.n_held >= ban.n_buffer:              # ik sends the buffer's oldest token and resets the count
            out = s.n_held - (ban.n_buffer - 1)
            s.n_held -= out
            s.probs += s.ban_probs[:out]
            del s.ban_probs[:out]
            s.ban_rewinds = 0
            n_out = len(s.generated) - s.n_held
            for k in [k for k in s.ban_at if k < n_out]:
                del s.ban_at[k]
        return False

    def _rewind(self, s: _Slot, j: int) -> bool:
        """Drop the answer's tokens from index j on (ik's rewind_context): ban the first banned_n of
        them at position j, cut the cache back to before token j - 1 (or the prompt's last token),
        which is read again to sample position j anew.  False when a context shift took those cells."""
        ban, n = s.job.ban, len(s.generated)
        feed = s.generated[j - 1] if j > 0 else s.job.prompt[-1]
        keep = len(s.cached) - (n - j)            # the cache holds all but the newest token
        if keep < 0 or keep >= len(s.cached) or s.cached[keep] != feed or s.cache.n != len(s.cached):
            return False
        if ban.banned_n != 0:
            drop = s.generated[j:] if ban.banned_n < 0 else s.generated[j:j + ban.banned_n]
            s.ban_at.setdefault(j, set()).update(drop)
        k = n - j
        s.cache.seq_rm(int(s.cache.pos[keep]))
        del s.cached[keep:]
        del s.generated[j:]
        del s.history[len(s.history) - k:]
        del s.ban_pieces[j:], s.ban_marks[j:]
        del s.ban_probs[len(s.ban_probs) - min(k, len(s.ban_probs)):]
        text_len, tail = s.ban_marks[j - 1] if j > 0 else (0, b"")
        s.text, s.tail = s.text[:text_len], bytearray(tail)
        s.n_held -= k
        if s.sampler.grammar is not None:
            s.sampler.grammar.rollback(k)
        s.n_rewound += k
        s.ban_rewinds += 1
        s.pending = feed
        return True

    def _shift(self, s: _Slot) -> bool:
        """llama-server's context shift: keep the first n_keep cached tokens (the whole prompt for
        n_keep -1; one more for a BOS), drop n_discard after them (default: half the rest) and
        move the later ones down.  False when nothing can be dropped."""
        from .arch.common import context_shift
        job = s.job
        n_past = s.cache.n
        n_keep = (len(job.prompt) if job.n_keep < 0 else job.n_keep) + self._bos(job.prompt)
        n_keep = max(0, min(self.n_ctx_slot - 4, n_keep))
        n_left = n_past - n_keep
        n_discard = job.n_discard if job.n_discard > 0 else n_left // 2
        n_discard = min(n_discard, n_left)
        if n_discard <= 0:
            return False
        self.log(f"slot context shift: id_slot={s.id} id_task={job.id_task} n_keep={n_keep} n_left={n_left} "
                 f"n_discard={n_discard} n_ctx={self.n_ctx_slot} n_past={n_past}")
        context_shift(self.model.arch, s.cache, n_keep, n_discard)
        del s.cached[n_keep:n_keep + n_discard]
        s.shift_keep = n_keep if not s.truncated else min(s.shift_keep, n_keep)
        s.truncated = True
        return True

    @staticmethod
    def _utf8_cut(b: bytearray) -> int:
        """Length of the longest prefix of b that does not end inside a multi-byte character."""
        n = len(b)
        for back in range(1, min(4, n) + 1):
            c = b[n - back]
            if c & 0xC0 != 0x80:                       # a lead byte (or ASCII)
                need = 1 if c < 0x80 else 2 if c >> 5 == 6 else 3 if c >> 4 == 14 else 4
                return n if back >= need else n - back
        return n

    def _sent_tokens(self, s: _Slot, upto: int) -> list[int]:
        """The generated ids from the last sent one up to `upto` (tokens banned strings hold back,
        which a rewind may still drop, are not sent)."""
        s.n_tok_sent = min(s.n_tok_sent, upto)
        out, s.n_tok_sent = s.generated[s.n_tok_sent:upto], upto
        return out

    def _emit(self, s: _Slot, text: str, tok: int | None, done: bool) -> None:
        s.n_sent += len(text)
        if text or done:
            probs, s.probs = s.probs, []
            toks = self._sent_tokens(s, len(s.generated) - (s.n_held if s.job.ban is not None else 0))
            self._send(s, Event(text, tok, done, None, "", len(s.job.prompt), len(s.generated), probs=probs,
                                tokens=toks))

    def _send(self, s: _Slot, ev: Event) -> None:
        try:
            s.job.on_event(ev)
        except Exception as e:          # a broken client callback must not stop the engine
            self.log(f"srv  callback error: {e}")
            s.job.cancelled = True

    def _finish(self, s: _Slot, reason: str, word: str = "") -> None:
        job = s.job
        now = time.perf_counter()
        t_p = ((s.t_prompt_done or now) - s.t_start) * 1e3
        t_g = (now - s.t_prompt_done) * 1e3 if s.t_prompt_done else 0.0
        n_p, n_g = s.n_fed - s.n_reused, len(s.generated)
        for acc in (self.totals, self.bucket):
            acc["n_prompt"] += n_p
            acc["t_prompt_ms"] += t_p
            acc["n_predicted"] += n_g
            acc["t_predicted_ms"] += t_g
        if job.ban is not None and reason in ("stop", "length") and not word and s.n_held:
            # the tokens banned strings held back go out through the stop strings, as ik sends its buffer
            full = s.text + bytes(s.tail).decode("utf-8", errors="replace")
            for w in job.stop:
                i = full.find(w, max(0, s.n_sent - len(w)))
                if i >= 0:
                    self._emit(s, full[s.n_sent:i], None, False)
                    reason, word = "stop", w
                    break
        s.probs += s.ban_probs
        s.ban_probs = []
        if reason != "stop" or not word:
            text = s.text + bytes(s.tail).decode("utf-8", errors="replace")
            rest = text[s.n_sent:] if reason != "cancelled" else ""
        else:
            rest = ""
        tm = Timings(n_p, t_p, n_g, t_g)
        s.stop_kind = {"stop": "word" if word else "eos", "length": "limit"}.get(reason, "")
        s.stop_word = word
        probs, s.probs = s.probs, []
        embedding = self._pooled(s) if job.embedding and reason != "cancelled" else None
        self._send(s, Event(rest, None, True, reason, word, len(job.prompt), n_g, tm, probs=probs,
                            truncated=s.truncated or job.truncated, embedding=embedding,
                            tokens=self._sent_tokens(s, len(s.generated))))
        self.log(f"slot print_timings: id {s.id:2d} | \n"
                 f"prompt eval time = {t_p:10.2f} ms / {n_p:5d} tokens ({t_p / max(n_p, 1):8.2f} ms per token, "
                 f"{1e3 * n_p / t_p if t_p > 0 else 0.0:8.2f} tokens per second)\n"
                 f"       eval time = {t_g:10.2f} ms / {n_g:5d} tokens ({t_g / max(n_g, 1):8.2f} ms per token, "
                 f"{1e3 * n_g / t_g if t_g > 0 else 0.0:8.2f} tokens per second)\n"
                 f"      total time = {t_p + t_g:10.2f} ms / {n_p + n_g:5d} tokens")
        s.job = None
        if reason == "cancelled":      # the cells of an interrupted step may be half written
            s.cache.clear()
            s.cached.clear()
