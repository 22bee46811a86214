"""ik_llama.cpp's common option set on ikcli's run tools: every spelling is implemented (the tool
declares it), ignored with one log line, or refused with one line naming it; never clustered,
misparsed or dropped; and the seed thread's real command lines parse or fail naming a flag."""
from __future__ import annotations

import re
import shlex

import pytest
import typer

from conftest import FINAL_PPL, cli
from ikcli.app import _checked_argv, _declared, app
from ikcli.common import NEGATIONS, RUN_TOOLS, normalize_argv
from ikcli.errors import CliError
from ikcli.ik_flags import COMMON_FLAGS, NO_EFFECT, REFUSED, USED_BY

try:  # recent Typer vendors Click
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click

CMD = typer.main.get_command(app)


def _run(tool: str, args: list[str]) -> tuple[list[str], list[str]]:
    """(argv the tool's parser gets, note lines)."""
    notes: list[str] = []
    out = _checked_argv(CMD, [tool] + args, lambda a, d=None, t=None: normalize_argv(a, d, t, notes.append))
    return out[1:], notes


def _value(spelling: str) -> str:
    return "distribute" if spelling == "--numa" else "7"


def test_table_matches_ik_and_the_tools():
    """The table holds ik 8337e4cd3's 448 spellings (common.cpp + log.h) with its value counts
    (a few read off common.cpp here), and every spelling a tool declares takes as many values
    there as in ik (-fa / -fmoe: ikcli also accepts them alone)."""
    table = {name: n for names, n in COMMON_FLAGS for name in names}
    assert len(table) == sum(len(names) for names, _ in COMMON_FLAGS) == 448
    assert {f: table[f] for f in ("-fa", "-ts", "--lora-scaled", "--control-vector-layer-range", "--numa", "-cb",
                                  "-mg", "-hft", "--log-file", "--spec-replace", "-rtr", "-ot")} == \
        {"-fa": 1, "-ts": 1, "--lora-scaled": 2, "--control-vector-layer-range": 2, "--numa": 1, "-cb": 0,
         "-mg": 1, "-hft": 1, "--log-file": 1, "--spec-replace": 2, "-rtr": 0, "-ot": 1}
    for tool in RUN_TOOLS:
        declared = _declared(CMD.commands[tool])
        for name, n in table.items():
            if name in declared and name not in ("-fa", "--flash-attn", "-h", "--help"):
                assert declared[name] == n, (tool, name, declared[name], n)


def test_argv_edge_cases():
    assert _run("perplexity", ["--save-all-logits=base.bin"])[0] == ["--kl-divergence-base=base.bin"]
    assert _run("perplexity", ["-c", "64", "-fa"])[0] == ["-c", "64", "-fa", "on"]           # -fa last
    assert _run("perplexity", ["--flash_attn", "-c", "64"])[0] == ["--flash-attn", "on", "-c", "64"]
    assert _run("perplexity", ["-c", "64", "--", "-thp"])[0] == ["-c", "64", "--", "-thp"]   # after --: as is
    assert _checked_argv(CMD, ["--help"], normalize_argv) == ["--help"]                     # no subcommand


@pytest.mark.parametrize("tool", RUN_TOOLS)
def test_every_common_spelling_has_one_outcome(tool):
    declared = _declared(CMD.commands[tool])
    seen = {"implemented": 0, "ignored": 0, "refused": 0}
    for names, n in COMMON_FLAGS:
        canon = names[0]
        for name in names:
            args = [name] + [_value(name)] * n
            try:
                out, notes = _run(tool, args + ["-c", "64"])
            except CliError as e:
                assert str(e).startswith(name + " ") and "\n" not in str(e), (name, str(e))
                assert not any(x in declared for x in names)
                assert canon in REFUSED or canon in USED_BY[tool], name
                seen["refused"] += 1
                continue
            assert out[-2:] == ["-c", "64"], (name, out)            # nothing after it was eaten
            if name in NEGATIONS:                                    # -no-fa: -fa off
                assert out[:2] == list(NEGATIONS[name]) and not notes
                seen["implemented"] += 1
            elif name in declared:
                assert out[0] in (name, "--help") and not notes, (name, out, notes)
                seen["implemented"] += 1
            elif any(x in declared for x in names):                 # ik's other spelling of a declared flag
                assert out[0] in declared and out[0] in names and not notes, (name, out)
                seen["implemented"] += 1
            elif canon == "-h":
                assert out[0] == "--help"
            else:
                assert out == ["-c", "64"] and len(notes) == 1 and notes[0].startswith(name), (name, out, notes)
                assert canon == "--numa" or (canon not in REFUSED and canon not in USED_BY[tool]), name
                seen["ignored"] += 1
    assert all(seen.values()), seen
    # the tables name only spellings of the set
    canon = {names[0] for names, _ in COMMON_FLAGS}
    assert set(NO_EFFECT) <= canon and set(REFUSED) <= canon and USED_BY[tool] <= canon


