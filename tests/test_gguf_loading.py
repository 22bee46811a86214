"""GGUF loading: metadata, mmap views, split files and one-line errors for bad files."""
from __future__ import annotations

import numpy as np
import pytest

from engine.gguf_file import ModelFileError, open_model_file
from engine.hparams import read_hparams


def test_tensors_are_memory_mapped_views(make_model):
    mf = open_model_file(make_model(qtype="q8_0"))
    t = mf.tensors["blk.1.ffn_up_exps.weight"]
    assert isinstance(t.raw.base, np.memmap) or isinstance(t.raw, np.memmap)
    assert t.ne == (64, 64, 8)           # ne[0] = n_embd, then n_ff_exp, then experts
    assert t.nbytes == 64 * 64 * 8 // 32 * 34


def test_prefetch_asks_to_populate_every_split_then_falls_back(make_model, monkeypatch):
    """load_model maps all pages up front (llama.cpp's MAP_POPULATE), asking for huge pages first;
    a kernel without MADV_POPULATE_READ gets read-ahead instead, and the tensors read the same
    either way."""
    import mmap

    from engine import gguf_file
    mf = open_model_file(make_model(qtype="q8_0", split=2))
    assert len(mf.maps) == 2
    calls = []

    class FakeMap:
        def __init__(self, real):
            self.real = real

        def madvise(self, advice, *args):
            calls.append(advice)
            if advice == gguf_file._MADV_POPULATE_READ:
                raise OSError(22, "Invalid argument")

    before = {n: np.asarray(t.raw).copy() for n, t in mf.tensors.items()}
    real = [m._mmap for m in mf.maps]
    for m in mf.maps:
        monkeypatch.setattr(m, "_mmap", FakeMap(m._mmap))
    mf.prefetch()
    assert calls == [gguf_file._MADV_HUGEPAGE, gguf_file._MADV_POPULATE_READ, mmap.MADV_WILLNEED] * 2
    for m, r in zip(mf.maps, real):
        monkeypatch.setattr(m, "_mmap", r)
    mf.prefetch()                        # the real call: populates, or quietly does what it can
    for n, t in mf.tensors.items():
        assert np.array_equal(np.asarray(t.raw), before[n]), n


def test_split_files_found_from_first_part(make_model):
    single = open_model_file(make_model(qtype="f16"))
    p = make_model(qtype="f16", split=3)
    assert p.endswith("-00001-of-00003.gguf")
    mf = open_model_file(p)
    assert len(mf.paths) == 3
    assert set(mf.tensors) == set(single.tensors)
    for name, t in single.tensors.items():
        assert np.array_equal(np.asarray(mf.tensors[name].raw), np.asarray(t.raw)), name


def test_missing_split_part_is_one_line_error(make_model, tmp_path):
    import shutil
    p = make_model(qtype="f16", split=3, seed=5)
    first = tmp_path / "m-00001-of-00003.gguf"
    shutil.copy(p, first)
    with pytest.raises(ModelFileError, match="no such file"):
        open_model_file(str(first))


@pytest.mark.parametrize("cut", [10, 100, 2000, -1000])
def test_truncated_file(make_model, tmp_path, cut):
    src = open(make_model(qtype="q8_0"), "rb").read()
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(src[:cut] if cut > 0 else src[:cut])
    with pytest.raises(ModelFileError) as e:
        open_model_file(str(bad))
    msg = str(e.value)
    assert "trunc.gguf" in msg and "\n" not in msg


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"hello world, this is not a gguf file at all" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        open_model_file(str(bad))


def test_unknown_architecture(tmp_path):
    import gguf
    p = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(p), "mamba9")
    w.add_tensor("x", np.zeros(32, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFileError, match="unknown model architecture 'mamba9'"):
        read_hparams(open_model_file(str(p)))


def test_unknown_tensor_type(make_model, tmp_path):
    """Patch a tensor's type id in the header to a value no GGML version uses."""
    import gguf
    p = tmp_path / "badtype.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tensor("weird", np.zeros(64, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    raw = bytearray(p.read_bytes())
    i = raw.find(b"weird") + len(b"weird")
    # after the name: n_dims (u32), dims (u64 each), then the type id (u32)
    raw[i + 4 + 8:i + 4 + 8 + 4] = (250).to_bytes(4, "little")
    p.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="unknown type id 250"):
        open_model_file(str(p))


