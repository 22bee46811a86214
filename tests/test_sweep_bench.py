"""`ikcli sweep-bench`: llama-sweep-bench's output on stderr (header, table, jsonl), its sweep
(N_KV = 0, ub, 2*ub ... while N_KV + ub <= n_ctx), stride / repetitions, one-line errors, plots."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ikcli.app import main
from conftest import cli

ROOT = Path(__file__).resolve().parents[1]

# What a user's parsing script matches in llama-sweep-bench's output.
MAIN_LINE = re.compile(r"^main: n_kv_max = (\d+), n_batch = (\d+), n_ubatch = (\d+), flash_attn = ([01]), "
                       r"n_gpu_layers = (-?\d+), n_threads = (\d+), n_threads_batch = (\d+)$")
HEADER = "|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |"
SEPARATOR = "|-------|--------|--------|----------|----------|----------|----------|"
ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+) \|$")
ROW_FMT = "|{:6d} | {:6d} | {:6d} | {:8.3f} | {:8.2f} | {:8.3f} | {:8.2f} |"
JSON_KEYS = ["n_kv_max", "n_batch", "n_ubatch", "flash_attn", "n_gpu_layers", "n_threads", "n_threads_batch",
             "pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg"]
JSON_LINE = re.compile(r'^\{"n_kv_max": \d+, "n_batch": \d+, "n_ubatch": \d+, "flash_attn": [01], "n_gpu_layers": -?\d+, '
                       r'"n_threads": \d+, "n_threads_batch": \d+, "pp": \d+, "tg": \d+, "n_kv": \d+, '
                       r'"t_pp": \d+\.\d{6}, "speed_pp": \d+\.\d{6}, "t_tg": \d+\.\d{6}, "speed_tg": \d+\.\d{6} \}$')
TIMINGS = re.compile(r"^llama_print_timings: prompt eval time = +[\d.]+ ms / +(\d+) tokens .*\n"
                     r"llama_print_timings: +eval time = +[\d.]+ ms / +(\d+) runs ", re.M)
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def table_rows(err: str) -> list[tuple]:
    return [tuple(float(x) if "." in x else int(x) for x in m.groups())
            for m in map(ROW.match, err.splitlines()) if m]


def json_rows(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """-c 256 -ub 64 with flash attention (the default): 4 rows; its stderr is kept as a file."""
    err = io.StringIO()     # capsys is function-scoped: run once here with plain redirection
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main(["sweep-bench", "-c", "256", "-ub", "64", "-t", "2"])
        except SystemExit as e:
            code = e.code or 0
    path = tmp_path_factory.mktemp("sweep") / "table.log"
    path.write_text(err.getvalue(), encoding="utf-8")
    return code, out.getvalue(), err.getvalue(), path


def test_table_output(table_run):
    code, out, err, _ = table_run
    assert code == 0, err
    assert out == ""                       # like the original: everything on stderr
    lines = err.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("main: n_kv_max"))
    m = MAIN_LINE.match(lines[i])
    assert m, lines[i]
    n_kv_max, n_batch, n_ubatch, fa, ngl, nt, ntb = map(int, m.groups())
    assert (n_kv_max, n_batch, n_ubatch, fa, ngl, nt, ntb) == (256, 2048, 64, 1, -1, 2, 2)
    assert lines[i - 1] == "" and lines[i + 1] == ""
    assert lines[i + 2] == HEADER and lines[i + 3] == SEPARATOR
    rows = table_rows(err)
    assert [r[2] for r in rows] == [0, 64, 128, 192]
    assert all(r[0] == 64 and r[1] == 16 for r in rows)       # PP = ub, TG = ub/4
    assert rows[-1][2] + 64 <= n_kv_max
    for r, line in zip(rows, lines[i + 4:i + 8]):
        pp, tg, n_kv, t_pp, s_pp, t_tg, s_tg = r
        assert line == ROW_FMT.format(pp, tg, n_kv, t_pp, s_pp, t_tg, s_tg)
        assert s_pp > 0 and s_tg > 0
        # S = tokens / T, with T printed to 3 decimals and S to 2
        for n, t_, s_ in ((pp, t_pp, s_pp), (tg, t_tg, s_tg)):
            assert n / (t_ + 0.0006) <= s_ + 0.006 and (t_ <= 0.0006 or s_ - 0.006 <= n / (t_ - 0.0006))
    t = TIMINGS.search(err)
    assert t, err[-800:]
    assert (int(t.group(1)), int(t.group(2))) == (4 * 64, 4 * 16)   # after the warmup's reset


def test_jsonl_no_fa_stride_nrep_plot(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    args = ["sweep-bench", "-fa", "off", "-c", "128", "-ub", "32", "-n", "4", "-t", "2", "--output-format", "jsonl",
            "--sweep-stride", "2", "-nrep", "2", "-wb"]
    if HAVE_MPL:
        args += ["--plot", str(png)]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert out == ""
    assert "main: n_kv_max" not in err and HEADER not in err      # jsonl mode prints no table header
    lines = [line for line in err.splitlines() if line.startswith("{")]
    assert len(lines) == 2
    for line in lines:
        assert JSON_LINE.match(line), line
    rows = [json.loads(line) for line in lines]
    assert all(list(r) == JSON_KEYS for r in rows)
    assert [r["n_kv"] for r in rows] == [0, 64]                   # rows 0, 32, 64, 96; every 2nd measured
    r = rows[0]
    assert (r["n_kv_max"], r["n_batch"], r["n_ubatch"], r["flash_attn"], r["pp"], r["tg"]) == (128, 2048, 32, 0, 32, 4)
    for r in rows:      # %f of the original's single-precision seconds and tokens / seconds
        assert r["speed_pp"] == pytest.approx(r["pp"] / r["t_pp"], rel=0.01)
        assert r["speed_tg"] == pytest.approx(r["tg"] / r["t_tg"], rel=0.01)
    t = TIMINGS.search(err)
    # PP: 2 reps on row 0 + 3 more rows; TG: 2 reps on row 0 + 1 on row 64
    assert (int(t.group(1)), int(t.group(2))) == (5 * 32, 3 * 4)
    if HAVE_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    """Without matplotlib, --plot fails before any work with one line."""
    import importlib.util as iu
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, out, err = cli(capsys, "sweep-bench", "-c", "128", "-ub", "32", "--plot", str(tmp_path / "x.png"))
    assert code == 1
    assert err.strip().splitlines() == [err.strip()] and "matplotlib" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_plot_sweep_script_two_runs(capsys, tmp_path, table_run):
    code, _, err = cli(capsys, "sweep-bench", "-fa", "off", "-c", "128", "-ub", "32", "-n", "4", "-t", "2",
                       "--output-format", "jsonl", "--no-warmup")
    assert code == 0, err
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(line for line in err.splitlines() if line.startswith("{")) + "\n")
    b = tmp_path / "b.jsonl"       # the same kind of file the original writes, as a user compares against
    b.write_text('{"n_kv_max": 8704, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "n_gpu_layers": -1, "n_threads": 32, '
                 '"n_threads_batch": 32, "pp": 512, "tg": 128, "n_kv": 0, "t_pp": 1.093814, "speed_pp": 468.086884, '
                 '"t_tg": 1.780312, "speed_tg": 71.897514 }\n'
                 '{"n_kv_max": 8704, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "n_gpu_layers": -1, "n_threads": 32, '
                 '"n_threads_batch": 32, "pp": 512, "tg": 128, "n_kv": 512, "t_pp": 1.169302, "speed_pp": 437.868073, '
                 '"t_tg": 1.897474, "speed_tg": 67.458099 }\n')
    png = tmp_path / "cmp.png"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_sweep.py"), str(a), str(b), str(table_run[3]),
                        "-o", str(png), "--labels", "ikcli,ik_llama.cpp,table log"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from ikcli.sweep_plot import read_results
    assert [x["n_kv"] for x in read_results(str(table_run[3]))] == [0, 64, 128, 192]
    assert [x["speed_tg"] for x in read_results(str(b))] == [71.897514, 67.458099]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_sweep.py"), str(a), "-o", str(png), "--labels", "x,y"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--labels" in r.stderr


@pytest.mark.parametrize("args, what", [
    (["-c", "16", "-ub", "64", "-fa", "off"], "no sweep row fits"),   # 16 pads to 32 cells without -fa
    (["-c", "16", "-ub", "512"], "no sweep row fits"),                # 16 pads to 256 cells with -fa
    (["-c", "128", "-ub", "32", "-n", "200"], "too large"),
    (["--output-format", "csv"], "--output-format"),
    (["-ctv", "q8_0", "-fa", "off"], "flash attention"),
])
def test_one_line_errors(capsys, args, what):
    code, out, err = cli(capsys, "sweep-bench", *args)
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("ikcli: error:") and what in last, err[-500:]
    assert "Traceback" not in err and out == ""


def test_bad_flag_value(capsys):
    code, _, err = cli(capsys, "sweep-bench", "-nrep", "many")
    assert code == 2
    assert err.strip().startswith("ikcli: error:") and len(err.strip().splitlines()) == 1
