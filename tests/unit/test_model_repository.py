"""Every config.pbtxt parses with Triton's own protobuf and declares the request schema, and the three
strategies differ only where they must: same inputs, outputs and engine knobs; batching mode and its own
parameters differ."""

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm.engine.engine_config import EngineConfig
from batchlm.request_schema import INPUTS, OUTPUTS
from batchlm.backend.serving_config import ServingConfig, check_batch_fits

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"
MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
# every model that speaks the whole request schema
SCHEMA_CONFIGS = (*sorted(REPO.glob("*/config.pbtxt")),
                  ROOT / "docker/trtllm/model_repository/continuous_batching_trtllm/config.pbtxt")
# a model with a narrower schema, for the client's tests: a part of it, each field as the schema has it
NARROW_CONFIG = ROOT / "tests/functional/narrow_schema_model/config.pbtxt"


def load(name: str) -> model_config_pb2.ModelConfig:
    return parse(REPO / name / "config.pbtxt")


def parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def declared(config: model_config_pb2.ModelConfig) -> tuple[dict, dict]:
    """Its inputs, name -> (data type, dims, optional), and outputs, name -> (data type, dims)."""
    dtype = model_config_pb2.DataType.Name
    return ({i.name: (dtype(i.data_type), tuple(i.dims), i.optional) for i in config.input},
            {o.name: (dtype(o.data_type), tuple(o.dims)) for o in config.output})


SCHEMA = ({f.name: (f.data_type.config, f.dims, not f.required) for f in INPUTS.values()},
          {f.name: (f.data_type.config, f.dims) for f in OUTPUTS.values()})