@pytest.mark.parametrize("args,expect", [
    (["-khad", "--threads", "2"], "-khad is not supported by ikcli"),
    (["-xyz"], "unknown argument: -xyz"),
    (["--no-webui"], "unknown argument: --no-webui"),
    (["-hfr", "user/model"], "-hfr is not supported by ikcli: it does not download models"),   # printed help
    (["--lora", "a.gguf"], "--lora is not supported by ikcli"),
    (["-gan", "4"], "-gan is not supported by ikcli: self-extend"),
    (["-c", "8", "-dsa"], "-dsa is not supported by ikcli: DeepSeek sparse attention"),
    (["-gaw"], "invalid parameter for argument: -gaw"),
])
def test_refusals_name_the_flag(args, expect):
    with pytest.raises(CliError, match=re.escape(expect)):
        _run("perplexity", args)


def test_values_spellings_and_ignored_lines(monkeypatch):
    out, notes = _run("perplexity", ["-mg", "0", "--ctx_size", "64", "-s", "-1", "-ser", "7,1", "-cmoe",
                                     "--temp", "0.3", "--numa", "distribute", "-fa", "-b", "512"])
    assert out == ["--ctx-size", "64", "-s", "-1", "-ser", "7,1", "--numa", "distribute", "-fa", "on", "-b", "512"]
    assert [n.split(":")[0] for n in notes] == ["-mg", "-cmoe", "--temp"]
    assert "ikcli drives one GPU" in notes[0] and "perplexity does not use it" in notes[2]
    out, notes = _run("server", ["--ctx-size=64", "-mqkv"])
    assert out == ["--ctx-size=64"] and notes and notes[0].startswith("-mqkv: ignored")
    # -v: ik's server logs request bodies with it (as ikcli's); its perplexity ignores it
    assert _run("server", ["-v", "-thp", "--threads", "2"]) == (["-v", "-thp", "--threads", "2"], [])  # -thp was -t hp
    assert _run("perplexity", ["-v"])[1][0].startswith("-v: ignored: ik_llama.cpp perplexity does not use it")
    assert _run("server", ["-cb"]) == (["-cb"], [])                          # declared: always on
    out, notes = _run("perplexity", ["--save-all-logits", "base.bin"])      # ik's alias of --kl-divergence-base
    assert out == ["--kl-divergence-base", "base.bin"] and not notes


def test_other_tools_refuse_unknown_flags_too():
    with pytest.raises(CliError, match="unknown argument: -xq"):
        _checked_argv(CMD, ["quantize", "-xq", "in.gguf", "out.gguf", "q8_0"], normalize_argv)
    args = _checked_argv(CMD, ["quantize", "--allow-requantize", "in.gguf", "out.gguf", "q8_0", "2"], normalize_argv)
    assert args[-4:] == ["in.gguf", "out.gguf", "q8_0", "2"]


def test_ignored_flags_end_to_end(capsys):
    code, out, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2", "-ngl", "0", "-cmoe",
                         "--top-k", "40", "-mqkv")
    assert code == 0, err[-2000:]
    assert "-cmoe: ignored: ikcli drives one GPU" in err
    assert "--top-k: ignored" in err and "-mqkv: ignored" in err
    m = FINAL_PPL.search(out)
    assert m and m.group(0).startswith("Final estimate: PPL over 1 chunks for n_ctx=64 = ")
    base = out
    code, out, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2", "--no-mmap")
    assert code == 0, err[-2000:]
    assert out == base                     # the same numbers from the file read into memory
    # -thp: huge pages where reserved, else the mapping stays (one line); --mlock: locked or ik's warning
    code, out, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2", "-thp", "--mlock")
    assert code == 0 and out == base, err[-2000:]
    assert "llama_mmap: using THP with page size" in err or "llama_mmap: mmap with huge page size" in err


def test_log_file(capsys, tmp_path):
    """--log-file BASE: the log lines also go to BASE.log (appended with --log-append; none with
    --log-disable); the results stay on stdout only."""
    base = str(tmp_path / "run")
    run = ("perplexity", "-c", "64", "--chunks", "1", "-t", "2", "--log-file", base)
    code, out, err = cli(capsys, *run)
    assert code == 0
    text = open(base + ".log").read()
    assert text.strip() and text.strip().splitlines() == [ln for ln in err.strip().splitlines() if ln in text]
    assert "Final estimate" not in text
    code, _, _ = cli(capsys, *run, "--log-append")
    both = open(base + ".log").read()
    assert code == 0 and both.startswith(text) and len(both) > len(text)
    code, _, _ = cli(capsys, *run)                                          # overwritten without it
    assert code == 0 and len(open(base + ".log").read()) < len(both)
    code, _, _ = cli(capsys, *run[:-1], str(tmp_path / "off"), "--log-disable")
    assert code == 0 and not (tmp_path / "off.log").exists()


