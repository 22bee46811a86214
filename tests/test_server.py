"""`ikcli server`: the HTTP layer on a fake engine, then the real server over HTTP.

The first half serves `ikcli.server_app.create_app` with a small fake of engine.serving's
ServingEngine (bytes as tokens, a fixed answer, a thread per job) with uvicorn on a free loopback
port: request checking, response shapes, streaming, stop strings, errors, cancellation on
disconnect.  The second half starts `ikcli server` on the embedded demo model (and, for the
disconnect checks, the real ServingEngine in-process) and talks to it with httpx and the official
openai client.  Those skip when engine.serving cannot be imported.
"""
from __future__ import annotations

import json
import os
import queue
import re
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from conftest import launch_server, stop_server

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from ikcli.server_app import create_app  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ============================================================================ serving helper

class ServerThread:
    """uvicorn serving `app` on a free 127.0.0.1 port from a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 10 or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def sse_events(lines) -> list:
    """The `data:` payloads of a server-sent event stream ('[DONE]' kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream_post(base: str, path: str, body: dict) -> list:
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def assert_error(r, code: int, type_: str = "invalid_request_error", contains: str = "") -> dict:
    assert r.status_code == code, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == type_, err
    assert isinstance(err["message"], str) and err["message"]
    assert contains.lower() in err["message"].lower(), err["message"]
    return err


def wait_until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ============================================================================ the fake engine

@dataclass
class FakeTimings:
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


@dataclass
class FakeEvent:
    text: str
    token: int | None
    done: bool
    finish_reason: str | None
    stopping_word: str
    n_prompt: int
    n_generated: int
    timings: FakeTimings | None = None


class FakeJob:
    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.id_slot = -1

    def cancel(self) -> None:
        self.cancelled.set()


FAKE_ANSWER = "Hello from the fake engine."
FAKE_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
BOS, EOS = 1, 2


class FakeTokenizer:
    n_vocab, bos_id, eos_id, add_bos = 259, BOS, EOS, True

    def token_to_bytes(self, t: int, special: bool = True) -> bytes:
        return {BOS: b"<s>", EOS: b"</s>"}.get(t, bytes([t - 3]) if t >= 3 else b"")

    def token_to_piece(self, t: int, special: bool = True) -> str:
        return self.token_to_bytes(t, special).decode("utf-8", errors="replace")


class FakeEngine:
    """engine.serving.ServingEngine's interface: a byte is a token (id = byte + 3), every job answers
    `answer` one character per token (then EOS), stop strings are held back and cut as the real one."""

    def __init__(self, n_parallel: int = 2, n_ctx_slot: int = 96, delay: float = 0.001, answer: str = FAKE_ANSWER,
                 fail_after: int = -1):
        self.n_parallel, self.n_ctx_slot, self.delay, self.answer = n_parallel, n_ctx_slot, delay, answer
        self.fail_after = fail_after      # >= 0: the "engine" gives up after that many tokens
        self.reuse = 0                    # prompt tokens each job "finds in its slot's cache" (not read again)
        self.slots: list = [None] * n_parallel
        self.cv = threading.Condition()
        self.finals: "queue.Queue[FakeEvent]" = queue.Queue()
        self.submitted: list = []
        self.cache_prompts: list = []
        self.model = SimpleNamespace(tokenizer=FakeTokenizer(),
                                     file=SimpleNamespace(meta={"tokenizer.chat_template": FAKE_TEMPLATE}))

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return ([BOS] if add_special else []) + [b + 3 for b in text.encode("utf-8")]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(FakeTokenizer().token_to_bytes(t) for t in tokens if t >= 3).decode("utf-8", errors="replace")

    def slots_info(self) -> list[dict]:
        with self.cv:
            return [{"id": i, "is_processing": j is not None} for i, j in enumerate(self.slots)]

    def submit(self, prompt, params, n_predict, stop, on_event, cache_prompt=True) -> FakeJob:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.n_ctx_slot:
            raise ValueError(f"the prompt has {len(prompt)} tokens, more than the slot's context of "
                             f"{self.n_ctx_slot} tokens allows")
        job = FakeJob()
        self.submitted.append((list(prompt), params, n_predict, list(stop)))
        self.cache_prompts.append(cache_prompt)
        threading.Thread(target=self._run, args=(job, prompt, n_predict, stop, on_event, self.answer_for(params)),
                         daemon=True).start()
        return job

    def answer_for(self, params) -> str:
        return self.answer

    def _run(self, job, prompt, n_predict, stop, on_event, answer) -> None:
        with self.cv:
            while None not in self.slots:
                self.cv.wait()
            slot = self.slots.index(None)
            self.slots[slot], job.id_slot = job, slot
        t0 = time.perf_counter()
        text, sent, reason, word, n = "", 0, None, "", 0
        try:
            while reason is None:
                if job.cancelled.is_set() or n == self.fail_after:
                    reason = "cancelled"
                elif n >= len(answer):
                    reason = "stop"            # EOS
                elif 0 <= n_predict <= n or len(prompt) + n + 1 >= self.n_ctx_slot:
                    reason = "length"
                else:
                    text += answer[n]
                    n += 1
                    hit = [(text.find(w), w) for w in stop if w in text]
                    if hit:
                        i, word = min(hit)
                        if text[sent:i]:
                            on_event(FakeEvent(text[sent:i], n + 3, False, None, "", len(prompt), n))
                        sent, reason = len(text), "stop"
                        break
                    hold = max((k for w in stop for k in range(1, len(w)) if text.endswith(w[:k])), default=0)
                    on_event(FakeEvent(text[sent:len(text) - hold], n + 3, False, None, "", len(prompt), n))
                    sent = len(text) - hold
                    time.sleep(self.delay)
            rest = "" if reason == "cancelled" else text[sent:]
            ms = 1e3 * (time.perf_counter() - t0)
            n_read = len(prompt) - min(self.reuse, len(prompt) - 1)
            ev = FakeEvent(rest, None, True, reason, word, len(prompt), n, FakeTimings(n_read, 1.0, n, ms))
            self.finals.put(ev)
            on_event(ev)
        finally:
            with self.cv:
                self.slots[slot] = None
                self.cv.notify_all()


def _fake_app(engine: FakeEngine, **kw):
    return create_app(engine, model_path="/models/fake-model.gguf", **kw)


@pytest.fixture(scope="module")
def fake():
    eng = FakeEngine()
    srv = ServerThread(_fake_app(eng, log_requests=False))
    yield SimpleNamespace(engine=eng, base=srv.base)
    srv.stop()


# ============================================================================ fake-engine tests

def test_health_props_models_slots(fake):
    r = httpx.get(fake.base + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "slots_idle": 2, "slots_processing": 0}
    props = httpx.get(fake.base + "/props").json()
    assert props["total_slots"] == 2 and props["model_path"] == "/models/fake-model.gguf"
    assert props["chat_template"] == FAKE_TEMPLATE and props["chat_format"] == "gguf"
    dgs = props["default_generation_settings"]
    assert dgs["n_ctx"] == 96 and {"temperature", "top_k", "top_p", "min_p", "seed", "stop"} <= set(dgs)
    models = httpx.get(fake.base + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model.gguf"
    assert models["data"][0]["object"] == "model"
    assert [s["id"] for s in httpx.get(fake.base + "/slots").json()] == [0, 1]


def test_completion_non_stream_and_stream(fake):
    body = {"prompt": "Hi", "n_predict": 64, "temperature": 0.5, "seed": 42}
    r = httpx.post(fake.base + "/completion", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["content"] == FAKE_ANSWER and d["stop"] is True
    assert d["stop_type"] == "eos" and d["stopped_eos"] and d["stopping_word"] == ""
    assert d["tokens_predicted"] == len(FAKE_ANSWER) and d["tokens_evaluated"] == 3
    assert d["prompt"] == "Hi" and d["model"] == "fake-model.gguf" and d["id_slot"] in (0, 1)
    t = d["timings"]
    assert t["prompt_n"] == 3 and t["predicted_n"] == len(FAKE_ANSWER)
    assert set(t) >= {"prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms",
                      "predicted_per_token_ms", "predicted_per_second"}
    assert d["generation_settings"]["temperature"] == 0.5 and d["generation_settings"]["seed"] == 42
    prompt, params, n_predict, stop = fake.engine.submitted[-1]
    assert prompt == [BOS, ord("H") + 3, ord("i") + 3] and n_predict == 64 and stop == []
    assert params.temperature == 0.5 and params.seed == 42

    events = stream_post(fake.base, "/completion", {**body, "stream": True})
    assert "[DONE]" not in events                       # llama.cpp's /completion ends without it
    parts, final = events[:-1], events[-1]
    assert all(e["stop"] is False for e in parts) and final["stop"] is True and final["content"] == ""
    assert "".join(e["content"] for e in parts) == FAKE_ANSWER
    assert final["stop_type"] == "eos" and final["tokens_predicted"] == len(FAKE_ANSWER)


def test_limits_and_stop_strings(fake):
    d = httpx.post(fake.base + "/completion", json={"prompt": "x", "n_predict": 5}).json()
    assert d["content"] == "Hello" and d["stop_type"] == "limit" and d["stopped_limit"]
    d = httpx.post(fake.base + "/completion", json={"prompt": "x", "stop": ["fake", "zzz"]}).json()
    assert d["content"] == "Hello from the " and d["stop_type"] == "word" and d["stopping_word"] == "fake"
    events = stream_post(fake.base, "/completion", {"prompt": "x", "stop": "engine", "stream": True})
    assert "".join(e["content"] for e in events) == "Hello from the fake "
    assert events[-1]["stopping_word"] == "engine"
    # OpenAI: a stop string or EOS is "stop", the token limit "length"
    c = httpx.post(fake.base + "/v1/completions", json={"prompt": "x", "max_tokens": 3}).json()
    assert c["choices"][0]["text"] == "Hel" and c["choices"][0]["finish_reason"] == "length"
    c = httpx.post(fake.base + "/v1/completions", json={"prompt": "x", "stop": "from"}).json()
    assert c["choices"][0]["text"] == "Hello " and c["choices"][0]["finish_reason"] == "stop"
    assert c["usage"] == {"completion_tokens": 10, "prompt_tokens": 2, "total_tokens": 12,
                          "prompt_tokens_details": {"cached_tokens": 0}}


def test_system_fingerprint_cached_tokens_and_truncated():
    """OpenAI answers carry system_fingerprint (llama-server's "b<build>-<commit>" form) in every object
    and chunk, and usage.prompt_tokens_details.cached_tokens: the prompt tokens the slot's cache
    supplied (the engine's prompt_n counts only those it read); /completion says truncated: false."""
    from ikcli import __version__
    eng = FakeEngine()
    eng.reuse = 5
    srv = ServerThread(_fake_app(eng, log_requests=False))
    fp = f"b{__version__}-ikcli"
    try:
        msgs = [{"role": "user", "content": "Hi there"}]
        d = httpx.post(srv.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}).json()
        assert d["system_fingerprint"] == fp and re.fullmatch(r"b[^-]+-\w+", fp)
        assert d["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
        assert d["timings"]["prompt_n"] == d["usage"]["prompt_tokens"] - 5
        events = stream_post(srv.base, "/v1/chat/completions", {"messages": msgs, "stream": True, "max_tokens": 3,
                                                                "stream_options": {"include_usage": True}})
        assert all(e["system_fingerprint"] == fp for e in events[:-1])
        assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
        c = httpx.post(srv.base + "/v1/completions", json={"prompt": ["abcdefgh", "ijklmnop"], "max_tokens": 2}).json()
        assert c["system_fingerprint"] == fp and c["usage"]["prompt_tokens_details"] == {"cached_tokens": 10}
        events = stream_post(srv.base, "/v1/completions", {"prompt": "abcdefgh", "max_tokens": 2, "stream": True})
        assert all(e["system_fingerprint"] == fp for e in events[:-1])
        assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
        a = httpx.post(srv.base + "/v1/messages", json={"max_tokens": 2, "messages": msgs}).json()
        assert a["usage"]["cache_read_input_tokens"] == 5
        assert a["usage"]["input_tokens"] + 5 == d["usage"]["prompt_tokens"]
        eng.reuse = 0
        d = httpx.post(srv.base + "/completion", json={"prompt": "abc", "n_predict": 2}).json()
        assert d["truncated"] is False and "system_fingerprint" not in d
        events = stream_post(srv.base, "/completion", {"prompt": "abc", "n_predict": 2, "stream": True})
        assert events[-1]["truncated"] is False
    finally:
        srv.stop()


def test_template_variables_and_refused_slot_fields():
    """add_generation_prompt and chat_template_kwargs reach the template (as llama-server passes
    them); id_slot and banned_strings, which this fake engine cannot honour (its submit() does not
    take them), are a 400 unless off (tests/test_tool_choice.py runs them on the real engine)."""
    tpl = ("{% if enable_thinking %}T:{% endif %}{% for m in messages %}{{ m['content'] }};{% endfor %}"
           "{% if add_generation_prompt %}>{% endif %}")
    srv = ServerThread(_fake_app(FakeEngine(), chat_template=tpl, log_requests=False))
    try:
        msgs = [{"role": "user", "content": "hi"}]
        apply = lambda **kw: httpx.post(srv.base + "/apply-template", json={"messages": msgs, **kw})
        assert apply().json() == {"prompt": "hi;>"}
        assert apply(add_generation_prompt=False).json() == {"prompt": "hi;"}
        assert apply(chat_template_kwargs={"enable_thinking": True}).json() == {"prompt": "T:hi;>"}
        assert apply(chat_template_kwargs=None, add_generation_prompt=None).json() == {"prompt": "hi;>"}
        assert_error(apply(add_generation_prompt="no"), 400)
        assert_error(apply(chat_template_kwargs=[1]), 400)
        url = srv.base + "/v1/chat/completions"
        for field, off, on in (("id_slot", -1, 0), ("banned_strings", [], ["x"])):
            assert httpx.post(url, json={"messages": msgs, field: off, "max_tokens": 2}).status_code == 200
            assert field in assert_error(httpx.post(url, json={"messages": msgs, field: on}), 400)["message"]
    finally:
        srv.stop()


def test_llama_server_parity_on_fake(fake):
    """/version (ik's fields), /v1/props, /health?include_slots, /detokenize joining the pieces as
    tokens_to_str (leading space and special tokens kept), CORS as llama-server's pre-routing
    handler, and the "2 assistant messages at the end" rule as a 400 in OpenAI's error shape."""
    assert httpx.get(fake.base + "/version").json() == {"version": 4, "features": {"sql": False,
                                                                                    "zstd_compression": False}}
    assert httpx.get(fake.base + "/v1/props").json() == {
        "model_name": "fake-model", "model_path": "/models/fake-model.gguf",
        "modalities": {"vision": False, "audio": False}, "n_ctx": 192}
    assert "slots" not in httpx.get(fake.base + "/health").json()
    h = httpx.get(fake.base + "/health?include_slots").json()
    assert [(s["id"], s["n_ctx"]) for s in h["slots"]] == [(0, 96), (1, 96)]
    toks = [BOS, ord(" ") + 3, ord("a") + 3]
    assert httpx.post(fake.base + "/detokenize", json={"tokens": toks}).json() == {"content": "<s> a"}
    assert httpx.post(fake.base + "/detokenize", json={"tokens": toks[1:]}).json() == {"content": " a"}
    assert httpx.post(fake.base + "/detokenize", json={}).json() == {"content": ""}
    origin = {"Origin": "http://ui.example:5173"}
    r = httpx.options(fake.base + "/completion", headers={**origin, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200 and r.text == ""
    assert {k: r.headers[k] for k in ("access-control-allow-origin", "access-control-allow-credentials",
                                      "access-control-allow-methods", "access-control-allow-headers")} == {
        "access-control-allow-origin": "http://ui.example:5173", "access-control-allow-credentials": "true",
        "access-control-allow-methods": "GET, POST", "access-control-allow-headers": "*"}
    r = httpx.post(fake.base + "/tokenize", json={"content": "a"}, headers=origin)
    assert r.headers["access-control-allow-origin"] == "http://ui.example:5173"
    two = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
           {"role": "assistant", "content": "b"}]
    for path in ("/v1/chat/completions", "/apply-template"):
        err = assert_error(httpx.post(fake.base + path, json={"messages": two}), 400)
        assert err["message"] == "Cannot have 2 or more assistant messages at the end of the list."
    n = len(fake.engine.submitted)
    ok = [two[1], two[0], two[2]]   # assistant messages, but not two at the end: served
    assert httpx.post(fake.base + "/v1/chat/completions", json={"messages": ok, "max_tokens": 1}).status_code == 200
    assert len(fake.engine.submitted) == n + 1


def test_prompt_forms(fake):
    # token ids, mixed pieces (BOS only before the first string), several prompts
    d = httpx.post(fake.base + "/completion", json={"prompt": [BOS, 50, 51], "n_predict": 1}).json()
    assert d["tokens_evaluated"] == 3 and d["prompt"] == [BOS, 50, 51]
    httpx.post(fake.base + "/completion", json={"prompt": ["ab", 7, "c"], "n_predict": 1}).raise_for_status()
    assert fake.engine.submitted[-1][0] == [BOS, ord("a") + 3, ord("b") + 3, 7, ord("c") + 3]
    r = httpx.post(fake.base + "/completion", json={"prompt": ["one", "two"], "n_predict": 2})
    assert [x["content"] for x in r.json()] == ["He", "He"] and [x["index"] for x in r.json()] == [0, 1]
    c = httpx.post(fake.base + "/v1/completions", json={"prompt": ["a", [BOS, 9]], "max_tokens": 4}).json()
    assert [ch["index"] for ch in c["choices"]] == [0, 1] and all(ch["text"] == "Hell" for ch in c["choices"])
    assert c["usage"]["prompt_tokens"] == 4 and c["usage"]["completion_tokens"] == 8
    events = stream_post(fake.base, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]"
    for i in (0, 1):
        ch = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == i]
        assert "".join(x["text"] for x in ch) == "Hell" and ch[-1]["finish_reason"] == "length"


def test_chat_template_usage_and_stream(fake):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = httpx.post(fake.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "model": "whatever"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-") and d["model"] == "fake-model.gguf"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert d["choices"][0]["finish_reason"] == "length"
    rendered = "<system>Be brief.\n<user>Hi\n<assistant>"
    assert fake.engine.submitted[-1][0] == fake.engine.tokenize(rendered, True)
    assert d["usage"] == {"prompt_tokens": 1 + len(rendered), "completion_tokens": 5, "total_tokens": 6 + len(rendered),
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert d["timings"]["predicted_n"] == 5

    events = stream_post(fake.base, "/v1/chat/completions",
                         {"messages": msgs, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == FAKE_ANSWER
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(FAKE_ANSWER)
    assert "timings" in chunks[-1]


def test_openai_client_on_fake(fake):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fake.base + "/v1", api_key="sk-none", max_retries=0, timeout=30)
    out = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert out.choices[0].message.content == FAKE_ANSWER[:8] and out.usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], stream=True) if c.choices)
    assert text == FAKE_ANSWER


BAD_REQUESTS = [
    ("/completion", b"{not json", "invalid json"),
    ("/completion", b"", "empty"),
    ("/completion", b"\xff\xfe", "utf-8"),
    ("/completion", b"[1, 2]", "json object"),
    ("/completion", {"n_predict": 3}, "prompt"),
    ("/completion", {"prompt": {"a": 1}}, "prompt"),
    ("/completion", {"prompt": [1, [2]]}, "prompt"),
    ("/completion", {"prompt": []}, "prompt"),
    ("/completion", {"prompt": "x", "n_predict": "ten"}, "n_predict"),
    ("/completion", {"prompt": "x", "n_predict": -5}, "n_predict"),
    ("/completion", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/completion", {"prompt": "x", "stop": 5}, "stop"),
    ("/completion", {"prompt": "x", "stop": ["a", 1]}, "stop"),
    ("/completion", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/completion", {"prompt": "x", "top_k": True}, "top_k"),
    ("/completion", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/completion", {"prompt": "x", "seed": 1.5}, "seed"),
    ("/completion", {"prompt": [1, 5000]}, "token id"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "'n' must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3},
     "cannot be greater than the number of slots"),
    ("/completion", {"prompt": "x", "n_cmpl": "2"}, "'n_cmpl' must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": [1]}, "max_tokens"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": 1}, "stream_options"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "no"}, "add_special"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "token id"),
    ("/completion", {"prompt": "x", "logprobs": 2}, "are OpenAI fields: use 'n_probs' here"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "'logprobs' must be a non-negative integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs requires logprobs to be set to true"),
    ("/completion", {"prompt": "x", "logit_bias": [[5]]}, "'logit_bias' entries must be [token, bias] pairs"),
    ("/completion", {"prompt": "x", "logit_bias": [[10 ** 9, 1.0]]}, "out of range"),
    ("/completion", {"prompt": "x", "logit_bias": [[5, "a"]]}, "bias must be a number or false"),
    ("/completion", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    # output-changing llama.cpp fields this server does not implement: refused, not silently dropped
    ("/completion", {"prompt": "x", "grammar": "root ::= \"a"}, "grammar"),
    ("/completion", {"prompt": "x", "adaptive_target": 0.5}, "'adaptive_target': not supported"),
    # ik's other samplers are implemented: bad values are named
    ("/completion", {"prompt": "x", "mirostat": 3}, "mirostat"),
    ("/completion", {"prompt": "x", "typical_p": 1.5}, "typical_p"),
    ("/completion", {"prompt": "x", "samplers": "kpz"}, "samplers"),
    ("/completion", {"prompt": "x", "dry_sequence_breakers": []}, "dry_sequence_breakers must be a non-empty array"),
    ("/completion", {"prompt": "x", "dry_sequence_breakers": [1]}, "dry_sequence_breakers"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "9"},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,contains", BAD_REQUESTS, ids=[f"{p}:{c}:{i}" for i, (p, _, c) in enumerate(BAD_REQUESTS)])
def test_bad_requests_are_400_json(fake, path, body, contains):
    if isinstance(body, bytes):
        r = httpx.post(fake.base + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(fake.base + path, json=body)
    assert_error(r, 400, contains=contains)
    assert httpx.get(fake.base + "/health").json()["status"] == "ok"


def test_request_fields_reach_the_engine(fake):
    """Fields the server accepts must change what the engine is asked to do."""
    chat = [{"role": "user", "content": "hi"}]
    off = {"ignore_eos": False, "logit_bias": {}, "grammar": "", "mirostat": 0, "typical_p": 1.0, "tfs_z": 1,
           "top_n_sigma": 0, "xtc_probability": 0, "dry_multiplier": 0, "dynatemp_range": 0,
           "response_format": {"type": "text"}, "json_schema": None}
    for path, body in (("/completion", {"prompt": "x"}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": chat})):
        # the off values of unsupported fields are accepted; the token limit follows llama.cpp's order
        r = httpx.post(fake.base + path, json={**body, **off, "max_completion_tokens": 2})
        assert r.status_code == 200, (path, r.text)
        assert fake.engine.submitted[-1][2] == 2, path
        httpx.post(fake.base + path, json={**body, "max_completion_tokens": 2, "max_tokens": 3}).raise_for_status()
        assert fake.engine.submitted[-1][2] == 3, path
        httpx.post(fake.base + path, json={**body, "max_tokens": 3, "n_predict": 4}).raise_for_status()
        assert fake.engine.submitted[-1][2] == 4, path
        httpx.post(fake.base + path, json={**body, "n_predict": 1, "cache_prompt": False}).raise_for_status()
        assert fake.engine.cache_prompts[-1] is False, path
        httpx.post(fake.base + path, json={**body, "n_predict": 1}).raise_for_status()
        assert fake.engine.cache_prompts[-1] is True, path
    # /v1/messages: max_tokens, else llama-server's 4096
    for extra, want in (({"max_tokens": 3}, 3), ({}, 4096)):
        httpx.post(fake.base + "/v1/messages", json={"messages": chat, **extra}).raise_for_status()
        assert fake.engine.submitted[-1][2] == want, extra
    body = {"prompt": "x", "n_predict": 1, "temperature": 0.25, "top_k": 7, "top_p": 0.5, "min_p": 0.125,
            "repeat_penalty": 1.5, "repeat_last_n": 9, "presence_penalty": 0.75, "frequency_penalty": 0.5, "seed": 77}
    httpx.post(fake.base + "/completion", json=body).raise_for_status()
    p = fake.engine.submitted[-1][1]
    assert {k: getattr(p, k) for k in body if k not in ("prompt", "n_predict")} == \
        {k: v for k, v in body.items() if k not in ("prompt", "n_predict")}


def test_new_sampler_fields_round_trip(fake):
    """ik's other samplers' request fields reach the engine's SamplingParams and come back in
    generation_settings; DRY gets the model's vocabulary; dry_base < 1 means the server's default."""
    fields = {"min_keep": 2, "typical_p": 0.9, "tfs_z": 0.95, "dynatemp_range": 0.25, "dynatemp_exponent": 1.5,
              "mirostat": 2, "mirostat_tau": 4.5, "mirostat_eta": 0.2, "xtc_probability": 0.5, "xtc_threshold": 0.1,
              "top_n_sigma": 1.5, "dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3,
              "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", "###"]}
    d = httpx.post(fake.base + "/completion", json={"prompt": "x", "n_predict": 1, **fields, "samplers": "dkt"}).json()
    p = fake.engine.submitted[-1][1]
    assert {k: getattr(p, k) for k in fields} == {**fields, "dry_sequence_breakers": ("\n", "###")}
    assert p.samplers == ("dry", "top_k", "temperature") and p.vocab is fake.engine.model.tokenizer
    gs = d["generation_settings"]
    assert {k: gs[k] for k in fields} == fields and gs["samplers"] == ["dry", "top_k", "temperature"]
    httpx.post(fake.base + "/completion", json={"prompt": "x", "n_predict": 1, "samplers": ["top_k", "temperature"],
                                                "dry_base": 0.5}).raise_for_status()
    p = fake.engine.submitted[-1][1]
    assert p.samplers == ("top_k", "temperature") and p.dry_base == 1.75 and p.vocab is None
    props = httpx.get(fake.base + "/props").json()["default_generation_settings"]
    assert props["samplers"] == ["dry", "top_k", "tfs_z", "typical_p", "top_p", "min_p", "xtc", "top_n_sigma",
                                 "temperature", "adaptive_p"] and props["xtc_threshold"] == 1.0


def test_server_defaults_seed_and_n_predict_cap():
    eng = FakeEngine()
    srv = ServerThread(_fake_app(eng, default_n_predict=4, log_requests=False,
                                 default_sampling={"seed": 123, "temperature": 0.25, "top_k": 3, "penalize_nl": True}))
    try:
        d = httpx.post(srv.base + "/completion", json={"prompt": "x"}).json()
        assert d["content"] == FAKE_ANSWER[:4] and d["stop_type"] == "limit"
        _prompt, params, n_predict, _stop = eng.submitted[-1]
        assert n_predict == 4 and (params.seed, params.temperature, params.top_k, params.penalize_nl) == (123, 0.25, 3, True)
        httpx.post(srv.base + "/completion", json={"prompt": "x", "n_predict": 50, "seed": 5, "top_k": 9}).raise_for_status()
        _prompt, params, n_predict, _stop = eng.submitted[-1]
        assert n_predict == 4 and (params.seed, params.top_k, params.temperature) == (5, 9, 0.25)   # -n caps; its own values win
        httpx.post(srv.base + "/completion", json={"prompt": "x", "n_predict": 2}).raise_for_status()
        assert eng.submitted[-1][2] == 2
    finally:
        srv.stop()


class SeededFake(FakeEngine):
    """A fake whose answer names the job's sampling seed: which choice is which shows in the text."""

    def answer_for(self, params) -> str:
        return f"seed {params.seed}."


@pytest.fixture(scope="module")
def seeded():
    eng = SeededFake(n_parallel=3)
    srv = ServerThread(_fake_app(eng, log_requests=False))
    yield SimpleNamespace(engine=eng, base=srv.base)
    srv.stop()


def test_n_choices_chat(seeded):
    """OpenAI's n as llama-server's n_cmpl: n jobs of the same prompt, choice j sampling with seed + j
    (a fixed seed gives distinct yet reproducible choices), choices in index order, the prompt counted
    once in usage and the completion tokens of every choice."""
    msgs = [{"role": "user", "content": "hi"}]
    one = httpx.post(seeded.base + "/v1/chat/completions", json={"messages": msgs, "seed": 42}).json()
    k = len(seeded.engine.submitted)
    d = httpx.post(seeded.base + "/v1/chat/completions", json={"messages": msgs, "seed": 42, "n": 3}).json()
    assert [c["index"] for c in d["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in d["choices"]] == ["seed 42.", "seed 43.", "seed 44."]
    assert all(c["finish_reason"] == "stop" for c in d["choices"])
    assert [p.seed for _pr, p, _n, _s in seeded.engine.submitted[k:]] == [42, 43, 44]
    assert len({tuple(pr) for pr, _p, _n, _s in seeded.engine.submitted[k - 1:]}) == 1   # the same prompt
    n_prompt = one["usage"]["prompt_tokens"]
    assert d["usage"] == {"completion_tokens": 3 * len("seed 42."), "prompt_tokens": n_prompt,
                          "total_tokens": n_prompt + 3 * len("seed 42."), "prompt_tokens_details": {"cached_tokens": 0}}
    assert d["choices"][0]["message"]["content"] == one["choices"][0]["message"]["content"]   # choice 0 = n=1
    # no seed: every choice draws its own random seed (-1 reaches each job)
    k = len(seeded.engine.submitted)
    httpx.post(seeded.base + "/v1/chat/completions", json={"messages": msgs, "n": 2}).raise_for_status()
    assert [p.seed for _pr, p, _n, _s in seeded.engine.submitted[k:]] == [-1, -1]
    # n_cmpl (llama-server's name) wins over n
    d = httpx.post(seeded.base + "/v1/chat/completions", json={"messages": msgs, "seed": 7, "n": 3, "n_cmpl": 2}).json()
    assert [c["message"]["content"] for c in d["choices"]] == ["seed 7.", "seed 8."]

    # streamed: a role chunk per choice, each chunk's choices[0].index routes its text, a finish chunk
    # per choice with that choice's usage, then (include_usage) the request's usage with empty choices
    events = stream_post(seeded.base, "/v1/chat/completions", {"messages": msgs, "seed": 42, "n": 3, "stream": True,
                                                               "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in chunks[:3])
    text = {0: "", 1: "", 2: ""}
    finished = {}
    for c in chunks[3:-1]:
        assert len(c["choices"]) == 1
        ch = c["choices"][0]
        text[ch["index"]] += ch["delta"].get("content") or ""
        if ch["finish_reason"]:
            finished[ch["index"]] = c["usage"]["completion_tokens"]
    assert text == {0: "seed 42.", 1: "seed 43.", 2: "seed 44."}
    assert finished == {0: 8, 1: 8, 2: 8}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    assert chunks[-1]["usage"]["prompt_tokens"] == n_prompt and "timings" in chunks[-1]


def test_n_choices_completions(seeded):
    """/v1/completions: prompts x n choices, index p * n + j (llama-server's order); /completion takes
    n_cmpl (or n) too and answers a list."""
    k = len(seeded.engine.submitted)
    d = httpx.post(seeded.base + "/v1/completions", json={"prompt": ["ab", "cdef"], "n": 2, "seed": 10}).json()
    assert [(c["index"], c["text"]) for c in d["choices"]] == [(0, "seed 10."), (1, "seed 11."),
                                                               (2, "seed 10."), (3, "seed 11.")]
    sub = seeded.engine.submitted[k:]
    assert [len(pr) for pr, _p, _n, _s in sub] == [3, 3, 5, 5] and [p.seed for _pr, p, _n, _s in sub] == [10, 11, 10, 11]
    assert d["usage"]["prompt_tokens"] == 3 + 5 and d["usage"]["completion_tokens"] == 4 * 8
    events = stream_post(seeded.base, "/v1/completions", {"prompt": "ab", "n": 3, "seed": 1, "stream": True})
    text: dict = {}
    for c in events[:-1]:
        text[c["choices"][0]["index"]] = text.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert text == {0: "seed 1.", 1: "seed 2.", 2: "seed 3."} and events[-1] == "[DONE]"

    out = httpx.post(seeded.base + "/completion", json={"prompt": ["ab", "cd"], "n_cmpl": 2, "seed": 5}).json()
    assert [(r["index"], r["prompt"], r["content"]) for r in out] == [
        (0, "ab", "seed 5."), (1, "ab", "seed 6."), (2, "cd", "seed 5."), (3, "cd", "seed 6.")]
    out = httpx.post(seeded.base + "/completion", json={"prompt": "ab", "n": 2, "seed": 5}).json()
    assert [r["content"] for r in out] == ["seed 5.", "seed 6."]
    events = stream_post(seeded.base, "/completion", {"prompt": "ab", "n_cmpl": 2, "seed": 0, "stream": True})
    text = {}
    for e in events:
        text[e["index"]] = text.get(e["index"], "") + e["content"]
    assert text == {0: "seed 0.", 1: "seed 1."} and sum(e["stop"] for e in events) == 2
    # a seed at the top of the range wraps; the limits are named
    k = len(seeded.engine.submitted)
    httpx.post(seeded.base + "/completion", json={"prompt": "ab", "n": 2, "seed": 2 ** 64 - 1}).raise_for_status()
    assert [p.seed for _pr, p, _n, _s in seeded.engine.submitted[k:]] == [2 ** 64 - 1, 0]
    assert_error(httpx.post(seeded.base + "/v1/completions", json={"prompt": "x", "n": 4}), 400,
                 contains="'n' (4) cannot be greater than the number of slots (3)")
    assert_error(httpx.post(seeded.base + "/completion", json={"prompt": "x", "n_cmpl": -1}), 400,
                 contains="'n_cmpl' must be >= 1")


def test_unknown_route_method_and_too_long_prompt(fake):
    assert_error(httpx.get(fake.base + "/no/such/route"), 404, "not_found_error", "not found")
    assert_error(httpx.post(fake.base + "/v2/chat"), 404, "not_found_error")
    assert_error(httpx.get(fake.base + "/v1/chat/completions"), 405)
    err = assert_error(httpx.post(fake.base + "/completion", json={"prompt": "y" * 200}), 400,
                       "exceed_context_size_error", "context")
    assert err["n_prompt_tokens"] == 201 and err["n_ctx"] == 96
    assert_error(httpx.post(fake.base + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "z" * 300}]}), 400, "exceed_context_size_error")


def test_tokenize_detokenize(fake):
    r = httpx.post(fake.base + "/tokenize", json={"content": "héllo"}).json()
    assert r["tokens"] == fake.engine.tokenize("héllo", False)
    assert httpx.post(fake.base + "/detokenize", json={"tokens": r["tokens"]}).json() == {"content": "héllo"}
    with_bos = httpx.post(fake.base + "/tokenize", json={"content": "a", "add_special": True}).json()["tokens"]
    assert with_bos == [BOS, ord("a") + 3]
    pieces = httpx.post(fake.base + "/tokenize", json={"content": "é", "with_pieces": True}).json()["tokens"]
    assert [p["piece"] for p in pieces] == [[0xC3], [0xA9]]   # bytes that are not UTF-8 on their own


@pytest.fixture()
def slow():
    """A fake whose answer is long and slow, for the disconnect checks."""
    eng = FakeEngine(n_parallel=1, n_ctx_slot=100000, delay=0.01, answer="x" * 5000)
    srv = ServerThread(_fake_app(eng, log_requests=False))
    yield SimpleNamespace(engine=eng, base=srv.base)
    srv.stop()


def _idle(base: str) -> bool:
    return httpx.get(base + "/health").json()["slots_idle"] == 1


def test_stream_disconnect_cancels_the_job(slow):
    for path, body in (("/completion", {"prompt": "x", "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})):
        with httpx.Client(timeout=10) as client:
            with client.stream("POST", slow.base + path, json=body) as r:
                for line in r.iter_lines():
                    if '"x"' in line:        # the first generated text
                        break
        t0 = time.time()
        ev = slow.engine.finals.get(timeout=3)
        assert ev.finish_reason == "cancelled" and ev.n_generated < 300
        wait_until(lambda: _idle(slow.base), 3, "the slot to be free")
        assert time.time() - t0 < 3


def test_non_stream_disconnect_cancels_the_job(slow):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.base + "/completion", json={"prompt": "x"}, timeout=0.3)
    ev = slow.engine.finals.get(timeout=3)
    assert ev.finish_reason == "cancelled" and ev.n_generated < 300
    wait_until(lambda: _idle(slow.base), 3, "the slot to be free")
    # the slot serves the next request
    d = httpx.post(slow.base + "/completion", json={"prompt": "x", "n_predict": 3}, timeout=10).json()
    assert d["content"] == "xxx"


def test_engine_failure_is_an_error_not_an_answer():
    srv = ServerThread(_fake_app(FakeEngine(fail_after=3), log_requests=False))
    try:
        assert_error(httpx.post(srv.base + "/completion", json={"prompt": "x"}), 500, "server_error", "engine")
        events = stream_post(srv.base, "/completion", {"prompt": "x", "stream": True})
        assert "".join(e.get("content", "") for e in events[:-1]) == "Hel"
        assert events[-1]["error"]["type"] == "server_error"
        events = stream_post(srv.base, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert events[-1]["error"]["code"] == 500 and "[DONE]" not in events
        assert httpx.get(srv.base + "/health").json()["status"] == "ok"
    finally:
        srv.stop()


def test_cli_errors_before_loading(capsys):
    from ikcli.app import main
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        for args, msg in ((["--port", str(busy.getsockname()[1])], "couldn't bind HTTP server socket"),
                          (["-np", "0"], "--parallel must be >= 1"),
                          (["--port", "70000"], "--port must be between 0 and 65535"),
                          (["--chat-template-file", "/no/such/file.jinja"], "cannot read chat template file"),
                          (["--chat-template", "llama-9"], "the supplied chat template is not supported: llama-9"),
                          (["--jinja", "--chat-template", "{% if %}"], "the supplied chat template is not supported"),
                          (["--chat-template", "llama3", "--chat-template-file", "t.jinja"], "not both"),
                          (["--api-key-file", "/no/such/keys.txt"], "failed to open file '/no/such/keys.txt'"),
                          (["--top-p", "1.5"], "--top-p: Sampling parameter 'top_p' must be between 0 and 1"),
                          (["--repeat-penalty", "0"], "--repeat-penalty: Sampling parameter 'repeat_penalty' must be > 0"),
                          (["--mirostat", "3"], "--mirostat: Sampling parameter 'mirostat' must be 0"),
                          (["--typical", "2"], "--typical: Sampling parameter 'typical_p'"),
                          (["--dry-penalty-last-n", "-2"], "--dry-penalty-last-n: Sampling parameter"),
                          (["--samplers", "top_k;bogus"], "--samplers: Sampling parameter 'samplers': unknown sampler 'bogus'"),
                          (["--sampling-seq", "kq"], "--sampling-seq: Sampling parameter 'samplers': unknown sampler letter 'q'"),
                          (["--samplers", "top_k", "--sampling-seq", "k"], "either --samplers or --sampling-seq")):
            with pytest.raises(SystemExit) as e:
                main(["server", *args])
            assert e.value.code == 1
            assert msg in capsys.readouterr().err
    finally:
        busy.close()


def test_builtin_chat_template_name_replaces_the_gguf_template(capsys):
    """--chat-template NAME: ik's built-in format is used for chat prompts instead of the GGUF's."""
    from engine.chat_template import render_builtin
    from ikcli.server_cmd import _builtin_or_jinja
    template, render = _builtin_or_jinja("llama3", False, None)
    srv = ServerThread(_fake_app(FakeEngine(), chat_template=template, render_chat=render, log_requests=False))
    try:
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": " hi "}]
        r = httpx.post(srv.base + "/apply-template", json={"messages": msgs})
        assert r.json() == {"prompt": render_builtin("llama3", msgs)}
        assert r.json()["prompt"].endswith("user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        props = httpx.get(srv.base + "/props").json()
        assert props["chat_template"] == "llama3" and props["chat_format"] == "llama3"
    finally:
        srv.stop()
    # with --jinja, a value that is no built-in name is a Jinja template (ik's --jinja behaviour)
    assert _builtin_or_jinja("{{ messages[0].content }}", True, None) == ("{{ messages[0].content }}", None)
    assert _builtin_or_jinja(None, True, None) == (None, None)
    with pytest.raises(Exception, match="chatml, command-r"):
        _builtin_or_jinja("nope", False, None)


def test_api_key():
    srv = ServerThread(_fake_app(FakeEngine(), api_key="secret-1234", log_requests=False))
    try:
        assert httpx.get(srv.base + "/health").status_code == 200          # public, as in llama.cpp
        assert httpx.get(srv.base + "/v1/models").status_code == 200
        assert_error(httpx.post(srv.base + "/completion", json={"prompt": "x"}), 401, "authentication_error")
        assert_error(httpx.post(srv.base + "/completion", json={"prompt": "x"},
                                headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
        r = httpx.post(srv.base + "/completion", json={"prompt": "x", "n_predict": 2},
                       headers={"Authorization": "Bearer secret-1234"})
        assert r.status_code == 200 and r.json()["content"] == "He"
        # a browser's CORS preflight needs no key
        r = httpx.options(srv.base + "/v1/chat/completions",
                          headers={"Origin": "http://example.org", "Access-Control-Request-Method": "POST",
                                   "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.org")
    finally:
        srv.stop()


def test_request_log_line(capsys):
    srv = ServerThread(_fake_app(FakeEngine()))
    try:
        httpx.get(srv.base + "/health?x=1")
    finally:
        srv.stop()
    out = capsys.readouterr().out
    assert re.search(r'^INFO \[\s+log_server_request\] request \| method="GET" params=\{"x":"1"\} path="/health" '
                     r'remote_addr="127.0.0.1" remote_port=\d+ status=200 tid="\d+" timestamp=\d+$', out, re.M), out


def _log_fields(line: str) -> dict:
    """The key=JSON pairs after ' | ' of a server log line."""
    rest, fields, dec = line.split(" | ", 1)[1], {}, json.JSONDecoder()
    while rest.strip():
        key, rest = rest.strip().split("=", 1)
        fields[key], end = dec.raw_decode(rest)
        rest = rest[end:]
    return fields


def test_verbose_request_lines(capsys):
    """-v: ik's VERB line with the request body and the response body (empty for a stream)."""
    srv = ServerThread(_fake_app(FakeEngine(), verbose=True))
    try:
        httpx.post(srv.base + "/completion", json={"prompt": "x", "n_predict": 2}).raise_for_status()
        with httpx.stream("POST", srv.base + "/completion", json={"prompt": "x", "n_predict": 2, "stream": True}) as r:
            r.read()
    finally:
        srv.stop()
    verb = [_log_fields(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("VERB")]
    assert len(verb) == 2, verb
    assert json.loads(verb[0]["request"]) == {"prompt": "x", "n_predict": 2}
    assert json.loads(verb[0]["response"])["content"] == "He"
    assert json.loads(verb[1]["request"])["stream"] is True and verb[1]["response"] == ""


# ============================================================================ the real server

def _serving_available() -> str:
    try:
        import engine.serving  # noqa: F401
        import engine.sampling  # noqa: F401
        import engine.chat_template  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"engine.serving is not usable yet ({type(e).__name__}: {e})"
    from ikcli.defaults import demo_model
    if not os.path.exists(demo_model()):
        return "the embedded demo model is missing"
    return ""


real = pytest.mark.skipif(bool(_serving_available()), reason=_serving_available() or "n/a")


@pytest.fixture(scope="module")
def server():
    """`ikcli server` on the demo model (ctx 256 over 4 slots) on a free port; stopped with SIGTERM."""
    if _serving_available():
        pytest.skip(_serving_available())
    s = launch_server("-c", "256", "-np", "4", "-t", "2", timeout=60)
    yield s
    rc = stop_server(s)
    assert rc == 0, "".join(s.err[-20:])
    assert any("HTTP server stopped" in x for x in s.out)


def _complete(base: str, prompt: str, seed: int, n: int = 24, **kw) -> dict:
    r = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": n, "seed": seed, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(base: str, prompt: str, seed: int, n: int = 24) -> str:
    events = stream_post(base, "/completion", {"prompt": prompt, "n_predict": n, "seed": seed, "stream": True})
    assert events[-1]["stop"] is True
    return "".join(e["content"] for e in events)


@real
def test_real_health_props_tokenize(server):
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    props = httpx.get(server.base + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 64
    assert props["model_path"].endswith("demo-deepseek2.gguf") and "chat_template" in props
    toks = httpx.post(server.base + "/tokenize", json={"content": "Hello world, it is me."}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    back = httpx.post(server.base + "/detokenize", json={"tokens": toks}).json()["content"]
    assert back == "Hello world, it is me."
    with_bos = httpx.post(server.base + "/tokenize", json={"content": "Hello world, it is me.", "add_special": True})
    assert len(with_bos.json()["tokens"]) == len(toks) + 1


@real
def test_real_completion_stream_non_stream_and_stop(server):
    d = _complete(server.base, "ROMEO:", seed=5)
    assert d["tokens_predicted"] <= 24 and d["stop_type"] in ("limit", "eos") and d["content"]
    assert d["timings"]["predicted_n"] == d["tokens_predicted"] and d["timings"]["prompt_n"] == d["tokens_evaluated"]
    assert _stream_text(server.base, "ROMEO:", seed=5) == d["content"]
    text = d["content"]
    if len(text) >= 14:
        stop = text[10:13]
        s = _complete(server.base, "ROMEO:", seed=5, stop=[stop])
        assert s["content"] == text[:text.find(stop)] and s["stop_type"] == "word" and s["stopping_word"] == stop


@real
def test_real_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="sk-none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["demo"]
    msgs = [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Speak."}]
    chat = client.chat.completions.create(model="demo", messages=msgs, max_tokens=12, seed=7)
    content = chat.choices[0].message.content
    assert isinstance(content, str) and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 0 and 0 < chat.usage.completion_tokens <= 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="demo", messages=msgs, max_tokens=12, seed=7, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    cmpl = client.completions.create(model="demo", prompt="JULIET:", max_tokens=10, seed=3)
    assert cmpl.choices[0].text and cmpl.usage.completion_tokens <= 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt="JULIET:", max_tokens=10, seed=3, stream=True) if c.choices)
    assert streamed == cmpl.choices[0].text


@real
def test_real_n_choices(server):
    """n = 2 on the demo model: choice j is what seed + j answers alone (the choices run side by
    side on two slots, batched, and still match), in index order; usage counts the prompt once."""
    msgs = [{"role": "user", "content": "Speak."}]
    body = {"messages": msgs, "max_tokens": 8, "temperature": 1.0}
    alone = [httpx.post(server.base + "/v1/chat/completions", json={**body, "seed": s}, timeout=60).json()
             for s in (7, 8)]
    d = httpx.post(server.base + "/v1/chat/completions", json={**body, "seed": 7, "n": 2}, timeout=60).json()
    assert [c["index"] for c in d["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in d["choices"]] == [a["choices"][0]["message"]["content"] for a in alone]
    assert d["choices"][0]["message"]["content"] != d["choices"][1]["message"]["content"]   # seeds 7 and 8 differ here
    assert d["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert d["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)


@real
def test_real_bad_input_keeps_serving(server):
    assert_error(httpx.post(server.base + "/completion", content=b'{"prompt": ', headers={"Content-Type": "application/json"}), 400)
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    assert_error(httpx.post(server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                        "temperature": "hot"}), 400, contains="temperature")
    assert_error(httpx.get(server.base + "/v1/engines"), 404, "not_found_error")
    # a prompt longer than the slot: cut to fit (context shift is on by default, as in ik)
    r = httpx.post(server.base + "/completion", json={"prompt": "the king " * 40, "n_predict": 4}, timeout=60).json()
    assert r["truncated"] and r["tokens_evaluated"] < 64 and r["tokens_predicted"] == 4
    assert _complete(server.base, "KING:", seed=1, n=4)["tokens_predicted"] <= 4


@real
def test_real_concurrent_streams_match_alone(server):
    jobs = [("ROMEO:", 1), ("JULIET:\nO", 2), ("First Citizen:\nWe are", 3), ("KING", 4)]
    alone = [_stream_text(server.base, p, s, 40) for p, s in jobs]
    together: list = [None] * len(jobs)
    errors: list = []

    def run(i: int) -> None:
        try:
            together[i] = _stream_text(server.base, *jobs[i], 40)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    t0 = time.time()
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200   # the loop is not blocked
    assert time.time() - t0 < 2
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert together == alone


@pytest.fixture(scope="module")
def inproc():
    """The real ServingEngine in this process (one slot of 256), its final events recorded."""
    if _serving_available():
        pytest.skip(_serving_available())
    from engine.model import load_model, quiet_log
    from engine.serving import ServingEngine
    from ikcli import common
    from ikcli.defaults import demo_model

    class Spy:
        def __init__(self, eng) -> None:
            self.eng, self.finals = eng, queue.Queue()

        def __getattr__(self, name):
            return getattr(self.eng, name)

        def submit(self, prompt, params, n_predict, stop, on_event):
            def cb(ev) -> None:
                if ev.done:
                    self.finals.put(ev)
                on_event(ev)
            return self.eng.submit(prompt, params, n_predict, stop, cb)

    path = demo_model()
    flags = common.EngineFlags(mla=3, fa="on", amb=256, ctk="f16", ctv="f16", fmoe="1", ser=None, ot=None)
    cfg = common.engine_config(path, flags, n_ctx=256, n_batch=2048, n_ubatch=512, threads=2, threads_batch=2)
    eng = ServingEngine(load_model(path, quiet_log), cfg, 1, quiet_log)
    eng.start()
    spy = Spy(eng)
    srv = ServerThread(create_app(spy, model_path=path, log_requests=False))
    yield SimpleNamespace(base=srv.base, spy=spy)
    srv.stop()
    eng.shutdown()


@real
def test_real_disconnect_frees_the_slot(inproc):
    for path, body in (("/completion", {"prompt": "ROMEO:", "stream": True, "seed": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})):
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", inproc.base + path, json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content":"' in line:
                        break
        ev = inproc.spy.finals.get(timeout=10)
        assert ev.finish_reason == "cancelled", ev
        assert ev.n_generated < 150    # it would run to ~250 tokens (the slot's end) if not cancelled
        wait_until(lambda: httpx.get(inproc.base + "/health").json()["slots_idle"] == 1, 5, "the slot to be free")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(inproc.base + "/completion", json={"prompt": "ROMEO:"}, timeout=0.15)
    ev = inproc.spy.finals.get(timeout=10)
    assert ev.finish_reason == "cancelled"
    d = httpx.post(inproc.base + "/completion", json={"prompt": "ROMEO:", "n_predict": 4}, timeout=30).json()
    assert d["tokens_predicted"] == 4


@real
def test_real_16_streams_on_4_slots_match_alone(server):
    """16 concurrent streaming clients on 4 slots (12 wait in the queue): all complete, each with the
    text it gives when run alone with the same seed."""
    jobs = [(f"{name}:\n", 10 + i) for i, name in enumerate(
        ["ROMEO", "JULIET", "HAMLET", "OPHELIA", "MACBETH", "BANQUO", "LEAR", "CORDELIA", "OTHELLO", "IAGO",
         "PROSPERO", "ARIEL", "PUCK", "OBERON", "TITANIA", "PORTIA"])]
    alone = [_stream_text(server.base, p, s, 12) for p, s in jobs]
    together: list = [None] * len(jobs)
    errors: list = []

    def run(i: int) -> None:
        try:
            together[i] = _stream_text(server.base, *jobs[i], 12)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert together == alone


@real
def test_real_burst_of_requests_loses_none(server):
    """200 requests at once (queued behind 4 slots): every one is answered, /health stays up."""
    import asyncio

    async def burst():
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as c:
            reqs = [c.post("/completion", json={"prompt": f"Line {i}:", "n_predict": 2, "seed": i})
                    for i in range(200)]
            health = c.get("/health")
            return await asyncio.gather(*reqs), await health

    results, health = asyncio.run(burst())
    assert health.status_code == 200
    assert [r.status_code for r in results] == [200] * 200
    assert all(r.json()["tokens_predicted"] >= 1 for r in results)


# ============================================================ each family's real chat template

FAMILY_TEMPLATES = [("qwen3moe", "Qwen-Qwen3-0.6B.jinja"), ("qwen2moe", "Qwen-Qwen2.5-7B-Instruct.jinja"),
                    ("glm4moe", "GLM-4.6.jinja"), ("gemma3", "google-gemma-2-2b-it.jinja"),
                    ("gpt-oss", "openai-gpt-oss-120b.jinja"), ("deepseek2", "Kimi-K2-Instruct.jinja")]


@pytest.mark.parametrize("arch,template", FAMILY_TEMPLATES)
def test_chat_through_each_family_template(make_model, shared_dir, arch, template):
    """A chat request on a model of each new architecture, its prompt rendered by the family's
    real template (../shared/templates): answered, and the prompt is the rendered template's."""
    from engine.chat_template import render_chat
    from engine.config import EngineConfig
    from engine.model import load_model, quiet_log
    from engine.serving import ServingEngine
    from ikcli.server_app import create_app
    path = make_model(arch=arch, qtype="f16")
    text = (shared_dir / "templates" / template).read_text(encoding="utf-8")
    m = load_model(path, quiet_log)
    eng = ServingEngine(m, EngineConfig(path, n_ctx=1024, n_threads=2), 1, quiet_log)   # gpt-oss: a long preamble
    eng.start()
    srv = ServerThread(create_app(eng, m, model_path=path, alias=arch, chat_template=text, log_requests=False))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    try:
        r = httpx.post(srv.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        d = r.json()
        tok = m.tokenizer
        prompt = render_chat(msgs, text, tok.token_to_piece(tok.bos_id, True), tok.token_to_piece(tok.eos_id, True),
                             True)[0]
        assert "Say hi" in prompt and d["usage"]["prompt_tokens"] in (len(eng.tokenize(prompt, True)),
                                                                       len(eng.tokenize(prompt, True)) - 1)
        assert d["choices"][0]["message"]["role"] == "assistant" and d["usage"]["completion_tokens"] <= 3
    finally:
        srv.stop()
        eng.shutdown()


# ============================================================ bad text and dropped clients (issue 18)

# raw bodies (httpx's json= cannot even encode a lone surrogate): each must be a 400 naming the field
SURROGATE_REQUESTS = [
    ("/completion", rb'{"prompt":"\ud800abc"}', "invalid text in 'prompt': lone UTF-16 surrogate at position 0"),
    ("/completion", rb'{"prompt":"x","stop":["ok","\udfff"]}', "'stop[1]'"),
    ("/completion", rb'{"prompt":"x","stop":"a\udc00"}', "'stop': lone UTF-16 surrogate at position 1"),
    ("/completion", rb'{"prompt":["ab",[5,6],"\uDBFF"]}', "'prompt[2]'"),
    ("/completion", rb'{"prompt":"x","\ud800key":1}', "a key of the request body"),
    ("/completions", rb'{"prompt":"\ud800"}', "'prompt'"),
    ("/v1/completions", rb'{"prompt":"\udc00"}', "'prompt'"),
    ("/v1/completions", rb'{"prompt":["a","\ud800"],"stream":true}', "'prompt[1]'"),
    ("/v1/chat/completions", rb'{"messages":[{"role":"user","content":"a\ud800"}]}',
     "invalid text in 'messages[0].content': lone UTF-16 surrogate at position 1"),
    ("/v1/chat/completions", rb'{"messages":[{"role":"user","content":[{"type":"text","text":"\ud800"}]}]}',
     "'messages[0].content[0].text'"),
    ("/chat/completions", rb'{"messages":[{"role":"\udbff","content":"x"}]}', "'messages[0].role'"),
    ("/tokenize", rb'{"content":"\ud800"}', "'content'"),
    ("/tokenize", rb'{"content":"ok","with_pieces":true,"x":{"\udc00":1}}', "a key of 'x'"),
    ("/detokenize", rb'{"tokens":[70],"note":"\ud800"}', "'note'"),
]


@pytest.mark.parametrize("path,raw,contains", SURROGATE_REQUESTS,
                         ids=[f"{p}:{i}" for i, (p, _, _c) in enumerate(SURROGATE_REQUESTS)])
def test_lone_surrogates_are_400_json(fake, path, raw, contains):
    r = httpx.post(fake.base + path, content=raw, headers={"Content-Type": "application/json"}, timeout=10)
    assert_error(r, 400, contains=contains)
    assert "\\ud" not in r.text.lower()    # the message names the field, it does not echo the bad text
    assert httpx.get(fake.base + "/health").json()["status"] == "ok"


def test_valid_surrogate_pairs_and_escapes_are_text(fake):
    """A \\ud83d\\ude00 pair is one character (U+1F600), and an escaped backslash before 'ud800' is
    plain text: neither is refused."""
    for raw, text in ((rb'{"content":"\ud83d\ude00"}', "\U0001F600"), (rb'{"content":"\\ud800"}', "\\ud800")):
        r = httpx.post(fake.base + "/tokenize", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == fake.engine.tokenize(text, False)


def test_too_long_number_is_400(fake):
    raw = b'{"prompt":"x","seed":' + b"9" * 5000 + b"}"     # past Python's int() digit limit
    r = httpx.post(fake.base + "/completion", content=raw, headers={"Content-Type": "application/json"})
    assert_error(r, 400, contains="too many digits")
    assert httpx.get(fake.base + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("path,raw", [
    ("/completion", rb'{"prompt":"\ud800abc","stream":true}'),
    ("/completion", rb'{"prompt":"x","stop":["\ud800"],"stream":true}'),
    ("/v1/completions", rb'{"prompt":"x","stop":"\udfff","stream":true}'),
    ("/v1/chat/completions", rb'{"messages":[{"role":"user","content":"\ud800"}],"stream":true}'),
], ids=["completion-prompt", "completion-stop", "v1-completions-stop", "chat-content"])
def test_stream_with_a_surrogate_is_400_before_any_event(fake, path, raw):
    n_jobs = len(fake.engine.submitted)
    with httpx.stream("POST", fake.base + path, content=raw, headers={"Content-Type": "application/json"},
                      timeout=10) as r:
        body = r.read()
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), body
    assert b"data:" not in body
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert len(fake.engine.submitted) == n_jobs        # nothing reached the engine
    assert httpx.get(fake.base + "/health").json() == {"status": "ok", "slots_idle": 2, "slots_processing": 0}


def test_client_dropping_mid_body_is_one_log_line(capsys):
    """A client that sends its headers (Content-Length: 1000) and 10 body bytes, then closes: one
    `request | ... client disconnected` line, no traceback, and the server goes on serving."""
    srv = ServerThread(_fake_app(FakeEngine()))
    out, err = "", ""
    try:
        for path in ("/completion", "/v1/chat/completions"):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      "Content-Length: 1000\r\n\r\n".encode() + b'{"prompt":')
            time.sleep(0.1)
            s.close()
        t0 = time.time()
        while out.count("client disconnected") < 2 and time.time() - t0 < 5:
            time.sleep(0.05)
            o, e = capsys.readouterr()
            out, err = out + o, err + e
        r = httpx.post(srv.base + "/completion", json={"prompt": "x", "n_predict": 2}, timeout=10)
        assert r.status_code == 200 and r.json()["content"] == "He"
    finally:
        srv.stop()
    o, e = capsys.readouterr()
    out, err = out + o, err + e
    assert "Traceback" not in out + err and "ClientDisconnect" not in out + err, out + err
    assert "Exception in ASGI application" not in err, err
    lines = [ln for ln in (out + err).splitlines() if "client disconnected" in ln]
    assert len(lines) == 2, out + err
    for ln, path in zip(lines, ("/completion", "/v1/chat/completions")):
        assert ln.startswith("INFO [      log_server_request] request | "), ln
        fields = _log_fields(ln)
        assert fields["path"] == path and fields["method"] == "POST" and fields["status"] == 400, fields


def test_queued_stream_dropped_before_its_turn_frees_everything(slow):
    """One slot: stream A runs, stream B waits for the slot; B's client leaves, then A's: both jobs
    end cancelled and the slot is free (a dropped waiting client must not take the slot later)."""
    body = {"prompt": "x", "stream": True}
    with httpx.Client(timeout=10) as ca, httpx.Client(timeout=10) as cb:
        with ca.stream("POST", slow.base + "/completion", json=body) as ra:
            lines = ra.iter_lines()
            for line in lines:
                if '"x"' in line:
                    break
            with cb.stream("POST", slow.base + "/completion", json=body) as rb:
                assert rb.status_code == 200
                wait_until(lambda: len(slow.engine.submitted) == 2, 3, "the second job to be queued")
    evs = [slow.engine.finals.get(timeout=3), slow.engine.finals.get(timeout=3)]
    assert all(ev.finish_reason == "cancelled" for ev in evs), evs
    assert sorted(ev.n_generated for ev in evs)[0] == 0        # B never generated
    wait_until(lambda: _idle(slow.base), 3, "the slot to be free")
    d = httpx.post(slow.base + "/completion", json={"prompt": "x", "n_predict": 2}, timeout=10).json()
    assert d["content"] == "xx"


@real
def test_llama_server_simple_endpoints_and_cors(server):
    """/version, /v1/props, /health?include_slots, /detokenize joining pieces (special ones too),
    CORS as llama-server (Origin echoed, preflight with credentials and GET, POST)."""
    assert httpx.get(server.base + "/version").json() == {"version": 4, "features": {"sql": False,
                                                                                      "zstd_compression": False}}
    p = httpx.get(server.base + "/v1/props").json()
    assert set(p) == {"model_name", "model_path", "modalities", "n_ctx"} and p["n_ctx"] == 256
    h = httpx.get(server.base + "/health?include_slots").json()
    assert h["status"] == "ok" and len(h["slots"]) == 4 and h["slots"][0]["n_ctx"] == 64
    bos = httpx.get(server.base + "/props").json()["bos_token"]
    toks = httpx.post(server.base + "/tokenize", json={"content": " hello", "add_special": True}).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": toks}).json()["content"]
    assert text == bos + " hello"
    r = httpx.get(server.base + "/health", headers={"Origin": "http://a.example"})
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    r = httpx.options(server.base + "/v1/chat/completions", headers={"Origin": "http://a.example",
                                                                       "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST" and r.text == ""
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]})
    assert r.status_code == 400 and "Cannot have 2 or more assistant messages at the end" in r.text


@real
def test_real_cached_tokens(server):
    """usage.prompt_tokens_details.cached_tokens on the real engine: the same conversation again finds
    its prefix in a slot (cache_prompt) and reports the reused tokens; cache_prompt: false reports 0."""
    body = {"messages": [{"role": "user", "content": "Tell me about the king, the queen and all of the lords."}],
            "max_tokens": 2, "temperature": 0}
    httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60).raise_for_status()
    d = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60).json()
    cached = d["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < d["usage"]["prompt_tokens"], d["usage"]
    assert cached == d["usage"]["prompt_tokens"] - d["timings"]["prompt_n"]
    d = httpx.post(server.base + "/v1/chat/completions", json={**body, "cache_prompt": False}, timeout=60).json()
    assert d["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert d["system_fingerprint"].startswith("b")


@real
def test_completion_probabilities(server):
    """/completion with n_probs: llama-server's completion_probabilities, one entry per generated
    token with the top n_probs tokens (softmax of the raw logits), the greedy choice first; the
    same per chunk when streaming."""
    body = {"prompt": "ROMEO:", "n_predict": 6, "temperature": 0, "n_probs": 3}
    d = httpx.post(server.base + "/completion", json=body, timeout=60).json()
    cp = d["completion_probabilities"]
    assert len(cp) == d["tokens_predicted"] and all(len(e["probs"]) == 3 for e in cp)
    for e in cp:
        ps = [p["prob"] for p in e["probs"]]
        assert ps == sorted(ps, reverse=True) and 0 < sum(ps) <= 1.0 + 1e-6
        assert e["probs"][0]["tok_str"] == e["content"]          # greedy: the most likely token
    assert "".join(e["content"] for e in cp) == d["content"]
    with httpx.stream("POST", server.base + "/completion", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    streamed = [e for ev in events if isinstance(ev, dict) and not ev.get("stop") for e in ev["completion_probabilities"]]
    assert [e["content"] for e in streamed] == [e["content"] for e in cp]
    plain = httpx.post(server.base + "/completion", json={**body, "n_probs": 0}, timeout=60).json()
    assert "completion_probabilities" not in plain and plain["content"] == d["content"]


@real
def test_completion_tokens_and_has_new_line(server):
    """mainline's /completion fields: `tokens` (the generated ids with return_tokens, else empty) and
    `has_new_line`; streamed, each chunk carries its own ids and they add up to the same list."""
    body = {"prompt": "ROMEO:", "n_predict": 24, "seed": 4, "return_tokens": True}
    d = httpx.post(server.base + "/completion", json=body, timeout=60).json()
    assert len(d["tokens"]) == d["tokens_predicted"] > 0
    back = httpx.post(server.base + "/detokenize", json={"tokens": d["tokens"]}).json()["content"]
    assert back == d["content"] and d["has_new_line"] == ("\n" in d["content"])
    assert httpx.post(server.base + "/completion", json={**body, "return_tokens": False}, timeout=60).json()["tokens"] == []
    events = stream_post(server.base, "/completion", {**body, "stream": True})
    assert [t for e in events[:-1] for t in e["tokens"]] == d["tokens"]
    assert events[-1]["stop"] and events[-1]["tokens"] == [] and events[-1]["has_new_line"] == d["has_new_line"]
    # answers with and without a newline
    texts = [httpx.post(server.base + "/completion", json={**body, "seed": k}, timeout=60).json() for k in range(3)]
    texts.append(httpx.post(server.base + "/completion", json={**body, "grammar": 'root ::= "a b"'}, timeout=60).json())
    assert all(t["has_new_line"] == ("\n" in t["content"]) for t in texts)
    assert any(t["has_new_line"] for t in texts) and not all(t["has_new_line"] for t in texts)


@real
def test_openai_logprobs(server):
    """/v1/chat/completions logprobs + top_logprobs and /v1/completions logprobs N: llama-server's
    OpenAI logprobs objects (per token text, bytes, logprob; the top ones), the greedy token first."""
    msgs = [{"role": "user", "content": "Say something"}]
    d = httpx.post(server.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                               "logprobs": True, "top_logprobs": 2}, timeout=60).json()
    content = d["choices"][0]["logprobs"]["content"]
    assert len(content) == d["usage"]["completion_tokens"]
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
        assert abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6 and bytes(e["bytes"]).decode() == e["token"]
    assert "".join(e["token"] for e in content) == d["choices"][0]["message"]["content"]
    d = httpx.post(server.base + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0,
                                                          "logprobs": 3}, timeout=60).json()
    lp = d["choices"][0]["logprobs"]["content"]
    assert len(lp) == d["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 3 for e in lp)
    plain = httpx.post(server.base + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4,
                                                              "temperature": 0}, timeout=60).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == d["choices"][0]["text"]


@real
def test_logit_bias_and_ignore_eos(server):
    """logit_bias in llama-server's forms changes the greedy output (a banned token never comes);
    the OpenAI object form too; ignore_eos is accepted."""
    body = {"prompt": "ROMEO:", "n_predict": 8, "temperature": 0}
    base = httpx.post(server.base + "/completion", json=body, timeout=60).json()
    toks = httpx.post(server.base + "/tokenize", json={"content": base["content"]}).json()["tokens"]
    first = toks[0]
    banned = httpx.post(server.base + "/completion", json={**body, "logit_bias": [[first, False]], "n_probs": 1},
                        timeout=60).json()
    got = httpx.post(server.base + "/tokenize", json={"content": banned["content"]}).json()["tokens"]
    assert banned["content"] != base["content"] and first not in got
    oai = httpx.post(server.base + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0,
                                                            "logit_bias": {str(first): -100}}, timeout=60).json()
    assert oai["choices"][0]["text"] == banned["content"]
    r = httpx.post(server.base + "/completion", json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 8


@real
def test_real_new_samplers(server):
    """A real generation with each of ik's other samplers on: it runs, is reproducible by seed, and
    greedy is untouched by them."""
    greedy = _complete(server.base, "ROMEO:", seed=1, n=8, temperature=0)["content"]
    for extra in ({"mirostat": 1}, {"mirostat": 2, "mirostat_tau": 3.0},
                  {"dry_multiplier": 0.8, "dry_allowed_length": 1, "typical_p": 0.9, "tfs_z": 0.95},
                  {"xtc_probability": 0.5, "xtc_threshold": 0.1, "top_n_sigma": 1.0, "dynatemp_range": 0.5,
                   "min_keep": 3, "samplers": "dnxykt"}):
        a = _complete(server.base, "ROMEO:", seed=9, n=8, **extra)
        assert a["content"] and a["content"] == _complete(server.base, "ROMEO:", seed=9, n=8, **extra)["content"]
        assert _complete(server.base, "ROMEO:", seed=1, n=8, temperature=0, **extra)["content"] == greedy


def test_metrics_and_apply_template(make_model):
    """/metrics (with metrics on) in llama-server's Prometheus names, counting what ran; 501
    without; /apply-template returns the rendered prompt."""
    from engine.config import EngineConfig
    from engine.model import load_model, quiet_log
    from engine.serving import ServingEngine
    from ikcli.defaults import demo_model
    m = load_model(demo_model(), quiet_log)
    eng = ServingEngine(m, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 2, quiet_log)
    eng.start()
    on = ServerThread(create_app(eng, m, model_path=demo_model(), log_requests=False, metrics=True))
    off = ServerThread(create_app(eng, m, model_path=demo_model(), log_requests=False))
    try:
        assert_error(httpx.get(off.base + "/metrics"), 501, "not_supported_error")
        d = httpx.post(on.base + "/completion", json={"prompt": "ROMEO:", "n_predict": 5, "temperature": 0}).json()
        text = httpx.get(on.base + "/metrics").text
        values = dict(re.findall(r"^llamacpp:(\w+) (\S+)$", text, re.M))
        assert "# TYPE llamacpp:prompt_tokens_total counter" in text
        assert "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage." in text
        assert int(values["prompt_tokens_total"]) == d["tokens_evaluated"]
        assert int(values["tokens_predicted_total"]) == d["tokens_predicted"] == 5
        assert float(values["predicted_tokens_seconds"]) > 0 and values["requests_processing"] == "0"
        again = dict(re.findall(r"^llamacpp:(\w+) (\S+)$", httpx.get(on.base + "/metrics").text, re.M))
        assert again["predicted_tokens_seconds"] == "0" and again["tokens_predicted_total"] == "5"   # bucket reset
        msgs = [{"role": "user", "content": "hi there"}]
        r = httpx.post(on.base + "/apply-template", json={"messages": msgs}).json()
        from engine.chat_template import render_chat
        tok = m.tokenizer
        want = render_chat(msgs, m.file.meta.get("tokenizer.chat_template"), tok.token_to_piece(tok.bos_id, True),
                           tok.token_to_piece(tok.eos_id, True), True)[0]
        assert r == {"prompt": want} and "hi there" in want
    finally:
        on.stop()
        off.stop()
        eng.shutdown()


@real
def test_anthropic_messages(server):
    """/v1/messages as llama-server answers it (text blocks): the same greedy text as the OpenAI chat
    endpoint for the same conversation, stop_reason / usage, the streamed event sequence, and
    /v1/messages/count_tokens; other block types are a 400."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    body = {"model": "demo", "max_tokens": 6, "temperature": 0, "system": "Go.", "messages": msgs}   # slots: 64 cells
    d = httpx.post(server.base + "/v1/messages", json=body, timeout=60).json()
    oai = httpx.post(server.base + "/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "Go."}, {"role": "user", "content": "Say hi"}],
        "max_tokens": 6, "temperature": 0}, timeout=60).json()
    assert d["type"] == "message" and d["role"] == "assistant" and d["id"].startswith("msg_")
    assert d["content"] == [{"type": "text", "text": oai["choices"][0]["message"]["content"]}]
    assert d["stop_reason"] in ("end_turn", "max_tokens") and d["usage"]["output_tokens"] <= 6
    n_in = httpx.post(server.base + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert n_in == d["usage"]["input_tokens"] + d["usage"]["cache_read_input_tokens"] == oai["usage"]["prompt_tokens"]
    with httpx.stream("POST", server.base + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start" and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    deltas = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert "".join(e["delta"]["text"] for e in deltas if e["type"] == "content_block_delta") == d["content"][0]["text"]
    r = httpx.post(server.base + "/v1/messages", json={**body, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and "content blocks of type 'image' are not supported" in r.text


def test_several_api_keys():
    """--api-key repeated and --api-key-file: any of the keys opens the endpoints, others do not."""
    srv = ServerThread(_fake_app(FakeEngine(), api_key=["key-one", "key-two"], log_requests=False))
    try:
        for key, code in (("key-one", 200), ("key-two", 200), ("key-three", 401), (None, 401)):
            r = httpx.post(srv.base + "/completion", json={"prompt": "x", "n_predict": 1},
                           headers={"Authorization": f"Bearer {key}"} if key else {})
            assert r.status_code == code, key
    finally:
        srv.stop()


# ============================================================================ reasoning split

THINK_ANSWER = "<think>\nLet me see.\n</think>\n\nHi there."
FORCED_TEMPLATE = FAKE_TEMPLATE.replace("<assistant>{% endif %}", "<assistant><think>\n{% endif %}")


def _chat_stream_parts(base: str, body: dict) -> list[tuple[str, str]]:
    """(field, text) of every streamed delta that carries text."""
    out = []
    for e in stream_post(base, "/v1/chat/completions", {**body, "stream": True}):
        if not isinstance(e, dict):
            continue
        for c in e.get("choices", []):
            for k in ("reasoning_content", "content"):
                if c.get("delta", {}).get(k):
                    out.append((k, c["delta"][k]))
    return out


def test_reasoning_split_unit():
    from ikcli.server_app import ReasoningSplit, split_reasoning
    assert split_reasoning(THINK_ANSWER) == ("Let me see.", "Hi there.")
    assert split_reasoning("  plain answer") == ("", "  plain answer")      # no tag: content as it is
    assert split_reasoning("Let me see.\n</think>\n\nHi", forced_open=True) == ("Let me see.", "Hi")
    assert split_reasoning("<think> \n</think>Hi") == ("", "Hi")          # whitespace-only reasoning
    assert split_reasoning("<think>still thinking") == ("still thinking", "")   # cut short: reasoning
    assert split_reasoning("<thinking>x") == ("", "<thinking>x")           # not the tag
    # any cut of the text into pieces gives the same split, tags never leak
    for cut in range(1, len(THINK_ANSWER)):
        sp = ReasoningSplit()
        parts = sp.feed(THINK_ANSWER[:cut]) + sp.feed(THINK_ANSWER[cut:]) + sp.finish()
        assert ("".join(t for k, t in parts if k == "reasoning"),
                "".join(t for k, t in parts if k == "content")) == ("Let me see.", "Hi there."), cut


def test_chat_reasoning_format():
    eng = FakeEngine(n_ctx_slot=256, answer=THINK_ANSWER)
    srv = ServerThread(_fake_app(eng, log_requests=False))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        url = srv.base + "/v1/chat/completions"
        msg = httpx.post(url, json=body).json()["choices"][0]["message"]          # default: deepseek (ik's)
        assert msg == {"role": "assistant", "content": "Hi there.", "reasoning_content": "Let me see."}
        msg = httpx.post(url, json={**body, "reasoning_format": "auto"}).json()["choices"][0]["message"]
        assert msg["content"] == "Hi there." and msg["reasoning_content"] == "Let me see."
        msg = httpx.post(url, json={**body, "reasoning_format": "none"}).json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": THINK_ANSWER}
        msg = httpx.post(url, json={**body, "reasoning_format": "deepseek-legacy"}).json()["choices"][0]["message"]
        assert msg["content"] == THINK_ANSWER and msg["reasoning_content"] == "Let me see."
        assert_error(httpx.post(url, json={**body, "reasoning_format": "bogus"}), 400, contains="reasoning format")

        # streamed one character per token: every tag arrives split across chunks
        parts = _chat_stream_parts(srv.base, body)
        assert "".join(t for k, t in parts if k == "reasoning_content") == "Let me see."
        assert "".join(t for k, t in parts if k == "content") == "Hi there."
        kinds = [k for k, _ in parts]
        assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")   # reasoning first, then content
        assert not any("<" in t or ">" in t for _, t in parts)
        parts = _chat_stream_parts(srv.base, {**body, "reasoning_format": "none"})
        assert {k for k, _ in parts} == {"content"} and "".join(t for _, t in parts) == THINK_ANSWER
        # /completion is untouched
        d = httpx.post(srv.base + "/completion", json={"prompt": "x"}).json()
        assert d["content"] == THINK_ANSWER and "reasoning_content" not in d
    finally:
        srv.stop()


def test_chat_reasoning_forced_open_and_server_default():
    eng = FakeEngine(n_ctx_slot=256, answer="Let me see.\n</think>\n\nHi there.")
    srv = ServerThread(_fake_app(eng, log_requests=False, chat_template=FORCED_TEMPLATE))
    none = ServerThread(_fake_app(eng, log_requests=False, reasoning_format="none"))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        msg = httpx.post(srv.base + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["content"] == "Hi there." and msg["reasoning_content"] == "Let me see."
        parts = _chat_stream_parts(srv.base, body)
        assert "".join(t for k, t in parts if k == "reasoning_content") == "Let me see."
        assert "".join(t for k, t in parts if k == "content") == "Hi there."
        # --reasoning-format none: the server's default, a request may still ask for the split
        msg = httpx.post(none.base + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": "Let me see.\n</think>\n\nHi there."}
        eng.answer = THINK_ANSWER
        msg = httpx.post(none.base + "/v1/chat/completions",
                         json={**body, "reasoning_format": "deepseek"}).json()["choices"][0]["message"]
        assert msg["content"] == "Hi there." and msg["reasoning_content"] == "Let me see."
    finally:
        srv.stop()
        none.stop()


# ============================================================================ slots: /slots, erase, save, restore

def test_slot_filename_validation_and_routes(fake, tmp_path):
    """llama.cpp's fs_validate_filename; /slots 501 with --no-slots; POST /slots/{id} exists only with
    --slot-save-path (404 otherwise, as llama-server registers it only then)."""
    from ikcli.server_app import valid_filename
    for ok in ("a", "slot0.bin", "x y", "é.bin", "a.b.c"):
        assert valid_filename(ok), ok
    for bad in ("", ".", "..", "a..b", "a/b", "a\\b", "c:x", "a*", "a?", 'a"', "a<", "a>", "a|", " a", "a ", "a.",
                "a\x01", "a\x7f", "a\u0085", "a\uff0e", "a\u2215", "a\u2216", "a\ufffd", "\ufeffa", "a\ud800",
                "x" * 256):
        assert not valid_filename(bad), repr(bad)
    assert httpx.post(fake.base + "/slots/0?action=erase").status_code == 404
    off = ServerThread(_fake_app(FakeEngine(), log_requests=False, slots_endpoint=False))
    try:
        assert_error(httpx.get(off.base + "/slots"), 501, "not_supported_error", "does not support slots endpoint")
    finally:
        off.stop()


@pytest.fixture(scope="module")
def slotsrv(tmp_path_factory):
    """The real ServingEngine (2 slots of 128 cells) behind an app with --slot-save-path."""
    if _serving_available():
        pytest.skip(_serving_available())
    from engine.config import EngineConfig
    from engine.model import load_model, quiet_log
    from engine.serving import ServingEngine
    from ikcli.defaults import demo_model
    d = tmp_path_factory.mktemp("slots")
    m = load_model(demo_model(), quiet_log)
    eng = ServingEngine(m, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 2, quiet_log)
    eng.start()
    srv = ServerThread(create_app(eng, m, model_path=demo_model(), log_requests=False, slot_save_path=str(d)))
    yield SimpleNamespace(base=srv.base, engine=eng, dir=d)
    srv.stop()
    eng.shutdown()


def _slot_post(base: str, id_slot, action: str, body=None):
    return httpx.post(f"{base}/slots/{id_slot}?action={action}", json=body, timeout=60)


@real
def test_real_slots_fields_and_action_errors(slotsrv):
    base = slotsrv.base
    d = httpx.post(base + "/completion", json={"prompt": "ROMEO: what light", "n_predict": 3, "temperature": 0,
                                               "stop": ["zzz"], "top_k": 7}, timeout=60).json()
    slots = httpx.get(base + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    s = slots[d["id_slot"]]
    assert s["n_ctx"] == 128 and s["state"] == 0 and s["is_processing"] is False and s["id_task"] >= 0
    assert s["top_k"] == 7 and s["temperature"] == 0 and s["stop"] == ["zzz"] and s["max_tokens"] == 3
    assert s["prompt"].endswith("ROMEO: what light")
    assert s["next_token"] == {"has_next_token": False, "n_remain": 0, "n_decoded": 3, "stopped_eos": False,
                               "stopped_word": False, "stopped_limit": True, "stopping_word": ""}
    assert_error(_slot_post(base, "x", "erase"), 400, contains="Invalid slot ID")
    assert_error(_slot_post(base, 2, "erase"), 400, contains="Invalid slot ID")
    assert_error(_slot_post(base, 0, "wipe"), 400, contains="Invalid action")
    assert_error(_slot_post(base, 0, "save", {"filename": "../x"}), 400, contains="Invalid filename")
    assert_error(_slot_post(base, 0, "save", {}), 400, contains="filename")
    assert_error(_slot_post(base, 0, "restore", {"filename": "missing.bin"}), 400, contains="Unable to restore slot")
    (slotsrv.dir / "junk.bin").write_bytes(b"not a slot file")
    assert_error(_slot_post(base, 0, "restore", {"filename": "junk.bin"}), 400, contains="Unable to restore slot")
    n_cells = d["tokens_evaluated"] + d["tokens_predicted"] - 1      # the last sampled token is never fed
    assert _slot_post(base, d["id_slot"], "erase").json() == {"id_slot": d["id_slot"], "n_erased": n_cells}
    assert _slot_post(base, d["id_slot"], "erase").json() == {"id_slot": d["id_slot"], "n_erased": 0}


@real
def test_real_slot_save_restore_continues_exactly(slotsrv):
    """A slot saved, erased and restored (into the other slot) serves the next request exactly as the
    never-saved cache did: same tokens, the same prefix reused (cached_tokens)."""
    base = slotsrv.base
    for i in (0, 1):
        _slot_post(base, i, "erase").raise_for_status()
    head = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet"
    first = httpx.post(base + "/completion", json={"prompt": head, "n_predict": 4, "temperature": 0}, timeout=60).json()
    src = first["id_slot"]
    saved = _slot_post(base, src, "save", {"filename": "romeo.slot"}).json()
    n = first["tokens_evaluated"] + first["tokens_predicted"] - 1
    assert saved["id_slot"] == src and saved["filename"] == "romeo.slot" and saved["n_saved"] == n
    assert saved["n_written"] == os.path.getsize(slotsrv.dir / "romeo.slot") > 0 and saved["timings"]["save_ms"] >= 0
    body = {"model": "demo", "prompt": head + " is the sun.", "max_tokens": 12, "temperature": 0}

    def ask() -> tuple[str, int, int]:
        r = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"], r["usage"]["prompt_tokens"]

    ref_text, ref_cached, n_prompt = ask()              # served from the never-saved cache
    assert 16 <= ref_cached < n_prompt
    for i in (0, 1):
        _slot_post(base, i, "erase").raise_for_status()
    assert ask()[1] == 0                                # nothing cached any more
    for i in (0, 1):
        _slot_post(base, i, "erase").raise_for_status()
    dst = 1 - src
    restored = _slot_post(base, dst, "restore", {"filename": "romeo.slot"}).json()
    assert restored["id_slot"] == dst and restored["filename"] == "romeo.slot" and restored["n_restored"] == n
    assert restored["n_read"] == saved["n_written"] and restored["timings"]["restore_ms"] >= 0
    text, cached, _ = ask()
    assert (text, cached) == (ref_text, ref_cached)


@real
def test_real_slot_action_waits_for_a_busy_slot(slotsrv):
    """An action on a busy slot is deferred until the slot is free (as ik), then sees its whole cache."""
    base = slotsrv.base
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(httpx.post(base + "/completion", json={
        "prompt": "JULIET: O Romeo, Romeo", "n_predict": 100, "temperature": 0, "ignore_eos": True}, timeout=60).json()))
    t.start()
    wait_until(lambda: any(s["is_processing"] for s in httpx.get(base + "/slots").json()), 30, "a busy slot")
    busy = next(s for s in httpx.get(base + "/slots").json() if s["is_processing"])
    assert busy["state"] == 1 and busy["next_token"]["has_next_token"] is True
    r = _slot_post(base, busy["id"], "erase").json()
    t.join(60)
    assert out["id_slot"] == busy["id"] and out["tokens_predicted"] == 100
    assert r == {"id_slot": busy["id"], "n_erased": out["tokens_evaluated"] + 100 - 1}


def test_penalty_prompt_refused_unless_off(fake):
    """ik's penalty_prompt (a string or a token array replacing the penalties' history) is not
    implemented: a 400 naming it rather than ik-different text; null or another type is off in ik."""
    url = fake.base + "/completion"
    for on in ("some text", [1, 2, 3], []):
        assert "penalty_prompt" in assert_error(httpx.post(url, json={"prompt": "x", "penalty_prompt": on}),
                                                400)["message"]
    for off in (None, 5):
        assert httpx.post(url, json={"prompt": "x", "penalty_prompt": off, "n_predict": 2}).status_code == 200
