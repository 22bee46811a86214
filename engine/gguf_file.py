"""Opening GGUF model files: metadata, memory-mapped tensors, split files, the loader's log lines.

Read by ikcli's own bounded walk (engine.gguf_scan); tensor infos are decoded with ikcli's own type
table (quant.types) so that types mainline's gguf package lacks (the IQK family, _R4/_R8) load
too, and so an unknown type or a truncated file is reported by name instead of as a traceback.
"""
from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from quant.tensor import QTensor
from quant.types import type_info

from . import gguf_scan

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)      # Linux's value
_MADV_POPULATE_READ = 22        # Linux >= 5.14; Python's mmap module has no name for it before 3.12
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)    # Linux's value; older Pythons lack the name


def _huge_page_size() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("Hugepagesize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2 * 1024 * 1024


def _huge_buffer(size: int) -> np.ndarray:
    """`size` bytes of anonymous memory in huge pages (MAP_HUGETLB); OSError where the system has
    none reserved (the mapping is refused up front, not at first touch)."""
    page = _huge_page_size()
    mm = mmap.mmap(-1, -(-size // page) * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
    return np.frombuffer(mm, dtype=np.uint8, count=size)


def _read_file_into(path: str, mem: np.ndarray) -> None:
    view = memoryview(mem)
    done = 0
    with open(path, "rb", buffering=0) as fh:
        while done < len(view):
            n = fh.readinto(view[done:done + (1 << 30)])
            if not n:
                raise ModelFileError(f"{path}: file changed size while loading")
            done += n


_KV_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def parse_kv_override(text: str) -> tuple[str, str, Any]:
    """`KEY=TYPE:VALUE` (TYPE int, float, bool, str) as ik's --override-kv reads it; ValueError
    with the reason otherwise."""
    key, eq, rest = text.partition("=")
    if not eq or not key or len(key) >= 128:
        raise ValueError(f"malformed KV override '{text}'")
    kind, colon, value = rest.partition(":")
    if not colon or kind not in _KV_TYPES.values():
        raise ValueError(f"invalid type for KV override '{text}' (use int:, float:, bool: or str:)")
    try:
        if kind == "bool":
            if value not in ("true", "false"):
                raise ValueError
            return key, kind, value == "true"
        if kind == "str":
            if len(value) > 127:
                raise ValueError
            return key, kind, value
        return key, kind, int(value) if kind == "int" else float(value)
    except ValueError:
        raise ValueError(f"invalid {kind} value for KV override '{text}'") from None


class ModelFileError(Exception):
    """A problem with a model file; str() is a complete one-line message."""


@dataclass
class TensorEntry:
    name: str
    qtype: int
    ne: tuple            # GGML order: ne[0] is the row length
    raw: np.ndarray      # uint8 view of the bytes (memory mapped)
    path: str

    @property
    def shape(self) -> tuple:
        """NumPy order (outermost first)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne))

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def qtensor(self) -> QTensor:
        # a plain ndarray view: slicing np.memmap subclasses costs ~10 us per slice in the hot loop
        return QTensor.from_raw(self.raw.view(np.ndarray), self.qtype, self.shape)

    def as_f32(self) -> np.ndarray:
        """Small tensors (norms, biases) as float32 NumPy arrays."""
        from quant.matmul import dequantize
        return dequantize(self.qtensor()).reshape(self.shape)


class _Reader:
    """One GGUF file: its metadata (meta, kv_types, version), its bytes memory-mapped (data) and
    its tensor table (ik_tensors, views of data) checked against ikcli's type registry and the
    file's size."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = np.memmap(path, mode="r", dtype=np.uint8)
        lay = gguf_scan.read_layout(self.data)
        self.version, self.meta, self.kv_types = lay.version, lay.meta, lay.kv_types
        self.ik_tensors: list[TensorEntry] = []
        seen: set[str] = set()
        file_size = len(self.data)
        align = lay.alignment
        expect = 0                  # ggml's rule: each tensor starts where the previous one, padded, ends
        for info in lay.tensors:
            name, tid, ne = info.name, info.type_id, info.ne
            if name in seen:
                raise ModelFileError(f"duplicated tensor '{name}'")
            seen.add(name)
            try:
                ti = type_info(tid)
                if ti.internal:
                    raise KeyError(tid)
            except KeyError:
                raise ModelFileError(f"tensor '{name}' has unknown type id {tid}") from None
            n_elem = int(np.prod(ne)) if ne else 1
            if ne[0] % ti.block_size:
                raise ModelFileError(f"tensor '{name}': row of {ne[0]} is not a multiple of the {ti.name} block size")
            if ti.interleave and len(ne) > 1 and ne[1] % ti.interleave:
                raise ModelFileError(f"tensor '{name}': {ne[1]} rows are not a multiple of the {ti.interleave} rows "
                                     f"{ti.name} interleaves")
            nbytes = ti.row_bytes(ne[0]) * (n_elem // ne[0]) if ne[0] else 0
            rel = info.offset
            if rel != expect:
                raise ModelFileError(f"tensor '{name}' has data offset {rel}, expected {expect} "
                                     f"(damaged tensor table, or a type id that does not fit its size)")
            expect += -(-nbytes // align) * align
            offs = int(lay.data_start + rel)
            if offs + nbytes > file_size:
                raise ModelFileError(
                    f"file is truncated: tensor '{name}' needs bytes {offs}..{offs + nbytes} but the file has {file_size}")
            self.ik_tensors.append(TensorEntry(name, tid, ne, self.data[offs:offs + nbytes], ""))


def split_paths(path: str, meta: dict[str, Any]) -> list[str]:
    """All files of a split model given its first part (`…-00001-of-0000N.gguf`)."""
    n = int(meta.get("split.count", 1) or 1)
    if n <= 1:
        return [path]
    m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", path)
    if not m:
        raise ModelFileError(f"{path}: file says it is split into {n} parts but its name does not end in -0000K-of-0000N.gguf")
    prefix = m.group(1)
    return [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


@dataclass
class ModelFile:
    path: str
    paths: list[str]
    meta: dict[str, Any]
    tensors: dict[str, TensorEntry]
    n_kv: int = 0
    version: int = 3
    meta_order: list[str] = field(default_factory=list)
    maps: list = field(default_factory=list)     # the files' np.memmap objects

    def prefetch(self) -> None:
        """Map every page of the files now, as llama.cpp's loader does (MAP_POPULATE): otherwise
        the first tokens fault in the experts they touch one page at a time (the first 128
        generated tokens of the 1B Q8_0 test model ran at 66 t/s, the next 128 at 89-92; with
        the pages mapped at load the first 128 ran at 90.6 and 93.4 t/s in two runs).  MADV_POPULATE_READ where the kernel has it (Linux >= 5.14),
        else read-ahead (MADV_WILLNEED); silently nothing where neither exists.

        MADV_HUGEPAGE first: pages not yet in the page cache are then read in 2 MiB folios, which
        the kernel maps with one PMD each (it aligns file mappings to 2 MiB).  One TLB entry per
        2 MiB instead of 512 let the products stream faster: ds2b-iq4_xs at -t 2, a copy of the
        file read in 4 KiB pages against one read in 2 MiB folios, three runs each in turns:
        8.3-10.4 against 7.7-9.0 ms per token.  Pages already cached keep their size."""
        for m in self.maps:
            mm = getattr(m, "_mmap", None)
            if mm is None or not hasattr(mm, "madvise"):
                continue
            try:
                mm.madvise(_MADV_HUGEPAGE)
            except (OSError, ValueError, OverflowError):
                pass
            for advice in (_MADV_POPULATE_READ, getattr(mmap, "MADV_WILLNEED", None)):
                if advice is None:
                    continue
                try:
                    mm.madvise(advice)
                    break
                except (OSError, ValueError, OverflowError):
                    continue

    def read_into_memory(self, huge: bool = False, log: Callable[[str], None] | None = None) -> bool:
        """Copy the files into anonymous memory and point every tensor there (--no-mmap): the
        weights then stay resident whatever the page cache does, at the cost of the read.
        huge (-thp): into huge pages, as ik's -thp does; False (files left mapped, one log line)
        where the system has no huge pages reserved for them."""
        log = log or (lambda s: None)
        bufs = []
        for p, m in zip(self.paths, self.maps):
            if not huge:
                bufs.append(np.empty(m.size, dtype=np.uint8))
                continue
            try:
                bufs.append(_huge_buffer(m.size))
            except OSError as e:
                log(f"llama_mmap: mmap with huge page size {_huge_page_size() // 2 ** 20} MiB failed "
                    f"({e.strerror}); the model stays memory-mapped")
                return False
        if huge:
            log(f"llama_mmap: using THP with page size {_huge_page_size() // 2 ** 20} MiB")
        for k, (p, m, mem) in enumerate(zip(self.paths, self.maps, bufs)):
            if os.path.getsize(p) != m.size:
                raise ModelFileError(f"{p}: file changed size while loading")
            _read_file_into(p, mem)
            base = m.ctypes.data
            for t in self.tensors.values():
                if t.path == p:
                    off = t.raw.ctypes.data - base
                    t.raw = mem[off:off + t.raw.size]
            self.maps[k] = mem
        return True

    def lock(self, log: Callable[[str], None]) -> None:
        """mlock every file's memory (--mlock); where the limit is too low, llama.cpp's warning
        and the run goes on unlocked."""
        import ctypes

        from .numa import libc
        done = 0
        for m in self.maps:
            if libc().mlock(ctypes.c_void_p(m.ctypes.data), ctypes.c_size_t(m.size)) != 0:
                err = ctypes.get_errno()
                log(f"warning: failed to mlock {m.size}-byte buffer (after previously locking {done} bytes): "
                    f"{os.strerror(err)}\nTry increasing RLIMIT_MEMLOCK ('ulimit -l' as root).")
                return
            done += m.size

    def check_tensors(self) -> None:
        """-vq / --check-tensors: every tensor's values finite, the check ik's loader makes (NaN or
        infinity in float data or in a block's scales); ModelFileError naming the first bad one."""
        from quant.matmul import dequantize
        step = 1 << 12                      # rows per slice: a multiple of every interleave
        for name, t in self.tensors.items():
            q = t.qtensor()
            rows = q.data.reshape(-1, q.data.shape[-1])
            for r0 in range(0, len(rows), step):
                part = rows[r0:r0 + step]
                v = dequantize(QTensor(part, q.qtype, (len(part), q.cols)))
                if not np.isfinite(v).all():
                    nans, infs = int(np.isnan(v).sum()), int(np.isinf(v).sum())
                    raise ModelFileError(f"{self.path}: tensor '{name}' has invalid data "
                                         f"({nans} NaN and {infs} infinite values in rows {r0}..{r0 + len(part) - 1})")

    def override_kv(self, overrides: list, log: Callable[[str], None]) -> None:
        """--override-kv (key, type, value) triples from parse_kv_override, applied to the metadata
        before anything reads it; one that does not match the key's type is skipped with ik's warning."""
        for key, kind, value in overrides:
            have = self.meta.get(key)
            have_kind = _KV_TYPES.get(type(have), "array") if have is not None else kind
            if have_kind != kind:
                log(f"validate_override: Warning: Bad metadata override type for key '{key}', "
                    f"expected {have_kind} but got {kind}")
                continue
            shown = ("true" if value else "false") if kind == "bool" else f"{value:.6f}" if kind == "float" else value
            log(f"validate_override: Using metadata override ({kind:>5s}) '{key}' = {shown}")
            if key not in self.meta:
                self.meta_order.append(key)
            self.meta[key] = value

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def get(self, name: str) -> TensorEntry | None:
        return self.tensors.get(name)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())


def _open_one(path: str) -> _Reader:
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    if os.path.getsize(path) < 24:
        raise ModelFileError(f"{path}: file is too small to be a GGUF file (truncated?)")
    try:
        return _Reader(path)
    except (ModelFileError, gguf_scan.ModelFileError) as e:
        raise ModelFileError(f"{path}: {e}") from None
    except (ValueError, IndexError, OverflowError, UnicodeDecodeError, TypeError, MemoryError) as e:
        msg = str(e) or type(e).__name__
        if "magic" in msg.lower():
            msg = "not a GGUF file (bad magic)"
        elif isinstance(e, (IndexError, OverflowError)) or "buffer" in msg or "size" in msg:
            msg = f"file is truncated or corrupt ({msg})"
        raise ModelFileError(f"{path}: {msg}") from None


def open_model_file(path: str, log: Callable[[str], None] | None = None) -> ModelFile:
    """Open a GGUF file (and the other parts of a split model) without copying tensor data."""
    first = _open_one(path)
    meta = dict(first.meta)
    paths = split_paths(path, meta)
    readers = [first] + [_open_one(p) for p in paths[1:]]
    tensors: dict[str, TensorEntry] = {}
    for p, r in zip(paths, readers):
        for t in r.ik_tensors:
            t.path = p
            if t.name in tensors:
                raise ModelFileError(f"{p}: tensor '{t.name}' appears in more than one split file")
            tensors[t.name] = t
    mf = ModelFile(path=path, paths=paths, meta=meta, tensors=tensors,
                   n_kv=len(meta), meta_order=list(meta.keys()), maps=[r.data for r in readers])
    mf.version = first.version
    if log is not None:
        log_model_file(mf, log)
    return mf


def _fmt_value(v: Any) -> tuple[str, str]:
    if isinstance(v, bool):
        return "bool", str(v).lower()
    if isinstance(v, int):
        return "u32" if 0 <= v < 2**32 else "i64", str(v)
    if isinstance(v, float):
        return "f32", f"{v:.6f}"   # llama.cpp prints floats with std::to_string
    if isinstance(v, str):
        s = v if len(v) <= 40 else v[:37] + "..."
        return "str", s.replace("\n", "\\n")
    if isinstance(v, list):
        kind = "str" if v and isinstance(v[0], str) else ("f32" if v and isinstance(v[0], float) else "i32")
        head = ", ".join(repr(x) if isinstance(x, str) else str(x) for x in v[:5])
        return f"arr[{kind},{len(v)}]", f"[{head}{', ...' if len(v) > 5 else ''}]"
    return "?", str(v)


def log_model_file(mf: ModelFile, log: Callable[[str], None]) -> None:
    """The llama_model_loader lines users compare across tools."""
    log(f"llama_model_loader: loaded meta data with {mf.n_kv} key-value pairs and {len(mf.tensors)} tensors "
        f"from {mf.path} (version GGUF V{mf.version}{' (latest)' if mf.version == 3 else ''})")
    for i, k in enumerate(mf.meta_order):
        t, v = _fmt_value(mf.meta[k])
        log(f"llama_model_loader: - kv {i:3d}: {k:>42s} {t:<16s} = {v}")
    if len(mf.paths) > 1:
        log(f"llama_model_loader: additional {len(mf.paths) - 1} GGUFs metadata loaded.")
    counts: dict[int, int] = {}
    for t in mf.tensors.values():
        counts[t.qtype] = counts.get(t.qtype, 0) + 1
    for tid in sorted(counts):
        log(f"llama_model_loader: - type {type_info(tid).name.lower():>4s}: {counts[tid]:4d} tensors")
