"""Where the embedded demo model and text live (shipped inside the engine package)."""
from __future__ import annotations

from pathlib import Path

_DATA = Path(__file__).resolve().parent.parent / "engine" / "data"


def demo_model() -> str:
    return str(_DATA / "demo-deepseek2.gguf")


def demo_text() -> str:
    return str(_DATA / "shakespeare.test.txt")
