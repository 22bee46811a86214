"""Reading a GGUF file's header, metadata and tensor table: a bounded walk that decodes as it goes.

Every count and length is checked against the bytes that are left before it is used, arrays nest
at most MAX_DEPTH deep, and the key (or tensor) that is wrong is named in one line.  (gguf's own
GGUFReader trusts counts -- one edited element type makes it loop past the end of the file -- and
builds a NumPy view per array element: 10-15 s for a 200k-token vocabulary, against ~0.5 s here.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class ModelFileError(ValueError):
    """What is wrong with the layout (engine.gguf_file re-raises it with the path)."""

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_BOOL = 7
_STRING, _ARRAY = 8, 9
MAX_DEPTH = 4               # arrays of arrays of ... (GGUF files in use nest at most 2)
MAX_DIMS = 4                # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32      # GGUF_DEFAULT_ALIGNMENT


MAX_NAME = 256              # longer key / tensor names are damage (GGML_MAX_NAME is 64)


def printable(name: bytes | str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message: non-printables escaped, long ones cut."""
    text = name.decode("utf-8", errors="replace") if isinstance(name, bytes) else name
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class TensorInfo:
    name: str
    ne: tuple               # GGML order: ne[0] is the row length
    type_id: int
    offset: int             # from the start of the data section


@dataclass
class Layout:
    """What the header, metadata and tensor table say."""
    version: int
    meta: dict[str, Any] = field(default_factory=dict)      # decoded values, in file order
    # each key's GGUF value type, and for an array its element type (None otherwise)
    kv_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0     # the data section's offset in the file (aligned)
    alignment: int = DEFAULT_ALIGNMENT


class _Walk:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)
        self.mv = memoryview(buf).cast("B")     # slicing a memoryview, not an np.memmap (~10 us each)

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.end - self.pos:
            raise ModelFileError(f"{what} needs {n} bytes at offset {self.pos} but the file has "
                                 f"{self.end - self.pos} left (truncated or corrupt)")
        p = self.pos
        self.pos += n
        return p

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(what)
        p = self.take(n, what)
        return bytes(self.mv[p:p + n])

    def text(self, what: str) -> str:
        return self.string(what).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """The next value of GGUF type vtype as a Python value (bool, int, float, str, list)."""
        if vtype in _SCALAR:
            v = np.frombuffer(self.buf, _DTYPE[vtype], 1, self.take(_SCALAR[vtype], what)).item()
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.text(what)
        if vtype == _ARRAY:
            if depth >= MAX_DEPTH:
                raise ModelFileError(f"{what}: arrays nested more than {MAX_DEPTH} deep")
            etype, n = self.u32(what), self.u64(what)
            if etype in _SCALAR:
                p = self.take(n * _SCALAR[etype], f"{what} ({n} elements)")
                out = np.frombuffer(self.buf, _DTYPE[etype], n, p).tolist()
                return [bool(v) for v in out] if etype == _BOOL else out
            if etype in (_STRING, _ARRAY):
                least = 8 if etype == _STRING else 12       # a length, or an element type and a count
                if n * least > self.end - self.pos:
                    raise ModelFileError(f"{what}: {n} elements cannot fit in the {self.end - self.pos} bytes left")
                if etype == _STRING:
                    return [self.text(what) for _ in range(n)]
                return [self.value(etype, what, depth + 1) for _ in range(n)]
            raise ModelFileError(f"{what}: unknown array element type {etype}")
        raise ModelFileError(f"{what}: unknown value type {vtype}")


def read_layout(buf: np.ndarray) -> Layout:
    """The header, metadata and tensor table of the GGUF file in buf; ModelFileError (without the
    path: the caller adds it) where one of them does not fit the file."""
    w = _Walk(buf)
    if bytes(w.mv[w.take(4, "the magic"):4]) != b"GGUF":
        raise ModelFileError("not a GGUF file (bad magic)")
    version = w.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise ModelFileError("big-endian GGUF files are not supported")
    if version < 2:
        raise ModelFileError(f"GGUF version {version} is not supported (version 2 or 3 needed)")
    out = Layout(version)
    n_tensors, n_kv = w.u64("the tensor count"), w.u64("the metadata count")
    if n_kv * 12 > w.end - w.pos or n_tensors * 24 > w.end - w.pos:
        raise ModelFileError(f"header claims {n_kv} metadata entries and {n_tensors} tensors: more than the "
                             f"file can hold")
    keys: set[bytes] = set()
    for i in range(n_kv):
        raw_key = w.string(f"metadata entry {i}'s key")
        key = printable(raw_key)
        if len(raw_key) > MAX_NAME:
            raise ModelFileError(f"metadata entry {i}'s key is {len(raw_key)} bytes long ('{key}')")
        if raw_key in keys:
            raise ModelFileError(f"metadata key '{key}' appears twice")
        keys.add(raw_key)
        vtype = w.u32(f"metadata key '{key}'")
        # an array's element type, read ahead for kv_types (value() reads it again)
        etype = struct.unpack_from("<I", buf, w.pos)[0] if vtype == _ARRAY and w.end - w.pos >= 4 else None
        name = raw_key.decode("utf-8", errors="replace")
        out.meta[name] = w.value(vtype, f"metadata key '{key}'")
        out.kv_types[name] = (vtype, etype)
    for i in range(n_tensors):
        raw_name = w.string(f"tensor info {i}'s name")
        name = printable(raw_name)
        if len(raw_name) > MAX_NAME:
            raise ModelFileError(f"tensor info {i}'s name is {len(raw_name)} bytes long ('{name}')")
        nd = w.u32(f"tensor '{name}'")
        if not 1 <= nd <= MAX_DIMS:
            raise ModelFileError(f"tensor '{name}' has {nd} dimensions (1..{MAX_DIMS} allowed)")
        dims = struct.unpack_from(f"<{nd}Q", buf, w.take(8 * nd, f"tensor '{name}'"))
        n = 1
        for d in dims:
            n *= d
        if not all(dims) or n >= 1 << 62:
            raise ModelFileError(f"tensor '{name}' has dimensions {list(dims)}")
        type_id = w.u32(f"tensor '{name}'")
        offset = w.u64(f"tensor '{name}'")
        out.tensors.append(TensorInfo(name, tuple(int(d) for d in dims), type_id, offset))
    align = out.meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise ModelFileError(f"general.alignment {align!r} is not a power of two")
    out.alignment = align
    out.data_start = -(-w.pos // align) * align
    return out
