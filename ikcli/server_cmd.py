"""`ikcli server`: llama-server's (ik_llama.cpp's) flags and HTTP API on the ikcli engine.

The socket is bound first (a busy port fails before the model loads), then the model is loaded and
the serving engine started on its own thread; uvicorn serves the FastAPI app of `server_app` on the
bound socket until Ctrl-C / SIGTERM, and the engine is shut down on the way out.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
from typing import List, Optional

import typer

from . import common
from .errors import CliError


class _Terminate(Exception):
    """Raised in the main thread by SIGTERM, after uvicorn's graceful shutdown, to exit cleanly."""


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CliError(f"couldn't resolve the host '{host}': {e.strerror}") from None
    family, _type, proto, _name, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise CliError(f"couldn't bind HTTP server socket, hostname: {host}, port: {port} ({e.strerror})") from None
    sock.setblocking(False)
    return sock


@common.with_engine_flags
def server(
    model: Optional[str] = common.ModelOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="ip address to listen on"),
    port: int = typer.Option(8080, "--port", help="port to listen on (0 = any free port; the log line says which)"),
    alias: Optional[str] = typer.Option(None, "-a", "--alias", help="model name in the API (default: the model's file name)"),
    ctx_size: int = typer.Option(0, "-c", "--ctx-size", help="size of the prompt context, shared by the slots (default: 0 = the model's training context)"),
    parallel: int = typer.Option(1, "-np", "--parallel", help="number of slots: requests served at the same time (each gets ctx-size / parallel)"),
    n_predict: int = typer.Option(-1, "-n", "--n-predict", "--predict", help="default (and maximum) tokens to predict per request (-1 = until EOS or the slot is full)"),
    seed: int = typer.Option(-1, "-s", "--seed", help="default sampling seed of requests that give none (-1 = random)"),
    temp: float = typer.Option(0.8, "--temp", help="default temperature of requests that give none (<= 0: greedy)"),
    top_k: int = typer.Option(40, "--top-k", help="default top-k sampling (0 = off)"),
    top_p: float = typer.Option(0.95, "--top-p", help="default top-p sampling (1.0 = off)"),
    min_p: float = typer.Option(0.05, "--min-p", help="default min-p sampling (0.0 = off)"),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", help="default last n tokens the penalties look at (0 = off, -1 = the context)"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="default repeat penalty (1.0 = off)"),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="default presence penalty (0.0 = off)"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="default frequency penalty (0.0 = off)"),
    penalize_nl: bool = typer.Option(False, "--penalize-nl", help="penalize the newline token too"),
    typical: float = typer.Option(1.0, "--typical", help="default locally typical sampling, parameter p (1.0 = off)"),
    tfs: float = typer.Option(1.0, "--tfs", help="default tail free sampling, parameter z (1.0 = off)"),
    dynatemp_range: float = typer.Option(0.0, "--dynatemp-range", help="default dynamic temperature range (0.0 = off)"),
    dynatemp_exp: float = typer.Option(1.0, "--dynatemp-exp", help="default dynamic temperature exponent"),
    mirostat: int = typer.Option(0, "--mirostat", help="default Mirostat sampling (0 = off, 1 = Mirostat, 2 = Mirostat 2.0); replaces the other samplers"),
    mirostat_lr: float = typer.Option(0.1, "--mirostat-lr", help="default Mirostat learning rate, parameter eta"),
    mirostat_ent: float = typer.Option(5.0, "--mirostat-ent", help="default Mirostat target entropy, parameter tau"),
    xtc_probability: float = typer.Option(0.0, "--xtc-probability", help="default xtc probability (0.0 = off)"),
    xtc_threshold: float = typer.Option(1.0, "--xtc-threshold", help="default xtc threshold (> 0.5 = off)"),
    top_n_sigma: float = typer.Option(0.0, "--top-n-sigma", help="default top-n-sigma (<= 0 = off)"),
    dry_multiplier: float = typer.Option(0.0, "--dry-multiplier", help="default DRY sampling multiplier (0.0 = off)"),
    dry_base: float = typer.Option(1.75, "--dry-base", help="default DRY sampling base value"),
    dry_allowed_length: int = typer.Option(2, "--dry-allowed-length", help="default allowed length for DRY sampling"),
    dry_penalty_last_n: int = typer.Option(-1, "--dry-penalty-last-n", help="default DRY penalty for the last n tokens (0 = off, -1 = the context)"),
    dry_sequence_breaker: List[str] = typer.Option([], "--dry-sequence-breaker", help="add DRY sequence breakers, one per character of the value (the first use clears the defaults '\\n', ':', '\"', '*'; 'none' clears them all); repeatable"),
    samplers: Optional[str] = typer.Option(None, "--samplers", help="samplers in order, separated by ';' (default: dry;top_k;tfs_z;typical_p;top_p;min_p;xtc;top_n_sigma;temperature;adaptive_p)"),
    sampling_seq: Optional[str] = typer.Option(None, "--sampling-seq", help="samplers in order, one letter each (default: dkfypmxntw)"),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="default GBNF grammar (or llguidance Lark) of requests that give no grammar / json_schema / response_format"),
    grammar_file: Optional[str] = typer.Option(None, "--grammar-file", help="file to read the default grammar from"),
    json_schema: Optional[str] = typer.Option(None, "-j", "--json-schema", help="default JSON schema (constrains requests that give no constraint of their own)"),
    banned_string_file: Optional[str] = typer.Option(None, "--banned-string-file", help="file of banned strings, one a line (banned in requests that give no banned_strings)"),
    banned_n: int = typer.Option(1, "--banned-n", help="number of tokens banned in the phrase during rewind; -1: all of them (default: 1)"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log every request's body and response (as --verbosity 1)"),
    verbosity: int = typer.Option(0, "--verbosity", help="> 0: log every request's body and response (VERB lines)"),
    api_key: List[str] = typer.Option([], "--api-key", help="require this key (Authorization: Bearer KEY) on all endpoints but /health and /v1/models; repeatable"),
    api_key_file: Optional[str] = typer.Option(None, "--api-key-file", help="a file of API keys, one per line (added to --api-key's)"),
    metrics: bool = typer.Option(False, "--metrics", help="enable the Prometheus-compatible /metrics endpoint"),
    no_slots: bool = typer.Option(False, "--no-slots", help="disable the GET /slots monitoring endpoint (it answers 501)"),
    slot_save_path: Optional[str] = typer.Option(None, "--slot-save-path", help="folder for slot save files: enables POST /slots/{id}?action=save|restore|erase"),
    public_path: Optional[str] = typer.Option(None, "--path", help="folder of static files served at / instead of the built-in chat page"),
    webui: str = typer.Option("auto", "--webui", help="none: no web page at /; any other name (auto, llamacpp): the chat page (default: auto)"),
    jinja: bool = typer.Option(False, "--jinja", help="use the Jinja chat template (ikcli always does: the GGUF's, or --chat-template-file)"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="ik's built-in chat format by name (chatml, llama3, gemma, mistral-v7, deepseek3, ...; a wrong name lists them all) instead of the GGUF's template; with --jinja, a value that is no built-in name is a Jinja template"),
    chat_template_file: Optional[str] = typer.Option(None, "--chat-template-file", help="Jinja chat template to use instead of the GGUF's tokenizer.chat_template"),
    context_shift: str = typer.Option("on", "--context-shift", help="auto|on|off|0|1: when a generation fills its slot's context, drop tokens after n_keep (half the rest, or the request's n_discard) and go on; off: stop at the context size (default: on, as ik; --no-context-shift: off)"),
    reasoning_format: str = typer.Option("deepseek", "--reasoning-format", help="chat answers: where <think>...</think> text goes: 'none' leaves it in message.content; 'deepseek' or 'auto' puts it in message.reasoning_content (streamed deltas too); 'deepseek-legacy' also keeps the tags in content, and streams them inline (default: deepseek)"),
    cont_batching: bool = typer.Option(True, "-cb/-nocb", "--cont-batching/--no-cont-batching", help="continuous batching: the slots' tokens decode together (always on in ikcli; -nocb is refused)"),
    embedding: bool = typer.Option(False, "--embedding", "--embeddings", help="serve POST /embedding, /embeddings and /v1/embeddings (the prompt's final normed hidden states, pooled)"),
    pooling: Optional[str] = typer.Option(None, "--pooling", metavar="{none,mean,cls,last}", help="pooling type for embeddings (default: the model's <arch>.pooling_type, else none)"),
    batch_size: int = common.BatchOpt,
    ubatch_size: int = common.UBatchOpt,
    threads: int = common.ThreadsOpt,
    threads_batch: int = common.ThreadsBatchOpt,
    ngl: int = common.NglOpt,
    flags: "common.EngineFlags" = None,
) -> None:
    common.check_common(ctx_size, batch_size, ubatch_size, threads, threads_batch, ngl, flags.mla)
    if parallel < 1:
        raise CliError(f"-np/--parallel must be >= 1 (got {parallel})")
    if not cont_batching:
        raise CliError("-nocb is not supported by ikcli server: its slots are always batched together")
    if not 0 <= port <= 65535:
        raise CliError(f"--port must be between 0 and 65535 (got {port})")
    if n_predict < -1:
        raise CliError(f"-n/--n-predict must be >= -1 (got {n_predict})")
    if reasoning_format not in ("none", "auto", "deepseek", "deepseek-legacy"):
        raise CliError(f"Unknown reasoning format: {reasoning_format}")
    _check_pooling(pooling)
    sampling = _default_sampling(seed=seed, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                 repeat_last_n=repeat_last_n, repeat_penalty=repeat_penalty,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                 penalize_nl=penalize_nl, typical_p=typical, tfs_z=tfs,
                                 dynatemp_range=dynatemp_range, dynatemp_exponent=dynatemp_exp, mirostat=mirostat,
                                 mirostat_eta=mirostat_lr, mirostat_tau=mirostat_ent, xtc_probability=xtc_probability,
                                 xtc_threshold=xtc_threshold, top_n_sigma=top_n_sigma, dry_multiplier=dry_multiplier,
                                 dry_base=dry_base, dry_allowed_length=dry_allowed_length,
                                 dry_penalty_last_n=dry_penalty_last_n,
                                 dry_sequence_breakers=_dry_breakers(dry_sequence_breaker),
                                 samplers=_sampler_order(samplers, sampling_seq))
    grammar_flag, default_grammar = _default_grammar(grammar, grammar_file, json_schema)
    if default_grammar:
        sampling["grammar"] = default_grammar
    banned = _banned_strings(banned_string_file)
    keys = [k for k in api_key]
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as fh:
                keys += [ln.rstrip("\r\n") for ln in fh if ln.rstrip("\r\n")]
        except OSError as e:
            raise CliError(f"failed to open file '{api_key_file}': {e.strerror}") from None
    if public_path and webui != "none" and not os.path.isdir(public_path):    # ik aborts the same way
        raise CliError(f"static assets path not found: {public_path}")
    template, render = _builtin_or_jinja(chat_template, jinja, chat_template_file)
    if chat_template_file is not None:
        try:
            with open(chat_template_file, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise CliError(f"cannot read chat template file '{chat_template_file}': {e.strerror}") from None
    try:
        import uvicorn

        from .server_app import WEBUI_DIR, create_app, server_log
    except ImportError as e:
        raise CliError(f"ikcli server needs fastapi and uvicorn ({e}); pip install fastapi uvicorn") from None

    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch, seed=seed, ngl=ngl)
    sock = _bind(host, port)
    engine = None
    try:
        from engine.serving import ServingEngine

        m = common.load_model(path, cfg)
        if default_grammar:
            _check_grammar(grammar_flag, default_grammar, m)
        if ctx_size == 0:
            cfg.n_ctx = m.hp.n_ctx_train
        elif ctx_size > m.hp.n_ctx_train:
            common.log(f"warning: model was trained on only {m.hp.n_ctx_train} context tokens ({ctx_size} specified)")
        engine = ServingEngine(m, cfg, parallel, common.log, common.new_context(m, cfg, flags, n_seq=parallel),
                               ctx_shift=common.parse_bool("--context-shift", context_shift),
                               pooling=_pooling_of(m, pooling) if embedding else "none")
        engine.start()
        app = create_app(engine, m, model_path=path, alias=alias or os.path.basename(path), chat_template=template,
                         render_chat=render, api_key=keys or None, default_n_predict=n_predict, default_sampling=sampling,
                         verbose=verbose or verbosity > 0, metrics=metrics,
                         reasoning_format=reasoning_format, slots_endpoint=not no_slots, embeddings=embedding,
                         banned_strings=banned, banned_n=banned_n,
                         slot_save_path=slot_save_path or None,
                         webui_path=None if webui == "none" else (public_path or WEBUI_DIR))
        server_log("INFO", "main", "model loaded")
        bound_host, bound_port = sock.getsockname()[:2]
        info = {"hostname": host, "port": str(bound_port), "n_threads_http": "1"}
        if len(keys) == 1:      # as llama-server logs them
            info["api_key"] = "api_key: ****" + keys[0][-4:]
        elif keys:
            info["api_key"] = f"api_key: {len(keys)} keys loaded"
        server_log("INFO", "main", "HTTP server listening", info)
        prev_term = signal.getsignal(signal.SIGTERM)

        def _on_term(signum, frame):
            raise _Terminate()

        try:   # Ctrl-C / SIGTERM at any point from here on: a clean stop
            if _is_main_thread():
                signal.signal(signal.SIGTERM, _on_term)
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=2, timeout_keep_alive=30)
            uvicorn.Server(config).run(sockets=[sock])
        except (KeyboardInterrupt, _Terminate):
            pass
        finally:
            if _is_main_thread():
                signal.signal(signal.SIGTERM, prev_term)
        server_log("INFO", "main", "HTTP server stopped")
    finally:
        if engine is not None:
            engine.shutdown()
        sock.close()
    sys.stdout.flush()


