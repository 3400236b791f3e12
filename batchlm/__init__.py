"""batchlm: a small PyTorch LLM engine (paged KV cache, chunked prefill, continuous batching).

The package is imported by the Triton Python models; importing it is cheap and loads no torch.
See docs/architecture.md for the module map and the contracts between modules.
"""
