"""The chat page at `/` (ikcli/webui) in a real headless browser: Debian's Chromium driven by
Playwright for Python, against `ikcli server` on the embedded demo model.

Playwright's own browser downloads are never used (`playwright install` cannot reach the network
here): the browser is /usr/bin/chromium (scripts/test.sh installs Debian's `chromium` with apt-get
when it is missing and it runs as root).  The browser tests skip, saying so, only when no Chromium
can be had.  Replies that cannot be made to happen on demand (a 400, a reply with reasoning and
content, a request that hangs before its first token) are canned with page.route; the rest talks
to the real server: the API key (401, then the key field), streamed text, the tokens/s label from
the server's `timings`, a reply whose reasoning the demo model writes (a chat template that opens
`<think>` when asked to think), Stop cancelling the job on the server.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from types import SimpleNamespace

import pytest
from conftest import launch_server, stop_server

httpx = pytest.importorskip("httpx")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-webui-test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# ChatML, plus an opened <think> when the last message asks to think: the demo model's whole reply
# is then reasoning_content (it never writes </think>)
THINK_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{% if 'think' in messages[-1]['content'] %}<think>\n{% endif %}{%- endif -%}")


def _chromium() -> str:
    for path in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if path and os.access(path, os.X_OK):
            return path
    return ""


def _browser_missing() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not _chromium():
        return ("no Chromium at /usr/bin/chromium (scripts/test.sh installs Debian's `chromium` with "
                "apt-get when it runs as root; else: apt-get install chromium)")
    return ""


# ============================================================================ no browser needed

def _static_app(**kw):
    """create_app on a stub engine: enough for the static routes."""
    from ikcli.server_app import create_app
    engine = SimpleNamespace(model=None, n_ctx_slot=64, n_parallel=1)
    render = lambda messages, template, bos, eos, agp, extra_vars=None: ("", "chatml")  # noqa: E731
    return create_app(engine, model_path="/m/x.gguf", render_chat=render, params_from_request=lambda b: None,
                      log_requests=False, **kw)


def test_static_routes_webui_none_and_path(tmp_path):
    from fastapi.testclient import TestClient
    with TestClient(_static_app(api_key=KEY)) as c:
        for path, ctype in (("/", "text/html"), ("/index.html", "text/html"), ("/app.js", "javascript"),
                            ("/style.css", "text/css")):
            r = c.get(path)     # no key: the page must load before the user can type one
            assert r.status_code == 200 and ctype in r.headers["content-type"], (path, r.status_code)
        assert "<title>ikcli chat</title>" in c.get("/").text
        # everything else still wants the key, unknown routes are still 404 and wrong methods 405
        assert c.get("/nope").status_code == 401 and c.get("/props").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/nope", headers=auth).status_code == 404
        assert c.get("/completion", headers=auth).status_code == 405
        assert c.post("/", headers=auth).status_code == 404
        for sneaky in ("/../server_app.py", "/%2e%2e/server_app.py", "/..%2fserver_app.py", "/webui/app.js"):
            assert c.get(sneaky, headers=auth).status_code == 404, sneaky
    with TestClient(_static_app(webui_path=None)) as c:    # --webui none
        assert c.get("/").status_code == 404 and c.get("/app.js").status_code == 404
    (tmp_path / "index.html").write_text("<p>mine</p>")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("x")
    with TestClient(_static_app(webui_path=str(tmp_path))) as c:    # --path DIR
        assert c.get("/").text == "<p>mine</p>" and c.get("/sub/x.txt").text == "x"
        assert c.get("/app.js").status_code == 404


def test_path_flag_must_exist(capsys):
    from conftest import cli
    code, _out, err = cli(capsys, "server", "--path", "/no/such/folder")
    assert code == 1 and "static assets path not found: /no/such/folder" in err


def test_webui_is_package_data():
    """pyproject ships the page's files (a plain `pip install .` serves the page)."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert 'ikcli = ["webui/*.html", "webui/*.js", "webui/*.css"]' in text
    names = set(os.listdir(os.path.join(ROOT, "ikcli", "webui")))
    assert {"index.html", "app.js", "style.css"} <= names


# ============================================================================ the browser

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if _browser_missing():
        pytest.skip(_browser_missing())
    tmpl = tmp_path_factory.mktemp("webui") / "think.jinja"
    tmpl.write_text(THINK_TEMPLATE, encoding="utf-8")
    s = launch_server("-c", "256", "-np", "1", "-t", "2", "-s", "1", "--api-key", KEY,
                      "--chat-template-file", str(tmpl), timeout=90)
    yield s
    rc = stop_server(s)
    assert rc == 0, "".join(s.err[-20:])


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=_chromium(), headless=True,
            args=CHROMIUM_ARGS)
        ctx.set_default_timeout(15_000)
        yield ctx
        ctx.close()


