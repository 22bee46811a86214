"""`ikcli perplexity` benchmark modes (--hellaswag, --winogrande, --multiple-choice) and strided
perplexity (--ppl-stride, --ppl-output-type): ik_llama.cpp's task selection, scores checked
against plain NumPy over full-sequence logits, output lines, one-line errors."""
from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest

from conftest import FINAL_PPL, cli

N_CTX = 256


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("deepseek2", "ik", "f16", "tiny")


@pytest.fixture(scope="module")
def engine(model):
    """(model, context) for computing the expected numbers in the tests."""
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model
    m = load_model(model, lambda s: None)
    return m, Context(m, EngineConfig(model, n_ctx=N_CTX, n_batch=N_CTX), lambda s: None)


@pytest.fixture(scope="module")
def lines(corpus_text):
    """Corpus lines long enough to be contexts and endings (no backslashes: -f processes escapes)."""
    return [s.strip() for s in corpus_text.splitlines() if len(s.strip()) > 25 and "\\" not in s][:400]


def _direct_logprobs(ctx, seq) -> np.ndarray:
    """log p(seq[t] | seq[:t]) at index t-1, from one decode of the whole sequence."""
    ctx.clear()
    lg = ctx.decode(np.asarray(seq, dtype=np.int32)).astype(np.float64)
    z = lg - lg.max(axis=1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return lp[np.arange(len(seq) - 1), np.asarray(seq[1:])]


def _prefix(seqs) -> int:
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


# ---- ik's random selection ---------------------------------------------------------------------

def test_rng_reproduces_libstdcxx():
    """Values printed by a g++ 12 program: std::mt19937, uniform_int_distribution<size_t>, and
    the float-scaled draws of winogrande / multiple-choice selection."""
    from engine.task_scores import mt19937, pick_tasks, uniform_index
    r = mt19937(5489)
    for _ in range(9999):
        r.getrandbits(32)
    assert r.getrandbits(32) == 4123659995          # the C++ standard's check value
    r = mt19937(1)
    assert [uniform_index(r, 10 - i) for i in range(10)] == [4, 8, 5, 6, 0, 0, 1, 2, 0, 0]
    r = mt19937(1)
    assert [uniform_index(r, 1000) for _ in range(4)] == [417, 997, 720, 932]
    assert pick_tasks(20, 8) == [8, 18, 12, 15, 0, 1, 4, 17]


# ---- scores against full-sequence logits -------------------------------------------------------

def test_ending_scores_are_mean_logprob_after_shared_prefix(engine):
    from engine.task_scores import ending_scores
    m, ctx = engine
    enc = m.tokenizer.encode
    ctxt = "Now is the winter of our discontent made glorious summer"
    seqs = [enc(ctxt + " " + e, add_special=True) for e in
            ("by this sun of York;", "by this son of York", "and all the clouds", "by this")]
    cp = _prefix(seqs)
    assert 1 < cp < min(len(s) for s in seqs) - 1
    got = ending_scores(ctx, seqs, 7)           # batches of 7: the prefix and tails cross batches
    want = [_direct_logprobs(ctx, s)[cp - 1:].mean() for s in seqs]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
    # one choice all shared prefix: the scored tokens start one earlier, for every choice
    seqs = [enc("to be or not", add_special=True), enc("to be or not to be", add_special=True)]
    first = len(seqs[0]) - 1
    want = [_direct_logprobs(ctx, s)[first - 1:].mean() for s in seqs]
    np.testing.assert_allclose(ending_scores(ctx, seqs, 64), want, rtol=0, atol=2e-4)


def _wg_reference(ctx, seqs, n_base):
    """ik's winogrande rule written out over full-sequence log-probabilities."""
    cp = _prefix(seqs)
    skip = all(len(s) - cp > 3 for s in seqs)
    lps = [_direct_logprobs(ctx, s) for s in seqs]
    ctx.clear()
    end0 = ctx.decode(np.asarray(seqs[0], dtype=np.int32))[-1].astype(np.float64)
    out = []
    for k, (s, lp) in enumerate(zip(seqs, lps)):
        b = n_base[k] if skip else cp
        stop = len(s) - (1 if len(s) - b > 1 else 0)
        v = lp[b - 1:stop - 1].copy()
        if k == 1 and not skip:      # ik scores this token with the logits after choice 1's end
            z = end0 - end0.max()
            v[0] = (z - np.log(np.exp(z).sum()))[s[b]]
        out.append(v.mean())
    return out, skip


@pytest.mark.parametrize("sentence,choices", [
    ("Romeo told _ that the night was long and the stars were bright above", ("Juliet", "Tybalt")),
    ("The letter was for _.", ("Al", "Bob")),
])
def test_winogrande_scores(engine, sentence, choices):
    from engine.task_scores import winogrande_scores
    m, ctx = engine
    enc = m.tokenizer.encode
    first, second = sentence.split("_")
    seqs = [enc(first + c + second, add_special=True) for c in choices]
    n_base = [len(enc(first + c, add_special=True)) for c in choices]
    want, skip = _wg_reference(ctx, seqs, n_base)
    assert skip == (len(second) > 10)       # both paths of ik's rule are covered
    np.testing.assert_allclose(winogrande_scores(ctx, seqs, n_base, 5), want, rtol=0, atol=2e-4)


# ---- strided perplexity and --ppl-output-type ----------------------------------------------------

@pytest.fixture(scope="module")
def text_file(tmp_path_factory, corpus_text):
    p = tmp_path_factory.mktemp("ppl_tasks") / "text.txt"
    p.write_text(corpus_text[:4000].replace("\\", "/"), encoding="utf-8")
    return p


def test_ppl_stride_matches_direct_windows(model, engine, text_file, capsys):
    """-c 64 -b 64 --ppl-stride 16: ik's context is 64 + 16/2 cells, padded to 256 (flash
    attention): windows of 256 tokens 16 apart, the last 16 of each scored, no BOS put in."""
    stride, n_chunk = 16, 3
    code, out, err = cli(capsys, "perplexity", "-m", model, "-f", str(text_file), "-c", "64", "-b", "64", "-t", "2",
                         "--ppl-stride", str(stride), "--chunks", str(n_chunk))
    assert code == 0, err
    assert "adjusting context size from 64 to 72" in err
    assert "perplexity_v2: calculating perplexity over 3 chunks, batch_size=64" in err
    m, ctx = engine
    tokens = m.tokenizer.encode(text_file.read_text(encoding="utf-8"), add_special=True)
    assert f"Calculation chunk = {N_CTX}" in err
    nll = []
    want = []
    for i in range(n_chunk):
        w = tokens[i * stride:i * stride + N_CTX]
        nll.extend(-_direct_logprobs(ctx, w)[-stride:])
        want.append(math.exp(np.mean(nll)))
    assert re.fullmatch(r"(\[\d+\]\d+\.\d{4},){3}\n", out), out
    got = [float(v) for v in re.findall(r"\]([\d.]+),", out)]
    np.testing.assert_allclose(got, want, rtol=2e-4)
    assert "Final estimate" not in out        # ik's strided mode prints none

    code, out1, err = cli(capsys, "perplexity", "-m", model, "-f", str(text_file), "-c", "64", "-b", "64", "-t", "2",
                          "--ppl-stride", str(stride), "--chunks", str(n_chunk), "--ppl-output-type", "1")
    assert code == 0, err
    rows = re.findall(r"^ {0,7}(\d+)  (\d+\.\d{4})$", out1, re.M)
    assert [int(r[0]) for r in rows] == [0, 16, 32] and [float(r[1]) for r in rows] == got


def test_ppl_output_type_1(model, text_file, capsys):
    """One line per chunk: the token offset of its batch of n_seq chunks (as ik prints it),
    PPL so far, mean NLL and its uncertainty; then the usual final line."""
    code, out, err = cli(capsys, "perplexity", "-m", model, "-f", str(text_file), "-c", "64", "-b", "128", "-t", "2",
                         "--chunks", "4", "--ppl-output-type", "1")
    assert code == 0, err
    rows = re.findall(r"^ {0,7}(\d+)  (\d+\.\d{4})  (\d+\.\d{6})  (\d+\.\d{6})$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 0, 128, 128]
    assert all(abs(math.exp(float(r[2])) - float(r[1])) < 1e-3 * float(r[1]) for r in rows)
    assert FINAL_PPL.search(out).group(1) == rows[-1][1]


# ---- the task modes through the command line -----------------------------------------------------

def _hellaswag_file(path, lines, n):
    with open(path, "w", encoding="utf-8") as f:
        for t in range(n):
            ctxt, *ends = lines[5 * t:5 * t + 5]
            f.write(f"{ctxt}\n{t % 4}\n" + "\n".join(ends) + "\n")


def test_hellaswag(model, engine, lines, tmp_path, capsys):
    from engine.task_scores import hellaswag_tasks
    p = tmp_path / "hs.txt"
    _hellaswag_file(p, lines, 8)
    code, out, err = cli(capsys, "perplexity", "-m", model, "-f", str(p), "-c", str(N_CTX), "-t", "2",
                         "--hellaswag", "--hellaswag-tasks", "5")
    assert code == 0, err
    assert "hellaswag_score : loaded 8 tasks from prompt." in err
    assert "hellaswag_score : selecting 5 randomized tasks." in err
    assert out.startswith("\ntask\tacc_norm\n") and out.endswith("\n\n")
    rows = re.findall(r"^(\d+)\t(\d+\.\d{8})$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    # the expected accuracies: ik's selection, each choice scored over its full sequence
    m, ctx = engine
    _, tasks = hellaswag_tasks(p.read_text(encoding="utf-8").rstrip("\n"), 5)
    right = 0
    for i, t in enumerate(tasks):
        seqs = [m.tokenizer.encode(t.context + " " + e, add_special=True) for e in t.endings]
        cp = _prefix(seqs)
        scores = [_direct_logprobs(ctx, s)[cp - 1:].mean() for s in seqs]
        right += int(np.argmax(scores)) == t.gold
        assert float(rows[i][1]) == pytest.approx(100.0 * right / (i + 1), abs=1e-8)


def test_hellaswag_selection_and_parsing():
    from engine.task_scores import hellaswag_tasks
    text = "".join(f"ctx{t}\n {t % 4}\ne0\ne1\ne2\ne3\n" for t in range(10))
    n_total, tasks = hellaswag_tasks(text, 4)
    # indices drawn from 10, 9, 8, 7 remaining tasks: 4, 8, 5, 6 (see the RNG test)
    assert n_total == 10 and [t.context for t in tasks] == ["ctx4", "ctx9", "ctx6", "ctx8"]
    assert [t.gold for t in tasks] == [0, 1, 2, 0]
    assert len(hellaswag_tasks(text, 400)[1]) == 10       # all of them, still shuffled


def _winogrande_rows(n):
    names = ["Romeo", "Juliet", "Hamlet", "Ophelia", "Lear"]
    rows = []
    for t in range(n):
        a, b = names[t % 5], names[(t + 2) % 5]
        if t % 2:
            rows.append(f'{t},"{a}, then {b}, said _ should go home before the night is over.",{a},{b},{1 + t % 3 % 2}')
        else:
            rows.append(f"{t},{a} gave {b} the book that _ wrote.,{a},{b},{1 + t % 2}")
    return rows


def test_winogrande(model, tmp_path, capsys):
    rows = _winogrande_rows(101)
    bad = ["index,sentence,option1,option2,answer", "5,no blank here,A,B,1", "6,a _ b,A,B,3", "7,too,few"]
    p = tmp_path / "wg.csv"
    p.write_text("\n".join(bad[:1] + rows[:50] + bad[1:] + rows[50:]) + "\n", encoding="utf-8")
    code, out, err = cli(capsys, "perplexity", "-m", model, "-f", str(p), "-c", str(N_CTX), "-t", "2",
                         "--winogrande")
    assert code == 0, err
    # -f drops the final newline and ik never reads a last line without one: 100 tasks
    assert "winogrande_score : loaded 100 tasks from prompt." in err
    for msg in ("no _ in <sentence>", "no _ in <no blank here>", "failed to parse answer <3>",
                "failed to find comma separators in <7,too,few>"):
        assert f"load_winogrande_from_csv: {msg}\n" in out
    lines = re.findall(r"^(\d+)\t(\d+\.\d{4})\t( *-?\d+\.\d{6})  ( *-?\d+\.\d{6})  ([12])  ([12])$", out, re.M)
    assert len(lines) == 100
    assert all(len(r[2]) == 10 and len(r[3]) == 10 for r in lines)
    assert all((r[4] == "1") == (float(r[2]) > float(r[3])) for r in lines)
    n_right = sum(r[4] == r[5] for r in lines)
    assert float(lines[-1][1]) == pytest.approx(n_right, abs=1e-4)
    final = re.search(r"^Final Winogrande score\(100 tasks\): (\d+\.\d{4}) \+/- (\d+\.\d{4})$", out, re.M)
    p_ = n_right / 100
    assert float(final.group(1)) == pytest.approx(100 * p_, abs=1e-4)
    assert float(final.group(2)) == pytest.approx(100 * math.sqrt(p_ * (1 - p_) / 99), abs=1e-4)


def test_winogrande_random_selection(model, tmp_path, capsys):
    from engine.task_scores import pick_tasks
    rows = _winogrande_rows(30)
    p = tmp_path / "wg.csv"
    p.write_text("\n".join(rows) + "\n\n", encoding="utf-8")    # last row followed by a newline: kept
    code, out, err = cli(capsys, "perplexity", "-m", model, "-f", str(p), "-c", str(N_CTX), "-t", "2",
                         "--winogrande", "--winogrande-tasks", "6")
    assert code == 0, err
    assert "loaded 30 tasks" in err and "selecting 6 random tasks" in err
    answers = [int(r[-1]) for r in re.findall(r"^\d+\t.*  ([12])  ([12])$", out, re.M)]
    assert answers == [int(rows[i][-1]) for i in pick_tasks(30, 6)]
    assert "Final Winogrande" not in out          # fewer than 100 tasks


def _mc_file(path, tasks) -> None:
    """ik's binary multiple-choice layout."""
    def s(x):
        b = x.encode()
        return struct.pack("<I", len(b)) + b

    blobs = []
    for q, answers, gold in tasks:
        labels = [int(k == gold) for k in range(len(answers))]
        blobs.append(s(q) + struct.pack("<I", len(answers)) + b"".join(s(a) for a in answers)
                     + struct.pack(f"<{len(answers)}i", *labels) + struct.pack("<I", 0))
    pos, off = [], 4 + 4 * len(blobs)
    for b in blobs:
        pos.append(off)
        off += len(b)
    path.write_bytes(struct.pack(f"<{1 + len(blobs)}I", len(blobs), *pos) + b"".join(blobs))


def test_multiple_choice(model, engine, lines, tmp_path, capsys):
    tasks = [(lines[6 * t], lines[6 * t + 1:6 * t + 3 + t % 3], t % 2) for t in range(7)]
    p = tmp_path / "mc.bin"
    _mc_file(p, tasks)
    code, out, err = cli(capsys, "perplexity", "-m", model, "-bf", str(p), "-c", str(N_CTX), "-t", "2",
                         "--multiple-choice")
    assert code == 0, err
    assert out.startswith("multiple_choice_score: there are 7 tasks in prompt\n"
                          "multiple_choice_score: reading tasks.......done\n"
                          "multiple_choice_score: preparing task data.......done\n"
                          "multiple_choice_score : calculating TruthfulQA score over 7 tasks.\n\ntask\tacc_norm\n")
    rows = re.findall(r"^(\d+)\t(\d+\.\d{8})$", out, re.M)
    m, ctx = engine
    right = 0
    for i, (q, answers, gold) in enumerate(tasks):
        seqs = [m.tokenizer.encode(q + " " + a, add_special=True) for a in answers]
        cp = _prefix(seqs)
        scores = [_direct_logprobs(ctx, s)[cp - 1:].mean() for s in seqs]
        right += int(np.argmax(scores)) == gold
        assert float(rows[i][1]) == pytest.approx(100.0 * right / (i + 1), abs=1e-8)
    final = re.search(r"^ Final result: (\d+\.\d{4}) \+/- (\d+\.\d{4})$", out, re.M)
    assert float(final.group(1)) == pytest.approx(100 * right / 7, abs=1e-4)
    n_answers = sum(len(t[1]) for t in tasks)
    chance = re.search(r"^Random chance: (\d+\.\d{4}) \+/- (\d+\.\d{4})$", out, re.M)
    pc = 7 / n_answers
    assert float(chance.group(1)) == pytest.approx(100 * pc, abs=1e-4)
    assert float(chance.group(2)) == pytest.approx(100 * math.sqrt(pc * (1 - pc) / 6), abs=1e-4)

    # two random tasks, read at their stored offsets (-f reads the binary file as is too)
    code, out, err = cli(capsys, "perplexity", "-m", model, "-f", str(p), "-c", str(N_CTX), "-t", "2",
                         "--multiple-choice", "--multiple-choice-tasks", "1")
    assert code == 0, err
    assert "selecting 1 random tasks from 7 tasks available" in out
    assert re.search(r"^ Final result: (0|100)\.0000 \+/- -nan$", out, re.M)     # glibc's printf of 0/0


# ---- errors --------------------------------------------------------------------------------------

def _files(tmp_path, lines):
    hs = tmp_path / "hs7.txt"
    hs.write_text("a\n0\nb\nc\nd\ne\nf\n")
    gold = tmp_path / "gold.txt"
    gold.write_text("a\nx\nb\nc\nd\ne\n")
    wg = tmp_path / "wg.csv"
    wg.write_text("index,sentence,option1,option2,answer\n1,a _ b,A,B,1\n2,c _ d,C,D,2\n")
    wg_none = tmp_path / "wg_none.csv"
    wg_none.write_text("index,sentence,option1,option2,answer\n\n")
    long = tmp_path / "long.txt"            # > 256 tokens: -c 32 is padded to 256 cells
    long.write_text(" ".join(lines[:12]) + "\n0\nx\ny\nz\nw\n")
    wg_long = tmp_path / "wg_long.csv"
    wg_long.write_text(f"1,{' '.join(lines[:12]).replace(',', ' ')} _.,A,B,1\n\n")
    mc_trunc = tmp_path / "trunc.bin"
    _mc_file(mc_trunc, [("q", ["a", "b"], 0)])
    mc_trunc.write_bytes(mc_trunc.read_bytes()[:-6])
    mc_empty = tmp_path / "empty.bin"
    mc_empty.write_bytes(b"")
    mc_noans = tmp_path / "noans.bin"
    _mc_file(mc_noans, [("q", ["a", ""], 0)])
    return locals()


@pytest.mark.parametrize("args,needle", [
    (["--hellaswag"], "--hellaswag needs a task file"),
    (["--hellaswag", "-f", "/no/such/tasks.txt"], "cannot read text file '/no/such/tasks.txt'"),
    (["--hellaswag", "-f", "{hs}"], "number of lines in prompt not a multiple of 6"),
    (["--hellaswag", "-f", "{gold}"], "bad gold ending index 'x'"),
    (["--hellaswag", "--hellaswag-tasks", "0", "-f", "{gold}"], "no tasks to evaluate"),
    (["--hellaswag", "-c", "32", "-f", "{long}"], "task 0 does not fit in the context window"),
    (["--winogrande", "-f", "{wg_none}"], "winogrande_score: no tasks"),
    (["--winogrande", "-c", "32", "-f", "{wg_long}"], "task 0 does not fit in the context window"),
    (["--multiple-choice", "-bf", "{mc_empty}"], "multiple_choice_score: no tasks"),
    (["--multiple-choice", "-bf", "{mc_trunc}"], "failed to read task 1 of 1"),
    (["--multiple-choice", "-bf", "{mc_noans}"], "found empty answer"),
    (["--multiple-choice", "-bf", "/no/such.bin"], "cannot read task file"),
    (["--ppl-output-type", "2"], "--ppl-output-type must be 0 or 1"),
    (["--ppl-stride", "600", "-c", "64", "-b", "64", "-f", "{long}"], "you need at least"),
])
def test_task_errors_are_one_line(model, lines, tmp_path, capsys, args, needle):
    f = {k: str(v) for k, v in _files(tmp_path, lines).items() if k != "lines" and k != "tmp_path"}
    args = [a.format(**f) for a in args]
    code, out, err = cli(capsys, "perplexity", "-m", model, "-t", "2", *args)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("ikcli: error:") and needle in last, err[-500:]
    assert "Traceback" not in err
