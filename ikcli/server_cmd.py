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
from typing import Optional

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
    api_key: Optional[str] = typer.Option(None, "--api-key", help="require this key (Authorization: Bearer KEY) on all endpoints but /health and /v1/models"),
    chat_template_file: Optional[str] = typer.Option(None, "--chat-template-file", help="Jinja chat template to use instead of the GGUF's tokenizer.chat_template"),
    cont_batching: bool = typer.Option(True, "-cb/-nocb", "--cont-batching/--no-cont-batching", help="continuous batching: the slots' tokens decode together (always on in ikcli; -nocb is refused)"),
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
    template = None
    if chat_template_file is not None:
        try:
            with open(chat_template_file, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise CliError(f"cannot read chat template file '{chat_template_file}': {e.strerror}") from None
    try:
        import uvicorn

        from .server_app import create_app, server_log
    except ImportError as e:
        raise CliError(f"ikcli server needs fastapi and uvicorn ({e}); pip install fastapi uvicorn") from None

    path = common.resolve_model(model)
    cfg = common.engine_config(path, flags, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, threads=threads,
                               threads_batch=threads_batch, seed=seed)
    sock = _bind(host, port)
    engine = None
    try:
        from engine.model import load_model
        from engine.serving import ServingEngine

        m = load_model(path, common.log, mla=flags.mla, overrides=cfg.tensor_overrides, repack=cfg.repack,
                   use_mmap=cfg.use_mmap)
        if ctx_size == 0:
            cfg.n_ctx = m.hp.n_ctx_train
        elif ctx_size > m.hp.n_ctx_train:
            common.log(f"warning: model was trained on only {m.hp.n_ctx_train} context tokens ({ctx_size} specified)")
        engine = ServingEngine(m, cfg, parallel, common.log)
        engine.start()
        app = create_app(engine, m, model_path=path, alias=alias or os.path.basename(path), chat_template=template,
                         api_key=api_key, default_n_predict=n_predict, default_seed=seed)
        server_log("INFO", "main", "model loaded")
        bound_host, bound_port = sock.getsockname()[:2]
        info = {"hostname": host, "port": str(bound_port), "n_threads_http": "1"}
        if api_key:
            info["api_key"] = "api_key: ****" + api_key[-4:]
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


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
