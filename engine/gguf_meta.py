"""GGUF metadata as plain Python values (str, int, float, bool, lists of those)."""
from __future__ import annotations

from typing import Any

from gguf import GGUFValueType


def field_value(field: Any) -> Any:
    """Decode one gguf.GGUFReader field into a Python value (for scripts that read files with the gguf
    package; ikcli's loader decodes with engine.gguf_scan)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    v = field.parts[field.data[0]].tolist()[0]
    if types[0] == GGUFValueType.BOOL:
        return bool(v)
    return v


def read_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (tensor data is not touched)."""
    import numpy as np

    from .gguf_scan import read_layout
    return read_layout(np.memmap(path, mode="r", dtype=np.uint8)).meta
