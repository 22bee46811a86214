"""Shared fixtures: small random GGUF models written once per session, paths to ../shared data."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))
# the `ikcli` processes some tests start use Numba's cache beside the sources, as this process
# does (ikcli.app: otherwise one directory per version of the kernel sources)
os.environ.setdefault("IKCLI_NUMBA_CACHE", "source")
# f32 generation attention in every process of the run, module-scoped fixtures and the commands
# tests start included (see _f32_flash_kernel; tests/test_flash_lanes.py turns bf16 on itself)
os.environ["IKCLI_FA_BF16"] = "0"
# without a GPU, the CUDA kernels and the -ngl / -ot CUDA0 paths run on Numba's CUDA simulator
# (it must be chosen before numba.cuda is first imported)
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


make_test_model = _load_script("make_test_model")
# the vocab fixtures' case files (llama.cpp's test-tokenizer-0 layout): split as the script that
# writes them splits them
split_vocab_cases = _load_script("extract_vocab_fixtures").split_cases

# perplexity's last line, in ik_llama.cpp's words (groups: PPL, its uncertainty)
FINAL_PPL = re.compile(r"^Final estimate: PPL over \d+ chunks for n_ctx=\d+ = (\d+\.\d{4}) \+/- (\d+\.\d{5})$", re.M)


def cli(capsys, *args):
    """Run `ikcli ARGS` in this process: (exit code, stdout, stderr)."""
    from ikcli.app import main
    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def launch_server(*args: str, timeout: float = 120):
    """`ikcli server --port 0 --alias demo ARGS` on the embedded demo model, in a process of its
    own, once it listens: SimpleNamespace(proc, base URL, out and err, the lines read so far,
    which threads keep reading).  stderr is drained from the start (a full pipe would stall the
    server's startup); pytest.fail with its output when no port is announced within timeout."""
    import subprocess
    import threading
    import time
    from types import SimpleNamespace
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ikcli", "server", "--port", "0", "--alias", "demo", *args],
                            cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list = []
    err: list = []
    err_reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    err_reader.start()
    port, t0 = None, time.time()
    for line in proc.stdout:
        out.append(line)
        m = re.search(r'HTTP server listening \|.* port="(\d+)"', line)
        if m:
            port = int(m.group(1))
            break
        if time.time() - t0 > timeout:
            break
    if port is None:
        proc.kill()
        err_reader.join(5)
        pytest.fail("ikcli server did not start:\n" + "".join(out) + "".join(err))
    out_reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    out_reader.start()
    return SimpleNamespace(proc=proc, base=f"http://127.0.0.1:{port}", out=out, err=err,
                           readers=(out_reader, err_reader))


def stop_server(s) -> int:
    """SIGTERM to a launch_server process; its exit status once it and the readers are done."""
    s.proc.terminate()
    rc = s.proc.wait(timeout=20)
    for t in s.readers:
        t.join(5)
    return rc


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_model(model_dir):
    """make_model(arch, layout, qtype, preset, **overrides) -> path; cached per argument set."""
    cache: dict = {}

    def make(arch="deepseek2", layout="ik", qtype="f16", preset="tiny", split=1, seed=0, **kw):
        key = (arch, layout, qtype, preset, split, seed, tuple(sorted(kw.items())))
        if key not in cache:
            name = f"{arch}-{layout}-{qtype}-{preset}-s{seed}-{len(cache)}.gguf"
            paths = make_test_model.write_model(str(model_dir / name), arch, layout, qtype, preset, seed, split, **kw)
            cache[key] = paths[0]
        return cache[key]

    return make


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared test data not found at {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def corpus_text(shared_dir) -> str:
    return (shared_dir / "corpus" / "shakespeare.test.txt").read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _f32_flash_kernel(monkeypatch):
    """Tests compare modes, paths and batchings at f32 tolerances (1e-3 and tighter), on CPUs
    with and without AVX512-BF16.  The bf16 generation kernel (engine.flash_lanes, the default
    on AMD CPUs with AVX512-BF16) rounds q, k, p and v to 8 bits (~2.5e-3 on attention outputs):
    pinned off here, in this process and in the commands tests start (IKCLI_FA_BF16=0);
    tests/test_flash_lanes.py turns it on and checks it against the f32 kernels."""
    from engine import flash_attn
    monkeypatch.setattr(flash_attn, "USE_BF16", False)
    monkeypatch.setenv("IKCLI_FA_BF16", "0")
