"""GGUF metadata as plain Python values (str, int, float, bool, lists of those)."""
from __future__ import annotations

from typing import Any


def read_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (tensor data is not touched), decoded by engine.gguf_scan."""
    import numpy as np

    from .gguf_scan import read_layout
    return read_layout(np.memmap(path, mode="r", dtype=np.uint8)).meta
