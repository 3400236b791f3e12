"""Measurements: `batchlm-bench SUBCOMMAND` (see `batchlm.bench.__main__`), the seeded workload they share,
and the engine analysis (the in-process baseline, the step-cost model)."""
