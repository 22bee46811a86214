"""`ikcli quantize`: the per-class type flags, --ffn-gate-inp-type, --override-kv and the ftype list
of --help, against ik_llama.cpp's llama-quantize.

tests/data/golden_mixtures.json.gz (scripts/make_goldens_mixtures.py) holds ik's usage list of
ftypes (number, name, order), ik's types for the override cases (the plan itself is checked case by
case in tests/test_quantize_mixtures.py; here the command line's path to it) and, for the
--override-kv case ik quantized for real, the keys of its output and the overridden values with
their GGUF value types.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import gguf
import pytest

from conftest import cli
from engine import quantize_plan as qp
from ikcli.quantize_cmd import _block_size

GOLD = json.loads(gzip.decompress((Path(__file__).parent / "data" / "golden_mixtures.json.gz").read_bytes()))
MODELS = GOLD["models"]


def _dry_run_types(out: str) -> dict[str, str]:
    got = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s+\[[^\]]*\]\s+(\S+)(?: -> (\S+))?\s", line)
        if m:
            got[m.group(1)] = (m.group(3) or m.group(2)).lower()
    return got


def _listing(out: str) -> list:
    """[number or None, name] per line of an "Allowed quantization types" list, in order."""
    text = out.split("Allowed quantization types:", 1)[1]
    rows = []
    for line in text.splitlines():
        m = re.match(r"^  ( ?\d+)  or  (\S+) +: \S", line)
        if m:
            rows.append([int(m.group(1)), m.group(2)])
        elif re.match(r"^ {10}COPY    : \S", line):
            rows.append([None, "COPY"])
    return rows


def test_help_lists_ik_ftypes_in_its_format(capsys):
    """--help (and -h): Typer's option help, then every ftype ik lists, numbered and in ik's order."""
    for flag in ("--help", "-h"):
        code, out, err = cli(capsys, "quantize", flag)
        assert code == 0, err
        for opt in ("--attn-q-type", "--ffn-gate-inp-type", "--override-kv", "--custom-q"):
            assert opt in out, opt
        assert _listing(out) == GOLD["ftypes"]
    desc = dict(re.findall(r"^ +\d+  or  (\S+) +: (.*)$", out, re.M))
    assert desc["Q4_K_M"] == "q4_K mix, 4.5 bpw" and desc["IQ2_XXS"] == "iq2_xxs, 2.0625 bpw"
    assert desc["Q4_K"] == "same as Q4_K_M" and desc["Q8_0_R8"].startswith("q8_0_r8 (q8_0 in groups of 8 rows)")


@pytest.mark.parametrize("args,needle", [
    ([], "bad arguments"),
    (["o.gguf"], "missing ftype"),
    (["o.gguf", "q9_9"], "invalid ftype 'q9_9'"),
])
def test_bad_or_missing_type_prints_the_list(make_model, tmp_path, capsys, args, needle):
    src = make_model(arch="llama", qtype="f16")
    code, out, err = cli(capsys, "quantize", src, *[str(tmp_path / a) if a.endswith(".gguf") else a for a in args])
    assert code == 1
    assert _listing(out) == GOLD["ftypes"]
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("model,case", [("llama8", "Q4_K_M+classes"), ("llama8", "IQ2_XXS+classes"),
                                        ("ds8", "Q4_K_M+classes"), ("llama-moe8", "Q4_K_M+gate-inp"),
                                        ("llama16-gqa4", "IQ4_XS+kv-gqa")])
def test_cli_dry_run_with_overrides_matches_ik(make_model, tmp_path, capsys, model, case):
    """The flags reach the plan as ik applies them (the IQ2 group ignores most class flags, a
    --custom-q match wins, --ffn-gate-inp-type quantizes the routers, an --override-kv of
    head_count_kv changes n_gqa and so attn_v's type)."""
    m, c = MODELS[model], MODELS[model]["cases"][case]
    src = make_model(**m["make"])
    code, out, err = cli(capsys, "quantize", "--dry-run", "--ignore-imatrix-rules", *c["args"], src,
                         str(tmp_path / "o.gguf"), c["ftype"])
    assert code == 0, err
    got = _dry_run_types(out)
    want = dict(zip([t[0] for t in m["tensors"]], c["types"].split()))
    assert got == want, [(n, want[n], got.get(n)) for n in want if got.get(n) != want[n]][:8]
    base = dict(zip([t[0] for t in m["tensors"]], m["cases"][c["ftype"]]["types"].split()))
    assert got != base                  # the case is not the plain ftype's mixture


def test_ffn_gate_inp_type_writes_the_routers(make_model, tmp_path, capsys):
    """Quantized for real: the routers in q8_0 (ik's Q8_0 mixture, recorded without the flag, leaves
    them f32), every other tensor as ik's Q8_0."""
    m = MODELS["llama-moe8"]
    src = make_model(**m["make"])
    out = str(tmp_path / "g.gguf")
    code, _, err = cli(capsys, "quantize", "--ffn-gate-inp-type", "q8_0", src, out, "Q8_0", "2")
    assert code == 0, err
    from engine.gguf_file import _open_one
    got = {t.name: qp.TYPE_NAME[int(t.qtype)].lower() for t in _open_one(out).ik_tensors}
    want = dict(zip([t[0] for t in m["tensors"]], m["cases"]["Q8_0"]["types"].split()))
    routers = [n for n in want if "ffn_gate_inp" in n]
    assert routers and all(want[n] == "f32" for n in routers)
    assert got == {n: "q8_0" if n in routers else t for n, t in want.items()}


def test_override_kv_lands_in_the_written_gguf(make_model, tmp_path, capsys):
    """The same keys in the same order as ik's output, the overridden values with ik's value types
    (int -> INT32 even over a UINT32 key, float -> FLOAT32, bool, str); general.file_type is
    written after the overrides, so an override of it does not stick."""
    m, c = MODELS["llama8"], MODELS["llama8"]["cases"]["Q8_0+kv"]
    src = make_model(**m["make"])
    out = str(tmp_path / "kv.gguf")
    code, _, err = cli(capsys, "quantize", *c["args"], src, out, c["ftype"], "2")
    assert code == 0, err
    r = gguf.GGUFReader(out)
    assert [k for k in r.fields if not k.startswith("GGUF.")] == c["kv"]["keys"]
    for key, (vtype, value) in c["kv"]["values"].items():
        f = r.fields[key]
        assert f.types[0].name == vtype, key
        got = bytes(f.parts[f.data[0]]).decode() if vtype == "STRING" else f.parts[f.data[0]].tolist()[0]
        assert got == value, key
    assert r.fields["general.file_type"].parts[-1][0] == 7
    assert {t.name: int(t.tensor_type) for t in r.tensors}["blk.0.attn_q.weight"] == 8


@pytest.mark.parametrize("args,needle", [
    (["--override-kv", "no_equals"], "malformed KV override 'no_equals'"),
    (["--override-kv", "a.b=double:1"], "invalid type for KV override 'a.b=double:1'"),
    (["--override-kv", "a.b=bool:yes"], "invalid bool value for KV override 'a.b=bool:yes'"),
    (["--attn-q-type", "q9_9"], "--attn-q-type: invalid type 'q9_9'; valid types: f32"),
    (["--ffn-gate-inp-type", "zz"], "--ffn-gate-inp-type: invalid type 'zz'"),
])
def test_bad_override_is_one_line(make_model, tmp_path, capsys, args, needle):
    src = make_model(arch="llama", qtype="f16")
    code, _, err = cli(capsys, "quantize", *args, src, str(tmp_path / "e.gguf"), "q8_0")
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert list(tmp_path.iterdir()) == []


def test_class_flags_with_pure_are_noted_and_ignored(make_model, tmp_path, capsys):
    src = make_model(arch="llama", qtype="f16")
    code, out, err = cli(capsys, "quantize", "--dry-run", "--pure", "--attn-q-type", "Q8_0", src,
                         str(tmp_path / "p.gguf"), "q4_0")
    assert code == 0, err
    assert "not with --pure" in err
    assert _dry_run_types(out)["blk.0.attn_q.weight"] == "q4_0"


def test_ffn_gate_inp_type_that_does_not_fit_the_rows_is_refused():
    mi = qp.ModelInfo("qwen3moe", 2, 8, 8, 2, 300, 64)
    tensors = [("blk.0.ffn_gate_inp.weight", (64, 8), 0), ("blk.0.ffn_up_exps.weight", (64, 64, 8), 1)]
    with pytest.raises(qp.PlanError, match="--ffn-gate-inp-type q4_K: tensor blk.0.ffn_gate_inp.weight has rows of 64"):
        qp.plan_tensors(tensors, qp.parse_ftype("Q8_0"), mi, ffn_gate_inp_type=qp.TYPE_ID["q4_k"],
                        block_size=_block_size)
    plans, _ = qp.plan_tensors(tensors, qp.parse_ftype("Q8_0"), mi, ffn_gate_inp_type=qp.TYPE_ID["f32"])
    assert not plans[0].quantize                 # its own type: left as it is