def params(config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def test_repository_holds_only_models():
    # Triton treats every folder as a model: nothing else may live at the top level.
    assert sorted(p.name for p in REPO.iterdir()) == sorted(MODELS)


@pytest.mark.parametrize("path", SCHEMA_CONFIGS, ids=lambda p: p.parent.name)
def test_config_declares_the_request_schema(path):
    config = parse(path)
    assert config.name == path.parent.name and config.backend == "python"
    assert (path.parent / "1" / "model.py").exists()
    inputs, outputs = declared(config)
    assert inputs == SCHEMA[0], "inputs: names, data types, dims or optional flags differ from request_schema.INPUTS"
    assert outputs == SCHEMA[1], "outputs: names, data types or dims differ from request_schema.OUTPUTS"


def test_the_narrow_test_model_declares_a_part_of_the_schema():
    inputs, outputs = declared(parse(NARROW_CONFIG))
    # its prompt is text alone: it requires text_input, which the schema leaves optional next to input_ids
    assert inputs.pop("text_input") == SCHEMA[0]["text_input"][:2] + (False,)
    assert inputs.items() <= SCHEMA[0].items() and outputs.items() <= SCHEMA[1].items()
    assert {n for n, f in INPUTS.items() if f.required} <= set(inputs)
    assert {n for n, f in OUTPUTS.items() if f.required} <= set(outputs)
    assert set(inputs) < set(INPUTS) and set(outputs) < set(OUTPUTS)  # narrower, as its tests need


@pytest.mark.parametrize("name", MODELS)
def test_every_parameter_is_known_and_valid(name):
    ServingConfig.from_parameters(params(load(name)))


def test_strategies_differ_only_in_batching():
    static, dynamic, continuous = (load(n) for n in MODELS)
    for a, b in ((static, dynamic), (static, continuous)):
        assert list(a.input) == list(b.input) and list(a.output) == list(b.output)
    # Only continuous batching streams; static batching parks requests behind response senders, one
    # response each, so it is not decoupled and plain infer reaches it.
    assert continuous.model_transaction_policy.decoupled
    assert not static.model_transaction_policy.decoupled and not dynamic.model_transaction_policy.decoupled
    assert static.max_batch_size == 0 and continuous.max_batch_size == 0
    assert dynamic.max_batch_size == 8 and dynamic.HasField("dynamic_batching")
    assert dynamic.dynamic_batching.max_queue_delay_microseconds > 0
    assert dynamic.dynamic_batching.default_queue_policy.max_queue_size > 0
    assert not static.HasField("dynamic_batching") and not continuous.HasField("dynamic_batching")
    # The same KV budget and in-flight limit everywhere, for a fair comparison.
    engines = [ServingConfig.from_parameters(params(c)) for c in (static, dynamic, continuous)]
    assert len({(e.engine.num_kv_blocks, e.engine.block_size, e.engine.max_model_len) for e in engines}) == 1
    assert engines[0].batch_size == dynamic.max_batch_size == engines[2].engine.max_num_seqs
    assert len({e.cancellation_check_period_ms for e in engines}) == 1


def test_unknown_parameter_is_named():
    with pytest.raises(ValueError, match="max_num_sqs"):
        ServingConfig.from_parameters({"max_num_sqs": "8"})
    with pytest.raises(ValueError, match="batch_size"):
        ServingConfig.from_parameters({"batch_size": "eight"})
    assert isinstance(ServingConfig.from_parameters({}).engine, EngineConfig)


def test_cancellation_check_period_is_parsed_and_checked():
    assert ServingConfig.from_parameters({}).cancellation_check_period_ms == 100  # TRT-LLM backend's default
    assert ServingConfig.from_parameters({"cancellation_check_period_ms": "20"}).cancellation_check_period_ms == 20
    with pytest.raises(ValueError, match="cancellation_check_period_ms"):
        ServingConfig.from_parameters({"cancellation_check_period_ms": "0"})
    with pytest.raises(ValueError, match="attention"):
        ServingConfig.from_parameters({"attention": "flash"})


def test_stream_interval_is_parsed_and_checked():
    assert ServingConfig.from_parameters({}).stream_interval == 1  # a response per token
    assert ServingConfig.from_parameters({"stream_interval": "4"}).stream_interval == 4
    for bad in ("0", "four"):
        with pytest.raises(ValueError, match="stream_interval"):
            ServingConfig.from_parameters({"stream_interval": bad})


def test_a_request_level_batch_must_fit_the_kv_pool_and_max_num_seqs():
    # The shipped static and dynamic batches fit exactly: 8 rows x 64 blocks of 16 = 512 blocks.
    static, dynamic = (ServingConfig.from_parameters(params(load(n))) for n in MODELS[:2])
    check_batch_fits(static.engine, static.batch_size, "batch_size")
    check_batch_fits(dynamic.engine, load("dynamic_batching").max_batch_size, "max_batch_size")
    # Loaded, these would fail every full batch as a whole.
    with pytest.raises(ValueError, match=r"^batch_size: 16 rows exceed max_num_seqs=8"):
        check_batch_fits(static.engine, 16, "batch_size")
    wide = EngineConfig(max_num_seqs=16)
    with pytest.raises(ValueError, match=r"^max_batch_size: 16 rows of max_model_len=1024 need 1024 KV blocks"):
        check_batch_fits(wide, 16, "max_batch_size")
    long = EngineConfig(max_model_len=2048)  # one 2048-token row fits 512 blocks; eight do not
    with pytest.raises(ValueError, match="need 1024 KV blocks of 16 tokens, num_kv_blocks is 512"):
        check_batch_fits(long, 8, "batch_size")
    check_batch_fits(EngineConfig(max_num_seqs=16, num_kv_blocks=1024), 16, "max_batch_size")


@pytest.mark.parametrize("path", [*(REPO / name / "1" / "model.py" for name in MODELS),
                                  REPO.parent / "docker/trtllm/model_repository/continuous_batching_trtllm/1/model.py"],
                         ids=lambda p: p.parts[-3])
def test_importing_a_model_file_imports_no_engine(path):
    """Triton's Python backend imports each model.py in a stub of its own to auto-complete the config,
    before the instance's stub imports it again to serve. The engine's imports (torch) at the top of the
    file would cost that first stub seconds of every model load."""
    import subprocess
    import sys

    code = ("import sys, types, runpy; sys.modules['triton_python_backend_utils'] = types.ModuleType('pb'); "
            f"runpy.run_path({str(path)!r}); print(sorted(m for m in ('torch', 'batchlm') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_max_wait_ms_is_parsed_checked_and_off_as_shipped():
    assert ServingConfig.from_parameters(params(load("static_batching"))).max_wait_ms == 0  # pure static
    assert ServingConfig.from_parameters({"max_wait_ms": "250"}).max_wait_ms == 250
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match="max_wait_ms"):
            ServingConfig.from_parameters({"max_wait_ms": bad})


def test_dynamic_batching_honours_request_timeouts_in_its_queue():
    policy = load("dynamic_batching").dynamic_batching.default_queue_policy
    assert policy.max_queue_size == 64 and policy.allow_timeout_override
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
    # Triton applies a request's own timeout only below the default: a default of 0 (none) would ignore it
    assert policy.default_timeout_microseconds == 600_000_000