_FLAG_OF = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
            "repeat_last_n": "--repeat-last-n", "repeat_penalty": "--repeat-penalty", "seed": "-s",
            "typical_p": "--typical", "tfs_z": "--tfs", "dynatemp_range": "--dynatemp-range",
            "dynatemp_exponent": "--dynatemp-exp", "mirostat": "--mirostat", "mirostat_eta": "--mirostat-lr",
            "mirostat_tau": "--mirostat-ent", "xtc_probability": "--xtc-probability",
            "xtc_threshold": "--xtc-threshold", "top_n_sigma": "--top-n-sigma", "dry_multiplier": "--dry-multiplier",
            "dry_base": "--dry-base", "dry_allowed_length": "--dry-allowed-length",
            "dry_penalty_last_n": "--dry-penalty-last-n"}


def _dry_breakers(values: List[str]) -> list[str]:
    """ik's --dry-sequence-breaker: the first use replaces the defaults, each character of a value is
    one breaker, and 'none' clears the list."""
    if not values:
        from engine.sampling import DEFAULT_DRY_BREAKERS
        return list(DEFAULT_DRY_BREAKERS)
    out: list[str] = []
    for v in values:
        if v == "none":
            out.clear()
        else:
            out += list(v)
    return out


def _default_grammar(grammar: Optional[str], grammar_file: Optional[str],
                     json_schema: Optional[str]) -> tuple[str, str]:
    """(flag, grammar text) of --grammar / --grammar-file / -j (("", "") when none): the server's
    default constraint, as ik's params_base.sampling.grammar.  A file that cannot be read or a schema
    that is no JSON object fails here, naming the flag."""
    given = [(f, v) for f, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                 ("--json-schema", json_schema)) if v is not None]
    if len(given) > 1:      # ik keeps the last one given; typer cannot tell the order
        raise CliError(f"give only one of {', '.join(f for f, _ in given)}: each sets the default grammar")
    if not given:
        return "", ""
    flag, value = given[0]
    if flag == "--grammar-file":
        try:
            with open(value, encoding="utf-8") as fh:
                return flag, fh.read()
        except (OSError, UnicodeDecodeError):
            raise CliError(f"--grammar-file: failed to open file '{value}'") from None
    if flag == "--json-schema":
        import json

        from engine import grammar as eg
        try:
            return flag, eg.schema_grammar(json.loads(value))
        except ValueError as e:         # bad JSON, or no schema object (GrammarError)
            raise CliError(f"--json-schema: {e}") from None
    return flag, value