def test_hparams_of_three_layouts_agree(make_model):
    hps = [read_hparams(open_model_file(make_model(layout=lay))) for lay in ("ik", "mainline-old", "mainline-mla")]
    for hp in hps[1:]:
        assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_head_kv, hp.kv_lora_rank) == \
               (hps[0].n_embd_head_k, hps[0].n_embd_head_v, hps[0].n_head_kv, hps[0].kv_lora_rank)


def _tensor_info_at(raw: bytes, name: str) -> tuple[int, int]:
    """(position of the type id, position of the data offset) of tensor `name`'s info."""
    i = raw.find(name.encode()) + len(name)
    n_dims = int.from_bytes(raw[i:i + 4], "little")
    t = i + 4 + 8 * n_dims
    return t, t + 4


def test_damaged_tensor_table_is_refused(make_model, tmp_path):
    """ggml's rule: each tensor's data starts where the previous one's (padded) ends. A shifted
    offset, or a type id that changes a tensor's size, names the tensor instead of loading."""
    src = make_model(arch="llama", qtype="q8_0")
    raw = bytearray(open(src, "rb").read())
    _, off = _tensor_info_at(raw, "blk.0.attn_k.weight")
    bad = bytearray(raw)
    bad[off:off + 8] = (int.from_bytes(raw[off:off + 8], "little") + 32).to_bytes(8, "little")
    (tmp_path / "off.gguf").write_bytes(bytes(bad))
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.attn_k.weight' has data offset \d+, expected \d+"):
        open_model_file(str(tmp_path / "off.gguf"))
    t, _ = _tensor_info_at(raw, "blk.0.attn_q.weight")
    bad = bytearray(raw)
    bad[t:t + 4] = (2).to_bytes(4, "little")          # Q8_0 -> Q4_0: same blocks, fewer bytes
    (tmp_path / "type.gguf").write_bytes(bytes(bad))
    with pytest.raises(ModelFileError, match=r"has data offset \d+, expected \d+ \(damaged tensor table"):
        open_model_file(str(tmp_path / "type.gguf"))


def test_interleaved_rows_must_fill_their_groups(tmp_path):
    import gguf
    p = tmp_path / "r4.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tensor("w", np.zeros((6, 32), dtype=np.float32))   # 6 rows of 32, relabelled below
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    raw = bytearray(p.read_bytes())
    t, _ = _tensor_info_at(raw, "w")
    raw[t:t + 4] = (208).to_bytes(4, "little")         # Q8_0_R8: groups of 8 rows
    p.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="6 rows are not a multiple of the 8 rows Q8_0_R8 interleaves"):
        open_model_file(str(p))


@pytest.mark.parametrize("key,value,msg", [
    ("llama.feed_forward_length", [], "'llama.feed_forward_length' must be an integer or an array of 3 integers"),
    ("llama.expert_count", [4, 4, 4], "'llama.expert_count' must be a non-negative integer, got [4, 4, 4]"),
    ("llama.attention.head_count", 0.0, "'llama.attention.head_count' must be a positive integer, got 0.0"),
    ("llama.attention.head_count", 0, "'llama.attention.head_count' must be a positive integer, got 0"),
    ("llama.block_count", "3", "'llama.block_count' must be a positive integer, got '3'"),
    ("llama.rope.freq_base", [1.0], "'llama.rope.freq_base' must be a number"),
    ("llama.attention.head_count_kv", [2, 2, 1], "differs between layers"),
])
def test_hyper_parameters_of_the_wrong_type_name_the_key(make_model, key, value, msg):
    """Wrong types in the metadata are one-line errors naming the key (they were IndexError /
    TypeError / ZeroDivisionError tracebacks)."""
    mf = open_model_file(make_model(arch="llama", qtype="f32"))
    mf.meta[key] = value
    with pytest.raises(ModelFileError, match=__import__("re").escape(msg)):
        read_hparams(mf)


def test_per_layer_arrays_of_equal_sizes_are_read(make_model):
    mf = open_model_file(make_model(arch="llama", qtype="f32"))
    want = read_hparams(mf)
    mf.meta["llama.attention.head_count_kv"] = [want.n_head_kv] * want.n_layer
    assert read_hparams(mf).n_head_kv == want.n_head_kv


def _kv_type_at(raw: bytes, key: str) -> int:
    """Position of the value type (u32) of metadata `key`."""
    return raw.find(key.encode()) + len(key)


