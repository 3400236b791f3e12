"""lm-evaluation-harness on the project's quiz, twice: its own Hugging Face backend on the checkpoint file,
and the served model through the OpenAI-compatible frontend; then the two compared item by item.

    batchlm-bench eval [--out results/eval] [--url http://127.0.0.1:9000] [--model PATH] [--num-concurrent 4]

1. The reference: `lm_eval --model hf` on the checkpoint (a GGUF file is dequantized by transformers,
   float32), the multiple-choice task as plain text, the generate-until task through the chat template.
2. The served model (`--served-model`, continuous_batching): `local-completions` for the multiple-choice
   task (lm-eval finds the server's tokenizer at /tokenizer_info and /tokenize and sends token ids) and
   `local-chat-completions --apply_chat_template` for the generate-until task. Without `--url` it serves
   the checkpoint itself (tritonserver with that model alone, and the frontend, on free ports) and stops
   them after; with `--url` it asks the frontend there (`make serve`'s is http://127.0.0.1:9000; a frontend
   with an API key wants it in $OPENAI_API_KEY).
3. batchlm/eval/compare.py on both runs: the report is printed and written to OUT/comparison.md.

Exit status 0 where lm-eval succeeded four times and the runs agree; every command and its time is printed.
Nothing is downloaded: the tasks read their data from batchlm/eval/tasks/, and lm-eval runs with the
Hugging Face hub and datasets offline.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from batchlm.eval.compare import LOGLIKELIHOOD_ATOL, compare_runs, report
from batchlm.paths import DEFAULT_MODEL, MODEL_ENV, PROJECT_ROOT

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
CHOICE_TASK = "batchlm_quiz_mc"  # multiple choice, by log-likelihood
ANSWER_TASK = "batchlm_quiz_gen"  # generate-until, exact match, through the chat template
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class LmEvalRun:
    """One `lm_eval` command line: which side it is, and what it runs."""

    name: str
    argv: tuple[str, ...]

    def shell(self) -> str:
        return " ".join(a if a and " " not in a else repr(a) for a in self.argv)


def _lm_eval(model: str, model_args: dict[str, object], task: str, out: Path, *extra: str) -> tuple[str, ...]:
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    return (sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", task,
            "--include_path", str(TASKS_DIR), "--log_samples", "--output_path", str(out), *extra)


def reference_runs(checkpoint: Path, out: Path) -> list[LmEvalRun]:
    """lm-eval's Hugging Face backend on `checkpoint` (a GGUF file, or a Hugging Face folder), float32 on
    the CPU, one request at a time (a padded batch would change the numbers it is compared by)."""
    model_args: dict[str, object] = ({"pretrained": checkpoint.parent, "gguf_file": checkpoint.name}
                                     if checkpoint.is_file() else {"pretrained": checkpoint})
    model_args["dtype"] = "float32"
    device = ("--device", "cpu", "--batch_size", "1")
    return [LmEvalRun("reference, multiple choice", _lm_eval("hf", model_args, CHOICE_TASK, out, *device)),
            LmEvalRun("reference, generate-until",
                      _lm_eval("hf", model_args, ANSWER_TASK, out, *device, "--apply_chat_template"))]


def served_runs(url: str, served_model: str, out: Path, num_concurrent: int = 4,
                batch_size: int = 4) -> list[LmEvalRun]:
    """The frontend at `url` (http://host:port): completions with token-id prompts, `batch_size` prompts a
    request and `num_concurrent` requests at once, and chat completions. One try each (`max_retries=1`):
    a deterministic server does not answer better the second time."""
    common = {"model": served_model, "num_concurrent": num_concurrent, "max_retries": 1}
    completions = {**common, "base_url": f"{url}/v1/completions", "tokenized_requests": True}
    chat = {**common, "base_url": f"{url}/v1/chat/completions"}
    return [LmEvalRun("served, multiple choice", _lm_eval("local-completions", completions, CHOICE_TASK, out,
                                                          "--batch_size", str(batch_size))),
            LmEvalRun("served, generate-until",
                      _lm_eval("local-chat-completions", chat, ANSWER_TASK, out, "--apply_chat_template"))]


def run(step: LmEvalRun, log_dir: Path, timeout: float = 1800) -> float:
    """Run one lm_eval command, its output in LOG_DIR/<name>.log; its wall time in seconds.
    CalledProcessError (naming the log) where lm-eval fails."""
    log = log_dir / (step.name.replace(", ", "_").replace(" ", "_").replace("-", "_") + ".log")
    print(f"$ {step.shell()}", flush=True)
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(step.argv, env={**os.environ, **OFFLINE}, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=PROJECT_ROOT)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise subprocess.CalledProcessError(proc.returncode, step.shell(), output=f"{log}:\n{tail}")
    print(f"  {step.name}: {elapsed:.0f} s (log: {log})", flush=True)
    return elapsed


def serve_and_run(checkpoint: Path, served_model: str, steps_for_url, log_dir: Path) -> dict[str, float]:
    """Serve `checkpoint` in `served_model` alone, with the frontend, for as long as the runs take."""
    from batchlm.launcher.frontend_process import FrontendProcess, ServerWithFrontend
    from batchlm.launcher.ports import free_port

    frontend = FrontendProcess("", port=free_port(), graceful_timeout=2, log_path=log_dir / "frontend.log")
    server = ServerWithFrontend(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                log_path=log_dir / "server.log", frontend=frontend, exit_timeout_s=5,
                                extra_args=("--model-control-mode=explicit", f"--load-model={served_model}"))
    saved = os.environ.get(MODEL_ENV)
    os.environ[MODEL_ENV] = str(checkpoint)  # the server, its stubs and the frontend inherit it
    try:
        with server.start(timeout=300):
            return {step.name: run(step, log_dir) for step in steps_for_url(frontend.url)}
    finally:
        if saved is None:
            os.environ.pop(MODEL_ENV, None)
        else:
            os.environ[MODEL_ENV] = saved


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "eval")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="the checkpoint both sides run (a llama GGUF file or a Hugging Face Llama folder)")
    p.add_argument("--served-model", default="continuous_batching", help="the served model lm-eval asks")
    p.add_argument("--url", help="a running frontend to ask (its model must be --model); default: serve one")
    p.add_argument("--num-concurrent", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per completions request")
    p.add_argument("--atol", type=float, default=LOGLIKELIHOOD_ATOL, help="per-item log-likelihood tolerance")
    p.add_argument("--skip-reference", action="store_true", help="compare with the reference already in --out")
    args = p.parse_args(argv)
    if not args.model.exists():
        p.error(f"--model: no checkpoint at {args.model}")
    args.model = args.model.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    from batchlm.launcher.processes import exit_cleanly_on_sigterm

    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    reference, served = args.out / "reference", args.out / "served"
    args.out.mkdir(parents=True, exist_ok=True)
    times = {}
    if not args.skip_reference:
        times.update({step.name: run(step, args.out) for step in reference_runs(args.model, reference)})

    def steps(url: str) -> list[LmEvalRun]:
        return served_runs(url.rstrip("/"), args.served_model, served, args.num_concurrent, args.batch_size)

    if args.url:
        times.update({step.name: run(step, args.out) for step in steps(args.url)})
    else:
        times.update(serve_and_run(args.model, args.served_model, steps, args.out))
    comparisons = compare_runs(reference, served, args.atol)
    text = report(comparisons, ("lm-eval hf", f"served {args.served_model}"))
    text += "\nRun times (wall clock, lm-eval's start and model load included):\n"
    text += "".join(f"- {name}: {seconds:.0f} s\n" for name, seconds in times.items())
    (args.out / "comparison.md").write_text(text)
    print("\n" + text, end="")
    return 0 if all(c.ok for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