def _check_grammar(flag: str, text: str, m) -> None:
    """The default grammar must compile for the model's vocabulary (fails at start, naming the flag)."""
    from engine import grammar as eg
    try:
        eg.check_grammar(text, m.tokenizer, getattr(m, "n_vocab", None))
    except eg.GrammarError as e:
        raise CliError(f"{flag}: {str(e).splitlines()[0] if str(e) else e}") from None


def _banned_strings(path: Optional[str]) -> list[str]:
    """--banned-string-file: its strings (ik's reading: one a line, double quotes removed)."""
    if path is None:
        return []
    from engine.banned import read_banned_file
    try:
        return read_banned_file(path)
    except (OSError, UnicodeDecodeError):
        raise CliError(f"--banned-string-file: failed to open file '{path}'") from None


def _sampler_order(samplers: Optional[str], sampling_seq: Optional[str]):
    """--samplers (names separated by ';') or --sampling-seq (letters); the default order otherwise."""
    from engine.sampling import DEFAULT_SAMPLERS, parse_samplers
    if samplers is not None and sampling_seq is not None:
        raise CliError("give either --samplers or --sampling-seq, not both")
    flag, value = (("--samplers", [s for s in samplers.split(";") if s]) if samplers is not None else
                   ("--sampling-seq", sampling_seq) if sampling_seq is not None else ("", DEFAULT_SAMPLERS))
    try:
        return list(parse_samplers(value))
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


