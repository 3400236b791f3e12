"""Sends the prefix-caching workloads (batchlm.bench.prefix_workload) to one served model and records
every answer: its client-side timings, its prompt and cached token counts and its token ids.

- chat: one thread per conversation; its first turn is sent at its script's start, each later turn
  its think time after the previous answer arrived, with that answer appended to the history as the
  assistant's message.
- closed loop (system, control): `concurrency` threads, each sending the next request when its last
  one is answered.
Greedy, EOS ignored, over Triton's HTTP `/generate` (`/generate_stream` for a model that streams, so
TTFT is the first text's arrival; a model that answers once has TTFT = E2E). The prefix cache's
Prometheus counters are read, settled, before and after each workload. One LLMClient per thread:
requests sessions are not thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from batchlm.bench.prefix_workload import Conversation
from batchlm.bench.served.metrics_timeline import PREFIX_FAMILIES, settled_scrape
from batchlm.bench.workload import WorkloadRequest
from batchlm.model.chat_template import ChatTemplate
from batchlm_client.triton_llm import LLMClient, RequestFailed, collect


@dataclass(frozen=True)
class Target:
    model: str
    http_url: str
    metrics_url: str
    streamed: bool           # read the answers as a stream (a decoupled model that accepts `stream`)
    timeout: float = 600.0   # per request, seconds


@dataclass
class Answer:
    key: str                 # "c<conversation>.t<turn>" (chat) or "r<index>"; the same on every server
    turn: int | None         # chat: the turn, from 1; None for the other workloads
    sent_at: float           # seconds from the workload's start
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0   # as the server counted them
    cached_tokens: int = 0   # of those, the ones whose KV came from the prefix cache
    output_tokens: int = 0
    token_ids: list[int] | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class WorkloadRun:
    workload: str
    answers: list[Answer]
    duration: float          # first request sent to last answer, seconds
    counters: dict[str, float] = field(default_factory=dict)  # PREFIX_FAMILIES over the run (cached_blocks: at its end)

    def as_dict(self) -> dict:
        return {"workload": self.workload, "duration_s": self.duration, "counters": self.counters,
                "answers": [asdict(a) for a in self.answers]}


class Driver:
    """Sends workloads to `target`; each method runs one workload to its end and returns its WorkloadRun."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._probe = LLMClient(target.http_url, timeout=target.timeout)
        self._probe.model_config(target.model)  # NOTE: read once here, not in a request's latency
        self._t0 = 0.0

    def close(self) -> None:
        self._probe.close()

    def chat(self, scripts: list[Conversation], template: ChatTemplate, max_tokens: int) -> WorkloadRun:
        def converse(script: Conversation, llm: LLMClient, answers: list[Answer]) -> None:
            said: list[str] = []
            time.sleep(max(0.0, self._t0 + script.start_s - time.perf_counter()))
            for turn in range(len(script.turns)):
                if turn:
                    time.sleep(script.think_s[turn - 1])
                prompt = template.render(script.messages(turn, said))
                answer = self._ask(llm, f"c{script.index}.t{turn + 1}", turn + 1, prompt, max_tokens)
                answers.append(answer)
                if not answer.ok:
                    return  # NOTE: the next turn's history needs this answer
                said.append(answer.text)

        return self._run("chat", [lambda llm, out, s=s: converse(s, llm, out) for s in scripts])

    def closed_loop(self, workload: str, requests: list[WorkloadRequest], concurrency: int) -> WorkloadRun:
        todo = list(reversed(requests))
        lock = threading.Lock()

        def worker(llm: LLMClient, answers: list[Answer]) -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    request = todo.pop()
                answers.append(self._ask(llm, f"r{request.index}", None, request.prompt, request.max_tokens))

        return self._run(workload, [worker] * concurrency)

    def _run(self, workload: str, jobs: list[Callable[[LLMClient, list[Answer]], None]]) -> WorkloadRun:
        """Each job on its own thread with its own client; the counters around all of them."""
        before = settled_scrape(self.target.metrics_url, self.target.model, PREFIX_FAMILIES) or {}
        answers: list[Answer] = []
        clients = [LLMClient(self.target.http_url, timeout=self.target.timeout, configs_of=self._probe)
                   for _ in jobs]
        threads = [threading.Thread(target=job, args=(llm, answers), name=f"prefix-{i}", daemon=True)
                   for i, (job, llm) in enumerate(zip(jobs, clients))]
        self._t0 = time.perf_counter()
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for llm in clients:
                llm.close()
        duration = max((a.sent_at + a.latency for a in answers), default=0.0)
        after = settled_scrape(self.target.metrics_url, self.target.model, PREFIX_FAMILIES) or {}
        counters = {k: after[k] - before.get(k, 0.0) for k in after if k != "cached_blocks"}
        if "cached_blocks" in after:
            counters["cached_blocks"] = after["cached_blocks"]
        return WorkloadRun(workload, sorted(answers, key=lambda a: a.sent_at), duration, counters)

    def _ask(self, llm: LLMClient, key: str, turn: int | None, prompt: str, max_tokens: int) -> Answer:
        start = time.perf_counter()
        answer = Answer(key, turn, start - self._t0)
        options = dict(temperature=0.0, ignore_eos=True)
        try:
            if self.target.streamed:
                result = collect(llm.stream("http", self.target.model, prompt, max_tokens, stream=True, **options),
                                 start)
            else:
                result = llm.answer("http", self.target.model, prompt, max_tokens, **options)
        except (RequestFailed, OSError) as exc:  # NOTE: requests' transport errors are OSErrors
            answer.error, answer.latency = str(exc), time.perf_counter() - start
            return answer
        answer.ttft, answer.latency, answer.text = result.ttft, result.latency, result.text
        answer.prompt_tokens = result.num_input_tokens or 0
        answer.cached_tokens = result.num_cached_tokens or 0
        answer.output_tokens = result.num_output_tokens or 0
        answer.token_ids = result.token_ids
        return answer
