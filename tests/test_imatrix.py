"""`ikcli imatrix` and `ikcli quantize --imatrix`: the .dat format, the statistics, combining files."""
from __future__ import annotations

import numpy as np
import pytest

N_CTX = 64          # padded to 256 by the context (flash attention), decoded in batches of 64


@pytest.fixture(scope="module")
def ds_model(make_model):
    return make_model("deepseek2", "ik", "f16", "tiny")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, corpus_text):
    p = tmp_path_factory.mktemp("imatrix") / "text.txt"
    p.write_text(corpus_text[:3000].replace("\\", "/"), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_model, text_file):
    """Three imatrix files: chunk 1, chunk 2, chunks 1+2 (computed once for the module)."""
    d = tmp_path_factory.mktemp("imatrix_runs")
    out = {}
    for key, extra in (("a", ["--chunks", "1"]), ("b", ["--chunk", "1", "--chunks", "1"]), ("ab", ["--chunks", "2"])):
        path = d / f"{key}.dat"
        code, stdout, err = _run(None, "imatrix", "-m", ds_model, "-f", str(text_file), "-o", str(path),
                                 "-c", str(N_CTX), "-t", "1", *extra)
        assert code == 0, err
        out[key] = (path, stdout, err)
    return out


def _run(_unused, *args):
    """`ikcli ARGS` in this process: (exit code, stdout, stderr); usable from module fixtures."""
    import contextlib
    import io
    from ikcli.app import main
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code or 0
    return code, out.getvalue(), err.getvalue()


def _entries(path):
    from engine.imatrix import read_dat
    dat = read_dat(str(path))
    return {n: (c, v) for n, c, v in dat.entries}, dat


def test_output_and_round_trip(runs, tmp_path):
    from engine.imatrix import read_dat, write_dat
    path, stdout, err = runs["ab"]
    assert stdout.startswith("[1]") and ",[2]" in stdout and "Final estimate: PPL = " in stdout
    assert "compute_imatrix: computing over 2 chunks with batch_size 64" in err
    assert f"save_imatrix: stored collected data after 8 chunks in {path}" in err
    ent, dat = _entries(path)
    assert dat.last_call == 8 and dat.dataset.endswith("text.txt")       # 2 chunks x 4 batches of 64
    # ik's entries for this model (-mla 3 -fa on, batches < 128: latent attention records W_k_b)
    assert len(ent) == 30
    assert ent["blk.0.ffn_gate.weight"][1].size == 64 and ent["blk.1.ffn_down_exps.weight"][1].size == 8 * 64
    assert ent["blk.1.attn_k_b.weight (reshaped)"][1].size == 4 * 32
    assert "blk.1.ffn_gate_exps.weight" not in ent and "blk.1.ffn_up_exps.weight" in ent   # -fmoe: up only
    assert all(c == 8 for c, _ in ent.values())
    copy = tmp_path / "copy.dat"
    write_dat(str(copy), dat.entries, dat.last_call, dat.dataset)
    assert copy.read_bytes() == path.read_bytes()
    again = read_dat(str(copy))
    assert [e[0] for e in again.entries] == [e[0] for e in dat.entries]


