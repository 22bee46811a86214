"""`ikcli quantize`: types, per-tensor rules, --custom-q, --dry-run, errors, atomic output."""
from __future__ import annotations

import os
import re

import gguf
import pytest

from ikcli import quantize_cmd
from conftest import FINAL_PPL, cli

FINAL = FINAL_PPL


def types_of(path):
    from engine.gguf_file import _open_one     # the gguf package's reader lacks ik's types (q6_0)
    r = _open_one(path)
    return {t.name: t.qtype for t in r.ik_tensors}, r


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, corpus_text):
    p = tmp_path_factory.mktemp("qtxt") / "t.txt"
    p.write_text(corpus_text[:12000], encoding="utf-8")
    return str(p)


def ppl(capsys, path, text_file):
    code, out, err = cli(capsys, "perplexity", "-m", path, "-f", text_file, "-c", "64", "--chunks", "2", "-t", "2")
    assert code == 0, err
    return float(FINAL.search(out).group(1))


@pytest.mark.parametrize("qtype,tid,tol", [("q8_0", 8, 0.01), ("Q4_0", 2, 0.15), ("q6_0", 133, 0.03)])
def test_quantize_and_perplexity(make_model, text_file, tmp_path, capsys, qtype, tid, tol):
    src = make_model(arch="llama", qtype="f16")
    out = str(tmp_path / f"m-{qtype}.gguf")
    code, so, err = cli(capsys, "quantize", src, out, qtype, "2")
    assert code == 0, err
    assert "converting to" in err and "llama_model_quantize_internal: quant size" in err
    types, r = types_of(out)
    assert types["blk.0.attn_q.weight"] == tid
    assert types["blk.0.attn_norm.weight"] == 0                # 1-D stays f32
    assert types["output.weight"] == 8                          # 64 columns: not a multiple of 256 -> q8_0
    assert r.meta["general.quantization_version"] == 2 and r.kv_types["general.quantization_version"] == (4, None)
    ft = {"q8_0": 7, "Q4_0": 2, "q6_0": 135}[qtype]
    assert r.meta["general.file_type"] == ft
    assert [t.name for t in r.ik_tensors] == [t.name for t in gguf.GGUFReader(src).tensors]
    if qtype != "q6_0":
        assert len(gguf.GGUFReader(out).tensors) == len(r.ik_tensors)
    from engine.model import load_model, quiet_log
    load_model(out, quiet_log)
    p0, p1 = ppl(capsys, src, text_file), ppl(capsys, out, text_file)
    assert abs(p1 - p0) / p0 < tol, (p0, p1)


def test_seed_recipe_with_interleaved_types_runs(make_model, text_file, tmp_path, capsys):
    """The seeds' recipe shape (q8_0 attention, iq3_k_r4 down, iq2_k_r4 gate/up) quantizes, loads and
    runs; the _R4 tensors hold the same values as the plain iq3_k / iq2_k, so perplexity is the same."""
    src = make_model(preset="small256", qtype="f16")
    ppls = []
    for suffix in ("_r4", ""):
        out = str(tmp_path / f"recipe{suffix}.gguf")
        rules = f"attn=q8_0,ffn_down=iq3_k{suffix},ffn_(gate|up)=iq2_k{suffix}"
        code, _, err = cli(capsys, "quantize", "--custom-q", rules, src, out, "q8_0", "2")
        assert code == 0, err
        types, _ = types_of(out)
        assert types["blk.1.ffn_down_exps.weight"] == (338 if suffix else 138)
        assert types["blk.1.ffn_up_exps.weight"] == (337 if suffix else 137)
        ppls.append(ppl(capsys, out, text_file))
    # same values; the _R4 tensors use their own kernels (quant.simd_r4: the same integer sums,
    # f32 sums in another order, products within 1e-6), which this random model's routing and
    # depth amplify a little (measured 1597.45 vs 1599.97)
    assert ppls[0] == pytest.approx(ppls[1], rel=5e-3)


