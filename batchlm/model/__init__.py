"""The model: a Llama decoder over a paged KV cache, its config, checkpoint loading, RoPE, attention and
the tokenizer; and what the model and the engine share, below both: the KV cache's storage (kv_cache),
one step's tensors (forward_batch) and the names of the compute backends (backends). Imports nothing
from batchlm.engine."""
