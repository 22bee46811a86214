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
