"""Running a model: GGUF loading, tokenizer, architectures, KV cache, contexts, perplexity."""