def _default_sampling(**given) -> dict:
    """The command line's sampling values (a request's own values win); checked here so a bad one
    fails at start, naming the flag, instead of on every request."""
    from engine.sampling import SamplingParams
    try:
        SamplingParams(**given)
    except ValueError as e:
        bad = next((f for k, f in _FLAG_OF.items() if f"'{k}'" in str(e)), "a sampling flag")
        raise CliError(f"{bad}: {e}") from None
    return given


def _builtin_or_jinja(value: Optional[str], jinja: bool, template_file: Optional[str]):
    """--chat-template VALUE -> (template for create_app, render_chat for create_app or None).

    A name of ik's built-in formats selects that formatter (also with --jinja, where ik would read
    the name as Jinja text); any other value is a Jinja template string with --jinja (checked by
    rendering one user message, as ik does) and refused without it, listing the names."""
    if value is None:
        return None, None
    from engine.chat_template import BUILTIN_TEMPLATES, builtin_renderer, builtin_template_names, render_chat
    if template_file is not None:
        raise CliError("give either --chat-template or --chat-template-file, not both")
    if value in BUILTIN_TEMPLATES:
        return value, builtin_renderer(value)
    if not jinja:
        raise CliError(f"the supplied chat template is not supported: {value}\n"
                       f"built-in templates: {', '.join(builtin_template_names())} "
                       f"(or give --jinja to use the value as a Jinja template)")
    try:
        render_chat([{"role": "user", "content": "test"}], value)
    except ValueError as e:
        raise CliError(f"the supplied chat template is not supported: {e}") from None
    return value, None


def _check_pooling(value: Optional[str]) -> None:
    """--pooling: ik's four names; rank (a reranker's head) is refused in one line."""
    if value is None or value in ("none", "mean", "cls", "last"):
        return
    if value == "rank":
        raise CliError("--pooling rank is not supported by ikcli: reranking models are not implemented")
    raise CliError(f"invalid parameter for argument: --pooling (none, mean, cls or last; got '{value}')")


def _pooling_of(m, value: Optional[str]) -> str:
    """--pooling, else the model's own pooling type (none without one, as llama.cpp), logged."""
    from engine.embeddings import model_pooling
    if value is None:
        try:
            value = model_pooling(m.file.meta, m.hp.arch)
        except ValueError as e:
            raise CliError(f"{m.file.path}: {e}") from None
        if value == "rank":
            raise CliError("the model's pooling type is rank: reranking models are not implemented by ikcli")
    common.log(f"embeddings: pooling type = {value}")
    return value


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