def test_values_match_numpy(runs, ds_model, text_file):
    """Mean squared activations recomputed from the raw activations the layers see."""
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.linear import observing
    from engine.model import load_model, quiet_log
    from engine.perplexity import chunk_logits
    from ikcli.textio import prompt_from_file

    m = load_model(ds_model, quiet_log)
    ctx = Context(m, EngineConfig(model_path=ds_model, n_ctx=N_CTX, n_batch=N_CTX, n_threads=1), quiet_log)
    toks = np.asarray(m.tokenizer.encode(prompt_from_file(text_file.read_text(encoding="utf-8"), True),
                                         add_special=True), dtype=np.int32)
    seen = []

    def record(op, weights, x, ids, rows):
        seen.append((op, [w.name for w in weights], x.copy(), None if ids is None else ids.copy(),
                     None if rows is None else rows.copy()))

    with observing(record):
        for i in range(2):
            chunk_logits(ctx, toks[i * ctx.n_ctx:(i + 1) * ctx.n_ctx], m.tokenizer.bos_id, ctx.n_batch)
    ent, _ = _entries(runs["ab"][0])

    # a dense weight: every call's rows
    xs = [x for op, names, x, _, _ in seen if "blk.0.ffn_down.weight" in names]
    allx = np.concatenate(xs).astype(np.float64)
    want = (allx ** 2).mean(axis=0) * len(xs)
    ncall, got = ent["blk.0.ffn_down.weight"]
    assert ncall == len(xs) == 8
    np.testing.assert_allclose(got, want, rtol=2e-6)

    # an expert tensor: per expert, the rows routed to it (fused up/gate: recorded under up)
    name = "blk.1.ffn_up_exps.weight"
    calls = [(x, ids, rows) for op, names, x, ids, rows in seen if op == "moe_fused_up_gate" and names[1] == name]
    n_exp = 8
    sums = np.zeros((n_exp, 64))
    cnt = np.zeros(n_exp)
    for x, ids, rows in calls:
        for p in range(ids.size):
            sums[ids[p]] += x[rows[p]].astype(np.float64) ** 2
            cnt[ids[p]] += 1
    assert (cnt > 0).all()
    ncall, got = ent[name]
    assert ncall == len(calls)
    np.testing.assert_allclose(got.reshape(n_exp, 64), sums / cnt[:, None] * len(calls), rtol=2e-6)

    # W_k_b, one block per head: the per-head inputs of the batched product
    name = "blk.2.attn_k_b.weight (reshaped)"
    calls = [(x, ids) for op, names, x, ids, _ in seen if names == [name]]
    xs = np.stack([x.reshape(-1, 4, 32) for x, _ in calls])           # (call, T, head, nope)
    want = (xs.astype(np.float64) ** 2).mean(axis=(0, 1)) * len(calls)
    np.testing.assert_allclose(ent[name][1].reshape(4, 32), want, rtol=2e-6)


def test_in_file_combination(runs, tmp_path):
    out = tmp_path / "comb.dat"
    code, stdout, err = _run(None, "imatrix", "--in-file", str(runs["a"][0]), "--in-file", str(runs["b"][0]),
                             "-o", str(out))
    assert code == 0, err
    assert f"main : loading imatrix from '{runs['a'][0]}'" in stdout and "main : saving combined imatrix" in stdout
    comb, dat = _entries(out)
    a, _ = _entries(runs["a"][0])
    b, _ = _entries(runs["b"][0])
    ab, _ = _entries(runs["ab"][0])
    assert dat.last_call == 0          # as ik: loaded files do not count as chunks of this run
    assert set(comb) == set(ab)
    for name, (c, v) in comb.items():
        assert c == a[name][0] + b[name][0] == ab[name][0]
        np.testing.assert_allclose(v, a[name][1] + b[name][1], rtol=1e-6)
        if "exps" not in name:         # equal rows per call: the same as accumulating both runs
            np.testing.assert_allclose(v, ab[name][1], rtol=1e-5)


def test_quantize_with_imatrix(runs, ds_model, tmp_path):
    from gguf import GGUFReader

    from engine.imatrix import mean_squares, read_dat
    from quant import reference
    from quant.types import type_info

    dat_path = runs["ab"][0]
    with_im, without = tmp_path / "q-im.gguf", tmp_path / "q.gguf"
    code, out, err = _run(None, "quantize", "--imatrix", str(dat_path), ds_model, str(with_im), "Q4_0", "1")
    assert code == 0, err
    assert "load_imatrix: loaded 30 importance matrix entries" in out and "computed on 8 chunks" in out
    assert "================================ Have weights data with 30 entries" in err
    assert "did not find weights for blk.0.attn_kv_b.weight" in err
    code, _, err = _run(None, "quantize", ds_model, str(without), "Q4_0", "1")
    assert code == 0, err
    r, r0 = GGUFReader(str(with_im)), GGUFReader(str(without))

    def kv(name):
        f = r.fields[name]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0].name == "STRING" else int(v[0])
    assert kv("quantize.imatrix.file") == str(dat_path)
    assert kv("quantize.imatrix.dataset").endswith("text.txt")
    assert kv("quantize.imatrix.entries_count") == 30 and kv("quantize.imatrix.chunks_count") == 8
    assert "quantize.imatrix.file" not in r0.fields
    t = {x.name: x for x in r.tensors}
    t0 = {x.name: x for x in r0.tensors}
    name = "blk.1.ffn_gate_exps.weight"            # -fmoe file: gets ffn_up_exps' data, as in ik
    got = np.asarray(t[name].data).view(np.uint8).reshape(-1)
    assert not np.array_equal(got, np.asarray(t0[name].data).view(np.uint8).reshape(-1))
    w = mean_squares(read_dat(str(dat_path)))["blk.1.ffn_up_exps.weight"].reshape(8, 64)
    src = {x.name: x for x in GGUFReader(ds_model).tensors}[name]
    x = np.asarray(src.data).view(np.float16).astype(np.float32).reshape(8, -1, 64)
    rb = type_info(2).row_bytes(64) * x.shape[1]
    for e in (0, 5):                                # each expert's rows with that expert's weights
        want = reference.quantize(x[e], 2, imatrix=w[e])
        assert np.array_equal(got[e * rb:(e + 1) * rb], want)