def test_repack_rewrites_layouts_only(make_model, text_file, tmp_path, capsys):
    """--repack: same blocks in the _R4/_R8 layout (token_embd and non-matching names kept), the
    repacked ftype, and the same perplexity; an f16 model has nothing to repack."""
    src = make_model(preset="small256", qtype="q4_0")
    out = str(tmp_path / "r.gguf")
    code, so, err = cli(capsys, "quantize", "--repack", "--repack-pattern", "ffn_,attn_kv", src, out, "q4_0")
    assert code == 0, err
    assert re.search(r"^===================== Model ftype: \S+: Repacked ftype: \S+$", so, re.M)
    types, r = types_of(out)
    assert types["blk.1.ffn_up_exps.weight"] == 202 and types["blk.0.attn_kv_b.weight"] in (202, 8)
    assert types["blk.0.attn_kv_b.weight"] == 202       # q4_0, 512 rows: repacked (a q8_0 here was never right)
    assert types["token_embd.weight"] == types_of(src)[0]["token_embd.weight"]
    assert types["blk.0.attn_output.weight"] == types_of(src)[0]["blk.0.attn_output.weight"]   # no match
    from engine.quantize_plan import parse_ftype, repacked_ftype
    assert repacked_ftype(parse_ftype("Q4_0").ftype).name == "Q4_0_R8"
    assert ppl(capsys, out, text_file) == pytest.approx(ppl(capsys, src, text_file), rel=1e-3)
    code, so, err = cli(capsys, "quantize", "--repack", make_model(preset="small256", qtype="f16"),
                        str(tmp_path / "n.gguf"), "q4_0")
    assert code == 0 and "nothing to do for only_repack option" in so and not (tmp_path / "n.gguf").exists()


