"""ModelRunner.prepare/run with a fake model: the ForwardBatch layout and which rows are sampled."""

from types import SimpleNamespace

import torch

from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.model_runner import ModelRunner
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import ScheduledSequence, SchedulerOutput
from batchlm.engine.sequence import Sequence

VOCAB = 100


class EchoModel(torch.nn.Module):
    """Logits whose argmax is (last scheduled token + 1); records the batch it saw."""

    def forward(self, batch, kv_cache):
        self.batch = batch
        last = batch.input_ids[batch.logits_indices]                        # (S,)
        return torch.nn.functional.one_hot((last + 1) % VOCAB, VOCAB).float()  # (S, V)


def make_seq(request_id, prompt, blocks, computed=0, output=()):
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=8))
    seq.output_ids = list(output)
    seq.block_table = list(blocks)
    seq.num_computed_tokens = computed
    return seq


def entry(seq, n):
    return ScheduledSequence(seq, n, samples=n == seq.num_uncomputed_tokens, is_prefill=n > 1)


def test_prepare_flattens_tokens_positions_slots_and_tables():
    runner = ModelRunner(EchoModel(), SimpleNamespace(block_size=4), EngineConfig(block_size=4))
    chunk = make_seq("chunk", list(range(10, 20)), blocks=[7, 3, 9], computed=4)   # feeds 4..7 of 10
    decode = make_seq("decode", [1, 2, 3, 4, 5], blocks=[2, 5], computed=5, output=[42])
    output = SchedulerOutput((entry(chunk, 4), entry(decode, 1)), ())
    batch = runner.prepare(output)
    assert batch.input_ids.tolist() == [14, 15, 16, 17, 42]
    assert batch.positions.tolist() == [4, 5, 6, 7, 5]
    assert batch.slot_mapping.tolist() == [3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 1]
    assert batch.query_lens == [4, 1] and batch.context_lens == [8, 6]
    assert batch.block_tables.tolist() == [[7, 3], [2, 5]]
    assert batch.logits_indices.tolist() == [3, 4]


def test_run_samples_only_sequences_that_reach_their_end():
    model = EchoModel()
    runner = ModelRunner(model, SimpleNamespace(block_size=4), EngineConfig(block_size=4))
    chunk = make_seq("chunk", list(range(10, 20)), blocks=[0, 1, 2])
    last_chunk = make_seq("last", [5, 6, 7], blocks=[3], computed=1)
    sampled = runner.run(SchedulerOutput((entry(chunk, 4), entry(last_chunk, 2)), ()))
    assert sampled.tokens == {"last": 8}
    assert model.batch.block_tables.tolist() == [[0], [3]]
