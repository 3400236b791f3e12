"""LLMEngine: continuous batching. Each step() is three calls: schedule, run the model, update state.

Not thread-safe: one thread owns an engine (in Triton, the engine thread of the continuous-batching
model); other threads hand it requests and aborts through a queue of their own. Build the engine on
the thread that steps it: a second thread running torch ops starts a second OpenMP team, and on a small
CPU each step then runs slower (`batchlm.engine.owner_thread` says why); `step()` warns once when called
from a thread other than the builder's.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from pathlib import Path
from typing import Callable
from typing import Sequence as Seq

import torch

from batchlm.engine.block_allocator import BlockAllocator
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.engine_stats import EngineStats
from batchlm.engine.guided_decoding import GuideCompiler
from batchlm.engine.model_runner import ModelRunner
from batchlm.engine.request_output import RequestOutput
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import KVPolicy, Scheduler, SchedulerOutput, check_fits
from batchlm.engine.sequence import Sequence
from batchlm.engine.thread_governor import ThreadGovernor
from batchlm.errors import InvalidArgument
from batchlm.model.checkpoint import load_model
from batchlm.model.kv_cache import KVCache
from batchlm.model.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int]
OnStep = Callable[[int, int], None]   # (sequences in the forward pass, tokens sampled) after a step
CancelledRows = Callable[[], Seq[int]]  # rows of generate()'s prompts to abort, asked after a step


class LLMEngine:
    """Holds the model, the KV cache and the scheduler; requests come and go between steps."""

    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                 kv_policy: KVPolicy = KVPolicy.ON_DEMAND) -> None:
        model, tokenizer = load_parts(model_dir, config)
        self._setup(model, tokenizer, config, kv_policy)

    @classmethod
    def from_parts(cls, model: torch.nn.Module, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(),
                   kv_policy: KVPolicy = KVPolicy.ON_DEMAND) -> LLMEngine:
        """An engine over an already-loaded model and tokenizer (tests, BatchGenerator)."""
        engine = cls.__new__(cls)
        _set_threads(config)
        engine._setup(model, tokenizer, config, kv_policy)
        return engine

    def _setup(self, model: torch.nn.Module, tokenizer: Tokenizer, config: EngineConfig,
               kv_policy: KVPolicy) -> None:
        if config.max_model_len > model.config.max_position_embeddings:
            # NOTE: the RoPE table ends there: a longer sequence failed its step, and with it every
            # sequence in flight (IndexError)
            raise InvalidArgument("max_model_len", f"{config.max_model_len} is beyond the model's "
                                                   f"max_position_embeddings ({model.config.max_position_embeddings})")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        _ = tokenizer.max_bytes_per_token  # NOTE: worked out at load, not on the first request's thread
        self.vocab_size = model.config.vocab_size
        dtype = next(model.parameters()).dtype
        self.kv_cache = KVCache(model.config, config.num_kv_blocks, config.block_size, config.device, dtype)
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.scheduler = Scheduler(config, self.allocator, kv_policy)
        self.runner = ModelRunner(model, self.kv_cache, config)
        self.guides = GuideCompiler(tokenizer.hf.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)
        self._pending: list[RequestOutput] = []      # cancellations to report at the next step
        self._last = SchedulerOutput((), ())
        self._total_generated = 0
        self._ids = itertools.count()
        self._builder_thread: int | None = threading.get_ident()  # None once warned
        self._governor = (ThreadGovernor(config.num_threads)
                          if config.adaptive_threads and config.num_threads > 1 else None)
        self._threads = config.num_threads

    # --- requests ---
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request; raises InvalidArgument (naming the field) if it is not acceptable."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id", "must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        self._check_logit_bias(params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        seq = Sequence(request_id, ids, params, self.tokenizer.eos_token_ids, detokenizer)
        if params.guided_decoding_guide_type is not None:
            seq.guide = self.guides.matcher(params.guided_decoding_guide_type, params.guided_decoding_guide)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request: its KV is freed now and a CANCELLED output comes at the next step.
        Unknown or already finished ids are ignored."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._pending.append(RequestOutput.take(seq))

    def encode(self, prompt: Prompt) -> list[int]:
        """Prompt text or ids -> validated token ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                       for t in ids):
                raise InvalidArgument("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        else:
            raise InvalidArgument("prompt", "must be a string or a list of token ids, "
                                  f"got {type(prompt).__name__}")
        if not ids:
            raise InvalidArgument("prompt", "is empty")
        return ids

    def check_fits(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validate a request without queueing it: its token ids, or InvalidArgument if it could never
        run. Reads only the config and the tokenizer, so any thread may call it.

        A text too long for the model whatever its tokens is refused before it is tokenized (see
        `Tokenizer.max_bytes_per_token`): tokenizing 64 KiB takes ~25 ms of CPU that a refusal need not cost."""
        per_token = self.tokenizer.max_bytes_per_token if isinstance(prompt, str) else None
        limit = self.config.max_request_tokens
        if per_token is not None and (size := len(prompt.encode())) > limit * per_token:
            raise InvalidArgument("prompt", f"{size} bytes cannot fit the limit of {limit} tokens (a token "
                                            f"stands for at most {per_token} bytes); refused before tokenizing")
        ids = self.encode(prompt)
        self._check_logit_bias(params)
        check_fits(len(ids), params.max_tokens, limit)
        if params.guided_decoding_guide_type is not None:
            self.guides.check(params.guided_decoding_guide_type, params.guided_decoding_guide)
        return ids

    def _check_logit_bias(self, params: SamplingParams) -> None:
        if any(token >= self.vocab_size for token, _ in params.logit_bias):
            raise InvalidArgument("logit_bias", f"token ids must be in [0, {self.vocab_size})")

    # --- the loop ---
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token (or was cancelled)."""
        if self._builder_thread is not None and threading.get_ident() != self._builder_thread:
            self._builder_thread = None
            warnings.warn("LLMEngine.step() runs on a thread other than the one that built the engine; "
                          "two OpenMP teams can make each step ~1.4x slower on a small CPU (build it on "
                          "its stepping thread, see batchlm.engine.owner_thread)", RuntimeWarning, stacklevel=2)
        if self._governor is not None:
            threads = self._governor.threads()
            if threads != self._threads:
                self._threads = threads
                torch.set_num_threads(threads)
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        result = self.runner.run(scheduled)
        updated = self.scheduler.update(scheduled, result.tokens, result.logprobs, result.prompt_logprobs)
        self._last = scheduled
        self._total_generated += len(result.tokens)
        return outputs + [RequestOutput.take(seq) for seq in updated]

    def running_request_ids(self) -> list[str]:
        """Ids of the requests whose sequences hold a batch slot now."""
        return [seq.request_id for seq in self.scheduler.running]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.allocator.num_used, kv_blocks_total=self.allocator.num_total,
            last_num_seqs=len(self._last.scheduled), last_num_tokens=self._last.num_batched_tokens,
            total_generated_tokens=self._total_generated, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits, kv_blocks_cached=self.allocator.num_cached,
            prefix_cache_evictions=self.allocator.num_evictions)

    def generate(self, prompts: Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
                 on_step: OnStep | None = None,
                 cancelled_rows: CancelledRows | None = None) -> list[RequestOutput]:
        """Offline convenience: run these prompts to completion on an idle engine; one output each
        (whole text, all ids), in input order. `on_step` is called after every step (metrics).
        `cancelled_rows()`, called after every step, names rows (indices into `prompts`) to abort: each
        such row leaves at once, its KV freed, and its output ends with what it had, finish reason
        CANCELLED; once every row has finished or left, generate returns."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drive step() yourself instead")
        per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_row) != len(prompts):
            raise InvalidArgument("params", f"{len(per_row)} params for {len(prompts)} prompts")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        parts: dict[str, list[RequestOutput]] = {request_id: [] for request_id in ids}
        try:
            for request_id, prompt, p in zip(ids, prompts, per_row):
                self.add_request(request_id, prompt, p)
            while self.has_unfinished():
                generated = self._total_generated
                for out in self.step():
                    parts[out.request_id].append(out)
                if on_step is not None:
                    on_step(len(self._last.scheduled), self._total_generated - generated)
                if cancelled_rows is not None:
                    for row in cancelled_rows():
                        self.abort_request(ids[row])
        except BaseException:
            # NOTE: leave the engine idle (and usable) whatever failed: a bad row or a model error.
            for request_id in ids:
                self.abort_request(request_id)
            self._pending.clear()
            raise
        return [RequestOutput.concat(parts[request_id]) for request_id in ids]


def load_parts(model_dir: str | Path, config: EngineConfig) -> tuple[torch.nn.Module, Tokenizer]:
    """Load the model (on config's device and dtype) and the tokenizer from a checkpoint dir."""
    _set_threads(config)
    model = load_model(model_dir, device=config.device, dtype=getattr(torch, config.resolved_dtype),
                       attention=config.attention, linear=config.linear, pointwise=config.pointwise,
                       weights=config.weights, activations=config.activations)
    return model, Tokenizer.from_dir(model_dir)


def _set_threads(config: EngineConfig) -> None:
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
