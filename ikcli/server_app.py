"""The HTTP layer of `ikcli server`: a FastAPI app with llama.cpp's (ik_llama.cpp's) endpoints.

The app never computes: it parses and checks requests, hands token lists to a serving engine
(`engine.serving.ServingEngine`, which runs the model on its own thread) and turns the engine's
events into JSON or server-sent events.  Events cross from the engine thread into the event loop
with `loop.call_soon_threadsafe` into one asyncio.Queue per request, so the loop is never blocked.

Endpoints: POST /completion (llama.cpp's own), POST /v1/completions, POST /v1/chat/completions
(OpenAI), POST /v1/messages (Anthropic), GET /v1/models, GET /health, GET /props, GET /v1/props,
GET /version, GET /slots, GET /metrics, POST /tokenize, POST /detokenize, POST /apply-template, and
with --slot-save-path POST /slots/{id}?action=save|restore|erase (as llama-server, that route exists
only then).  GET / is the chat page (ikcli/webui: plain HTML/CSS/JS; --path DIR serves DIR instead,
--webui none turns it off); its files need no API key, as llama-server's "/".
OpenAI answers carry llama-server's system_fingerprint ("b<build>-<commit>"; here ikcli's version
and "ikcli") and usage.prompt_tokens_details.cached_tokens (prompt tokens reused from the slot).
Chat requests may offer tools (OpenAI `tools`, Anthropic `tools`): the template gets them, and the
answer is parsed in the template's tool-call syntax (engine.tool_calls) into message.tool_calls /
tool_use blocks, streamed as tool_calls deltas / input_json_delta; tool_choice is enforced by a
grammar over the format's syntax (engine.tool_grammar; lazy for "auto", apply_tool_grammar).
POST /embedding, /embeddings (llama-server's form) and /v1/embeddings (OpenAI's) answer with --embeddings
(create_app's `embeddings`): each prompt is an embedding job of the engine (ServingEngine.submit_embedding),
pooled as the engine's `pooling` says; without the flag they are llama-server's 501.
Constrained output (constraint_of, constrain): `grammar` (GBNF or llguidance Lark), `json_schema` and
OpenAI's `response_format` on /completion, /v1/completions and /v1/chat/completions become one
grammar text for the sampler (engine.grammar), checked here so a bad one is a 400.
Errors are JSON in OpenAI's shape: {"error": {"code": 400, "message": "...", "type": "..."}}.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import inspect
import json
import math
import os
import re
import secrets
import string
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

# ---------------------------------------------------------------------------------------- logging


def server_log(level: str, function: str, message: str, extra: Optional[dict] = None, out=None) -> None:
    """One log line as ik_llama.cpp's server prints them (on stdout, keys sorted as nlohmann's json):
    `INFO [                    main] HTTP server listening | hostname="127.0.0.1" port="8080" ...`"""
    items = {"tid": str(threading.get_ident()), "timestamp": int(time.time())}
    items.update(extra or {})
    line = f"{level:>4} [{function:>24}] {message} |" + "".join(
        f" {k}={json.dumps(items[k], ensure_ascii=False, separators=(',', ':'))}" for k in sorted(items))
    stream = out or sys.stdout
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):   # closed or broken stdout: logging must never take a request down
        pass


# ----------------------------------------------------------------------------------------- errors

class ApiError(Exception):
    """An error answered as {"error": {"code", "message", "type", ...}} with HTTP status `code`."""

    def __init__(self, code: int, message: str, type_: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.type, self.extra = code, message, type_, extra

    def as_json(self) -> dict:
        return {"code": self.code, "message": self.message, "type": self.type, **self.extra}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.as_json()}, status_code=self.code)


def error_response(code: int, message: str, type_: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "type": type_, **extra}}, status_code=code)


def valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename: a plain file name, no folder parts, nothing a file system
    rewrites or refuses (control characters, / \\ : * ? " < > |, look-alike slashes and dots, "..",
    a leading or trailing space, a trailing dot), at most 255 bytes."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:      # lone surrogates
        return False
    if not name or len(raw) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if (c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or c in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF)
                or 0xD800 <= c <= 0xDFFF or ch in '/\\:*?"<>|'):
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name or name == ".")


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error")


_HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                     501: "not_supported_error", 503: "unavailable_error"}


# ---------------------------------------------------------------------------- request field checks

_MISSING = object()


def _field(body: dict, name: str, default: Any = _MISSING) -> Any:
    v = body.get(name, None)
    if v is None:   # absent or JSON null: the default (OpenAI clients send null for "unset")
        return default
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body: dict, name: str, default: int, lo: Optional[int] = None) -> int:
    v = _field(body, name)
    if v is _MISSING:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer (got {json.dumps(v)[:40]})")
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo} (got {v})")
    return v


def get_shift(body: dict) -> tuple[int, int]:
    """llama-server's context-shift fields: n_keep (tokens kept at the start; -1: the whole prompt)
    and n_discard (tokens dropped per shift; 0: half of the rest)."""
    return get_int(body, "n_keep", 0, lo=-1), get_int(body, "n_discard", 0, lo=0)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = _field(body, name)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean (got {json.dumps(v)[:40]})")
    return v


def get_cache_prompt(body: dict) -> bool:
    v = body.get("cache_prompt", True)
    if v is None:
        return True
    if not isinstance(v, bool):
        raise bad_request("'cache_prompt' must be a boolean")
    return v


def get_stop(body: dict) -> list[str]:
    v = _field(body, "stop")
    if v is _MISSING:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings")
    return [s for s in v if s]


def _token_list(v: Any, n_vocab: Optional[int], what: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad_request(f"'{what}' must be a list of integer token ids")
    if n_vocab is not None:
        bad = [t for t in v if t < 0 or t >= n_vocab]
        if bad:
            raise bad_request(f"invalid token id {bad[0]} in '{what}' (the vocabulary has {n_vocab} tokens)")
    return list(v)


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")   # how one can reach json.loads's output at all


def _json_path(parts: tuple) -> str:
    """'messages[0].content' from ('messages', 0, 'content') (keys written ASCII-safe)."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            key = p if p.isidentifier() and p.isascii() else json.dumps(p)
            out += ("." if out else "") + key
    return out


def check_text(body: Any, raw_text: str = "") -> None:
    """Refuse (400) a JSON document with a lone UTF-16 surrogate (U+D800..U+DFFF) in any string or key.

    json.loads turns a `\\ud800` escape without its pair into a str no UTF-8 codec will encode, which
    would fail deep in the tokenizer or mid-stream; llama.cpp's JSON parser rejects such a body at
    parse time, and so does this server, naming the field.  raw_text: the document's text, to skip the
    walk when it has no surrogate escape at all (raw UTF-8 cannot carry a surrogate)."""
    if raw_text and not _SURROGATE_ESCAPE.search(raw_text):
        return
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:   # no recursion: json.loads accepts nesting deeper than a recursive walk would
        v, path = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m:
                where = _json_path(path) or "the request body"
                raise bad_request(f"invalid text in '{where}': lone UTF-16 surrogate at position {m.start()}")
        elif isinstance(v, dict):
            for k, x in v.items():
                m = _SURROGATE.search(k)
                if m:
                    where = f"'{_json_path(path)}'" if path else "the request body"
                    raise bad_request(f"invalid text in a key of {where}: lone UTF-16 surrogate "
                                      f"at position {m.start()}")
                if isinstance(x, (str, dict, list)):
                    stack.append((x, path + (k,)))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, (str, dict, list)):
                    stack.append((x, path + (i,)))


# llama.cpp request fields that change the output but that this server does not implement, each with
# the test for its "off" value: a request that turns one on is refused (400) rather than answered as
# if it had not asked (clients routinely send the off values, and JSON null, which stay accepted)
_UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    # ik's adaptive-p sampler (off while the target is negative) is not implemented
    "adaptive_target": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0,
    # ik's penalty_prompt (a string or token array: penalize those tokens + the generated ones instead
    # of the sampler's one-token history) is not implemented; ik ignores any other type
    "penalty_prompt": lambda v: not isinstance(v, (str, list)),
}


def check_unsupported(body: dict) -> None:
    on = [k for k, off in _UNSUPPORTED_FIELDS.items() if body.get(k) is not None and not off(body[k])]
    if on:
        raise bad_request(f"{', '.join(repr(k) for k in on)}: not supported by this server "
                          f"(leave {'it' if len(on) == 1 else 'them'} out or at the default)")


def constraint_of(body: dict) -> tuple[str, Any]:
    """The output constraint a request asks for, as llama-server reads it: ("grammar", GBNF or
    llguidance Lark text), ("json_schema", schema) or ("", None).  Fields: `grammar`, `json_schema`
    (/completion's), `response_format` (OpenAI's: {"type": "json_object"} is any JSON object, with an
    optional "schema"; {"type": "json_schema", "json_schema": {"schema", "name", "strict"}}).
    JSON null and "" are "not set"; response_format {"type": "text"} is free text.  Unlike
    llama-server, which lets one silently win, two constraints at once are a 400."""
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise bad_request("'grammar' must be a string")
    schema = body.get("json_schema")
    sources = ["json_schema"] if schema is not None else []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad_request("'response_format' must be an object")
        kind = rf.get("type")
        if kind is not None and not isinstance(kind, str):
            raise bad_request("'response_format.type' must be a string")
        if kind == "json_object":
            schema = rf.get("schema")
            schema = {} if schema is None else schema
            sources.append("response_format")
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            wrapper = {} if wrapper is None else wrapper
            if not isinstance(wrapper, dict):
                raise bad_request("'response_format.json_schema' must be an object")
            if wrapper.get("strict") is not None and not isinstance(wrapper.get("strict"), bool):
                raise bad_request("'response_format.json_schema.strict' must be a boolean")
            # mainline also reads the schema beside the type; OpenAI's place is json_schema.schema
            schema = wrapper.get("schema", rf.get("schema"))
            schema = {} if schema is None else schema
            sources.append("response_format")
        elif kind not in (None, "", "text"):
            raise bad_request(f'response_format type must be one of "text" or "json_object", but got: {kind}')
    if len(sources) > 1:
        raise bad_request("Cannot use both json_schema and response_format")
    if grammar and sources:
        raise bad_request(f"Cannot use both {sources[0]} and grammar")
    if sources:
        if not isinstance(schema, dict):
            raise bad_request('"json_schema": the schema must be a JSON object')
        return "json_schema", schema
    return ("grammar", grammar) if grammar else ("", None)


REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back: the
    tag may be completed by the next token)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplit:
    """Splits generated text, fed piece by piece, into reasoning (between <think> and </think>) and
    content, as llama-server's reasoning_format=deepseek does: the tags never come out, the
    whitespace around the reasoning and before the content that follows it is dropped, a tag cut
    across pieces is held back until it is known.  forced_open: the prompt already opened <think>,
    so the text starts inside the reasoning.  feed() returns [(kind, text)], kind "reasoning" or
    "content"; finish() flushes what is held (an unclosed reasoning stays reasoning)."""

    def __init__(self, forced_open: bool = False) -> None:
        self.state = "reasoning" if forced_open else "start"
        self.buf = ""
        self.lead = True        # still dropping the leading whitespace of the current part

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        if text:
            out.append((kind, text))

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.state, self.lead = head[len(THINK_OPEN):], "reasoning", True
                    continue
                if not final and THINK_OPEN.startswith(head):
                    return out          # only whitespace or part of the tag so far
                self.state, self.lead = "content", False   # no reasoning: the text is all content
                continue
            if self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit(out, "reasoning", self.buf[:i].rstrip())
                    self.buf, self.state, self.lead = self.buf[i + len(THINK_CLOSE):], "content", True
                    continue
                # hold a possible partial </think> and trailing whitespace (dropped if the tag follows)
                keep = len(self.buf) if final else _partial_tail(self.buf, THINK_CLOSE)
                body, tail = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                stripped = body.rstrip()
                if final:
                    stripped, tail = self.buf.rstrip(), ""
                self._emit(out, "reasoning", stripped)
                self.buf = body[len(stripped):] + tail if not final else ""
                return out
            self._emit(out, "content", self.buf)
            self.buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        return self.feed("", final=True)


def split_reasoning(text: str, forced_open: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole answer (the non-streamed form of ReasoningSplit)."""
    sp = ReasoningSplit(forced_open)
    parts = sp.feed(text) + sp.finish()
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))


@dataclasses.dataclass
class ToolRequest:
    """A chat request's tools as the server uses them: the normalized tools, tool_choice's mode
    ("auto", "required", "function") and function name, parallel_tool_calls, and the tool-call
    format of the chat template (engine.tool_calls.FORMATS)."""
    tools: list
    mode: str
    function: Optional[str]
    parallel: bool
    format: str

    @property
    def max_calls(self) -> Optional[int]:
        return None if self.parallel else 1


def _rand_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))


def _takes_keyword(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def oai_tool_calls(calls: list) -> list[dict]:
    """OpenAI's message.tool_calls of parsed calls (engine.tool_calls.ToolCall with their ids)."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def anthropic_tool_input(arguments: str) -> dict:
    """A call's arguments as an Anthropic tool_use `input` (an object; {} when they are no JSON object,
    as llama-server does)."""
    try:
        v = json.loads(arguments)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


# -------------------------------------------------------------------- engine events -> the event loop

_SEED_SPAN = 2 ** 64   # sampling seeds are 0 .. 2**64-1 (-1: random); a child's seed + j wraps in that range


class Generation:
    """The engine jobs of one request.  The engine calls on_event on its own thread; the events are
    put into this request's asyncio.Queue on the loop's thread (call_soon_threadsafe)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs: list = []
        self.prompts: list[list[int]] = []
        self.finished: set[int] = set()
        self.cancelled = False

    def _callback(self, index: int) -> Callable:
        loop, queue = self.loop, self.queue

        def on_event(ev) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (index, ev))
            except RuntimeError:   # the loop is closed (server shutting down): nobody is listening
                pass
        return on_event

    def submit(self, engine, prompts: list[list[int]], params, n_predict: int, stop: list[str],
               cache_prompt: bool = True, n_cmpl: int = 1, preserved: Optional[list[int]] = None,
               shift: tuple[int, int] = (0, 0), id_slot: int = -1, ban: Any = None) -> None:
        """One job per prompt and choice: n_cmpl jobs of each prompt, job p * n_cmpl + j the choice j of
        prompt p (llama-server's order of results and their `index`).  As llama-server's child tasks,
        choice j > 0 samples with seed + j when the request fixes a seed, so the choices differ yet
        the answer is reproducible; a random seed (-1) stays random, one draw per choice.
        preserved: token ids to come out as text although they are control tokens (tool-call markers,
        llama.cpp's preserved_tokens); handed to an engine whose submit() takes `preserved_tokens`.
        shift: the request's (n_keep, n_discard) for a context shift.
        id_slot: llama-server's id_slot for choice 0 of each prompt (mainline's child tasks take other
        slots); ban: an engine.banned.BanSpec (banned strings) for every job."""
        kw = {} if cache_prompt else {"cache_prompt": False}   # llama.cpp's field: reuse the slot's prefix
        for name, value, off in (("id_slot", id_slot, -1), ("ban", ban, None)):
            if value != off and not _takes_keyword(engine.submit, name):    # an engine without them (tests' fakes)
                raise bad_request(f"{'id_slot' if name == 'id_slot' else 'banned_strings'}: not supported by "
                                  f"this engine")
        if ban is not None:
            kw["ban"] = ban
        if preserved and _takes_keyword(engine.submit, "preserved_tokens"):
            kw["preserved_tokens"] = list(preserved)
        if shift != (0, 0) and _takes_keyword(engine.submit, "n_keep"):
            kw["n_keep"], kw["n_discard"] = shift
        for i, prompt in enumerate(p for p in prompts for _ in range(n_cmpl)):
            if not prompt:
                self.cancel()
                raise bad_request("empty prompt: the prompt tokenizes to no tokens")
            job_params = copy.deepcopy(params)
            j = i % n_cmpl
            seed = getattr(job_params, "seed", -1)
            if j and _is_int(seed) and seed != -1:
                job_params.seed = (seed + j) % _SEED_SPAN
            if id_slot != -1:
                kw["id_slot"] = id_slot if j == 0 else -1
            try:
                job = engine.submit(prompt, job_params, n_predict, list(stop), self._callback(i), **kw)
            except (ValueError, RuntimeError) as e:
                self.cancel()
                raise _refusal(engine, prompt, e, len(prompt) >= int(getattr(engine, "n_ctx_slot", 0) or 0)) from None
            self.jobs.append(job)
            self.prompts.append(prompt)

    def submit_embeddings(self, engine, prompts: list[list[int]], embd_normalize: int) -> None:
        """One embedding job per prompt (engine.submit_embedding), job i the prompt i; a prompt may
        fill its slot (no token is generated after it)."""
        for i, prompt in enumerate(prompts):
            try:
                job = engine.submit_embedding(prompt, self._callback(i), embd_normalize)
            except (ValueError, RuntimeError) as e:
                self.cancel()
                raise _refusal(engine, prompt, e, len(prompt) > int(getattr(engine, "n_ctx_slot", 0) or 0)) from None
            self.jobs.append(job)
            self.prompts.append(prompt)

    def cancel(self) -> None:
        """Cancel the jobs that have not finished (frees their slots; safe to call more than once)."""
        for i, job in enumerate(self.jobs):
            if i not in self.finished:
                self.cancelled = True
                try:
                    job.cancel()
                except Exception:  # noqa: BLE001 - cancelling must never raise into a request
                    pass

    def engine_failed(self, ev) -> bool:
        """A job ended as "cancelled" that this request did not cancel: the engine failed or stopped."""
        return ev.done and ev.finish_reason == "cancelled" and not self.cancelled

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        while len(self.finished) < len(self.jobs):
            index, ev = await self.queue.get()
            if ev.done:
                self.finished.add(index)
            yield index, ev


def _refusal(engine, prompt: list[int], e: Exception, too_long: bool) -> ApiError:
    """The answer to a job the engine would not take: a prompt that does not fit a slot (too_long)
    is llama-server's exceed_context_size_error, another ValueError a 400, a stopped engine
    (RuntimeError) a 503."""
    if isinstance(e, RuntimeError):
        return ApiError(503, f"the server cannot take requests now: {e}", "unavailable_error")
    n_ctx = int(getattr(engine, "n_ctx_slot", 0) or 0)
    if n_ctx and too_long:
        return ApiError(400, f"the request exceeds the available context size: {e}",
                        "exceed_context_size_error", n_prompt_tokens=len(prompt), n_ctx=n_ctx)
    return bad_request(str(e))


async def _cancel_on_disconnect(request: Request, gen: Generation) -> None:
    """Wait for the client to go away (http.disconnect) and cancel the request's jobs then."""
    try:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                gen.cancel()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a broken receive channel means the client is gone
        gen.cancel()


class EventStream(Response):
    """text/event-stream from an async iterator of `data: ...` strings.  A task listens for the
    client's disconnect; when it comes, or the stream ends in any way, `on_close` runs at once."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self.chunks, self.on_close = chunks, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        stop = asyncio.Event()

        async def stream() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except (asyncio.CancelledError, OSError):
                raise
            except Exception as e:  # noqa: BLE001 - a bug: log it; the client sees the stream end
                server_log("ERR", "stream_response", "exception while streaming",
                           {"error": f"{type(e).__name__}: {e}"}, out=sys.stderr)
                raise
            finally:
                stop.set()

        async def listen() -> None:
            try:
                while True:
                    message = await receive()
                    if message.get("type") == "http.disconnect":
                        return
            finally:
                stop.set()

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(listen())]
        try:
            await stop.wait()
        finally:
            self.on_close()
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass
                except Exception:  # noqa: BLE001 - the client went away while we wrote
                    pass
            try:
                await self.chunks.aclose()   # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                pass


def engine_failed_error() -> ApiError:
    return ApiError(500, "the engine stopped this generation (see the server log)", "server_error")


def sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# ------------------------------------------------------------------------------- response pieces

def _div(a: float, b: float) -> Optional[float]:
    # C++ gives inf/nan for x/0, which nlohmann's json writes as null
    return a / b if b else None


def timings_json(t, n_ctx: int, n_past: int) -> dict:
    if t is None:
        return {"prompt_n": 0, "prompt_ms": 0.0, "prompt_per_token_ms": None, "prompt_per_second": None,
                "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": None, "predicted_per_second": None,
                "n_ctx": n_ctx, "n_past": n_past}
    return {
        "prompt_n": t.prompt_n, "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": _div(t.prompt_ms, t.prompt_n),
        "prompt_per_second": _div(1e3 * t.prompt_n, t.prompt_ms),
        "predicted_n": t.predicted_n, "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": _div(t.predicted_ms, t.predicted_n),
        "predicted_per_second": _div(1e3 * t.predicted_n, t.predicted_ms),
        "n_ctx": n_ctx, "n_past": n_past,
    }


def stop_type(ev) -> str:
    if ev.finish_reason == "length":
        return "limit"
    if ev.finish_reason == "stop":
        return "word" if ev.stopping_word else "eos"
    return "none"


def oai_finish_reason(ev, tool_calls: bool = False) -> str:
    """llama-server's finish_reason: "length" at the token limit, else "tool_calls" when the answer
    has tool calls, else "stop"."""
    if ev.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage_json(n_prompt: int, n_gen: int, n_cached: int = 0) -> dict:
    """OpenAI's usage object as llama-server writes it; n_cached: the prompt tokens taken from the
    slot's cache (cache_prompt reuse) rather than read again."""
    return {"completion_tokens": n_gen, "prompt_tokens": n_prompt, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def _system_fingerprint() -> str:
    """llama-server's system_fingerprint is "b<build number>-<commit>"; ikcli has no build number or
    commit baked in, so its package version stands for the build and "ikcli" for the commit."""
    try:
        from ikcli import __version__
    except ImportError:     # pragma: no cover - a partial install
        __version__ = "0"
    return f"b{__version__}-ikcli"


SYSTEM_FINGERPRINT = _system_fingerprint()


# ------------------------------------------------------------------------------------------- web UI

# the chat page served at "/" (plain HTML/CSS/JS shipped in the package; --path DIR serves DIR instead)
WEBUI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "webui")


def static_path(root: str, url_path: str) -> Optional[str]:
    """The file under `root` that a GET of `url_path` (already percent-decoded) names, or None:
    "/" and paths ending in "/" name the folder's index.html; nothing outside `root` (.., links)."""
    rel = url_path.lstrip("/")
    if rel == "" or rel.endswith("/"):
        rel += "index.html"
    try:
        base = os.path.realpath(root)
        full = os.path.realpath(os.path.join(base, rel))
        if os.path.commonpath([base, full]) != base or not os.path.isfile(full):
            return None
    except (ValueError, OSError):     # a NUL byte, a name too long ...
        return None
    return full


class _StaticFiles:
    """Pure ASGI middleware: a GET (or HEAD) that no API route answers is served from the web UI's
    folder when it names a file there (as llama-server's mount point at "/"); anything else goes on
    to the app (unknown routes stay a 404, a wrong method on an API route a 405)."""

    def __init__(self, app, static_file: Callable[[dict], Optional[str]]) -> None:
        self.app, self.static_file = app, static_file

    async def __call__(self, scope, receive, send) -> None:
        full = self.static_file(scope) if scope["type"] == "http" else None
        if full is None:
            await self.app(scope, receive, send)
            return
        from starlette.responses import FileResponse
        await FileResponse(full, headers={"cache-control": "no-cache"})(scope, receive, send)


# ------------------------------------------------------------------------------------------- app

class _AccessLogAndAuth:
    """Pure ASGI middleware (streams pass straight through): the API key check and ik_llama.cpp's
    per-request log line (`request | method=... path=... status=...`)."""

    PUBLIC = {"/health", "/v1/health", "/models", "/v1/models"}

    def __init__(self, app, api_key, log_requests: bool, verbose: bool = False,
                 static_file: Optional[Callable[[dict], Optional[str]]] = None) -> None:
        # api_key: one key or a list of keys (any of them is accepted), None: no check
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.app, self.api_key, self.log_requests, self.verbose = app, keys, log_requests, verbose
        # the web UI's files need no key (ik: "/" is public; a browser sends no key for <script src>)
        self.static_file = static_file

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        origin = dict(scope.get("headers", [])).get(b"origin", b"")
        if scope.get("method") == "OPTIONS":     # llama-server's CORS preflight: no key needed, a blank 200
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
                (b"access-control-allow-methods", b"GET, POST"), (b"access-control-allow-headers", b"*"),
                (b"content-type", b"text/html"), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        status: dict[str, Any] = {"code": 500}   # unless a response starts: an exception went past the handlers
        bodies = {"request": bytearray(), "response": bytearray(), "stream": False}

        async def receive_wrapper():
            message = await receive()
            if self.verbose and message.get("type") == "http.request":
                bodies["request"] += message.get("body", b"")
            return message

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":     # every answer echoes the Origin, as llama-server
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"access-control-allow-origin", origin)]}
                status["code"], status["started"] = message["status"], True
                if self.verbose:    # ik's verbose line carries no body for streamed (SSE) answers
                    ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                    bodies["stream"] = ctype.startswith(b"text/event-stream")
            elif self.verbose and message["type"] == "http.response.body" and not bodies["stream"]:
                bodies["response"] += message.get("body", b"")
            await send(message)

        try:
            if self.api_key and scope.get("method") != "OPTIONS" and path not in self.PUBLIC \
                    and not (self.static_file is not None and self.static_file(scope)):
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
                auth = headers.get("authorization", "")
                given = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
                ok = False
                for k in self.api_key:          # every key compared: no early exit to time
                    ok |= secrets.compare_digest(given.encode(), k.encode())
                if not ok:
                    await error_response(401, "Invalid API Key", "authentication_error")(scope, receive, send_wrapper)
                    return
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except ClientDisconnect:
                # the client went away while the request body was read: nobody to answer, nothing broke.
                # One log line (below), no traceback; the status is what cpp-httplib logs for a body it
                # cannot read (400)
                if not status.get("started"):
                    status["code"], status["error"] = 400, "client disconnected while sending the request body"
        finally:
            if self.log_requests and path not in ("/v1/health", "/v1/completions"):   # as ik_llama.cpp skips them
                client = scope.get("client") or ("", 0)
                query = scope.get("query_string", b"").decode("latin-1")
                params = dict(p.split("=", 1) if "=" in p else (p, "") for p in query.split("&") if p)
                extra = {"remote_addr": client[0], "remote_port": client[1], "status": status["code"],
                         "method": scope.get("method", ""), "path": path, "params": params}
                if "error" in status:
                    extra["error"] = status["error"]
                server_log("INFO", "log_server_request", "request", extra)
                if self.verbose:
                    server_log("VERB", "log_server_request", "request",
                               {"request": bodies["request"].decode("utf-8", "replace"),
                                "response": bodies["response"].decode("utf-8", "replace")})


