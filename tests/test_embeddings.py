"""`ikcli server --embeddings`: POST /embedding, /embeddings and /v1/embeddings against a direct engine
computation on the embedded demo model.

The reference is Context.decode(..., embeddings=True) (the normed final hidden states, llama.cpp's
result_norm) pooled and normalized here with plain NumPy, so the engine's pooling and
common_embd_normalize port are checked too.  One real `ikcli server` (mean pooling, 2 slots) serves
the request forms, the openai client, base64 and embeddings beside a running generation; apps over an
in-process ServingEngine serve the other pooling types and the server without --embeddings.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import cli, launch_server, stop_server

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from test_server import ServerThread, _serving_available, assert_error  # noqa: E402

from ikcli.server_app import create_app  # noqa: E402

pytestmark = pytest.mark.skipif(bool(_serving_available()), reason=_serving_available() or "n/a")

TEXTS = ["ROMEO: But soft, what light through yonder window breaks?", "JULIET:", "O Romeo, Romeo!"]


@pytest.fixture(scope="module")
def demo():
    """The demo model loaded in this process, with the server's engine settings, and the reference:
    hidden(tokens) -> the normed final hidden states of a prompt read alone into an empty cache."""
    from engine.context import Context
    from engine.model import load_model, quiet_log
    from ikcli import common
    from ikcli.defaults import demo_model

    path = demo_model()
    flags = common.EngineFlags(mla=3, fa="on", amb=256, ctk="f16", ctv="f16", fmoe="1", ser=None, ot=None)
    cfg = common.engine_config(path, flags, n_ctx=256, n_batch=2048, n_ubatch=512, threads=2, threads_batch=2)
    m = load_model(path, quiet_log)
    ctx = Context(m, cfg, quiet_log)

    def hidden(tokens: list[int]) -> np.ndarray:
        ctx.clear()
        return ctx.decode(tokens, embeddings=True)

    def tokens(text: str) -> list[int]:
        return m.tokenizer.encode(text, add_special=True, parse_special=True)

    return SimpleNamespace(path=path, m=m, cfg=cfg, hidden=hidden, tokens=tokens, log=quiet_log)


def expected(h: np.ndarray, pooling: str, norm: int = 2) -> np.ndarray:
    """llama.cpp's pooled embedding, normalized as common_embd_normalize (in double)."""
    v = {"mean": h.astype(np.float64).mean(axis=0), "cls": h[0], "last": h[-1]}[pooling].astype(np.float64)
    s = 1.0 if norm == -1 else np.abs(v).max() / 32760.0 if norm == 0 else (np.abs(v) ** norm).sum() ** (1.0 / norm)
    return v / s


def close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=1e-4, atol=2e-5)


@contextlib.contextmanager
def app_server(demo, pooling: str = "mean", embeddings: bool = True, n_ubatch: int = 512, n_parallel: int = 1):
    """create_app over a ServingEngine of this process (the pattern of test_server's `inproc`)."""
    from engine.serving import ServingEngine
    cfg = dataclasses.replace(demo.cfg, n_ubatch=n_ubatch)
    eng = ServingEngine(demo.m, cfg, n_parallel, demo.log, pooling=pooling)
    eng.start()
    srv = ServerThread(create_app(eng, demo.m, model_path=demo.path, log_requests=False, embeddings=embeddings))
    try:
        yield srv.base
    finally:
        srv.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def server():
    """`ikcli server --embeddings --pooling mean` on the demo model, 2 slots of 256."""
    s = launch_server("--embeddings", "--pooling", "mean", "-c", "512", "-np", "2", "-t", "2", timeout=60)
    yield s
    assert stop_server(s) == 0, "".join(s.err[-20:])


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


# ---------------------------------------------------------------------------------------- flags

