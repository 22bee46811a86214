"""The command line: llama-perplexity's output and method, KL-divergence files, tokenize, one-line errors."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import FINAL_PPL, cli

PPL_LINE = re.compile(r"^(\[\d+\]\d+\.\d{4},)+$")
FINAL = FINAL_PPL


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, corpus_text):
    p = tmp_path_factory.mktemp("txt") / "t.txt"
    p.write_text(corpus_text[:20000], encoding="utf-8")
    return str(p)


def test_perplexity_output_and_method(make_model, text_file, capsys):
    """Output parses like llama-perplexity's, and the number is exp(mean NLL) of the scored halves."""
    path = make_model(qtype="q8_0")
    code, out, err = cli(capsys, "perplexity", "-m", path, "-f", text_file, "-c", "64", "--chunks", "3", "-t", "2")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert PPL_LINE.match(lines[0]), lines[0]
    m = FINAL.match(lines[-1])
    assert m, lines[-1]
    assert "calculating perplexity over 3 chunks, n_ctx=64, batch_size=2048, n_seq=32" in err
    # recompute independently: chunk of 64 with BOS first, score tokens 33..63 from logits 32..62
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    mdl = load_model(path, quiet_log)
    toks = mdl.tokenizer.encode(open(text_file, encoding="utf-8").read(), add_special=True)
    ctx = Context(mdl, EngineConfig(path, n_ctx=64), quiet_log)
    nll = []
    for c in range(3):
        ch = list(toks[c * 64:(c + 1) * 64])
        ch[0] = mdl.tokenizer.bos_id
        ctx.clear()
        lg = ctx.decode(np.array(ch, dtype=np.int32)).astype(np.float64)
        for j in range(32, 63):
            row = lg[j] - lg[j].max()
            nll.append(math.log(np.exp(row).sum()) - row[toks[c * 64 + j + 1]])
    assert float(m.group(1)) == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_run_time_repack(make_model, text_file, capsys, qtype):
    """-rtr repacks the matrices (not token_embd) into Q8_0_R8 / Q4_0_R8 and logs it as ik does;
    perplexity stays the same (the trained demo model gives identical figures; this random one
    may differ in the last digits: f32 sums in another order)."""
    path = make_model(qtype=qtype, preset="tiny-v3")
    args = ["perplexity", "-m", path, "-f", text_file, "-c", "64", "--chunks", "2", "-t", "2"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert "Repacked" not in err
    code_r, out_r, err_r = cli(capsys, *args, "-rtr")
    assert code_r == 0, err_r
    from engine.model import load_model, quiet_log
    plain = load_model(path, quiet_log)
    n_mat = sum(1 for e in plain.file.tensors.values() if len(e.shape) >= 2 and e.qtype != 0)
    m = re.search(r"^============ Repacked (\d+) tensors$", err_r, re.M)
    assert m and 0 < int(m.group(1)) <= n_mat - 1, err_r      # token_embd stays as it is
    a, b = float(FINAL.match(out.strip().splitlines()[-1]).group(1)), float(FINAL.match(out_r.strip().splitlines()[-1]).group(1))
    assert b == pytest.approx(a, rel=2e-3)


def test_kl_divergence_roundtrip(make_model, text_file, tmp_path, capsys):
    base = tmp_path / "base.kld"
    path = make_model(qtype="f16")
    code, out, err = cli(capsys, "perplexity", "-m", path, "-f", text_file, "-c", "64", "--chunks", "4",
                         "--kl-divergence-base", str(base))
    assert code == 0, err
    ppl_base = float(FINAL.match(out.strip().splitlines()[-1]).group(1))
    raw = base.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype="<i4")
    nv = 2 * ((n_vocab + 1) // 2) + 4
    assert len(raw) == 20 + 4 * n_ctx * n_chunk + 2 * nv * n_chunk * (n_ctx - 1 - n_ctx // 2)
    # same model against its own base: KLD ~ 0, same top token everywhere
    code, out, err = cli(capsys, "perplexity", "-m", path, "--kl-divergence-base", str(base), "--kl-divergence")
    assert code == 0, err
    assert "Mean    KLD:" in out
    kld = float(re.search(r"Mean    KLD:\s+(-?\d+\.\d+)", out).group(1))
    assert abs(kld) < 1e-3
    assert re.search(r"Same top p: 100\.000", out)
    ppl_q = float(re.search(r"Mean PPL\(Q\)\s+:\s+(\d+\.\d+)", out).group(1))
    assert ppl_q == pytest.approx(ppl_base, rel=1e-4)
    # a quantized model differs measurably from the f16 base
    code, out, err = cli(capsys, "perplexity", "-m", make_model(qtype="q4_0"), "--kl-divergence-base", str(base),
                         "--kl-divergence")
    kld_q4 = float(re.search(r"Mean    KLD:\s+(-?\d+\.\d+)", out).group(1))
    assert kld_q4 > 1e-3


def test_short_text_is_a_clear_error(make_model, tmp_path, capsys):
    p = tmp_path / "short.txt"
    p.write_text("To be, or not to be.")
    code, out, err = cli(capsys, "perplexity", "-m", make_model(), "-f", str(p), "-c", "128")
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("ikcli: error:") and "you need at least 256 tokens" in last


@pytest.mark.parametrize("args,needle", [
    (["perplexity", "-m", "/no/such/model.gguf"], "no such file"),
    (["perplexity", "--bogus"], "unknown argument: --bogus"),
    (["perplexity", "-c", "x"], "ctx-size"),
    (["perplexity", "-mla", "7"], "-mla must be"),
    (["perplexity", "-fa", "none"], "invalid value 'none' for -fa"),
    (["perplexity", "-ctk", "q9_0"], "Invalid cache type: q9_0"),
    (["perplexity", "-ctk", "iq4_nl"], "not available in ikcli"),
    (["perplexity", "-ser", "6"], "invalid value '6' for -ser"),
    (["perplexity", "-fa", "off", "-ctv", "q8_0"], "Quantized V cache cannot be used without flash attention"),
    (["perplexity", "-ot", "exps=CUDA1"], "available buffer types: CPU"),
    (["perplexity", "-ot", "(exps=CPU"], "bad regex in -ot rule '(exps=CPU'"),
    (["perplexity", "-ot", "exps"], "expected REGEX=BUFFER"),
    (["tokenize", "-m", "/no/such.gguf", "-p", "x"], "no such file"),
])
def test_bad_input_one_line(args, needle, capsys):
    code, out, err = cli(capsys, *args)
    assert code != 0
    assert needle in err
    assert err.strip().count("\n") == 0 and "Traceback" not in err


def test_tokenize_ids(shared_dir, capsys):
    vocab = shared_dir / "vocab" / "ggml-vocab-llama-spm.gguf"
    code, out, err = cli(capsys, "tokenize", "-m", str(vocab), "-p", "Hello world", "--ids")
    assert code == 0, err
    ids = eval(out.strip())  # a Python-style list, as llama-tokenize prints it
    assert ids == [1, 15043, 3186]
    code, out, err = cli(capsys, "tokenize", "-m", str(vocab), "-p", "Hello world")
    assert out.splitlines()[1] == " 15043 -> ' Hello'"


@pytest.mark.parametrize("argv,expect", [
    (["--help"], ("perplexity", "tokenize", "imatrix")),
    (["server", "--help"], ("--parallel",)),
    (["sweep-bench", "--help"], ("--plot",)),
    (["quantize", "--help"], ("--repack",)),
    (["imatrix", "--help"], ("--in-file",)),
])
def test_help_does_not_import_numba(argv, expect):
    code = ("import sys; from ikcli.app import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "heavy = {'numba', 'numpy', 'llvmlite', 'fastapi', 'uvicorn', 'gguf'} & set(sys.modules)\n"
            # (quantize --help lists ik's types from quant.types / engine.quantize_plan: pure-Python tables)

            "assert not heavy, sorted(heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert all(e in r.stdout for e in expect), r.stdout


@pytest.mark.parametrize("flags,echo", [
    ([], {"flash_attn": "1", "mla_attn": "3", "fused_moe": "1", "attn_max_b": "256", "ser": "-1, 0"}),
    (["-fa", "-fmoe", "-mla", "2"], {"flash_attn": "1", "mla_attn": "2", "fused_moe": "1"}),
    (["-fa", "0", "-no-fmoe", "-mla", "1"], {"flash_attn": "0", "mla_attn": "1", "fused_moe": "0"}),
    (["-no-fa", "-fmoe", "1", "-amb", "64"], {"flash_attn": "0", "fused_moe": "1", "attn_max_b": "128"}),
    (["-fa", "off", "--fused-moe", "0", "-ser", "6,1", "-mla", "0"],
     {"flash_attn": "0", "fused_moe": "0", "ser": "6, 1", "mla_attn": "0"}),
])
def test_engine_flag_spellings_and_startup_echo(flags, echo, capsys):
    code, out, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2", *flags)
    assert code == 0, err[-2000:]
    for key, val in echo.items():
        assert f"llama_init_from_model: {key:<13s} = {val}\n" in err, (key, val)
    assert "Final estimate: PPL" in out


def test_override_tensor_logs_matches_first_rule_wins(capsys):
    code, out, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2",
                         "-ot", "ffn_up_exps=CPU", "-ot", "exps=CPU,attn=CPU")
    assert code == 0, err[-2000:]
    lines = [x for x in err.splitlines() if "buffer type overridden to CPU" in x]
    assert any(x.startswith("Tensor blk.1.ffn_up_exps.weight (size = ") for x in lines)
    assert any("blk.1.ffn_gate_exps.weight" in x for x in lines) and any("attn_kv_a_mqa" in x for x in lines)
    assert len(lines) == len(set(lines))            # each tensor once: the first matching rule places it