@pytest.mark.parametrize("case", ["no_text", "short", "bad_dat", "nothing", "quantize_bad_dat", "both_filters"])
def test_bad_inputs(case, ds_model, text_file, tmp_path):
    bad = tmp_path / "bad.dat"
    bad.write_bytes(b"\x05\x00\x00\x00\xff\xff\xff\x7fgarbage")
    short = tmp_path / "short.txt"
    short.write_text("only a few words", encoding="utf-8")
    out = str(tmp_path / "o.dat")
    args = {
        "no_text": ["imatrix", "-m", ds_model, "-f", str(tmp_path / "missing.txt"), "-o", out],
        "short": ["imatrix", "-m", ds_model, "-f", str(short), "-o", out, "-c", str(N_CTX)],
        "bad_dat": ["imatrix", "--in-file", str(bad), "-o", out],
        "nothing": ["imatrix", "-o", out],
        "quantize_bad_dat": ["quantize", "--imatrix", str(bad), ds_model, str(tmp_path / "q.gguf"), "Q4_0"],
        "both_filters": ["quantize", "--imatrix", str(bad), "--include-weights", "a", "--exclude-weights", "b",
                         ds_model, str(tmp_path / "q.gguf"), "Q4_0"],
    }[case]
    needle = {
        "no_text": "cannot read text file",
        "short": "you need at least",
        "bad_dat": f"failed to load {bad}",
        "nothing": "nothing to do",
        "quantize_bad_dat": "bad name length",
        "both_filters": "--include-weights and --exclude-weights cannot be used together",
    }[case]
    code, _, err = _run(None, *args)
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], err           # this case's error, not another one that happens to fire
    assert not (tmp_path / "o.dat").exists()


def test_include_exclude_weights_and_hide(runs, ds_model, tmp_path):
    """--exclude-weights / --include-weights filter the imatrix entries by name (substring);
    --hide-imatrix stores 'top_secret' and zero counts; the bytes of a tensor left without data
    are those of a run without imatrix."""
    from gguf import GGUFReader
    dat_path = runs["ab"][0]
    ent, _ = _entries(dat_path)
    n_ffn = sum("ffn_" in n for n in ent)
    assert 0 < n_ffn < len(ent)
    plain, excl, incl = tmp_path / "p.gguf", tmp_path / "x.gguf", tmp_path / "i.gguf"
    code, _, err = _run(None, "quantize", ds_model, str(plain), "Q4_0", "1")
    assert code == 0, err
    code, out, err = _run(None, "quantize", "--imatrix", str(dat_path), "--exclude-weights", "ffn_", "--hide-imatrix",
                          ds_model, str(excl), "Q4_0", "1")
    assert code == 0, err
    assert f"prepare_imatrix: have {len(ent) - n_ffn} importance matrix entries" in out
    assert "did not find weights for blk.1.ffn_gate_exps.weight" in err
    kept = next(n for n in ent if "ffn_" not in n and n.endswith(".weight"))
    assert f"did not find weights for {kept}" not in err
    r = GGUFReader(str(excl))

    def kv(name):
        f = r.fields[name]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0].name == "STRING" else int(v[0])
    assert kv("quantize.imatrix.file") == "top_secret" and kv("quantize.imatrix.dataset") == "top_secret"
    assert kv("quantize.imatrix.entries_count") == 0 and kv("quantize.imatrix.chunks_count") == 0
    t, t0 = ({x.name: x for x in GGUFReader(str(f)).tensors} for f in (excl, plain))
    name = "blk.1.ffn_gate_exps.weight"
    assert np.array_equal(np.asarray(t[name].data).view(np.uint8), np.asarray(t0[name].data).view(np.uint8))
    code, out, err = _run(None, "quantize", "--imatrix", str(dat_path), "--include-weights", "ffn_up_exps",
                          ds_model, str(incl), "Q4_0", "1")
    assert code == 0, err
    n_up = sum("ffn_up_exps" in n for n in ent)
    assert n_up > 0 and f"prepare_imatrix: have {n_up} importance matrix entries" in out
    assert "did not find weights for blk.0.ffn_down.weight" in err
    assert "did not find weights for blk.1.ffn_gate_exps.weight" not in err     # ffn_up_exps' data, as ik