@pytest.fixture()
def page(browser, server):
    """The chat page, freshly loaded, with no settings stored; page.errors / page.urls collect the
    page's uncaught errors and every URL it requested."""
    pg = browser.new_page()
    errors: list = []
    urls: list = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("request", lambda r: urls.append(r.url))
    pg.goto(server.base + "/")
    pg.evaluate("localStorage.clear()")
    pg.reload()
    pg.errors, pg.urls = errors, urls
    yield pg
    pg.close()
    assert not errors, errors


def _settings(page, key: str | None = KEY, system: str = "", temperature: str = "") -> None:
    page.click("#settings summary")
    page.fill("#api-key", key or "")
    page.fill("#system", system)
    page.fill("#temperature", temperature)
    page.click("#settings summary")


def _send(page, text: str) -> None:
    page.fill("#input", text)
    page.click("#send")


def _wait_idle(page) -> None:
    """The request in flight has ended (Send enabled again, Stop disabled)."""
    page.wait_for_function("!document.getElementById('send').disabled && document.getElementById('stop').disabled")


def _last(page, sel: str):
    return page.locator(".msg.assistant >> nth=-1").locator(sel)


def _count_updates(page) -> None:
    """window.__updates: how many times the last assistant message's text changed (streaming)."""
    page.evaluate("""() => {
        window.__updates = 0;
        new MutationObserver(() => { window.__updates++; })
            .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")


def _eval_tokens(server, start: int, timeout: float = 10.0) -> int:
    """The generated-token count of the first `eval time = ... / N tokens` log line after err[start:]."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        for line in list(server.err[start:]):
            m = re.match(r"^\s+eval time = .*/\s*(\d+) tokens", line)
            if m:
                return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError("no `eval time` line in the server's log:\n" + "".join(server.err[start:]))


def test_chat_streams_with_key_and_speed(page, server):
    # no key yet: the server's 401 is shown in the page, and the turn is given back to edit
    _send(page, "Hello")
    err = _last(page, ".error")
    err.wait_for()
    assert "Error 401" in err.inner_text() and "Invalid API Key" in err.inner_text()
    assert page.input_value("#input") == "Hello"
    assert "dropped" in page.locator(".msg.user").first.get_attribute("class")
    _wait_idle(page)

    _settings(page, KEY, temperature="0")
    _count_updates(page)
    page.click("#send")
    content = _last(page, ".content")
    speed = _last(page, ".meta.speed")
    speed.wait_for()
    text = content.inner_text()
    assert len(text) > 20, text
    # streamed: the text changed many times, not once at the end
    assert page.evaluate("window.__updates") > 10
    m = re.fullmatch(r"(\d+) tokens, (\d+\.\d) tokens/s", speed.inner_text())
    assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, speed.inner_text()
    assert "prompt:" in speed.get_attribute("title")
    assert _last(page, ".reasoning").is_hidden()     # no reasoning in this reply
    # the model's name from /v1/models, the key kept for the next visit, nothing fetched elsewhere
    assert page.inner_text("#model") == "demo"
    page.reload()
    assert page.input_value("#api-key") == KEY and page.input_value("#temperature") == "0"
    assert page.evaluate("localStorage.getItem('ikcli.apiKey')") == KEY
    assert page.urls and all(u.startswith(server.base + "/") for u in page.urls), page.urls


def test_reasoning_from_the_demo_model_is_collapsed(page):
    _settings(page, KEY, temperature="0")
    _send(page, "Please think first")
    _last(page, ".meta.speed").wait_for()
    details = _last(page, "details.reasoning")
    assert details.is_visible() and details.evaluate("d => d.open") is False
    assert _last(page, ".reasoning-text").is_hidden()        # collapsed: its text is not shown
    assert len(_last(page, ".reasoning-text").text_content()) > 20
    details.locator("summary").click()
    assert _last(page, ".reasoning-text").is_visible()


def _sse(*chunks) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _delta(**d) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "finish_reason": None, "delta": d}]}


