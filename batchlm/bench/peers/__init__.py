"""`batchlm-bench peers`: the project's engine next to the CPU engines a user would otherwise pick, on one
workload and one checkpoint. The command and what it measures: cli.py. One module per engine's case
(batchlm_case, transformers_case, ct2_case, llama_cpp_case), each run in a process of its own; the
shared parts: the engines (peer), the workload (workload), request-level groups (groups), converted
checkpoints (checkpoint) and the table (report)."""