def test_no_ppl_and_save_frequency(runs, ds_model, text_file, tmp_path):
    """--no-ppl: no perplexity lines, the same statistics; --save-frequency N: OUT.at_N copies;
    -ofreq N: saves along the way."""
    path = tmp_path / "n.dat"
    code, stdout, err = _run(None, "imatrix", "-m", ds_model, "-f", str(text_file), "-o", str(path), "-c", str(N_CTX),
                             "-t", "1", "--chunks", "1", "--no-ppl", "--save-frequency", "2", "-ofreq", "2")
    assert code == 0, err
    assert "[1]" not in stdout and "Final estimate" not in stdout
    assert path.read_bytes() == runs["a"][0].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.dat", "n.dat.at_2", "n.dat.at_4"]
    _, dat2 = _entries(tmp_path / "n.dat.at_2")
    assert dat2.last_call == 2
    assert f"save_imatrix: stored collected data after 2 chunks in {path}" in err


# ---- ik's entry set, --process-output, -lsim, --verbosity 2, timings (a quantized model) ----------

@pytest.fixture(scope="module")
def q8_model(make_model):
    """Q8_0 weights (ik's graph fuses each dense up/gate pair) in the old mainline layout (no
    W_k_b / W_v_b in the file: derived at load, as ik does)."""
    return make_model("deepseek2", "mainline-old", "q8_0", "tiny")


@pytest.fixture(scope="module")
def q8_runs(tmp_path_factory, q8_model, text_file):
    """One chunk each: plain; -lsim at verbosity 2 (after -v: the later wins); --process-output
    with -v after --verbosity 2 (verbosity 1)."""
    d = tmp_path_factory.mktemp("imatrix_q8")
    out = {}
    for key, extra in (("plain", []), ("lsim", ["-v", "--verbosity", "2", "-lsim"]),
                       ("output", ["--verbosity", "2", "-v", "--process-output"])):
        path = d / f"{key}.dat"
        code, stdout, err = _run(None, "imatrix", "-m", q8_model, "-f", str(text_file), "-o", str(path),
                                 "-c", str(N_CTX), "-t", "1", "--chunks", "1", *extra)
        assert code == 0, err
        out[key] = (path, stdout, err)
    return out


def _gguf_kv(reader, key):
    f = reader.fields[key]
    return int(f.parts[f.data[0]][0])


def _expected_entries(model_path) -> dict[str, tuple[int, int]]:
    """name -> (values, blocks) of ik's entries for a quantized DeepSeek model decoded in batches
    under 128 tokens (-mla 3 -fa: latent attention): every block matrix the graph multiplies, but
    attn_kv_b (prompt decompression only) and the gates fused with their up projection (recorded
    under up), plus W_k_b and W_v_b, one block per head."""
    from gguf import GGUFReader
    r = GGUFReader(model_path)
    n_head = _gguf_kv(r, "deepseek2.attention.head_count")
    lora = _gguf_kv(r, "deepseek2.attention.kv_lora_rank")
    nope = _gguf_kv(r, "deepseek2.attention.key_length") - _gguf_kv(r, "deepseek2.rope.dimension_count")
    out = {}
    for t in r.tensors:
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if not kind or len(t.shape) < 2 or kind in ("attn_kv_b", "ffn_gate", "ffn_gate_shexp", "ffn_gate_exps"):
            continue
        blocks = int(t.shape[2]) if len(t.shape) == 3 else 1
        out[t.name] = (int(t.shape[0]) * blocks, blocks)
    for i in range(_gguf_kv(r, "deepseek2.block_count")):
        out[f"blk.{i}.attn_k_b.weight"] = (n_head * nope, n_head)
        out[f"blk.{i}.attn_v_b.weight"] = (n_head * lora, n_head)
    return out


