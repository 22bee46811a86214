"""ikcli: the ik_llama.cpp tools in Python. This package holds the command line only (no math)."""
__version__ = "0.1.0"
