"""Where the embedded demo model and text live (package data of `engine`)."""
from __future__ import annotations

from pathlib import Path


def _data() -> Path:
    import engine  # the package's __init__ is empty: cheap to import
    return Path(engine.__file__).resolve().parent / "data"


def demo_model() -> str:
    return str(_data() / "demo-deepseek2.gguf")


def demo_text() -> str:
    return str(_data() / "shakespeare.test.txt")