def test_entry_set_as_ik(q8_runs, q8_model):
    ent, dat = _entries(q8_runs["plain"][0])
    want = _expected_entries(q8_model)
    assert {n: v.size for n, (_, v) in ent.items()} == {n: size for n, (size, _) in want.items()}
    assert dat.last_call == 4 and all(c == 4 for c, _ in ent.values())      # 256 tokens in batches of 64
    assert "llama_print_timings" not in q8_runs["plain"][1]


def test_process_output_adds_the_output_tensor(q8_runs):
    plain, _ = _entries(q8_runs["plain"][0])
    path, stdout, err = q8_runs["output"]
    ent, _ = _entries(path)
    assert set(ent) - set(plain) == {"output.weight"} and set(plain) <= set(ent)
    ncall, vals = ent["output.weight"]
    assert ncall == 4 and vals.size == 64          # every row of every batch, as ik's logits_all
    for name, (c, v) in plain.items():             # the other products are unchanged
        assert ent[name][0] == c and np.array_equal(ent[name][1], v), name
    assert "collect_imatrix[" not in stdout        # -v after --verbosity 2: verbosity 1
    assert f"save_imatrix: stored collected data after 4 chunks in {path}" in err
    assert "sorted layer importances" not in stdout


_TRACE = r"^collect_imatrix\[(\d+)\]: +(\S+), (MUL_MAT|MUL_MAT_ID|FUSED_UP_GATE|MOE_FUSED_UP_GATE), +(\d+) x +(\d+), 0$"


def test_verbosity_2_lines(q8_runs, q8_model):
    """One ik line per recorded product: the entry's name, ggml's op, columns x tokens, the call
    count before it."""
    import re
    from collections import Counter
    path, stdout, _ = q8_runs["lsim"]
    ent, _ = _entries(path)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("collect_imatrix")]
    parsed = [re.match(_TRACE, ln) for ln in lines]
    assert all(parsed), [ln for ln, p in zip(lines, parsed) if not p]
    assert Counter(p.group(2) for p in parsed) == {n: c for n, (c, _) in ent.items()}
    blocks = {n: b for n, (_, b) in _expected_entries(q8_model).items()}
    for p in parsed:
        name, op, cols, n_tok = p.group(2), p.group(3), int(p.group(4)), int(p.group(5))
        assert n_tok == N_CTX and cols * blocks.get(name, 1) == ent[name][1].size, p.group(0)
        want_op = {"ffn_up": "FUSED_UP_GATE", "ffn_up_shexp": "FUSED_UP_GATE", "ffn_up_exps": "MOE_FUSED_UP_GATE",
                   "ffn_down_exps": "MUL_MAT_ID"}.get(name.split(".")[-2], "MUL_MAT")
        assert op == want_op, p.group(0)
    firsts = [int(p.group(1)) for p in parsed if p.group(2) == "blk.0.attn_q_a.weight"]
    assert firsts == [0, 1, 2, 3]                  # each batch starts at the previous call count
    assert stdout.index("collect_imatrix") < stdout.index("[1]")    # printed while collecting


def _lsim_reference(model_path, text_file) -> dict[str, dict[int, float]]:
    """-lsim's statistics recomputed from the activations: per batch, the input of each layer's
    first plain product, of its first ffn product and of the output tensor; mean row cosines."""
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.linear import observing
    from engine.model import load_model, quiet_log
    from ikcli.textio import prompt_from_file

    m = load_model(model_path, quiet_log)
    ctx = Context(m, EngineConfig(model_path=model_path, n_ctx=N_CTX, n_batch=N_CTX, n_threads=1), quiet_log)
    toks = np.asarray(m.tokenizer.encode(prompt_from_file(text_file.read_text(encoding="utf-8"), True),
                                         add_special=True), dtype=np.int32)[:ctx.n_ctx].copy()
    toks[0] = m.tokenizer.bos_id
    n_layer = len(m.arch.layers)
    batch: list = []

    def record(op, weights, x, ids, rows):
        name = weights[-1].name
        wanted = name.startswith("blk.") or name == "output.weight"
        if op in ("mul_mat", "fused_up_gate") and x.shape[0] >= 16 and wanted:
            layer = n_layer if name == "output.weight" else int(name.split(".")[1])
            batch.append((layer, ".ffn_" in name, x.astype(np.float64)))

    def cos(a, b):
        return (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))

    sums = {k: {i: [] for i in range(n_layer)} for k in ("layer", "attention", "ffn")}
    ctx.clear()
    with observing(record):
        for s in range(0, ctx.n_ctx, ctx.n_batch):
            batch.clear()
            ctx.decode(toks[s:s + ctx.n_batch], logits_from=0)
            first_in = {i: next(x for j, _, x in batch if j == i) for i in range(n_layer + 1)}
            first_ffn = {i: next(x for j, f, x in batch if j == i and f) for i in range(n_layer)}
            for i in range(n_layer):
                sums["layer"][i].append(cos(first_in[i], first_in[i + 1]))
                sums["attention"][i].append(cos(first_ffn[i], first_in[i]))
                sums["ffn"][i].append(cos(first_ffn[i], first_in[i + 1]))
    return {k: {i: float(np.concatenate(v).mean()) for i, v in d.items()} for k, d in sums.items()}