def test_keep_split_writes_the_input_shards(make_model, text_file, tmp_path, capsys):
    src = make_model(arch="llama", qtype="f16", split=3)
    code, _, err = cli(capsys, "quantize", "--keep-split", "--dry-run", src, str(tmp_path / "k.gguf"), "q8_0")
    assert code == 0 and os.listdir(tmp_path) == [], err
    assert [ln.split()[4] for ln in err.splitlines() if ln.startswith("dry run: would write")] == [
        str(tmp_path / f"k-0000{i}-of-00003.gguf") for i in (1, 2, 3)]
    code, _, err = cli(capsys, "quantize", "--keep-split", src, str(tmp_path / "k.gguf"), "q8_0")
    assert code == 0, err
    shards = sorted(os.listdir(tmp_path))
    assert shards == [f"k-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, name in enumerate(shards):
        _, r = types_of(str(tmp_path / name))
        assert r.meta["split.no"] == i and r.meta["split.count"] == 3
    code, _, err = cli(capsys, "quantize", src, str(tmp_path / "one.gguf"), "q8_0")
    assert code == 0, err
    _, r = types_of(str(tmp_path / "one.gguf"))
    assert "split.count" not in r.meta
    assert ppl(capsys, str(tmp_path / shards[0]), text_file) == ppl(capsys, str(tmp_path / "one.gguf"), text_file)


def test_type_by_number_and_moe_rules(make_model, tmp_path, capsys):
    src = make_model(arch="deepseek2", qtype="f16")
    out = str(tmp_path / "ds.gguf")
    code, _, err = cli(capsys, "quantize", src, out, "2")           # 2 = Q4_0
    assert code == 0, err
    types, _ = types_of(out)
    assert types["blk.1.ffn_up_exps.weight"] == 2                 # 3-D expert tensor, row-wise
    assert types["blk.0.attn_kv_b.weight"] == 8                   # attn_k* with >= 4 experts -> q8_0
    assert types["blk.1.ffn_gate_inp.weight"] == 0                # router stays as is


def test_custom_rules_first_wins_and_file(make_model, tmp_path, capsys):
    src = make_model(arch="llama", qtype="f16")
    out = str(tmp_path / "c.gguf")
    code, _, err = cli(capsys, "quantize", "--custom-q", r"attn_q=q4_0,blk\.0\..*=f16,attn=q6_0", src, out, "q8_0")
    assert code == 0, err
    assert "Using custom type q4_0 for tensor blk.0.attn_q.weight" in err
    types, _ = types_of(out)
    assert types["blk.0.attn_q.weight"] == 2 and types["blk.1.attn_q.weight"] == 2
    assert types["blk.0.attn_k.weight"] == 1 and types["blk.0.ffn_up.weight"] == 1
    assert types["blk.1.attn_k.weight"] == 133 and types["blk.1.ffn_up.weight"] == 8
    rules = tmp_path / "rules.txt"
    rules.write_text("# my rules\nffn_down=q4_0  # small\nffn=Q6_0,\n", encoding="utf-8")
    out2 = str(tmp_path / "c2.gguf")
    code, _, err = cli(capsys, "quantize", "--custom-q", f"@{rules}", src, out2, "q8_0")
    assert code == 0, err
    types, _ = types_of(out2)
    assert types["blk.2.ffn_down.weight"] == 2 and types["blk.2.ffn_up.weight"] == 133
    assert types["blk.2.attn_v.weight"] == 8


def test_pure_and_output_types(make_model, tmp_path, capsys):
    src = make_model(arch="llama", qtype="f16")
    out = str(tmp_path / "p.gguf")
    code, _, err = cli(capsys, "quantize", "--pure", "--output-tensor-type", "f16", "--token-embedding-type", "Q6_0",
                       src, out, "q4_0")
    assert code == 0, err
    types, _ = types_of(out)
    assert types["output.weight"] == 1 and types["token_embd.weight"] == 133
    out2 = str(tmp_path / "p2.gguf")
    code, _, err = cli(capsys, "quantize", "--pure", src, out2, "q4_0")
    assert code == 0, err
    assert types_of(out2)[0]["output.weight"] == 2               # no output.weight rule with --pure
    out3 = str(tmp_path / "p3.gguf")
    code, _, err = cli(capsys, "quantize", "--leave-output-tensor", src, out3, "q4_0")
    assert code == 0, err
    assert types_of(out3)[0]["output.weight"] == 1


def test_fallback_for_256_block_types(make_model, tmp_path, capsys):
    src = make_model(arch="llama", qtype="f16")
    code, out, err = cli(capsys, "quantize", "--dry-run", "--custom-q", "ffn_up=q6_K", src, str(tmp_path / "f.gguf"), "q8_0")
    assert code == 0, err
    assert "tensor cols 64 x 128 are not divisible by 256, required for q6_K - using fallback quantization q8_0" in err


def test_dry_run_writes_nothing(make_model, tmp_path, capsys):
    src = make_model(arch="llama", qtype="f16")
    out = tmp_path / "d.gguf"
    code, so, err = cli(capsys, "quantize", "--dry-run", src, str(out), "q4_0")
    assert code == 0, err
    assert not out.exists() and os.listdir(tmp_path) == []
    assert re.search(r"blk\.0\.attn_q\.weight +\[ +64, +64, +1, +1\] +f16 -> q4_0 +\d+\.\d{3}", so)
    assert re.search(r"^total: \d+ tensors, \d+ weights, .* MiB -> .* MiB, \d+\.\d{3} bits per weight$", so, re.M)


@pytest.mark.parametrize("args,needle", [
    (["q9_9"], "invalid ftype 'q9_9'; valid types: Q4_0"),
    (["--custom-q", "attn=q9_k", "q8_0"], "invalid quantization type 'q9_k' in custom rule 'attn=q9_k'; valid types: f32"),
    (["--custom-q", "attn", "q8_0"], "invalid custom quantization rule 'attn'"),
    (["--custom-q", "attn[=q4_0", "q8_0"], "invalid regex in custom rule 'attn[=q4_0'"),
    (["--output-tensor-type", "zz", "q8_0"], "invalid type 'zz'; valid types:"),
    (["--imatrix", "x.dat", "q8_0"], "failed to open x.dat"),
    (["iq2_bn"], "ikcli cannot quantize to"),    # the BitNet types: not in ikcli
])
def test_errors_are_one_line_and_write_nothing(make_model, tmp_path, capsys, args, needle):
    # 256-wide matrices, so that a 256-block type does not simply fall back
    src = make_model(preset="small256", qtype="f16") if args[-1] == "iq1_s_r4" else make_model(arch="llama", qtype="f16")
    out = tmp_path / "e.gguf"
    opts = [a for a in args[:-1]]
    code, _, err = cli(capsys, "quantize", *opts, src, str(out), args[-1])
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert os.listdir(tmp_path) == []


def test_requantize_needs_flag(make_model, tmp_path, capsys):
    src = make_model(arch="llama", qtype="q8_0")
    out = tmp_path / "r.gguf"
    code, _, err = cli(capsys, "quantize", src, str(out), "q4_0")
    assert code != 0 and "requantizing from type q8_0 is disabled" in err and not out.exists()
    code, _, err = cli(capsys, "quantize", "--allow-requantize", src, str(out), "q4_0")
    assert code == 0, err
    assert types_of(str(out))[0]["blk.0.attn_q.weight"] == 2


def _fail_on_write(monkeypatch, k: int, exc: BaseException) -> None:
    """The k-th tensor written by quantize raises exc (an interrupt, a full disk)."""
    calls = []

    def emit(writer, data):
        calls.append(1)
        if len(calls) == k:
            raise exc
        writer.write_tensor_data(data)

    monkeypatch.setattr(quantize_cmd, "_emit", emit)


def test_interrupt_leaves_no_file(make_model, tmp_path, capsys, monkeypatch):
    src = make_model(arch="llama", qtype="f16")
    out = tmp_path / "i.gguf"
    _fail_on_write(monkeypatch, 5, KeyboardInterrupt())
    code, _, err = cli(capsys, "quantize", src, str(out), "q8_0")
    assert code == 130
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("qtype", ["q4_0", "q5_k"])
def test_nthreads_gives_the_same_bytes(make_model, tmp_path, capsys, qtype):
    """NTHREADS spreads a tensor's rows over threads; the file must not depend on it."""
    src = make_model(preset="small256", qtype="f16")
    one, four = str(tmp_path / "1.gguf"), str(tmp_path / "4.gguf")
    assert cli(capsys, "quantize", "--pure", src, one, qtype, "1")[0] == 0
    code, _, err = cli(capsys, "quantize", "--pure", src, four, qtype, "4")
    assert code == 0 and "using 4 threads" in err, err
    with open(one, "rb") as a, open(four, "rb") as b:
        assert a.read() == b.read()


def test_flags_that_need_another_flag_say_so(make_model, tmp_path, capsys):
    """--repack-pattern without --repack, imatrix filters without --imatrix: accepted (as ik) but noted."""
    src = make_model(arch="llama", qtype="f16")
    code, _, err = cli(capsys, "quantize", "--dry-run", "--repack-pattern", "ffn_", "--exclude-weights", "ffn_",
                       src, str(tmp_path / "n.gguf"), "q8_0")
    assert code == 0, err
    assert "--repack-pattern is used only with --repack (ignored)" in err
    assert "are used only with --imatrix (ignored)" in err
    code, _, err = cli(capsys, "quantize", "--dry-run", src, str(tmp_path / "n.gguf"), "q8_0")
    assert code == 0 and "(ignored)" not in err, err


# ---- issue 18: signals, stale temporary files, unwritable outputs, full disks ------------------

def test_sigterm_leaves_no_temp_file(make_model, tmp_path):
    """SIGTERM (as a job scheduler or `timeout` sends it) during the conversion removes the
    temporary file, as Ctrl-C does, and ends with 'terminated by SIGTERM', status 143."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    src = make_model(preset="small256", qtype="f16")    # iq2_k on 2 threads: ~1.5 s of conversion
    out = tmp_path / "t.gguf"
    p = subprocess.Popen([sys.executable, "-m", "ikcli", "quantize", src, str(out), "iq2_k", "2"],
                         cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while p.poll() is None and time.time() < deadline and not any(".tmp-" in f for f in os.listdir(tmp_path)):
            time.sleep(0.005)
        assert p.poll() is None, "the run ended before its temporary file was seen"
        assert os.listdir(tmp_path) == [f".t.gguf.tmp-{p.pid}"]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1] == "ikcli: terminated by SIGTERM", err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_stale_temp_file_of_a_dead_process_is_removed(make_model, tmp_path, capsys):
    """A SIGKILLed run's temporary file (its process is gone) is removed by the next run writing
    the same output, with one line; a running process's file and other outputs' are left alone."""
    import subprocess
    import sys
    src = make_model(arch="llama", qtype="f16")
    out = tmp_path / "s.gguf"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".s.gguf.tmp-{dead_pid}"
    live = tmp_path / f".s.gguf.tmp-{os.getppid()}"          # a running process (this one's parent)
    other = tmp_path / f".other.gguf.tmp-{dead_pid}"         # another output's
    for f in (stale, live, other):
        f.write_bytes(b"GGUF" + bytes(1000))
    code, _, err = cli(capsys, "quantize", src, str(out), "q8_0")
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if "removed" in ln]
    assert len(lines) == 1 and str(stale) in lines[0] and f"process {dead_pid} is no longer running" in lines[0], err
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name, "s.gguf"])


@pytest.mark.parametrize("case", ["directory", "no_folder", "directory_imatrix", "no_folder_keep_split"])
def test_unwritable_output_is_refused_before_any_work(make_model, tmp_path, capsys, monkeypatch, case):
    """An output that is a directory or in a missing folder: one line naming it, before the model
    is read (not after the whole conversion)."""
    src = make_model(arch="llama", qtype="f16")
    if case.startswith("directory"):
        out = tmp_path / "d.gguf"
        out.mkdir()
        needle = f"cannot write {out}: it is a directory"
    else:
        out = tmp_path / "missing" / "o.gguf"
        needle = f"cannot write {out}: folder '{tmp_path / 'missing'}' does not exist"
    opts = {"directory_imatrix": ["--imatrix", str(tmp_path / "x.dat")],     # not read either
            "no_folder_keep_split": ["--keep-split"]}.get(case, [])

    def no_work(*a, **k):
        raise AssertionError("the model was read")
    import engine.gguf_file
    monkeypatch.setattr(engine.gguf_file, "open_model_file", no_work)
    code, _, err = cli(capsys, "quantize", *opts, src, str(out), "q8_0")
    assert code == 1
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "main: quantizing" not in err and "converting" not in err


@pytest.mark.parametrize("exc,reason", [
    (OSError(28, "No space left on device"), "No space left on device"),
    (OSError("294912 requested and 134016 written"), "(294912 requested and 134016 written)"),   # NumPy's tofile
])
def test_full_disk_names_the_output_and_removes_the_temp_file(make_model, tmp_path, capsys, monkeypatch, exc,
                                                               reason):
    src = make_model(arch="llama", qtype="f16")
    out = tmp_path / "full.gguf"
    _fail_on_write(monkeypatch, 3, exc)
    code, _, err = cli(capsys, "quantize", src, str(out), "q8_0")
    assert code == 1
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and lines[0].startswith(f"ikcli: error: cannot write {out}: ") and reason in lines[0], err
    assert os.listdir(tmp_path) == []
