"""`batchlm-bench peers-served`: the project's `continuous_batching`, served, next to llama.cpp's server and
OpenVINO GenAI on one workload, each through its own API. The command and what it measures: cli.py. The
parts: the workload (workload), the servers (server; started by triton_target, llama_server, and
openvino_case and engine_case, each in a process of its own framed by in_process), their HTTP APIs
(http_api), closed-loop streams (closed_loop), peak memory (rss), the figures (stats), agreement with
transformers (reference), the exported IR (openvino_ir), one family of servers measured (measure) and the
tables (report)."""