@pytest.mark.parametrize("qtype,tensor,bad", [("f16", "output_norm.weight", b"\x00\x00\xc0\x7f"),   # f32 NaN
                                              ("q8_0", "blk.0.attn_output.weight", b"\x00\x7c")])  # a block's d = inf
def test_check_tensors(capsys, tmp_path, make_model, qtype, tensor, bad):
    """-vq: a NaN value or an infinite block scale is a one-line error naming the tensor; a clean
    file passes; without -vq the file loads as ik's does."""
    import shutil

    from gguf import GGUFReader
    src = make_model("deepseek2", "ik", qtype, "tiny")
    code, _, err = cli(capsys, "perplexity", "-m", str(src), "-c", "64", "--chunks", "1", "-t", "2", "-vq")
    assert code == 0, err[-2000:]
    path = tmp_path / "bad.gguf"
    shutil.copy(src, path)
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == tensor)
    with open(path, "r+b") as fh:
        fh.seek(int(t.data_offset) + (34 if qtype == "q8_0" else 0))   # q8_0: the second block's d
        fh.write(bad)
    code, _, err = cli(capsys, "perplexity", "-m", str(path), "-c", "64", "--chunks", "1", "-t", "2", "--check-tensors")
    assert code != 0 and f"tensor '{tensor}' has invalid data (" in err and len(err.strip().splitlines()[-1]) < 300
    assert "Traceback" not in err
    code, _, err = cli(capsys, "perplexity", "-m", str(path), "-c", "64", "--chunks", "1", "-t", "2", "--no-warmup")
    assert "has invalid data" not in err              # without -vq the file loads, and the NaN stops the run
    assert code != 0 and "ikcli: error: chunk 1: " in err and "NaN or infinite" in err and "--check-tensors" in err


def test_invalid_utf8_is_counted(capsys, tmp_path, corpus_text):
    f = tmp_path / "bad.txt"
    f.write_bytes(corpus_text[:3000].encode() + b"\xff\xfe ok \xc3")
    code, out, err = cli(capsys, "perplexity", "-f", str(f), "-c", "64", "--chunks", "1", "-t", "2")
    assert code == 0 and f"warning: {f}: 3 bytes of invalid UTF-8 replaced by U+FFFD" in err


def test_metadata_and_rope_overrides(capsys):
    """--override-kv changes what the model reads; --rope-freq-base the same value by flag; a
    mistyped override is skipped with ik's warning; bad spellings fail in one line."""
    run = ("perplexity", "-c", "64", "--chunks", "1", "-t", "2")
    code, base, _ = cli(capsys, *run)
    assert code == 0
    code, by_kv, err = cli(capsys, *run, "--override-kv", "deepseek2.rope.freq_base=float:500")
    assert code == 0 and by_kv != base, err[-2000:]
    assert "validate_override: Using metadata override (float) 'deepseek2.rope.freq_base' = 500.000000" in err
    code, by_flag, err = cli(capsys, *run, "--rope-freq-base", "500")
    assert code == 0 and by_flag == by_kv and "freq_base     = 500.0" in err
    code, out, err = cli(capsys, *run, "-okv", "deepseek2.rope.freq_base=int:500")
    assert code == 0 and out == base and "Bad metadata override type for key 'deepseek2.rope.freq_base', " \
                                         "expected float but got int" in err
    code, yarn, err = cli(capsys, *run, "--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32")
    assert code == 0 and yarn != base and "freq_scale    = 0.25" in err
    code, out, _ = cli(capsys, *run, "--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32",
                       "--yarn-ext-factor", "0")
    assert code == 0 and out not in (base, yarn)          # the extrapolation mix is what --yarn-ext-factor sets
    for args, msg in ((["--override-kv", "x.y=double:1"], "Invalid type for KV override: invalid type for KV override 'x.y=double:1'"),
                      (["--override-kv", "novalue"], "malformed KV override 'novalue'"),
                      (["--override-kv", "a=bool:maybe"], "invalid bool value for KV override 'a=bool:maybe'"),
                      (["--rope-scaling", "cubic"], "invalid value 'cubic' for --rope-scaling")):
        code, _, err = cli(capsys, *run, *args)
        assert code != 0 and msg in err and len(err.strip().splitlines()) == 1, err


