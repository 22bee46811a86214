"""Forward passes, one module per GGUF architecture."""