@pytest.mark.parametrize("edit,msg", [
    ("tokens-elem-array", "metadata key 'tokenizer.ggml.tokens'"),      # gguf's reader looped, memory grew
    ("merges-elem-array", "metadata key 'tokenizer.ggml.merges'"),
    ("tokens-count", "metadata key 'tokenizer.ggml.tokens': 1099511627776 elements cannot fit"),
])
def test_metadata_counts_are_checked_before_reading(make_model, tmp_path, edit, msg):
    """Counts and element types that do not fit the file are one-line errors naming the key, found
    before gguf's reader could loop past the end of the file."""
    import time
    raw = bytearray(open(make_model(arch="llama", qtype="f32"), "rb").read())
    key = "tokenizer.ggml.tokens" if edit.startswith("tokens") else "tokenizer.ggml.merges"
    t = _kv_type_at(raw, key)
    assert int.from_bytes(raw[t:t + 4], "little") == 9 and int.from_bytes(raw[t + 4:t + 8], "little") == 8
    if edit.endswith("elem-array"):
        raw[t + 4:t + 8] = (9).to_bytes(4, "little")
    else:
        raw[t + 8:t + 16] = (1 << 40).to_bytes(8, "little")
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(raw))
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=__import__("re").escape(msg)):
        open_model_file(str(p))
    assert time.perf_counter() - t0 < 5


def test_deeply_nested_arrays_are_refused(tmp_path):
    import struct
    depth = 30000                                       # was a RecursionError
    body = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    p = tmp_path / "nested.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    with pytest.raises(ModelFileError, match="metadata key 'x': arrays nested more than 4 deep"):
        open_model_file(str(p))


def _gguf_package_value(field):
    """One gguf.GGUFReader field as a Python value: the oracle ikcli's reader is checked against."""
    from gguf import GGUFValueType
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    v = field.parts[field.data[0]].tolist()[0]
    return bool(v) if types[0] == GGUFValueType.BOOL else v


def test_metadata_decodes_as_the_gguf_package_reads_it(tmp_path):
    """ikcli's own reader (engine.gguf_scan) against gguf.GGUFReader on every value type: the same
    Python values in the same order, and each key's GGUF type (what quantize writes back)."""
    import gguf

    from engine.gguf_file import _open_one
    p = str(tmp_path / "kv.gguf")
    w = gguf.GGUFWriter(p, "llama")
    VT = gguf.GGUFValueType
    values = [("u8", 200, VT.UINT8), ("i8", -5, VT.INT8), ("u16", 65000, VT.UINT16), ("i16", -300, VT.INT16),
              ("u32", 4_000_000_000, VT.UINT32), ("i32", -7, VT.INT32), ("f32", 0.1, VT.FLOAT32),
              ("b", True, VT.BOOL), ("s", "héllo\n", VT.STRING), ("u64", 2 ** 63 + 5, VT.UINT64),
              ("i64", -2 ** 40, VT.INT64), ("f64", 0.1, VT.FLOAT64)]
    for k, v, t in values:
        w.add_key_value(k, v, t)
    w.add_array("a_i32", [1, -2, 3])
    w.add_array("a_f32", [0.5, 0.25])
    w.add_array("a_str", ["x", "", "ü" * 3])
    w.add_array("a_bool", [True, False])
    w.add_array("a_empty", [])
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = gguf.GGUFReader(p)
    want = {k: _gguf_package_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    r = _open_one(p)
    assert r.meta == want and list(r.meta) == list(want)
    assert r.meta["f32"] == float(np.float32(0.1)) and r.meta["b"] is True and r.meta["a_bool"] == [True, False]
    for k, f in ref.fields.items():
        if not k.startswith("GGUF."):
            sub = int(f.types[-1]) if f.types[0] == VT.ARRAY and len(f.types) > 1 else None
            assert r.kv_types[k][0] == int(f.types[0]), k
            if sub is not None:
                assert r.kv_types[k][1] == sub, k
    assert r.version == 3 and [t.name for t in r.ik_tensors] == ["t"]
    np.testing.assert_array_equal(r.ik_tensors[0].raw.view(np.float32), np.arange(32, dtype=np.float32))


def test_old_and_big_endian_versions_are_one_line_errors(tmp_path):
    import struct
    for version, msg in ((1, "GGUF version 1 is not supported"),
                         (struct.unpack("<I", struct.pack(">I", 3))[0], "big-endian GGUF files are not supported")):
        p = tmp_path / "v.gguf"
        p.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, 0) + bytes(16))
        with pytest.raises(ModelFileError, match=msg):
            open_model_file(str(p))