_TOOLS = {"llama-server": "server", "llama-sweep-bench": "sweep-bench", "llama-perplexity": "perplexity",
          "llama-imatrix": "imatrix"}


def _expand(body: str) -> str:
    """What the shell makes of `$(...)` / `$((...))` on these lines: a number here."""
    out, i = [], 0
    while i < len(body):
        if body.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(body):
                depth += {"(": 1, ")": -1}.get(body[j], 0)
                j += 1
                if depth == 0:
                    break
            out.append("16")
            i = j
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def _seed_command_lines(text: str) -> list[tuple[str, list[str]]]:
    """The tool command lines of the user-guide thread, whatever the binary's path (./build/bin,
    /opt/..., Windows .\\bin\\), continuation lines (\\, ^, `) joined, shell expansions done."""
    lines = [ln.lstrip("> ").strip() for ln in text.splitlines()]
    found = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(?:\S+=\S+\s+|numactl\s+(?:--?\S+\s+)*|CUDA\S*\s+)*`?[\w./\\~#-]*?"
                     r"(llama-(?:server|sweep-bench|perplexity|imatrix))(?:\.exe)?(\s.*|$)", lines[i])
        if m:
            body = m.group(2)
            while body.rstrip().endswith(("\\", "^", "`")) and i + 1 < len(lines):
                i += 1
                body = body.rstrip()[:-1] + " " + lines[i]
            body = re.split(r"\s(?:2>&1|\||>)\s?", _expand(body))[0]
            try:
                found.append((_TOOLS[m.group(1)], shlex.split(body)))
            except ValueError:
                pass
        i += 1
    return found


def test_seed_thread_command_lines(shared_dir):
    """Every command line of the guide either parses unchanged or fails naming one flag."""
    lines = _seed_command_lines((shared_dir / "seeds" / "002_461f69e337bfe271.txt").read_text(errors="replace"))
    assert len(lines) >= 65
    ok, failed = 0, []
    for tool, args in lines:
        if "--version" in args:
            continue
        try:
            argv, _ = _run(tool, args)
            CMD.commands[tool].make_context(tool, argv)
            ok += 1
        except CliError as e:
            msg = str(e)
            assert re.match(r"^(unknown argument: )?-{1,2}[a-z]", msg), (tool, args, msg)
            failed.append((tool, re.search(r"-{1,2}[a-z][\w-]*", msg).group(0)))
        except click.ClickException as e:      # only text glued to a line by the thread's formatting
            assert "unexpected extra argument" in e.format_message(), (tool, args, e.format_message())
    assert ok >= 52, ok     # 65 lines: 2 --version, 4 --no-webui and 1 --numactl (unknown to ik too),
    #                         4 with prose or output glued on by the thread's formatting
    assert sorted(set(failed)) == [("server", "--no-webui"), ("server", "--numactl")], failed


def test_prompt_text_and_minilog(capsys, tmp_path, corpus_text):
    """-p gives perplexity and imatrix their text on the command line (the same numbers as the
    same text in a -f file); sweep-bench --minilog leaves the loader's listings out."""
    text = corpus_text[:3000].replace("\\", "/").rstrip("\n")
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    run = ("perplexity", "-c", "64", "--chunks", "2", "-t", "2")
    code, by_file, err = cli(capsys, *run, "-f", str(f))
    assert code == 0, err[-2000:]
    code, by_prompt, err = cli(capsys, *run, "-p", text)
    assert code == 0 and by_prompt == by_file, err[-2000:]
    code, _, err = cli(capsys, *run, "-p", text, "-f", str(f))
    assert code != 0 and "give one of them" in err
    code, _, err = cli(capsys, *run, "--perplexity", "-np", "4", "-p", text)
    assert code == 0 and "--perplexity: ignored" in err and "-np: ignored" in err
    from engine.imatrix import read_dat
    dats = []
    for src in (["-f", str(f)], ["-p", text]):
        out = tmp_path / f"im{len(dats)}.dat"
        code, _, err = cli(capsys, "imatrix", *src, "-c", "64", "--chunks", "1", "-t", "2", "-o", str(out))
        assert code == 0, err[-2000:]
        dats.append({n: (c, v.tolist()) for n, c, v in read_dat(str(out)).entries})
    assert dats[0] == dats[1]
    code, _, full = cli(capsys, "sweep-bench", "-c", "256", "-ub", "128", "-n", "4")
    code2, _, mini = cli(capsys, "sweep-bench", "-c", "256", "-ub", "128", "-n", "4", "--minilog")
    assert code == code2 == 0
    assert "llama_model_loader: - kv " in full and "llm_load_print_meta:" in full
    assert "llama_model_loader: - kv " not in mini and "llm_load_print_meta:" not in mini and "|    PP |" in mini
