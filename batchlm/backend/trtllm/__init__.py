"""The TensorRT-LLM front (`continuous_batching_trtllm`): this repository's request schema in front of
TensorRT-LLM's `tensorrt_llm` model, over BLS calls."""