def test_pooling_flag_errors_before_loading(capsys):
    for args, msg in ((["--pooling", "rank"], "--pooling rank is not supported by ikcli"),
                      (["--pooling", "max"], "invalid parameter for argument: --pooling")):
        code, _, err = cli(capsys, "server", "--embeddings", *args)
        assert code == 1 and msg in err and "llm_load" not in err, err
    code, _, err = cli(capsys, "perplexity", "--embeddings")
    assert code == 1 and "served by `ikcli server --embeddings` only" in err


def test_model_pooling_key():
    from engine.embeddings import model_pooling
    assert model_pooling({}, "qwen3") == "none"              # a generative model: llama.cpp's NONE
    assert model_pooling({"qwen3.pooling_type": -1}, "qwen3") == "none"
    assert model_pooling({"qwen3.pooling_type": 3}, "qwen3") == "last"
    assert model_pooling({"llama.pooling_type": 1}, "llama") == "mean"
    with pytest.raises(ValueError, match="unknown pooling type 7"):
        model_pooling({"llama.pooling_type": 7}, "llama")


# ------------------------------------------------------------------------------- the real server

def test_request_forms_match_the_engine(server, demo):
    toks = [demo.tokens(t) for t in TEXTS]
    want = [expected(demo.hidden(t), "mean") for t in toks]
    # llama-server's own form: always a list of {embedding: [[...]], index}
    r = post(server.base, "/embedding", {"content": TEXTS[0]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 1 and out[0]["index"] == 0
    assert len(out[0]["embedding"]) == 1 and len(out[0]["embedding"][0]) == demo.m.hp.n_embd
    close(out[0]["embedding"][0], want[0])
    assert abs(np.linalg.norm(out[0]["embedding"][0]) - 1.0) < 1e-5
    for path, body in (("/embeddings", {"content": TEXTS}), ("/embeddings", {"input": toks}),
                       ("/v1/embeddings", {"content": TEXTS})):       # `content` keeps llama-server's form
        out = post(server.base, path, body).json()
        assert [o["index"] for o in out] == [0, 1, 2]
        for o, w in zip(out, want):
            close(o["embedding"][0], w)
    # OpenAI's form: a string, strings, token ids, lists of token ids
    for inp, idx in ((TEXTS[1], [1]), (TEXTS, [0, 1, 2]), (toks[2], [2]), (toks[:2], [0, 1])):
        r = post(server.base, "/v1/embeddings", {"input": inp, "model": "my-model"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "list" and out["model"] == "my-model"
        assert [d["index"] for d in out["data"]] == list(range(len(idx)))
        assert all(d["object"] == "embedding" for d in out["data"])
        n = sum(len(toks[i]) for i in idx)
        assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
        for d, i in zip(out["data"], idx):
            close(d["embedding"], want[i])
    assert post(server.base, "/v1/embeddings", {"input": "x"}).json()["model"] == "gpt-3.5-turbo-0613"   # ik's default


def test_normalization_choices(server, demo):
    h = demo.hidden(demo.tokens(TEXTS[0]))
    for norm in (-1, 0, 1, 2, 3):
        r = post(server.base, "/embedding", {"content": TEXTS[0], "embd_normalize": norm})
        assert r.status_code == 200, r.text
        close(r.json()[0]["embedding"][0], expected(h, "mean", norm))


def test_base64_and_openai_client(server):
    body = {"input": TEXTS[:2]}
    floats = post(server.base, "/v1/embeddings", body).json()["data"]
    b64 = post(server.base, "/v1/embeddings", {**body, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, b64):
        assert b["encoding_format"] == "base64" and isinstance(b["embedding"], str)
        # two requests: the prompts may share a batch in one and not in the other, and a product's
        # rounding depends on the batch's row count, so the values agree closely, not bit for bit
        close(np.frombuffer(base64.b64decode(b["embedding"]), "<f4"), np.asarray(f["embedding"], np.float64))
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="sk-none", max_retries=0, timeout=60)
    for kw in ({}, {"encoding_format": "float"}):       # the client asks for base64 unless told otherwise
        res = client.embeddings.create(model="demo", input=TEXTS[:2], **kw)
        assert [d.index for d in res.data] == [0, 1] and res.usage.prompt_tokens > 0
        for d, f in zip(res.data, floats):
            close(d.embedding, np.asarray(f["embedding"], np.float64))
    single = client.embeddings.create(model="demo", input=TEXTS[0])
    close(single.data[0].embedding, np.asarray(floats[0]["embedding"], np.float64))


def test_errors(server):
    base = server.base
    assert_error(post(base, "/v1/embeddings", {"model": "x"}), 400, contains='"input" or "content" must be provided')
    for inp in ([[]], [TEXTS[0], []]):
        assert_error(post(base, "/v1/embeddings", {"input": inp}), 400, contains="Input content cannot be empty")
    assert_error(post(base, "/embedding", {"content": []}), 400, contains="'content' is empty")
    assert_error(post(base, "/v1/embeddings", {"input": "hi", "encoding_format": "int8"}), 400,
                 contains="Can be either float or base64")
    assert_error(post(base, "/v1/embeddings", {"input": [5, 10 ** 6]}), 400, contains="invalid token id 1000000 in 'input'")
    err = assert_error(post(base, "/v1/embeddings", {"input": [5] * 257}), 400, "exceed_context_size_error")
    assert err["n_prompt_tokens"] == 257 and err["n_ctx"] == 256
    r = post(base, "/v1/embeddings", {"input": [5] * 256})        # a prompt may fill its slot
    assert r.status_code == 200, r.text


def test_embeddings_beside_a_generation(server, demo):
    """Embedding requests while a generation streams on the other slot: the same vectors as alone,
    and the same generated text as without them."""
    body = {"prompt": "KING HENRY:", "n_predict": 96, "seed": 5, "ignore_eos": True, "stream": True}
    alone = post(server.base, "/completion", {**body, "stream": False}).json()["content"]
    want = expected(demo.hidden(demo.tokens(TEXTS[0])), "mean")
    started, done, text = threading.Event(), threading.Event(), []

    def generate() -> None:
        with httpx.stream("POST", server.base + "/completion", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    text.append(json.loads(line[6:]).get("content", ""))
                    started.set()
        done.set()

    t = threading.Thread(target=generate)
    t.start()
    assert started.wait(60)
    overlapped = 0
    for _ in range(4):
        r = post(server.base, "/v1/embeddings", {"input": TEXTS[0]})
        assert r.status_code == 200, r.text
        close(r.json()["data"][0]["embedding"], want)
        overlapped += not done.is_set()
    t.join(60)
    assert overlapped > 0, "the generation ended before any embedding request"
    assert "".join(text) == alone


# ------------------------------------------------------------------------------ in-process apps

def test_without_embeddings_flag(demo):
    with app_server(demo, embeddings=False) as base:
        for path in ("/embedding", "/embeddings", "/v1/embeddings"):
            assert_error(post(base, path, {"input": "hi"}), 501, "not_supported_error",
                         "This server does not support embeddings. Start it with `--embeddings`")


def test_pooling_none_per_token(demo):
    toks = demo.tokens(TEXTS[0])
    h = demo.hidden(toks)
    with app_server(demo, pooling="none") as base:
        assert_error(post(base, "/v1/embeddings", {"input": "hi"}), 400,
                     contains="Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        out = post(base, "/embedding", {"content": TEXTS[0], "embd_normalize": 1}).json()   # not normalized
        assert len(out) == 1 and np.asarray(out[0]["embedding"]).shape == h.shape
        np.testing.assert_allclose(out[0]["embedding"], h, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooling_types_over_several_batches(demo, pooling):
    """ubatches of 4 tokens: a prompt is read in several steps, two prompts side by side."""
    toks = [demo.tokens(t) for t in TEXTS[:2]]
    want = [expected(demo.hidden(t), pooling) for t in toks]
    with app_server(demo, pooling=pooling, n_ubatch=4, n_parallel=2) as base:
        r = post(base, "/v1/embeddings", {"input": TEXTS[:2]})
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want):
            close(d["embedding"], w)
