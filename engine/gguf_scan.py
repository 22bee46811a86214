"""A bounded walk over a GGUF file's header, metadata and tensor table before gguf's reader sees it.

gguf.GGUFReader trusts counts and lengths: one edited element type (a token list whose elements
claim to be arrays) makes it loop past the end of the file while its lists grow without bound.
This walk checks every count and length against the bytes that are left, nests arrays at most
MAX_DEPTH deep, and names the key (or tensor) that is wrong, in one line.
"""
from __future__ import annotations

import struct

import numpy as np



class ModelFileError(ValueError):
    """What is wrong with the layout (engine.gguf_file re-raises it with the path)."""

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
MAX_DEPTH = 4               # arrays of arrays of ... (GGUF files in use nest at most 2)
MAX_DIMS = 4                # GGML_MAX_DIMS


MAX_NAME = 256              # longer key / tensor names are damage (GGML_MAX_NAME is 64)


def printable(name: bytes | str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message: non-printables escaped, long ones cut."""
    text = name.decode("utf-8", errors="replace") if isinstance(name, bytes) else name
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


class _Walk:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

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
        return bytes(self.buf[p:p + n])

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in _SCALAR:
            self.take(_SCALAR[vtype], what)
        elif vtype == _STRING:
            self.take(self.u64(what), what)
        elif vtype == _ARRAY:
            if depth >= MAX_DEPTH:
                raise ModelFileError(f"{what}: arrays nested more than {MAX_DEPTH} deep")
            etype, n = self.u32(what), self.u64(what)
            if etype in _SCALAR:
                self.take(n * _SCALAR[etype], f"{what} ({n} elements)")
            elif etype in (_STRING, _ARRAY):
                least = 8 if etype == _STRING else 12       # a length, or an element type and a count
                if n * least > self.end - self.pos:
                    raise ModelFileError(f"{what}: {n} elements cannot fit in the {self.end - self.pos} bytes left")
                for _ in range(n):
                    self.value(etype, what, depth + 1)
            else:
                raise ModelFileError(f"{what}: unknown array element type {etype}")
        else:
            raise ModelFileError(f"{what}: unknown value type {vtype}")


def check_layout(buf: np.ndarray) -> None:
    """Raise ModelFileError (without the path: the caller adds it) where the header, a metadata
    value or a tensor info does not fit the file."""
    w = _Walk(buf)
    if bytes(buf[w.take(4, "the magic"):4]) != b"GGUF":
        raise ModelFileError("not a GGUF file (bad magic)")
    version = w.u32("the version")
    if version < 2:
        return                                     # v1's 32-bit counts: gguf's reader refuses it itself
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
        w.value(w.u32(f"metadata key '{key}'"), f"metadata key '{key}'")
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
        w.take(4 + 8, f"tensor '{name}'")