def test_layer_similarity(q8_runs, q8_model, text_file):
    import re
    path, stdout, _ = q8_runs["lsim"]
    ent, _ = _entries(path)
    assert "output.weight" in ent                 # -lsim records the output tensor too, as ik
    want = _lsim_reference(q8_model, text_file)
    tail = stdout[stdout.index("Final estimate"):].splitlines()[1:]
    got: dict[str, list[tuple[int, float]]] = {}
    for ln in tail:
        if m := re.match(r"^======================== sorted (\w+) importances$", ln):
            cur = got.setdefault(m.group(1), [])
        elif m := re.match(r"^ *(\d+): Layer +(\d+), <cos_sim> = (\S+)$", ln):
            assert int(m.group(1)) == len(cur)
            cur.append((int(m.group(2)), float(m.group(3))))
        else:
            assert ln == "", ln
    assert list(got) == ["layer", "attention", "ffn"]
    for what, rows in got.items():
        assert sorted(i for i, _ in rows) == sorted(want[what])
        for i, v in rows:
            assert v == pytest.approx(want[what][i], rel=2e-5, abs=1e-6), (what, i)
        vals = [abs(v) for _, v in rows]
        assert vals == sorted(vals)                # least similar first


def test_timing_lines(q8_runs):
    """llama_print_timings' closing lines: 256 tokens of prompt evaluation in one chunk."""
    import re
    err = q8_runs["plain"][2]
    num = r" *\d+\.\d\d"
    p = "^llama_print_timings:"
    pats = [rf"{p}        load time = {num} ms$",
            rf"{p}      sample time = {num} ms / +1 runs   \( *0\.00 ms per token, +inf tokens per second\)$",
            rf"{p} prompt eval time = {num} ms / +256 tokens \({num} ms per token, {num} tokens per second\)$",
            rf"{p}        eval time = {num} ms / +1 runs   \(",
            rf"{p}       total time = {num} ms / +257 tokens$"]
    lines = err.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.startswith("llama_print_timings"))
    assert lines[k - 1] == "" and len(lines) == k + 5
    for ln, p in zip(lines[k:], pats):
        assert re.match(p, ln), (ln, p)
    t = {m.group(1): float(m.group(2)) for ln in lines[k:]
         if (m := re.match(r"^llama_print_timings: +([\w ]+?) time = +(\S+) ms", ln))}
    assert 0 < t["prompt eval"] <= t["total"] and 0 < t["load"] <= t["total"]