def test_canned_reasoning_content_and_request_body(page):
    """A canned stream (page.route): reasoning deltas go to a collapsed <details> above the answer,
    the tokens/s label comes from `timings`; the request carries the system prompt, the temperature,
    the key and the whole conversation; "New chat" forgets it."""
    bodies: list = []

    def reply(route):
        bodies.append((route.request.post_data_json, route.request.headers.get("authorization")))
        final = {"object": "chat.completion.chunk", "choices": [{"index": 0, "finish_reason": "stop", "delta": {}}],
                 "usage": {"completion_tokens": 6, "prompt_tokens": 10, "total_tokens": 16},
                 "timings": {"prompt_n": 10, "prompt_per_second": 500.0, "predicted_n": 6,
                             "predicted_per_second": 42.0}}
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=_sse(
            _delta(role="assistant", content=None), _delta(reasoning_content="Let me "),
            _delta(reasoning_content="see."), _delta(content="Hello"), _delta(content=", world"), final))

    page.route("**/v1/chat/completions", reply)
    _settings(page, "k1", system="Be brief.", temperature="0.5")
    _send(page, "Hi")
    speed = _last(page, ".meta.speed")
    speed.wait_for()
    assert speed.inner_text() == "6 tokens, 42.0 tokens/s"
    assert _last(page, ".content").inner_text() == "Hello, world"
    assert _last(page, ".reasoning-text").text_content() == "Let me see."
    details = _last(page, "details.reasoning")
    assert details.is_visible() and details.evaluate("d => d.open") is False
    # the details block comes before the answer
    assert details.evaluate("d => !!(d.compareDocumentPosition(d.parentNode.querySelector('.content')) & 4)")
    body, auth = bodies[0]
    assert body == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    "stream": True, "temperature": 0.5}
    assert auth == "Bearer k1"

    _send(page, "Again")     # the answer (not its reasoning) goes back with the next turn
    page.wait_for_function("document.querySelectorAll('.meta.speed').length == 2")
    assert bodies[1][0]["messages"][1:] == [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello, world"},
                                            {"role": "user", "content": "Again"}]
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    _send(page, "Fresh")
    page.wait_for_function("document.querySelectorAll('.meta.speed').length == 1")
    assert bodies[2][0]["messages"][1:] == [{"role": "user", "content": "Fresh"}]


def test_speed_measured_in_the_browser_without_timings(page):
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body=_sse(_delta(content="a"), _delta(content="b"),
                  {"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}],
                   "usage": {"completion_tokens": 2, "prompt_tokens": 1, "total_tokens": 3}})))
    _send(page, "Hi")
    speed = _last(page, ".meta.speed")
    speed.wait_for()
    assert re.fullmatch(r"2 tokens, \d+\.\d tokens/s \(measured in the browser\)", speed.inner_text())


def test_errors_are_shown(page):
    too_long = {"error": {"code": 400, "type": "exceed_context_size_error",
                          "message": "the request exceeds the available context size (300 tokens > 256)"}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=400, headers={"Content-Type": "application/json"}, body=json.dumps(too_long)))
    _send(page, "A long story")
    err = _last(page, ".error")
    err.wait_for()
    assert err.inner_text().startswith("Error 400") and "exceeds the available context size" in err.inner_text()
    assert err.get_attribute("role") == "alert"
    _wait_idle(page)
    assert page.input_value("#input") == "A long story"     # given back, to shorten and send again

    # an error chunk in the middle of a stream
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body="data: " + json.dumps(_delta(content="par")) + "\n\n"
             + "data: " + json.dumps({"error": {"code": 500, "message": "the engine stopped", "type": "server_error"}})
             + "\n\n"))
    page.fill("#input", "")
    _send(page, "Go")
    page.wait_for_function("document.querySelectorAll('.error').length == 2")
    assert "the engine stopped" in _last(page, ".error").inner_text()
    assert _last(page, ".content").inner_text() == "par"


def test_stop_before_the_first_token(page):
    """A request that hangs (a route never answered): Stop (a real click) aborts the fetch."""
    held: list = []
    page.route("**/v1/chat/completions", lambda route: held.append(route))
    _send(page, "Hi")
    page.wait_for_function("!document.getElementById('stop').disabled")
    assert page.is_disabled("#send")
    page.click("#stop")
    _wait_idle(page)
    assert _last(page, ".meta").inner_text() == "stopped"
    assert page.input_value("#input") == "Hi"     # no answer: the turn is given back
    assert held


def test_stop_cancels_the_job_on_the_server(page, server):
    """Stop pressed when the first streamed text shows: the partial answer stays, the server sees the
    disconnect and cancels the job (its log counts far fewer tokens than the 4000 asked for), and
    the next turn, with the partial answer in the conversation, is answered in full."""
    _settings(page, KEY, temperature="0")
    # clicked from inside the page at the first text, so the click cannot come after the end
    page.evaluate("""() => {
        const obs = new MutationObserver(() => {
            const c = document.querySelector('.msg.assistant:last-child .content');
            if (c && c.textContent) { obs.disconnect(); document.getElementById('stop').click(); }
        });
        obs.observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    # this request asks for 4000 tokens whatever the model says (EOS ignored, the slot shifts), so
    # a late cancel on a loaded machine still shows as far fewer tokens than the reply would have
    def longer(route):
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True, "max_tokens": 4000}))
    page.route("**/v1/chat/completions", longer)
    n_err = len(server.err)
    _send(page, "Hello")
    _wait_idle(page)
    page.unroute("**/v1/chat/completions")
    assert _last(page, ".meta").inner_text() == "stopped"
    partial = _last(page, ".content").inner_text()
    assert partial
    n_gen = _eval_tokens(server, n_err)
    assert n_gen < 2000, f"the job ran on after Stop: {n_gen} tokens"

    _send(page, "And then?")
    _last(page, ".meta.speed").wait_for()
    assert _last(page, ".content").inner_text()