def create_app(engine, model=None, *, model_path: str = "", alias: Optional[str] = None,
               params_from_request: Optional[Callable[[dict], Any]] = None,
               render_chat: Optional[Callable] = None, chat_template: Optional[str] = None,
               api_key: Optional[str | list[str]] = None, default_n_predict: int = -1,
               default_sampling: Optional[dict] = None, log_requests: bool = True, verbose: bool = False,
               metrics: bool = False, reasoning_format: str = "deepseek", slots_endpoint: bool = True,
               slot_save_path: Optional[str] = None, webui_path: Optional[str] = WEBUI_DIR,
               embeddings: bool = False, banned_strings: Optional[list[str]] = None,
               banned_n: int = 1) -> FastAPI:
    """The FastAPI app serving `engine` (a started ServingEngine or anything with its interface).

    model: the loaded model (tokenizer, GGUF metadata); default `engine.model`.
    params_from_request / render_chat: default engine.sampling.SamplingParams.from_request and
    engine.chat_template.render_chat (injectable so the HTTP layer can be tested on its own).
    chat_template: a Jinja template that replaces the GGUF's tokenizer.chat_template.
    default_n_predict: -n of the command line (also a cap on what a request may ask for, when > 0).
    default_sampling: the command line's sampling values (--temp, --top-k, -s ...), used where a request
    gives none, as llama-server does.
    verbose: also log each request's body and response body (ik's `VERB ... request` lines).
    metrics: serve /metrics (--metrics).
    slots_endpoint: serve GET /slots (false: --no-slots, answered 501).
    slot_save_path: --slot-save-path, the folder of slot save files; POST /slots/{id} exists only with it.
    webui_path: the folder served at "/" (GET / is its index.html; no API key needed): default the
    chat page in ikcli/webui, --path DIR another, None (--webui none) no page.
    reasoning_format: --reasoning-format, the chat answers' default split of <think> text into
    message.reasoning_content ("none", "auto", "deepseek", "deepseek-legacy"; ik's default deepseek).
    embeddings: --embeddings, serve POST /embedding(s) and /v1/embeddings (else they answer 501), pooled
    as the engine's `pooling` says.
    banned_strings / banned_n: --banned-string-file's strings (banned in requests that give no
    banned_strings of their own) and --banned-n (engine.banned).  A "grammar" in default_sampling
    (--grammar, --grammar-file, -j) constrains requests that give no constraint of their own.
    """
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"Unknown reasoning format: {reasoning_format}")
    default_sampling = dict(default_sampling or {})
    if model is None:
        model = getattr(engine, "model", None)
    if params_from_request is None:
        from engine.sampling import SamplingParams
        params_from_request = SamplingParams.from_request
    if render_chat is None:
        from engine.chat_template import render_chat as _render
        render_chat = _render
    from engine import tool_calls as tool_calls_mod     # parsers only (no model code)
    alias = alias or (os.path.basename(model_path) if model_path else "unknown")
    tok = getattr(model, "tokenizer", None)
    meta = getattr(getattr(model, "file", None), "meta", None) or {}
    template = chat_template if chat_template is not None else meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        template = None
    n_vocab = getattr(tok, "n_vocab", None)
    bos_id = getattr(tok, "bos_id", None)
    eos_id = getattr(tok, "eos_id", None)
    add_bos = bool(getattr(tok, "add_bos", False))

    def piece(tid: Optional[int]) -> str:
        if tid is None or tok is None:
            return ""
        try:
            return tok.token_to_piece(tid, True)
        except Exception:  # noqa: BLE001
            return ""

    bos_token, eos_token = piece(bos_id), piece(eos_id)
    try:
        chat_format = render_chat([{"role": "user", "content": "hi"}], template, bos_token, eos_token, True)[1]
    except Exception:  # noqa: BLE001 - a broken template shows up on the first chat request
        chat_format = "unknown"
    n_ctx_slot = int(getattr(engine, "n_ctx_slot", 0) or 0)
    n_parallel = int(getattr(engine, "n_parallel", 1) or 1)

    app = FastAPI(title="ikcli server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    def static_file(scope) -> Optional[str]:
        """The web UI file a request names: GET/HEAD only, and only where no API route matches."""
        if webui_path is None or scope.get("method") not in ("GET", "HEAD"):
            return None
        full = static_path(webui_path, scope.get("path", ""))
        if full is None or any(r.matches(scope)[0] != Match.NONE for r in app.router.routes):
            return None
        return full

    app.add_middleware(_StaticFiles, static_file=static_file)    # inside the key check and the log
    app.add_middleware(_AccessLogAndAuth, api_key=api_key, log_requests=log_requests, verbose=verbose,
                       static_file=static_file)
    # browsers' web UIs on other origins may call the API, as llama.cpp's server allows (outermost:
    # CORS preflights are answered before the API key check)

    # --------------------------------------------------------------------------- error handlers
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(404, "File Not Found", "not_found_error")
        if exc.status_code == 405:
            return error_response(405, f"Method {request.method} is not allowed for {request.url.path}",
                                  "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        server_log("ERR", "exception_handler", "unhandled exception", {"error": f"{type(exc).__name__}: {exc}"},
                   out=sys.stderr)
        return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")

    # --------------------------------------------------------------------------------- helpers
    async def read_json(request: Request) -> dict:
        raw = await request.body()
        if not raw.strip():
            raise bad_request("the request body is empty: expected a JSON object")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise bad_request("the request body is not valid UTF-8 JSON") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise bad_request(f"invalid JSON in the request body: {e.msg} at line {e.lineno} column {e.colno}") from None
        except RecursionError:
            raise bad_request("invalid JSON in the request body: nested too deeply") from None
        except ValueError:   # an integer of more digits than int() converts (sys.get_int_max_str_digits)
            raise bad_request("invalid JSON in the request body: a number has too many digits") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        check_text(body, text)
        return body

    def constrain(data: dict) -> None:
        """Replace the request's grammar / json_schema / response_format by the one grammar text the
        sampler runs (a JSON schema becomes llguidance's "%llguidance {}\nstart: %json ..." text, as
        llama-server with llguidance writes it; generation_settings shows it), checked against the
        model's vocabulary: a grammar that does not compile is a 400 here, not a failed job."""
        kind, value = constraint_of(data)
        for k in ("grammar", "json_schema", "response_format"):
            data.pop(k, None)
        if not kind:
            return
        if data.get("tools") and data.get("tool_choice") != "none":
            # llama-server's words (it refuses `grammar`; a schema beside tool calls is refused too:
            # the answer could not hold the template's tool-call syntax)
            raise bad_request("Cannot use custom grammar constraints with tools.")
        from engine import grammar as eg
        try:
            text = eg.schema_grammar(value) if kind == "json_schema" else value
            eg.check_grammar(text, tok, getattr(model, "n_vocab", None) or n_vocab)
        except eg.GrammarUnavailable as e:
            raise bad_request(str(e)) from None
        except eg.GrammarError as e:
            raise bad_request(f'"json_schema": {e}' if kind == "json_schema" else f"Failed to parse grammar: {e}") from None
        data["grammar"] = text

    def sampling_params(body: dict, probs: str = "n_probs"):
        """probs: how the endpoint asks for token probabilities, as llama-server reads them:
        "n_probs" (/completion), "logprobs" (/v1/completions: an int), "chat" (logprobs: true with
        top_logprobs, default 20)."""
        data = {k: v for k, v in body.items() if v is not None}
        if probs == "logprobs":
            n = data.pop("logprobs", 0)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise bad_request("'logprobs' must be a non-negative integer")
            data.pop("n_probs", None)
            data["n_probs"] = n
        elif probs == "chat":
            want, top = data.pop("logprobs", False), data.pop("top_logprobs", None)
            if not isinstance(want, bool):
                raise bad_request("'logprobs' must be a boolean")
            if top is not None and not want:
                raise bad_request("top_logprobs requires logprobs to be set to true")
            if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
                raise bad_request("'top_logprobs' must be an integer between 0 and 20")
            data.pop("n_probs", None)
            if want:
                data["n_probs"] = 20 if top is None else top
        elif data.get("logprobs") not in (None, False, 0) or data.get("top_logprobs") not in (None, 0):
            raise bad_request("'logprobs' / 'top_logprobs' are OpenAI fields: use 'n_probs' here")
        if "logit_bias" in data:
            data["logit_bias"] = logit_bias_pairs(data["logit_bias"])
        check_unsupported(data)
        constrain(data)
        lazy_triggers(data)
        if data.get("dry_sequence_breakers", None) == []:
            raise bad_request("Error: dry_sequence_breakers must be a non-empty array of strings")
        base = data.get("dry_base")
        if isinstance(base, (int, float)) and not isinstance(base, bool) and base < 1.0:
            data.pop("dry_base")       # as llama-server: a base below 1 means the server's default
        data = {**default_sampling, **data}
        try:
            params = params_from_request(data)
            if tok is not None and getattr(params, "dry_multiplier", 0):
                params.vocab = tok     # DRY maps its sequence breakers on the model's vocabulary
            return params
        except ValueError as e:
            raise bad_request(str(e)) from None
        except TypeError as e:
            raise bad_request(f"invalid sampling parameters: {e}") from None

    def request_preserved(body: dict) -> list[int]:
        """llama-server's `preserved_tokens`: strings whose token (each one token, special ones
        parsed; others are skipped, as llama-server does) comes out as text."""
        v = _field(body, "preserved_tokens", None)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise bad_request("'preserved_tokens' must be an array of strings")
        out = []
        for text in v:
            ids = engine.tokenize(text, False)
            if len(ids) == 1:
                out.append(int(ids[0]))
        return out

    def lazy_triggers(data: dict) -> None:
        """llama-server's `grammar_lazy` and `grammar_triggers` ([{"type": 1 word | 2 pattern | 3
        full pattern | 0 token, "value": ..., "token": id}]), checked: a word that is one token
        becomes a token trigger and must be one of `preserved_tokens`, as llama-server requires."""
        from engine import grammar as eg
        trig = data.get("grammar_triggers")
        if trig is not None:
            try:
                trig = eg.normalize_triggers(trig)
            except eg.GrammarError as e:
                raise bad_request(str(e)) from None
            preserved = set(request_preserved(data))
            out = []
            for t in trig:
                if t["type"] == eg.TRIGGER_WORD:
                    ids = engine.tokenize(t["value"], False)
                    if len(ids) == 1:
                        if int(ids[0]) not in preserved:
                            raise bad_request("Grammar trigger word should be marked as preserved token: " + t["value"])
                        t = {"type": eg.TRIGGER_TOKEN, "value": t["value"], "token": int(ids[0])}
                elif t["type"] == eg.TRIGGER_TOKEN and n_vocab is not None and t["token"] >= n_vocab:
                    raise bad_request(f"grammar trigger token {t['token']} is out of range [0, {n_vocab})")
                out.append(t)
            data["grammar_triggers"] = out
        if data.get("grammar_lazy") is True and not data.get("grammar_triggers"):
            raise bad_request("Error: no triggers set for lazy grammar!")

    def request_ban(body: dict) -> Any:
        """The request's banned strings (engine.banned.BanSpec; None: none), the server's
        --banned-string-file strings where it gives no banned_strings."""
        from engine.banned import spec_of_request
        try:
            return spec_of_request(body, banned_strings or (), banned_n)
        except ValueError as e:
            raise bad_request(str(e)) from None

    def request_id_slot(body: dict) -> int:
        """llama-server's id_slot: -1 (any slot) or a slot's id.  An id no slot has is a 400 here
        (ik and mainline defer such a task for ever: the request never returns)."""
        v = get_int(body, "id_slot", -1)
        if not -1 <= v < n_parallel:
            raise bad_request("Invalid slot ID")
        return v

    def apply_tool_grammar(params, treq: Optional[ToolRequest], prompt_text: str) -> None:
        """tool_choice as llama-server enforces it: the grammar of the template's tool-call format
        (engine.tool_grammar) in the request's sampler params; lazy for "auto" (free text until the
        format's trigger).  Needs the model's vocabulary and llguidance; without llguidance
        "required" / a named function are a 400 and "auto" stays free."""
        if treq is None or tok is None or not hasattr(params, "grammar"):
            return
        from engine import grammar as eg
        from engine.tool_grammar import tool_grammar
        if not eg.available():
            if treq.mode != "auto":
                raise bad_request(f"tool_choice '{treq.mode if treq.mode == 'required' else treq.function}' "
                                  f"needs a grammar: {eg.GrammarUnavailable.__doc__}")
            return
        width = getattr(model, "n_vocab", None) or n_vocab
        vocab = eg.TokenVocab.of(tok, width)
        tail = prompt_text.rstrip()
        think = ("forced" if tail.endswith(THINK_OPEN) else "" if tail.endswith(THINK_CLOSE)
                 else "optional" if template and THINK_OPEN in template else "")
        tg = tool_grammar(treq.format, treq.tools, treq.mode, treq.function, treq.parallel,
                          special_id=vocab.special_id, think=think)
        if tg is None:
            return
        try:
            eg.check_grammar(tg.grammar, tok, width)
        except eg.GrammarError as e:
            raise bad_request(f'"tools": the tool-call grammar cannot be built: {e}') from None
        params.grammar, params.grammar_lazy, params.grammar_triggers = tg.grammar, tg.lazy, tuple(tg.triggers)

    def n_predict_of(body: dict) -> int:
        """The token limit of a request: n_predict, else max_tokens, else max_completion_tokens (llama.cpp's
        order, the same on every endpoint), capped by the server's -n."""
        n = default_n_predict
        for name in ("n_predict", "max_tokens", "max_completion_tokens"):
            if _field(body, name) is not _MISSING:
                n = get_int(body, name, -1, lo=-1)
                break
        if default_n_predict > 0 and (n < 0 or n > default_n_predict):
            n = default_n_predict   # the server's -n caps what a request asks for, as in llama.cpp
        return n

    def request_basics(body: dict) -> tuple[bool, list[str], int]:
        """(stream, stop strings, token limit) of a generation request, read the same way on every
        endpoint."""
        return get_bool(body, "stream", False), get_stop(body), n_predict_of(body)

    def n_cmpl_of(body: dict) -> int:
        """How many completions of each prompt a request asks for: llama-server's n_cmpl, else
        OpenAI's `n` (its order, on every completion endpoint), from 1 to the number of slots (the
        choices of one prompt run side by side, one a slot)."""
        name = "n_cmpl" if _field(body, "n_cmpl") is not _MISSING else "n"
        n = get_int(body, name, 1)
        if n < 1:
            raise bad_request(f"'{name}' must be >= 1 (got {n})")
        if n > n_parallel:
            raise bad_request(f"'{name}' ({n}) cannot be greater than the number of slots ({n_parallel}), "
                              f"please increase -np")
        return n

    async def tokenize(text: str, add_special: bool) -> list[int]:
        return await asyncio.to_thread(engine.tokenize, text, add_special)

    async def tokenize_prompt(p: Any) -> list[int]:
        """A prompt: a string, a list of token ids, or a list mixing strings and ids (llama.cpp's
        tokenize_mixed: only the first string piece gets the BOS)."""
        if isinstance(p, str):
            return await tokenize(p, True)
        if isinstance(p, list) and all(_is_int(t) or isinstance(t, str) for t in p):
            out: list[int] = []
            for i, part in enumerate(p):
                if isinstance(part, str):
                    out += await tokenize(part, i == 0)
                else:
                    out += _token_list([part], n_vocab, "prompt")
            return out
        raise bad_request("'prompt' must be a string, a list of token ids, or a list of those")

    def split_prompts(p: Any) -> list[Any]:
        """One prompt or several (llama.cpp's rules): a string, or a list holding a token id, is one
        prompt; a list of strings and/or lists is several."""
        if p is _MISSING:
            raise bad_request("'prompt' is required")
        if isinstance(p, str):
            return [p]
        if isinstance(p, list):
            if not p:
                raise bad_request("'prompt' is empty")
            if any(_is_int(x) for x in p):
                return [p]
            if all(isinstance(x, (str, list)) for x in p):
                return list(p)
        raise bad_request("'prompt' must be a string, a list of token ids, or a list of those")

    async def prompts_of(body: dict) -> tuple[list[Any], list[list[int]]]:
        raw = split_prompts(_field(body, "prompt"))
        return raw, [await tokenize_prompt(p) for p in raw]

    builtin_template = getattr(render_chat, "builtin_name", None)   # --chat-template NAME (no tool calls)

    def tool_request(body: dict) -> Optional[ToolRequest]:
        """The request's tools, tool_choice and parallel_tool_calls (None: no tools, or tool_choice
        "none": the template gets no tools and the answer is not parsed for calls).  As llama-server,
        tools need a Jinja template: with a built-in --chat-template NAME format they are refused.
        "required", a named function and "auto" are enforced by a grammar over the format's syntax
        (apply_tool_grammar); parallel_tool_calls false allows one call (and keeps the first)."""
        try:
            tools = tool_calls_mod.normalize_tools(_field(body, "tools", None))
            mode, function = tool_calls_mod.parse_tool_choice(_field(body, "tool_choice", None), tools)
        except ValueError as e:
            raise bad_request(str(e)) from None
        parallel = get_bool(body, "parallel_tool_calls", True)
        if not tools:
            if mode in ("required", "function"):
                raise bad_request(f"'tool_choice' {json.dumps(body.get('tool_choice'))[:60]} needs 'tools'")
            return None
        if builtin_template:
            raise bad_request(f"'tools' need a Jinja chat template: the built-in '{builtin_template}' format "
                              f"(--chat-template) has no tool calls; use the GGUF's template or --jinja")
        if mode == "none":
            return None
        kind, _constraint = constraint_of(body)
        if kind == "grammar":
            raise bad_request("Cannot use custom grammar constraints with tools.")
        if kind:    # the answer would be held to the schema: no call could come out
            raise bad_request("'tools' and a JSON schema constraint (json_schema / response_format) cannot be "
                              "used together by this server")
        fmt = tool_calls_mod.detect_format(template) or "generic"
        return ToolRequest(tools, mode, function, parallel, fmt)

    async def render_prompt(body: dict) -> str:
        """The chat request's messages through the template (what /apply-template answers)."""
        messages = _field(body, "messages")
        if messages is _MISSING:
            raise bad_request("'messages' is required")
        treq = tool_request(body)
        if isinstance(messages, list) and len(messages) >= 2 and all(
                isinstance(m, dict) and m.get("role") == "assistant" for m in messages[-2:]):
            raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
        # llama-server's template variables: add_generation_prompt (default true) and the request's
        # chat_template_kwargs (enable_thinking, reasoning_effort, ...) as extra variables
        agp = _field(body, "add_generation_prompt")
        agp = True if agp is _MISSING or agp is None else agp
        if not isinstance(agp, bool):
            raise bad_request("'add_generation_prompt' must be a boolean")
        kwargs = _field(body, "chat_template_kwargs")
        kwargs = {} if kwargs is _MISSING or kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise bad_request("'chat_template_kwargs' must be an object")
        tool_kw = {"tools": treq.tools} if treq is not None else {}
        try:
            prompt, _kind = await asyncio.to_thread(render_chat, messages, template, bos_token, eos_token, agp,
                                                    extra_vars=kwargs or None, **tool_kw)
        except ValueError as e:
            raise bad_request(f"cannot apply the chat template: {e}") from None
        return prompt

    async def chat_prompt(body: dict, prompt: Optional[str] = None) -> list[int]:
        if prompt is None:
            prompt = await render_prompt(body)
        tokens = await tokenize(prompt, True)
        if add_bos and bos_id is not None and len(tokens) >= 2 and tokens[0] == tokens[1] == bos_id:
            tokens = tokens[1:]   # the template wrote the BOS and the tokenizer added one too
        return tokens

    def generation_settings(params, n_predict: int, stop: list[str], stream: bool) -> dict:
        if dataclasses.is_dataclass(params):
            sp = dataclasses.asdict(params)
        else:
            sp = {k: v for k, v in vars(params).items() if not k.startswith("_")} if hasattr(params, "__dict__") else {}
        if "logit_bias" in sp:     # as llama-server reports it; a ban (-inf) is false, JSON has no infinity
            sp["logit_bias"] = [{"token": t, "bias": b if math.isfinite(b) else False} for t, b in sp["logit_bias"]]
        return {"n_ctx": n_ctx_slot, "n_predict": default_n_predict, "model": alias, **sp, "stop": stop,
                "max_tokens": n_predict, "stream": stream}

    async def collect(request: Request, gen: Generation) -> dict[int, dict]:
        """Run the jobs to the end (non-streaming); a client that goes away cancels them."""
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, gen))
        results: dict[int, dict] = {i: {"text": [], "final": None, "probs": [], "tokens": []}
                                    for i in range(len(gen.jobs))}
        try:
            async for i, ev in gen.events():
                results[i]["probs"] += getattr(ev, "probs", None) or []
                results[i]["tokens"] += getattr(ev, "tokens", None) or []
                if ev.text:
                    results[i]["text"].append(ev.text)
                if ev.done:
                    results[i]["final"] = ev
        finally:
            watcher.cancel()
            gen.cancel()
        if any(r["final"] is None or gen.engine_failed(r["final"]) for r in results.values()):
            raise engine_failed_error()
        return results

    def stream_response(gen: Generation, chunks: AsyncIterator[str]) -> EventStream:
        return EventStream(chunks, gen.cancel)

    def token_text(t: int) -> str:
        """llama-server's tokens_to_output_formatted_string: the piece, or 'byte: \\xhh' for a lone
        byte of a multi-byte character."""
        b = tok.token_to_bytes(t, True) if tok is not None else b""
        if len(b) == 1 and b[0] & 0x80:
            return f"byte: \\x{b[0]:x}"
        return b.decode("utf-8", errors="replace")

    def token_probs_json(probs) -> list:
        """llama-server's completion_probabilities: per generated token its text and the top n_probs
        tokens with their probabilities (softmax of the raw logits)."""
        return [{"content": token_text(p.token), "probs": [{"tok_str": token_text(t), "prob": q} for t, q in p.top]}
                for p in probs or []]

    def logit_bias_pairs(v) -> list:
        """llama-server's logit_bias forms as (token id, bias) pairs: [[id or "text", bias or false], ...]
        or OpenAI's {"id": bias}; a text gives every one of its tokens the bias, false bans."""
        items = list(v.items()) if isinstance(v, dict) else v
        if not isinstance(items, list):
            raise bad_request("'logit_bias' must be an array of [token, bias] pairs or an object")
        out = []
        for it in items:
            if not isinstance(it, (list, tuple)) or len(it) != 2:
                raise bad_request("'logit_bias' entries must be [token, bias] pairs")
            t, b = it
            if b is False:
                b = -math.inf
            elif isinstance(b, bool) or not isinstance(b, (int, float)):
                raise bad_request("a 'logit_bias' bias must be a number or false")
            if isinstance(t, str) and t.lstrip("-").isdigit() and isinstance(v, dict):
                t = int(t)                                  # OpenAI's object keys are token ids
            if isinstance(t, str):
                ids = engine.tokenize(t, False)
            elif isinstance(t, int) and not isinstance(t, bool):
                ids = [t]
            else:
                raise bad_request("a 'logit_bias' token must be an id or a string")
            for i in ids:
                if not 0 <= i < n_vocab:
                    raise bad_request(f"'logit_bias': token id {i} out of range [0, {n_vocab})")
                out.append((i, float(b)))
        return out

    def oai_logprobs(params, probs):
        """OpenAI's logprobs object as llama-server writes it (None where none were asked for):
        per token its text, bytes and log-probability, and the top tokens' (softmax of the raw logits)."""
        if params.n_probs <= 0:
            return None

        def entry(t: int, p: float) -> dict:
            b = tok.token_to_bytes(t, True) if tok is not None else b""
            return {"id": t, "token": b.decode("utf-8", errors="ignore"), "bytes": list(b),
                    "logprob": math.log(p) if p > 0 else -3.4028234663852886e38}

        return {"content": [{**entry(p.token, p.prob), "top_logprobs": [entry(t, q) for t, q in p.top]}
                            for p in probs or []]}

    def counts(gen: Generation, i: int, ev) -> tuple[int, int]:
        return (ev.n_prompt if ev.n_prompt else len(gen.prompts[i])), ev.n_generated

    def n_cached(gen: Generation, i: int, ev) -> int:
        """The prompt tokens job i reused from its slot's cache: the engine reads only the rest, and
        its timings count those (prompt_n), so the difference is what the cache supplied."""
        if ev.timings is None:
            return 0
        n_prompt = counts(gen, i, ev)[0]
        return max(0, min(n_prompt, n_prompt - int(ev.timings.prompt_n)))

    # ------------------------------------------------------------------------ simple endpoints
    @app.get("/health")
    @app.get("/v1/health")
    async def health(request: Request):
        slots = engine.slots_info()
        busy = sum(1 for s in slots if s.get("is_processing"))
        out: dict[str, Any] = {"status": "ok", "slots_idle": len(slots) - busy, "slots_processing": busy}
        if "include_slots" in request.query_params:
            out["slots"] = [{"n_ctx": n_ctx_slot, **s} for s in slots]
        if busy == len(slots):
            out["status"] = "no slot available"
            if "fail_on_no_slot" in request.query_params:
                return JSONResponse(out, status_code=503)
        return out

    @app.get("/metrics")
    async def metrics_endpoint():
        if not metrics or not hasattr(engine, "metrics"):
            raise ApiError(501, "This server does not support metrics endpoint.", "not_supported_error")
        m = engine.metrics()
        tot, b = m["totals"], m["bucket"]
        defs = [("counter", "prompt_tokens_total", "Number of prompt tokens processed.", tot["n_prompt"]),
                ("counter", "prompt_seconds_total", "Prompt process time", int(tot["t_prompt_ms"]) / 1e3),
                ("counter", "tokens_predicted_total", "Number of generation tokens processed.", tot["n_predicted"]),
                ("counter", "tokens_predicted_seconds_total", "Predict process time",
                 int(tot["t_predicted_ms"]) / 1e3),
                ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                 1e3 / int(b["t_prompt_ms"]) * b["n_prompt"] if b["n_prompt"] and int(b["t_prompt_ms"]) else 0.0),
                ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                 1e3 / int(b["t_predicted_ms"]) * b["n_predicted"] if b["n_predicted"] and int(b["t_predicted_ms"])
                 else 0.0),
                ("gauge", "kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                 m["kv_cells_used"] / max(1, n_ctx_slot * n_parallel)),
                ("gauge", "kv_cache_tokens", "KV-cache tokens.", m["kv_cells_used"]),
                ("gauge", "requests_processing", "Number of request processing.", m["processing"]),
                ("gauge", "requests_deferred", "Number of request deferred.", m["deferred"])]
        text = "".join(f"# HELP llamacpp:{n} {h}\n# TYPE llamacpp:{n} {t}\nllamacpp:{n} {v:g}\n"
                       for t, n, h, v in defs)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.post("/apply-template")
    async def apply_template(request: Request):
        return {"prompt": await render_prompt(await read_json(request))}

    @app.get("/version")
    async def version():
        return {"version": 4, "features": {"sql": False, "zstd_compression": False}}

    @app.get("/v1/props")
    async def props_simple():
        return {"model_name": os.path.splitext(os.path.basename(model_path))[0] if model_path else alias,
                "model_path": model_path, "modalities": {"vision": False, "audio": False},
                "n_ctx": n_ctx_slot * n_parallel}

    @app.get("/slots")
    async def slots():
        if not slots_endpoint:
            raise ApiError(501, "This server does not support slots endpoint.", "not_supported_error")
        out = []
        for s in engine.slots_info():
            # ik's fields: the slot's generation settings, then id, id_task, state, prompt, next_token
            params = s.get("params")
            if params is None:
                params = sampling_params({})
            d = generation_settings(params, s.get("n_predict", default_n_predict), s.get("stop", []), False)
            d.update({"id": s["id"], "id_task": s.get("id_task", -1), "state": s.get("state", int(s["is_processing"])),
                      "is_processing": s["is_processing"]})
            d["prompt"] = engine.detokenize(s["prompt_tokens"]) if s.get("prompt_tokens") else ""
            d["next_token"] = s.get("next_token", {"has_next_token": s["is_processing"], "n_remain": -1, "n_decoded": 0,
                                                   "stopped_eos": False, "stopped_word": False, "stopped_limit": False,
                                                   "stopping_word": ""})
            out.append(d)
        return out

    if slot_save_path:
        from engine.serving import SlotError

        @app.post("/slots/{id_slot}")
        async def slots_action(request: Request, id_slot: str):
            try:
                n = int(id_slot.strip())
            except ValueError:
                raise bad_request("Invalid slot ID") from None
            action = request.query_params.get("action", "")
            if action not in ("save", "restore", "erase"):
                raise bad_request("Invalid action")
            path, out = "", {"id_slot": n}
            if action != "erase":
                body = await read_json(request)
                filename = body.get("filename")
                if not isinstance(filename, str):
                    raise bad_request("'filename' is required: the name of the file in --slot-save-path")
                if not valid_filename(filename):
                    raise bad_request("Invalid filename")
                path, out["filename"] = os.path.join(slot_save_path, filename), filename
            try:
                res = await asyncio.wrap_future(engine.slot_action(n, action, path))
            except SlotError as e:
                raise bad_request(str(e)) from None
            return {**out, **res}

    @app.get("/props")
    async def props():
        params = sampling_params({})
        return {
            "system_prompt": "",
            "model_alias": alias,
            "model_path": model_path,
            "default_generation_settings": generation_settings(params, default_n_predict, [], False),
            "total_slots": n_parallel,
            "model_name": os.path.splitext(os.path.basename(model_path))[0] if model_path else alias,
            "chat_template": template or "",
            "chat_format": chat_format,
            "bos_token": bos_token,
            "eos_token": eos_token,
            "modalities": {"vision": False, "audio": False},
            "n_ctx": n_ctx_slot * n_parallel,
        }

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        info: dict[str, Any] = {}
        try:
            vocab_type = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5}.get(meta.get("tokenizer.ggml.model"), 0)
            info = {"vocab_type": vocab_type, "n_vocab": n_vocab, "n_ctx_train": model.hp.n_ctx_train,
                    "n_embd": getattr(model.hp, "n_embd", None), "n_params": model.n_params(),
                    "size": model.size_bytes()}
        except Exception:  # noqa: BLE001 - a fake or partial model: fewer facts
            info = {"n_vocab": n_vocab}
        return {"object": "list",
                "data": [{"id": alias, "object": "model", "created": int(time.time()), "owned_by": "llamacpp",
                          "meta": info, "max_model_len": n_ctx_slot * n_parallel}]}

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request):
        body = await read_json(request)
        content = _field(body, "content")
        add_special = get_bool(body, "add_special", False)
        with_pieces = get_bool(body, "with_pieces", False)
        if content is _MISSING:
            return {"tokens": []}
        if not isinstance(content, str):
            raise bad_request("'content' must be a string")
        tokens = await tokenize(content, add_special)
        if not with_pieces:
            return {"tokens": tokens}
        out = []
        for t in tokens:
            b = tok.token_to_bytes(t, True) if tok is not None else engine.detokenize([t]).encode("utf-8")
            try:
                p: Any = b.decode("utf-8")
            except UnicodeDecodeError:
                p = list(b)
            out.append({"id": t, "piece": p})
        return {"tokens": out}

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request):
        body = await read_json(request)
        tokens = _field(body, "tokens")
        if tokens is _MISSING:
            return {"content": ""}
        tokens = _token_list(tokens, n_vocab, "tokens")
        try:
            if tok is not None:     # llama-server joins the pieces (a leading space stays)
                content = b"".join(tok.token_to_bytes(t, True) for t in tokens).decode("utf-8", errors="replace")
            else:
                content = await asyncio.to_thread(engine.detokenize, tokens)
        except (ValueError, IndexError, KeyError) as e:
            raise bad_request(f"cannot detokenize: {e}") from None
        return {"content": content}

    # ------------------------------------------------------------------------------ embeddings
    pooling = getattr(engine, "pooling", "none")

    async def embeddings_answer(request: Request, oai: bool) -> JSONResponse:
        """llama-server's handle_embeddings_impl: /embedding(s) answer a list of {embedding, index}
        (one row per token with pooling none, else one normalized row), /v1/embeddings OpenAI's
        list object; a request with `content` instead of `input` gets llama-server's own form."""
        if not embeddings:
            raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`",
                           "not_supported_error")
        if oai and pooling == "none":
            raise bad_request("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        body = await read_json(request)
        if _field(body, "input") is not _MISSING:
            name = "input"
        elif _field(body, "content") is not _MISSING:
            name, oai = "content", False
        else:
            raise bad_request('"input" or "content" must be provided')
        fmt = _field(body, "encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise bad_request("The format to return the embeddings in. Can be either float or base64")
        try:        # the prompt forms of /completion: a string, token ids, mixed, or a list of those
            prompts = [await tokenize_prompt(p) for p in split_prompts(body[name])]
        except ApiError as e:
            raise bad_request(e.message.replace("'prompt'", f"'{name}'")) from None
        if any(not p for p in prompts):
            raise bad_request("Input content cannot be empty")
        norm = get_int(body, "embd_normalize", 2)
        gen = Generation()
        gen.submit_embeddings(engine, prompts, norm)
        results = await collect(request, gen)
        vectors = [results[i]["final"].embedding for i in range(len(prompts))]     # float32 arrays
        if not oai:
            return JSONResponse([{"embedding": v.tolist(), "index": i} for i, v in enumerate(vectors)])
        data = []
        for i, v in enumerate(vectors):
            if fmt == "base64":     # the float32 values' little-endian bytes, as llama-server sends them
                data.append({"embedding": base64.b64encode(v[0].astype("<f4").tobytes()).decode("ascii"),
                             "encoding_format": "base64", "index": i, "object": "embedding"})
            else:
                data.append({"embedding": v[0].tolist(), "index": i, "object": "embedding"})
        n_tokens = sum(len(p) for p in prompts)
        model_name = body.get("model") if isinstance(body.get("model"), str) else "gpt-3.5-turbo-0613"
        return JSONResponse({"data": data, "model": model_name, "object": "list",
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    @app.post("/embedding")
    @app.post("/embeddings")
    async def embeddings_endpoint(request: Request):
        return await embeddings_answer(request, oai=False)

    @app.post("/v1/embeddings")
    async def oai_embeddings_endpoint(request: Request):
        return await embeddings_answer(request, oai=True)

    # ---------------------------------------------------------------- llama.cpp's /completion
    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request):
        body = await read_json(request)
        stream, stop, n_predict = request_basics(body)
        n_cmpl = n_cmpl_of(body)
        params = sampling_params(body, "n_probs")
        id_slot, ban = request_id_slot(body), request_ban(body)
        raw_prompts, prompts = await prompts_of(body)
        gen = Generation()
        gen.submit(engine, prompts, params, n_predict, stop, get_cache_prompt(body), n_cmpl, shift=get_shift(body),
                   preserved=request_preserved(body), id_slot=id_slot, ban=ban)
        settings = generation_settings(params, n_predict, stop, stream)
        with_probs = params.n_probs > 0
        # mainline's fields (ik has them commented out): the generated ids with return_tokens, and
        # whether the answer holds a newline
        return_tokens = get_bool(body, "return_tokens", False)
        new_line: dict[int, bool] = {}

        def final(i: int, ev, content: str, probs=None, tokens=None) -> dict:
            n_prompt, n_gen = counts(gen, i, ev)
            extra = {"completion_probabilities": token_probs_json(probs)} if with_probs and probs is not None else {}
            return {**extra,
                "content": content, "tokens": list(tokens) if return_tokens and tokens else [],
                "id_slot": getattr(gen.jobs[i], "id_slot", -1), "stop": True, "model": alias,
                "has_new_line": new_line.get(i, False) or "\n" in content,
                "tokens_predicted": n_gen, "tokens_evaluated": n_prompt, "generation_settings": settings,
                "prompt": raw_prompts[i // n_cmpl], "truncated": bool(getattr(ev, "truncated", False)),
                "stopped_eos": stop_type(ev) == "eos", "stopped_word": stop_type(ev) == "word",
                "stopped_limit": stop_type(ev) == "limit", "stop_type": stop_type(ev),
                "stopping_word": ev.stopping_word or "", "tokens_cached": n_prompt + n_gen,
                "timings": timings_json(ev.timings, n_ctx_slot, n_prompt + n_gen),
                "index": i,
            }

        if not stream:
            results = await collect(request, gen)
            out = []
            for i in range(len(gen.jobs)):
                ev = results[i]["final"]
                out.append(final(i, ev, "".join(results[i]["text"]), results[i]["probs"], results[i]["tokens"]))
            return out[0] if len(out) == 1 else out

        async def chunks() -> AsyncIterator[str]:
            async for i, ev in gen.events():
                if ev.text:
                    extra = {"completion_probabilities": token_probs_json(getattr(ev, "probs", None))} if with_probs else {}
                    new_line[i] = new_line.get(i, False) or "\n" in ev.text
                    yield sse({"content": ev.text, "tokens": list(ev.tokens) if return_tokens else [], "stop": False,
                               "id_slot": getattr(gen.jobs[i], "id_slot", -1), "multimodal": False, "index": i, **extra})
                if gen.engine_failed(ev):
                    yield sse({"error": engine_failed_error().as_json()})
                    return
                if ev.done:
                    yield sse(final(i, ev, ""))

        return stream_response(gen, chunks())

    # --------------------------------------------------------------------- OpenAI completions
    @app.post("/v1/completions")
    async def oai_completions(request: Request):
        body = await read_json(request)
        stream, stop, n_predict = request_basics(body)
        n_cmpl = n_cmpl_of(body)
        echo = get_bool(body, "echo", False)
        params = sampling_params(body, "logprobs")
        if echo and params.n_probs > 0:
            raise bad_request("'echo' with 'logprobs' needs the prompt tokens' log-probabilities, which this "
                              "server does not compute")
        id_slot, ban = request_id_slot(body), request_ban(body)
        raw, prompts = await prompts_of(body)
        # echo (OpenAI's): each choice's text starts with its prompt, as given (token ids as their text)
        echoed = [(p if isinstance(p, str) else await asyncio.to_thread(engine.detokenize, q)) if echo else ""
                  for p, q in zip(raw, prompts)]
        gen = Generation()
        gen.submit(engine, prompts, params, n_predict, stop, get_cache_prompt(body), n_cmpl, shift=get_shift(body),
                   preserved=request_preserved(body), id_slot=id_slot, ban=ban)
        cmpl_id, created = _rand_id("cmpl-"), int(time.time())

        def head() -> dict:
            return {"id": cmpl_id, "object": "text_completion", "created": created, "model": alias,
                    "system_fingerprint": SYSTEM_FINGERPRINT}

        if not stream:
            results = await collect(request, gen)
            choices, n_prompt_total, n_gen_total, n_cached_total = [], 0, 0, 0
            last_timings = None
            for i in range(len(gen.jobs)):
                ev = results[i]["final"]
                n_prompt, n_gen = counts(gen, i, ev)
                n_gen_total += n_gen
                if i % n_cmpl == 0:   # OpenAI's usage: each prompt once, however many choices it has
                    n_prompt_total += n_prompt
                    n_cached_total += n_cached(gen, i, ev)
                last_timings = timings_json(ev.timings, n_ctx_slot, n_prompt + n_gen)
                choices.append({"text": echoed[i // n_cmpl] + "".join(results[i]["text"]), "index": i,
                                "logprobs": oai_logprobs(params, results[i]["probs"]),
                                "finish_reason": oai_finish_reason(ev)})
            return {**head(), "choices": choices,
                    "usage": usage_json(n_prompt_total, n_gen_total, n_cached_total),
                    "timings": last_timings}

        async def chunks() -> AsyncIterator[str]:
            for i in range(len(gen.jobs) if echo else 0):
                yield sse({**head(), "choices": [{"text": echoed[i // n_cmpl], "index": i, "logprobs": None,
                                                  "finish_reason": None}]})
            async for i, ev in gen.events():
                if ev.text:
                    yield sse({**head(), "choices": [{"text": ev.text, "index": i,
                                                      "logprobs": oai_logprobs(params, getattr(ev, "probs", None)),
                                                      "finish_reason": None}]})
                if gen.engine_failed(ev):
                    yield sse({"error": engine_failed_error().as_json()})
                    return
                if ev.done:
                    n_prompt, n_gen = counts(gen, i, ev)
                    yield sse({**head(), "choices": [{"text": "", "index": i, "logprobs": None,
                                                      "finish_reason": oai_finish_reason(ev)}],
                               "usage": usage_json(n_prompt, n_gen, n_cached(gen, i, ev)),
                               "timings": timings_json(ev.timings, n_ctx_slot, n_prompt + n_gen)})
            yield "data: [DONE]\n\n"

        return stream_response(gen, chunks())

    # ------------------------------------------------------------------------- tool calls
    preserved_cache: dict[str, list[int]] = {}

    def preserved_ids(treq: Optional[ToolRequest]) -> list[int]:
        """The token ids of the format's call markers (each a single token), for an engine that can
        write control tokens out as text: a vocabulary may hold the markers as control tokens."""
        if treq is None or not _takes_keyword(engine.submit, "preserved_tokens"):
            return []
        if treq.format not in preserved_cache:
            ids = []
            for marker in tool_calls_mod.preserved_tokens(treq.format):
                try:
                    t = engine.tokenize(marker, False)
                except Exception:  # noqa: BLE001 - a marker the vocabulary cannot take is no token
                    continue
                if len(t) == 1:
                    ids.append(t[0])
            preserved_cache[treq.format] = ids
        return preserved_cache[treq.format]

    def parse_answer(treq: ToolRequest, text: str, rfmt: str):
        """A whole answer's content -> engine.tool_calls.ParsedMessage, calls with ids (the model's,
        else 32 random letters and digits, as llama-server's)."""
        msg = tool_calls_mod.parse_message(text, treq.format, tools=treq.tools, extract_reasoning=rfmt != "none",
                                           max_calls=treq.max_calls)
        for c in msg.tool_calls:
            c.id = c.id or _rand_id("")
        return msg

    def tool_stream(treq: ToolRequest, rfmt: str):
        return tool_calls_mod.ToolCallStream(treq.format, tools=treq.tools, extract_reasoning=rfmt != "none",
                                             max_calls=treq.max_calls, new_id=lambda: _rand_id(""))

    def oai_delta(part: tuple) -> dict:
        """An OpenAI chat delta of one streamed part: ("content"|"reasoning", text), or a tool call's
        start ("tool_call", index, id, name, "") / its next arguments ("tool_call", index, None, None, text)."""
        if part[0] == "reasoning":
            return {"reasoning_content": part[1]}
        if part[0] == "content":
            return {"content": part[1]}
        _, index, id_, name, frag = part
        if name is not None:
            return {"tool_calls": [{"index": index, "id": id_, "type": "function",
                                    "function": {"name": name, "arguments": frag}}]}
        return {"tool_calls": [{"index": index, "function": {"arguments": frag}}]}

    # ------------------------------------------------------------------------- OpenAI chat
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def oai_chat(request: Request):
        body = await read_json(request)
        stream, stop, n_predict = request_basics(body)
        n_cmpl = n_cmpl_of(body)
        stream_options = _field(body, "stream_options", {})
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object")
        include_usage = get_bool(stream_options, "include_usage", False)
        params = sampling_params(body, "chat")
        rfmt = _field(body, "reasoning_format", reasoning_format)
        if rfmt not in REASONING_FORMATS:
            raise bad_request(f"Unknown reasoning format: {rfmt}")
        messages = _field(body, "messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "assistant":
            rfmt = "none"       # a prefilled assistant answer is continued as it is, as ik does
        text = await render_prompt(body)
        treq = tool_request(body)
        # the template opened the reasoning itself (Qwen3 / DeepSeek-R1 prompts ending in <think>):
        # the answer starts inside it and only </think> comes
        forced_open = text.rstrip().endswith(THINK_OPEN)
        await asyncio.to_thread(apply_tool_grammar, params, treq, text)
        id_slot, ban = request_id_slot(body), request_ban(body)
        prompt = await chat_prompt(body, text)
        gen = Generation()
        gen.submit(engine, [prompt], params, n_predict, stop, get_cache_prompt(body), n_cmpl, shift=get_shift(body),
                   preserved=preserved_ids(treq) if treq is not None else request_preserved(body),
                   id_slot=id_slot, ban=ban)
        cmpl_id, created = _rand_id("chatcmpl-"), int(time.time())

        def head() -> dict:
            return {"id": cmpl_id, "object": "chat.completion.chunk" if stream else "chat.completion",
                    "created": created, "model": alias, "system_fingerprint": SYSTEM_FINGERPRINT}

        def usage_of(finals: dict) -> dict:
            """OpenAI's usage of the choices that ended: the prompt once (every choice reads the
            same one; choice 0's cache counts), the completion tokens of all of them."""
            n_prompt = counts(gen, 0, finals[0])[0] if 0 in finals else len(prompt)
            return usage_json(n_prompt, sum(ev.n_generated for ev in finals.values()),
                              n_cached(gen, 0, finals[0]) if 0 in finals else 0)

        if not stream:
            results = await collect(request, gen)
            choices = []
            for i in range(n_cmpl):
                ev = results[i]["final"]
                answer = "".join(results[i]["text"])
                message = {"role": "assistant", "content": answer}
                if rfmt != "none":
                    reasoning, content = split_reasoning(answer, forced_open)
                    if rfmt != "deepseek-legacy":   # legacy keeps the tags in content
                        message["content"] = content
                    if reasoning:
                        message["reasoning_content"] = reasoning
                calls: list = []
                if treq is not None:     # the content's tool calls (content null when only calls)
                    parsed = parse_answer(treq, message["content"], rfmt)
                    calls = parsed.tool_calls
                    message["content"] = parsed.content if parsed.content or not calls else None
                    if parsed.reasoning:     # gpt-oss: its analysis channel
                        message["reasoning_content"] = message.get("reasoning_content", "") + parsed.reasoning
                    if calls:
                        message["tool_calls"] = oai_tool_calls(calls)
                choice = {"index": i, "finish_reason": oai_finish_reason(ev, bool(calls)), "message": message}
                if params.n_probs > 0:
                    choice["logprobs"] = oai_logprobs(params, results[i]["probs"])
                choices.append(choice)
            ev0 = results[0]["final"]
            n_prompt, n_gen = counts(gen, 0, ev0)
            return {**head(), "choices": choices,
                    "usage": usage_of({i: results[i]["final"] for i in range(n_cmpl)}),
                    "timings": timings_json(ev0.timings, n_ctx_slot, n_prompt + n_gen)}   # choice 0's, as llama-server

        async def chunks() -> AsyncIterator[str]:
            for i in range(n_cmpl):
                yield sse({**head(), "choices": [{"index": i, "finish_reason": None,
                                                  "delta": {"role": "assistant", "content": None}}]})
            finals: dict = {}
            timings = None
            # deepseek-legacy streams the reasoning inline, tags and all, as ik does
            splits = {i: ReasoningSplit(forced_open) for i in range(n_cmpl)} \
                if rfmt in ("deepseek", "auto") else None
            held_probs: dict[int, list] = {i: [] for i in range(n_cmpl)}   # of text held back
            # the content goes on through the tool-call parser: calls come out as tool_calls deltas
            tstreams = {i: tool_stream(treq, rfmt) for i in range(n_cmpl)} if treq is not None else None
            async for i, ev in gen.events():
                if splits is None:
                    parts = [("content", ev.text)] if ev.text else []
                else:
                    parts = splits[i].feed(ev.text or "")
                    if ev.done:
                        parts += splits[i].finish()
                if tstreams is not None:
                    routed: list = []
                    for part in parts:
                        routed += tstreams[i].feed(part[1]) if part[0] == "content" else [part]
                    if ev.done:
                        routed += tstreams[i].finish()
                    parts = routed
                held_probs[i] += getattr(ev, "probs", None) or []
                for n, part in enumerate(parts):
                    delta = {"index": i, "finish_reason": None, "delta": oai_delta(part)}
                    if params.n_probs > 0 and n == len(parts) - 1:
                        delta["logprobs"] = oai_logprobs(params, held_probs[i])
                        held_probs[i] = []
                    yield sse({**head(), "choices": [delta]})
                if gen.engine_failed(ev):
                    yield sse({"error": engine_failed_error().as_json()})
                    return
                if ev.done:
                    finals[i] = ev
                    n_prompt, n_gen = counts(gen, i, ev)
                    has_calls = tstreams is not None and bool(tstreams[i].ids)
                    last = {**head(), "choices": [{"index": i, "finish_reason": oai_finish_reason(ev, has_calls),
                                                   "delta": {}}],
                            "usage": usage_json(n_prompt, n_gen, n_cached(gen, i, ev))}
                    timings = timings_json(ev.timings, n_ctx_slot, n_prompt + n_gen)
                    # each choice's last chunk carries its own usage (and timings); with include_usage
                    # one chunk with empty choices ends the stream with the whole request's usage
                    yield sse(last if include_usage else {**last, "timings": timings})
            if include_usage:   # OpenAI: a last chunk with empty choices carries the usage
                yield sse({**head(), "choices": [], "usage": usage_of(finals), "timings": timings})
            yield "data: [DONE]\n\n"

        return stream_response(gen, chunks())

    # ------------------------------------------------------------------- Anthropic Messages API
    def anthropic_chat(body: dict) -> dict:
        """An Anthropic Messages request as the OpenAI chat body the chat path reads, as llama-server
        converts it: text blocks, tool_use blocks (assistant tool calls), tool_result blocks (tool
        messages, in their place among the user's text), thinking blocks (reasoning_content);
        `tools` with input_schema, `tool_choice` auto/any/tool/none.  Images and documents are refused."""
        def blocks_of(v: Any, what: str) -> list:
            if isinstance(v, str):
                return [{"type": "text", "text": v}]
            if not isinstance(v, list):
                raise bad_request(f"{what} must be a string or an array of content blocks")
            for j, b in enumerate(v):
                if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                    raise bad_request(f"{what}[{j}] must be a content block object with a 'type'")
            return v

        def text_of(v: Any, what: str) -> str:
            parts = []
            for j, b in enumerate(blocks_of(v, what)):
                if b["type"] != "text" or not isinstance(b.get("text"), str):
                    raise bad_request(f"{what}: content blocks of type '{b['type']}' are not supported by this server")
                parts.append(b["text"])
            return "".join(parts)

        messages = _field(body, "messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array")
        out: list[dict] = []
        system = _field(body, "system")
        if system not in (_MISSING, None):
            out.append({"role": "system", "content": text_of(system, "'system'")})
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise bad_request(f"messages[{i}]: 'role' must be 'user' or 'assistant'")
            what = f"messages[{i}].content"
            blocks = blocks_of(m.get("content", ""), what)
            if m["role"] == "assistant":
                text, thinking, calls = [], [], []
                for j, b in enumerate(blocks):
                    if b["type"] == "text" and isinstance(b.get("text"), str):
                        text.append(b["text"])
                    elif b["type"] == "thinking" and isinstance(b.get("thinking"), str):
                        thinking.append(b["thinking"])
                    elif b["type"] == "tool_use":
                        if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str) \
                                or not isinstance(b.get("input", {}), dict):
                            raise bad_request(f"{what}[{j}]: a tool_use block needs 'id', 'name' and an 'input' object")
                        calls.append({"id": b["id"], "type": "function", "function": {
                            "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
                    else:
                        raise bad_request(f"{what}: content blocks of type '{b['type']}' are not supported by this server")
                msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
                if calls:
                    msg["tool_calls"] = calls
                if thinking:
                    msg["reasoning_content"] = "".join(thinking)
                out.append(msg)
                continue
            text = []

            def flush() -> None:
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text.clear()
            for j, b in enumerate(blocks):
                if b["type"] == "text" and isinstance(b.get("text"), str):
                    text.append(b["text"])
                elif b["type"] == "tool_result":
                    if not isinstance(b.get("tool_use_id"), str):
                        raise bad_request(f"{what}[{j}]: a tool_result block needs 'tool_use_id'")
                    flush()
                    result = text_of(b.get("content", ""), f"{what}[{j}].content")
                    if b.get("is_error") is True:
                        result = "Error: " + result
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
                else:
                    raise bad_request(f"{what}: content blocks of type '{b['type']}' are not supported by this server")
            flush()
            if not blocks:
                out.append({"role": "user", "content": ""})
        # llama-server's default when max_tokens (required by Anthropic's API) is missing
        chat: dict[str, Any] = {"messages": out, "stream": _field(body, "stream", False), "max_tokens": 4096}
        for src, dst in (("max_tokens", "max_tokens"), ("stop_sequences", "stop"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("top_k", "top_k")):
            if _field(body, src) is not _MISSING:
                chat[dst] = body[src]
        tools = _field(body, "tools")
        if tools not in (_MISSING, None):
            if not isinstance(tools, list):
                raise bad_request("'tools' must be an array")
            chat["tools"] = []
            for j, t in enumerate(tools):
                if not isinstance(t, dict) or not isinstance(t.get("name"), str) \
                        or not isinstance(t.get("input_schema"), dict):
                    raise bad_request(f"tools[{j}]: a client tool with 'name' and 'input_schema' is needed "
                                      f"(server tools are not supported by this server)")
                chat["tools"].append({"type": "function", "function": {
                    "name": t["name"], "description": t.get("description") or "", "parameters": t["input_schema"]}})
        choice = _field(body, "tool_choice")
        if choice is not _MISSING:
            kind = choice.get("type") if isinstance(choice, dict) else None
            if kind not in ("auto", "any", "tool", "none"):
                raise bad_request("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}")
            if kind == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
            else:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
            if choice.get("disable_parallel_tool_use") is True:
                chat["parallel_tool_calls"] = False
        return chat

    def anthropic_usage(gen: Generation, ev) -> dict:
        n_prompt, n_gen = counts(gen, 0, ev)
        cached = n_cached(gen, 0, ev)
        return {"cache_read_input_tokens": cached, "input_tokens": n_prompt - cached, "output_tokens": n_gen}

    def anthropic_stop(ev, tool_calls: bool = False) -> tuple[str, Optional[str]]:
        kind = stop_type(ev)
        if kind in ("eos", "word"):
            return ("tool_use" if tool_calls else "end_turn"), (ev.stopping_word or None)
        return "max_tokens", (ev.stopping_word or None)

    def asse(event: str, data: dict) -> str:
        return f"event: {event}\n" + sse(data)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        chat = anthropic_chat(await read_json(request))
        stream, stop, n_predict = request_basics(chat)
        params = sampling_params(chat, "chat")
        treq = tool_request(chat)
        text = await render_prompt(chat)
        await asyncio.to_thread(apply_tool_grammar, params, treq, text)
        prompt = await chat_prompt(chat, text)
        gen = Generation()
        gen.submit(engine, [prompt], params, n_predict, stop, True, preserved=preserved_ids(treq))
        msg_id = _rand_id("msg_")
        if not stream:
            results = await collect(request, gen)
            ev = results[0]["final"]
            text = "".join(results[0]["text"])
            calls: list = []
            if treq is not None:
                parsed = parse_answer(treq, text, "none")
                text, calls = parsed.content, parsed.tool_calls
            reason, word = anthropic_stop(ev, bool(calls))
            content = [{"type": "text", "text": text}] if text else []
            content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": anthropic_tool_input(c.arguments)}
                        for c in calls]
            return {"id": msg_id, "type": "message", "role": "assistant", "content": content, "model": alias,
                    "stop_reason": reason, "stop_sequence": word, "usage": anthropic_usage(gen, ev)}

        async def chunks() -> AsyncIterator[str]:
            yield asse("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "content": [], "model": alias,
                "stop_reason": None, "stop_sequence": None,
                "usage": {"cache_read_input_tokens": 0, "input_tokens": len(prompt), "output_tokens": 0}}})
            # content blocks one after the other: text, then each tool_use (its input as JSON fragments);
            # text after a call opens a new text block
            tstream = tool_stream(treq, "none") if treq is not None else None
            block: dict[str, Any] = {"index": -1, "kind": None}

            def start(kind: str, content_block: dict) -> list[str]:
                out = stop_block()
                block["index"] += 1
                block["kind"] = kind
                return out + [asse("content_block_start", {"type": "content_block_start", "index": block["index"],
                                                           "content_block": content_block})]

            def stop_block() -> list[str]:
                if block["kind"] is None:
                    return []
                block["kind"] = None
                return [asse("content_block_stop", {"type": "content_block_stop", "index": block["index"]})]

            def delta(d: dict) -> str:
                return asse("content_block_delta", {"type": "content_block_delta", "index": block["index"], "delta": d})

            async for _i, ev in gen.events():
                parts = [("content", ev.text)] if ev.text else []
                if tstream is not None:
                    parts = tstream.feed(ev.text or "") + (tstream.finish() if ev.done else [])
                for part in parts:
                    if part[0] in ("content", "reasoning"):
                        if block["kind"] != "text":
                            for e in start("text", {"type": "text", "text": ""}):
                                yield e
                        yield delta({"type": "text_delta", "text": part[1]})
                    elif part[3] is not None:       # a tool call starts
                        for e in start("tool_use", {"type": "tool_use", "id": part[2], "name": part[3], "input": {}}):
                            yield e
                    else:
                        yield delta({"type": "input_json_delta", "partial_json": part[4]})
                if gen.engine_failed(ev):
                    yield asse("error", {"type": "error", "error": {"type": "api_error",
                                                                    "message": engine_failed_error().message}})
                    return
                if ev.done:
                    for e in stop_block():
                        yield e
                    reason, word = anthropic_stop(ev, tstream is not None and bool(tstream.ids))
                    yield asse("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": reason, "stop_sequence": word},
                                                 "usage": {"output_tokens": counts(gen, 0, ev)[1]}})
                    yield asse("message_stop", {"type": "message_stop"})

        return stream_response(gen, chunks())

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request):
        return {"input_tokens": len(await chat_prompt(anthropic_chat(await read_json(request))))}

    return app
