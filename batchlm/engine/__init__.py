"""The engine: requests, the scheduler (pure bookkeeping), the paged KV cache's blocks, the model runner
and the loop that steps them (`LLMEngine.step()` = schedule, run, update)."""
