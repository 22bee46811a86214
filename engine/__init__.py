"""Running a model: GGUF loading, tokenizer, architectures, KV cache, contexts, perplexity."""
from quant.numba_stamp import install as _stamp_kernel_cache

_stamp_kernel_cache()
