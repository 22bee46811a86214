"""The warm-up run: the first-run notice and its record, a clean cache afterwards, unchanged results."""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import FINAL_PPL, cli


@pytest.fixture
def record_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))     # the record goes beside Numba's cache
    return tmp_path


def test_notice_until_warmed_then_silent(record_dir):
    from engine import warmup
    lines: list[str] = []
    warmup.first_run_notice(lines.append)
    assert len(lines) == 1 and "first run of these kernels here" in lines[0] and \
        f"~{warmup._FIRST_GUESS_S:.0f} s" in lines[0]
    warmup._announced.clear()
    key = warmup.sources_key()
    warmup._save_record({"key": key, "warm": [warmup._MODEL_KEY, "Q4_K"], "seconds": {warmup._MODEL_KEY: 30.0}})
    lines.clear()
    warmup.first_run_notice(lines.append)
    assert lines == []
    warmup._save_record({"key": "other", "warm": [warmup._MODEL_KEY], "seconds": {warmup._MODEL_KEY: 42.0}})
    warmup.first_run_notice(lines.append)                  # sources changed: compiled again, last time's guess
    assert len(lines) == 1 and "~42 s" in lines[0]
    warmup._announced.clear()


def test_warm_up_leaves_an_empty_cache_and_records_types(record_dir, make_model):
    from engine import warmup
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model
    path = make_model("deepseek2", "ik", "q8_0", "tiny")
    m = load_model(str(path), lambda s: None)
    ctx = Context(m, EngineConfig(model_path=str(path), n_ctx=256), lambda s: None)
    lines: list[str] = []
    warmup.warm_up(ctx, lines.append)
    assert ctx.n_past == 0
    assert lines[0].startswith("warmup: compiling kernels for ") and "Q8_0" in lines[0]
    assert lines[-1].startswith("warmup: kernels ready in ")
    rec = warmup._load_record(warmup.sources_key())
    assert {"Q8_0", warmup._MODEL_KEY} <= set(rec["warm"]) and set(rec["seconds"]) >= {"Q8_0", warmup._MODEL_KEY}
    lines.clear()
    warmup.warm_up(ctx, lines.append)                     # warm now: nothing to say
    assert lines == [] and ctx.n_past == 0


@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_K_R4", "Q8_0", "F16"])
def test_compile_kernels_runs_every_path(qtype, monkeypatch):
    """compile_kernels on a 3-D (expert) tensor of each family: w untouched, and the plain, the
    per-expert and the fused up/gate products each run at one token, at the count from which the
    integer GEMM (or the tile path) takes over, and past the threaded-BLAS threshold."""
    import quant.matmul as M
    from quant import gemm as G
    from quant import kernels as K
    from quant.reference import quantize
    from quant.tensor import QTensor
    from quant.types import type_info
    ti = type_info(qtype)
    w = np.random.default_rng(1).standard_normal((2 * 32, 256)).astype(np.float32)
    raw = quantize(w, ti.id)
    q = QTensor.from_raw(raw, ti.id, (2, 32, 256))
    before = q.data.copy()
    seen: dict[str, set[int]] = {"matmul": set(), "matmul_id": set(), "moe_up_gate": set()}
    for name in seen:
        real = getattr(M, name)
        x_at = 2 if name == "moe_up_gate" else 1          # the activations' argument
        monkeypatch.setattr(M, name, lambda *a, _f=real, _n=name, _i=x_at: seen[_n].add(a[_i].shape[0]) or _f(*a))
    M.compile_kernels(q)
    assert np.array_equal(q.data, before)
    many = M.many_tokens(ti.id)
    want = {1, min(K.GEMM_MIN, 64)} | ({many} if many < 1 << 20 else set())
    for name, counts in seen.items():
        assert want <= counts, (name, counts)
        assert max(counts) * 16 * 256 >= G.SMALL_WORK, (name, counts)


def test_results_do_not_depend_on_the_warm_up(capsys):
    code, warm, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "2", "-t", "2")
    assert code == 0 and FINAL_PPL.search(warm)
    code, cold, err2 = cli(capsys, "perplexity", "-c", "64", "--chunks", "2", "-t", "2", "--no-warmup")
    assert code == 0 and cold == warm and "warmup:" not in err2


def test_command_runs_cache_kernels_per_source_version(tmp_path, monkeypatch):
    """A command run (ikcli.app.main without argv) puts Numba's cache in a directory keyed by the
    kernel sources (a stale kernel calling changed code can never be loaded); old versions' go."""
    import numba
    from engine import warmup
    from ikcli import app
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.delenv("IKCLI_NUMBA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)      # restored afterwards
    base = tmp_path / "ikcli" / "numba"
    (base / "old").mkdir(parents=True)
    (base / "recent").mkdir()
    os.utime(base / "old", (0, 0))
    app._versioned_numba_cache()
    want = base / warmup.sources_key()
    assert os.environ["NUMBA_CACHE_DIR"] == str(want) == numba.config.CACHE_DIR and want.is_dir()
    assert not (base / "old").exists() and (base / "recent").exists()
    monkeypatch.setenv("IKCLI_NUMBA_CACHE", "source")                         # the test suite's setting
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    app._versioned_numba_cache()
    assert "NUMBA_CACHE_DIR" not in os.environ
