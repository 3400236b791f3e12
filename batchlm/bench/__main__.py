"""The one bench entry point: `batchlm-bench SUBCOMMAND [options]` (or `python -m batchlm.bench ...`).

Served (each against a real tritonserver; most can start their own with --start-server):
    run              the serving benchmark of one model: a seeded workload, closed loop or at a rate
    compare          the measured comparison of the three strategies (`make compare`)
    sweep            tune one knob: one config field served at several values, the same load each time
    stream-interval  what streaming every N tokens saves (continuous_batching)
    client-cost      the client's CPU per token, per transport
    locust-table     Locust's stats CSV files as one markdown table
    contention       what a busy process beside the server costs, in process and served
    soak             Locust at saturation against every model at once; failures, p99 drift, server resources
    memory           resident memory of every process of a served repository, and its start-up time
    prefix           prefix caching on and off: multi-turn chat, a shared system prompt, a control
    eval             lm-evaluation-harness on the project's quiz, served and on transformers, compared (`make eval`)
In process (the engine alone, no server):
    engine           engine throughput per batch size (`make bench-engine`)
    forward          one forward pass per batch size: where a step's time goes (--profile, --interfere)
    attention        the attention kernel against torch's SDPA, and that they agree
    threads          the engine's throughput per thread count and placement
    ratios           the strategies' throughput ratios, the engine alone, interleaved batch by batch
    predict          the same ratios predicted from timed forward passes (the step-count bound)
    invariance       a sequence's tokens do not depend on what shares its batch
    agreement        each tier's tokens and log-probabilities against transformers (float32, int8 activations)
    kernel-outputs   save what the kernels compute on fixed inputs, or compare two such files to the bit
    stop-cost        what stop strings cost per generated token
    guided           what guided decoding costs a step, and the two grammar libraries side by side
    peers            the engine next to transformers, CTranslate2 and llama.cpp on one workload (`make bench-peers`)
Served vs served (each server through its own API):
    peers-served     continuous_batching next to llama.cpp's server and OpenVINO GenAI (`make bench-peers-served`)

`batchlm-bench SUBCOMMAND --help` prints each one's options.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "run": "batchlm.bench.served.run",
    "compare": "batchlm.bench.served.compare",
    "sweep": "batchlm.bench.served.sweep",
    "stream-interval": "batchlm.bench.served.stream_interval",
    "client-cost": "batchlm.bench.served.client_cost",
    "locust-table": "batchlm.bench.served.locust_table",
    "contention": "batchlm.bench.served.contention",
    "soak": "batchlm.bench.served.soak",
    "memory": "batchlm.bench.served.memory",
    "prefix": "batchlm.bench.served.prefix",
    "eval": "batchlm.eval.run",
    "engine": "batchlm.bench.engine",
    "forward": "batchlm.bench.forward",
    "attention": "batchlm.bench.attention",
    "threads": "batchlm.bench.threads",
    "ratios": "batchlm.bench.ratios",
    "predict": "batchlm.bench.predict",
    "invariance": "batchlm.bench.invariance",
    "agreement": "batchlm.bench.agreement",
    "kernel-outputs": "batchlm.bench.kernel_outputs",
    "stop-cost": "batchlm.bench.stop_cost",
    "guided": "batchlm.bench.guided",
    "peers": "batchlm.bench.peers.cli",
    "peers-served": "batchlm.bench.peers_served.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"batchlm-bench: unknown subcommand {name!r}; one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name])
    # NOTE: each subcommand parses sys.argv with its own argparse; its program name is the full command
    sys.argv = [f"batchlm-bench {name}", *rest]
    status = module.main()
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