def test_fusion_rules():
    """The products ik's graph holds: a fused dense up/gate only for quantized weights of one type
    (recorded under up, any batch size), else two mul_mats (16 rows or more); MoE experts fused
    for one type and shape, else two mul_mat_ids; the output tensor only when asked for."""
    from types import SimpleNamespace as W

    from engine.imatrix import Collector
    from quant.types import F16, Q4_0, Q8_0
    rng = np.random.default_rng(0)
    few, many = rng.standard_normal((3, 32)).astype(np.float32), rng.standard_normal((20, 32)).astype(np.float32)

    def dense(qg, qu, x):
        col = Collector()
        col("fused_up_gate", (W(name="blk.0.ffn_gate.weight", qtype=qg, shape=(64, 32)),
                              W(name="blk.0.ffn_up.weight", qtype=qu, shape=(64, 32))), x, None, None)
        return sorted(col.entries)
    assert dense(Q8_0, Q8_0, few) == ["blk.0.ffn_up.weight"]
    assert dense(F16, F16, few) == [] and dense(Q8_0, Q4_0, few) == []
    assert dense(F16, F16, many) == dense(Q8_0, Q4_0, many) == ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]

    def moe(qg, qu):
        col = Collector()
        ids = np.array([0, 1, 1, 0, 2, 3]), np.array([0, 0, 1, 1, 2, 2])
        col("moe_fused_up_gate", (W(name="blk.1.ffn_gate_exps.weight", qtype=qg, shape=(4, 64, 32)),
                                  W(name="blk.1.ffn_up_exps.weight", qtype=qu, shape=(4, 64, 32))), few, *ids)
        return sorted(col.entries)
    assert moe(F16, F16) == moe(Q8_0, Q8_0) == ["blk.1.ffn_up_exps.weight"]
    assert moe(Q8_0, Q4_0) == ["blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"]

    out = W(name="output.weight", qtype=Q8_0, shape=(100, 32))
    col = Collector()
    col("mul_mat", (out,), many, None, None)
    assert not col.entries
    col.output_name = "output.weight"
    col("mul_mat", (out,), few, None, None)
    col("mul_mat", (out,), many, None, None)
    assert list(col.entries) == ["output.weight"] and col.entries["output.weight"].ncall == 1


# ---- issue 18: broken .dat files are refused, nothing non-finite is written, -o checked first -----

def _write_raw_dat(path, entries, n_entries=None, trailer=True, last_call=3, dataset="t.txt", extra=b""):
    """A legacy .dat written field by field with struct: entries are (name, ncall, values) or
    (name, ncall, nval, values) where nval is what the file claims."""
    import struct
    b = struct.pack("<i", len(entries) if n_entries is None else n_entries)
    for e in entries:
        name, ncall, vals = e[0], e[1], e[-1]
        nval = e[2] if len(e) == 4 else len(vals)
        nb = name.encode()
        b += struct.pack("<i", len(nb)) + nb + struct.pack("<ii", ncall, nval)
        b += struct.pack(f"<{len(vals)}f", *vals)
    if trailer:
        b += struct.pack("<ii", last_call, len(dataset)) + dataset.encode()
    path.write_bytes(b + extra)
    return path


_GOOD = ("blk.0.ffn_up.weight", 2, [1.0, 2.0, 3.0, 4.0])
_BROKEN_DAT = {
    # case: (entries, _write_raw_dat options, what the one error line says after the file's name)
    "ncall_zero": ([_GOOD, ("blk.0.ffn_down.weight", 0, [1.0, 1.0])], {},
                   "entry 2 ('blk.0.ffn_down.weight') has ncall 0 (must be > 0)"),
    "ncall_negative": ([("blk.0.attn_q.weight", -4, [1.0]), _GOOD], {},
                       "entry 1 ('blk.0.attn_q.weight') has ncall -4 (must be > 0)"),
    "negative_value": ([_GOOD, ("blk.1.ffn_up.weight", 1, [0.5, -2.0, 1.0])], {},
                       "entry 2 ('blk.1.ffn_up.weight') has a negative value (-2 at index 1)"),
    "nan": ([_GOOD, ("blk.1.ffn_up.weight", 1, [0.5, 1.0, float("nan")])], {},
            "entry 2 ('blk.1.ffn_up.weight') has a non-finite value (nan at index 2)"),
    "inf": ([("blk.0.attn_q.weight", 1, [float("inf")]), _GOOD], {},
            "entry 1 ('blk.0.attn_q.weight') has a non-finite value (inf at index 0)"),
    "minus_inf": ([_GOOD, ("blk.1.ffn_up.weight", 1, [0.5, float("-inf")])], {},
                  "entry 2 ('blk.1.ffn_up.weight') has a non-finite value (-inf at index 1)"),
    "trailing_garbage": ([_GOOD], {"extra": b"\x01\x02\x03garbage"},
                         "10 bytes of unexpected data after the last entry (1: 'blk.0.ffn_up.weight')"),
    "too_few_entries_claimed": ([_GOOD, ("blk.1.ffn_up.weight", 2, [1.0, 1.0, 1.0, 1.0])], {"n_entries": 1},
                                "after the last entry (1: 'blk.0.ffn_up.weight'); "
                                "does the file hold more than the 1 entries it claims?"),
    "nval_too_large": ([_GOOD, ("blk.1.ffn_up.weight", 2, 1000, [1.0, 1.0])], {},
                       "entry 2 ('blk.1.ffn_up.weight') claims 1000 values but only"),
    "too_many_entries_claimed": ([_GOOD], {"n_entries": 7, "trailer": False},
                                 "truncated file (failed reading the name of entry 2; the file claims 7 entries)"),
    "duplicate_name": ([_GOOD, _GOOD], {}, "entry 2 ('blk.0.ffn_up.weight') repeats an earlier entry's name"),
}


