"""The model: a Llama decoder over a paged KV cache, its config, checkpoint loading, RoPE, attention and
the tokenizer."""