@pytest.mark.parametrize("tool", ["imatrix", "quantize"])
@pytest.mark.parametrize("case", sorted(_BROKEN_DAT))
def test_broken_dat_files_are_refused(case, tool, ds_model, tmp_path):
    """ncall <= 0, negative / NaN / inf values, trailing bytes, counts that do not fit the file:
    one line naming the file and the entry, from `imatrix --in-file` and `quantize --imatrix`."""
    entries, opts, needle = _BROKEN_DAT[case]
    bad = _write_raw_dat(tmp_path / "broken.dat", entries, **opts)
    out = tmp_path / ("o.dat" if tool == "imatrix" else "q.gguf")
    args = (["imatrix", "--in-file", str(bad), "-o", str(out)] if tool == "imatrix" else
            ["quantize", "--imatrix", str(bad), ds_model, str(out), "Q4_0"])
    code, _, err = _run(None, *args)
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(bad) in lines[0] and needle in lines[0], err
    assert lines[0].count(str(bad)) == 1, err            # named once (not "failed to load F: F: ...")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.dat"]


def test_good_raw_dat_is_read(tmp_path):
    """The struct-written layout above is the real one: a well-formed file reads back."""
    from engine.imatrix import read_dat
    path = _write_raw_dat(tmp_path / "good.dat", [_GOOD, ("blk.1.ffn_up.weight", 1, [0.0, 5.0])])
    dat = read_dat(str(path))
    assert [(n, c, v.tolist()) for n, c, v in dat.entries] == [
        ("blk.0.ffn_up.weight", 2, [1.0, 2.0, 3.0, 4.0]), ("blk.1.ffn_up.weight", 1, [0.0, 5.0])]
    assert dat.last_call == 3 and dat.dataset == "t.txt"


def test_non_finite_values_are_never_written(tmp_path):
    """Combining two files whose sums overflow float32 would store inf: refused, naming the entry,
    and nothing is written (write_dat refuses non-finite values itself too)."""
    from engine.imatrix import ImatrixError, write_dat
    big = ("blk.0.ffn_up.weight", 1, [3e38, 1.0])
    a = _write_raw_dat(tmp_path / "a.dat", [big])
    b = _write_raw_dat(tmp_path / "b.dat", [big])
    out = tmp_path / "comb.dat"
    code, _, err = _run(None, "imatrix", "--in-file", str(a), "--in-file", str(b), "-o", str(out))
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and str(out) in lines[0] and "entry 'blk.0.ffn_up.weight' has a non-finite value" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.dat", "b.dat"]
    for vals in ([1.0, float("nan")], [float("-inf")]):
        with pytest.raises(ImatrixError, match="non-finite"):
            write_dat(str(out), [("x", 1, np.array(vals, np.float32))], 1, "")
        assert not out.exists()


@pytest.mark.parametrize("case", ["directory", "no_folder"])
def test_imatrix_output_checked_before_any_work(case, tmp_path):
    good = _write_raw_dat(tmp_path / "in.dat", [_GOOD])
    if case == "directory":
        out = tmp_path / "d.dat"
        out.mkdir()
        needle = f"cannot write {out}: it is a directory"
    else:
        out = tmp_path / "missing" / "o.dat"
        needle = f"cannot write {out}: folder '{tmp_path / 'missing'}' does not exist"
    code, stdout, err = _run(None, "imatrix", "--in-file", str(good), "-o", str(out))
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("ikcli: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "loading imatrix" not in stdout                # refused before the inputs are read


def test_imatrix_full_disk_names_the_file(tmp_path, monkeypatch):
    from engine import imatrix as eim
    good = _write_raw_dat(tmp_path / "in.dat", [_GOOD])
    out = tmp_path / "o.dat"

    def full(fh, *a):
        fh.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(eim, "_write_entries", full)
    code, _, err = _run(None, "imatrix", "--in-file", str(good), "-o", str(out))
    assert code == 1
    assert f"ikcli: error: cannot write {out}: No space left on device" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.dat"]
