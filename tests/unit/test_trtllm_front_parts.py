"""The TensorRT-LLM front's pure parts: the engine's tensor contract, the front's parameters, the shipped
configs (parsed with Triton's own protobuf), and the stream buffer it shares with continuous_batching."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm.engine.request_output import RequestOutput
from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from batchlm.backend.serving_config import ServingConfig
from batchlm.backend.stream_buffer import StreamBuffer
from batchlm.backend.trtllm import protocol as trtllm_protocol
from batchlm.backend.trtllm.front_config import TrtllmFrontConfig

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "docker" / "trtllm" / "model_repository"
DTYPE = model_config_pb2.DataType.Name


def load(name: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((REPO / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_greedy_request_tensors():
    t = trtllm_protocol.request_inputs([1, 5, 9], SamplingParams(max_tokens=7), stream=True, eos_token_id=2,
                                       pad_token_id=2)
    assert t["input_ids"].tolist() == [[1, 5, 9]] and t["input_ids"].dtype == np.int32
    assert t["input_lengths"].tolist() == [[3]] and t["request_output_len"].tolist() == [[7]]
    assert t["runtime_top_k"].tolist() == [[1]] and "temperature" not in t  # greedy
    assert t["end_id"].tolist() == [[2]] and t["streaming"].tolist() == [[True]]
    assert "random_seed" not in t and "stop" not in t


def test_sampled_request_tensors_and_ignore_eos():
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 1, ignore_eos=True)
    t = trtllm_protocol.request_inputs([3], params, stream=False, eos_token_id=2, pad_token_id=0)
    assert t["temperature"].dtype == np.float32 and t["temperature"][0, 0] == pytest.approx(0.7)
    assert t["runtime_top_k"].tolist() == [[40]] and t["runtime_top_p"][0, 0] == pytest.approx(0.9)
    assert t["random_seed"].dtype == np.uint64 and int(t["random_seed"][0, 0]) == 2**64 - 1
    assert "end_id" not in t  # no end id: the engine generates exactly max_tokens
    assert t["streaming"].tolist() == [[False]]


def test_an_unseeded_sampled_request_gets_a_fresh_seed_and_a_greedy_one_none():
    # The engine starts every request without random_seed from seed 0: with no random_seed sent, the
    # same prompt would sample the same text every time
    sampled = SamplingParams(max_tokens=4, temperature=0.8)
    seeds = {int(trtllm_protocol.request_inputs([3], sampled, False, 2, 0)["random_seed"][0, 0]) for _ in range(8)}
    assert len(seeds) == 8
    assert "random_seed" not in trtllm_protocol.request_inputs([3], SamplingParams(max_tokens=4), False, 2, 0)


@pytest.mark.parametrize("temperature", [1e-38, 1e-46, 1e-31])
def test_a_temperature_too_small_for_float32_is_sent_as_greedy(temperature):
    # 1e-46 is 0 in float32, and 1/1e-38 scales a logit of 10 past float32's largest value: the engine
    # would divide by 0 or overflow; greedy is what such a temperature samples
    t = trtllm_protocol.request_inputs([3], SamplingParams(max_tokens=4, temperature=temperature), False, 2, 0)
    assert t["runtime_top_k"].tolist() == [[1]] and "temperature" not in t
    t = trtllm_protocol.request_inputs([3], SamplingParams(max_tokens=4, temperature=1e-29), False, 2, 0)
    assert t["runtime_top_k"].tolist() == [[0]] and t["temperature"][0, 0] > 0


def test_a_top_k_the_engine_would_clip_is_refused_naming_it():
    trtllm_protocol.check_params(SamplingParams(temperature=0.7, top_k=trtllm_protocol.TOP_K_MAX))
    with pytest.raises(InvalidArgument) as info:
        trtllm_protocol.check_params(SamplingParams(temperature=0.7, top_k=trtllm_protocol.TOP_K_MAX + 1))
    assert info.value.field == "top_k" and "1024" in str(info.value)
    # greedy: sent as runtime_top_k 1, its top_k never reaches the engine
    trtllm_protocol.check_params(SamplingParams(top_k=trtllm_protocol.TOP_K_MAX + 1))


def test_every_tensor_sent_is_declared_by_the_shipped_engine_config_with_its_type():
    declared = {i.name: DTYPE(i.data_type) for i in load("tensorrt_llm").input}
    wire = {np.int32: "TYPE_INT32", np.float32: "TYPE_FP32", np.uint64: "TYPE_UINT64", np.bool_: "TYPE_BOOL"}
    params = SamplingParams(max_tokens=4, temperature=0.5, seed=1)
    for tensors in (trtllm_protocol.request_inputs([1, 2], params, True, 2, 2), trtllm_protocol.stop_inputs()):
        for name, array in tensors.items():
            assert declared[name] == wire[array.dtype.type], name
    required = {i.name for i in load("tensorrt_llm").input if not i.optional}
    assert required <= set(trtllm_protocol.stop_inputs())
    assert set(trtllm_protocol.BACKEND_OUTPUTS) <= {o.name for o in load("tensorrt_llm").output}


def test_the_front_knows_when_the_engine_ends_a_request_by_itself():
    # A checkpoint with two EOS ids (2 and 7): the engine is sent the smallest as its end_id.
    end = trtllm_protocol.end_id(frozenset({7, 2}))
    assert end == 2 and trtllm_protocol.end_id(frozenset()) is None
    ends = trtllm_protocol.engine_ends_by_itself
    params = SamplingParams(max_tokens=5)
    assert ends([4, 2], params, end)  # its end_id
    assert ends([4, 5, 6, 7, 8], params, end)  # max_tokens
    # The front's text ended at the other EOS id (or at a stop string): the engine goes on and must be
    # stopped. Were any EOS id of the checkpoint read as the engine's own end, no stop would be sent and
    # the engine would run to max_tokens in a slot of max_in_flight.
    assert not ends([4, 7], params, end)
    assert not ends([4, 9], params, end)
    # Under ignore_eos the engine got no end_id: an id equal to it ends nothing.
    assert not ends([4, 2], SamplingParams(max_tokens=5, ignore_eos=True), end)
    assert not ends([4, 2], params, None)


def test_new_token_ids_reads_beam_zero_up_to_its_length():
    assert trtllm_protocol.new_token_ids(np.array([[[4, 5, 6, 0]]], np.int32), np.array([[3]], np.int32)) == [4, 5, 6]
    assert trtllm_protocol.new_token_ids(np.array([[[7]]], np.int32), None) == [7]
    assert trtllm_protocol.new_token_ids(np.zeros((1, 1, 0), np.int32), np.array([[0]], np.int32)) == []
    assert trtllm_protocol.new_token_ids(None, None) == []


def test_engine_config_is_inflight_batching_and_decoupled():
    config = load("tensorrt_llm")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["exclude_input_in_output"] == "true"  # the front reads only generated ids
    assert config.max_batch_size > 0


def test_front_config_has_valid_parameters():
    # its inputs and outputs: tests/unit/test_model_repository.py::test_config_declares_the_request_schema
    config = load("continuous_batching_trtllm")
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    front = TrtllmFrontConfig.from_parameters({k: v.string_value for k, v in config.parameters.items()})
    assert front.backend_model == load("tensorrt_llm").name
    assert sorted(p.name for p in REPO.iterdir()) == ["continuous_batching_trtllm", "tensorrt_llm"]


@pytest.mark.parametrize("params, field", [
    ({"max_in_flight": "0"}, "max_in_flight"),
    ({"max_model_len": "many"}, "max_model_len"),
    ({"backend_modle": "x"}, "backend_modle"),
    ({"backend_model": ""}, "backend_model"),
])
def test_front_parameters_are_checked_naming_the_key(params, field):
    with pytest.raises(InvalidArgument) as err:
        TrtllmFrontConfig.from_parameters(params)
    assert err.value.field == field


def _out(text, n, finished=False, first=0):
    return RequestOutput("r", text, list(range(first, first + n)), finished, None, 3, 0)


def _sent(due):
    return None if due is None else (due.text, due.token_ids)


def test_stream_buffer_sends_first_text_at_once_then_every_interval_tokens():
    buffer = StreamBuffer(stream=True, interval=3)
    assert buffer.take(_out("", 1)) is None  # no text yet (a character still incomplete)
    assert _sent(buffer.take(_out("a", 1, first=1))) == ("a", [0, 1])  # the first text goes at once
    assert buffer.take(_out("b", 1, first=2)) is None and buffer.take(_out("c", 1, first=3)) is None
    assert _sent(buffer.take(_out("d", 1, first=4))) == ("bcd", [2, 3, 4])
    assert _sent(buffer.take(_out("", 0, finished=True))) == ("", [])


def test_stream_buffer_without_streaming_answers_once():
    buffer = StreamBuffer(stream=False)
    assert buffer.take(_out("a", 1)) is None and buffer.take(_out("b", 1, first=1)) is None
    assert _sent(buffer.take(_out("c", 1, finished=True, first=2))) == ("abc", [0, 1, 2])


def test_engine_build_plan_takes_its_limits_from_the_shipped_configs():
    plan = json.loads(subprocess.run([sys.executable, str(ROOT / "scripts" / "build_trtllm_engine.py"), "--dry-run"],
                                     check=True, capture_output=True, text=True).stdout)
    front = TrtllmFrontConfig.from_parameters(
        {k: v.string_value for k, v in load("continuous_batching_trtllm").parameters.items()})
    assert plan["max_seq_len"] == front.max_model_len
    assert plan["max_batch_size"] == load("tensorrt_llm").max_batch_size
    assert f"--max_seq_len={front.max_model_len}" in plan["trtllm_build"]
    assert "--use_paged_context_fmha=enable" in plan["trtllm_build"]  # needed by enable_chunked_context


def test_served_repository_fills_the_engine_folder_and_the_device(tmp_path):
    out = tmp_path / "repo"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_trtllm.py"), "--prepare-only", "--out", str(out),
                    "--engine-dir", str(tmp_path / "engine"), "--device", "cuda"], check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["static_batching", "dynamic_batching", "continuous_batching", "continuous_batching_trtllm", "tensorrt_llm"])
    engine = text_format.Parse((out / "tensorrt_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert engine.parameters["gpt_model_path"].string_value == str((tmp_path / "engine").resolve())
    for name in ("static_batching", "dynamic_batching", "continuous_batching"):
        config = text_format.Parse((out / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        serving = ServingConfig.from_parameters({k: v.string_value for k, v in config.parameters.items()})
        assert serving.engine.device == "cuda", name
    assert "${" not in (ROOT / "docker" / "trtllm" / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text() \
        .replace("${engine_dir}", "")  # the only placeholder is the engine folder


def _serve_trtllm():
    spec = importlib.util.spec_from_file_location("serve_trtllm", ROOT / "scripts" / "serve_trtllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_engine_built_to_another_plan_or_tensorrt_llm_is_built_again(tmp_path):
    """An engine folder with config.json and rank0.engine is not served as it is: one without
    batchlm_build.json, or built to another plan or TensorRT-LLM version, is built again."""
    serve = _serve_trtllm()
    engine = tmp_path / "engine"
    plan = json.loads(subprocess.run([sys.executable, str(ROOT / "scripts" / "build_trtllm_engine.py"), "--dry-run",
                                      "--out", str(engine)], check=True, capture_output=True, text=True).stdout)
    engine.mkdir()
    for name in serve.ENGINE_FILES:
        (engine / name).write_text("{}")
    assert "has no batchlm_build.json" in serve.why_build(engine, plan, "0.14.0")
    (engine / serve.PLAN_FILE).write_text(json.dumps({**plan, "tensorrt_llm": "0.14.0"}))
    assert serve.why_build(engine, plan, "0.14.0") is None
    assert serve.why_build(engine, plan, None) is None  # the version could not be read: not compared
    assert "TensorRT-LLM 0.14.0, 0.15.0 installed" in serve.why_build(engine, plan, "0.15.0")
    bigger = {**plan, "max_batch_size": plan["max_batch_size"] + 1}
    assert f"max_batch_size ({plan['max_batch_size']}, now {plan['max_batch_size'] + 1})" in \
        serve.why_build(engine, bigger, "0.14.0")
    changed = {**plan, "max_seq_len": plan["max_seq_len"] * 2}
    assert serve.why_build(engine, changed, "0.14.0").startswith("built with other max_seq_len")
    assert "checkpoint_sha256" in serve.why_build(engine, {**plan, "checkpoint_sha256": "0" * 64}, "0.14.0")
    # the same build seen from a checkout at another path: nothing to build
    moved = json.loads(json.dumps(plan).replace(str(ROOT), "/elsewhere/checkout").replace(str(tmp_path), "/mnt"))
    assert moved != plan and serve.why_build(engine, moved, "0.14.0") is None
    assert serve.installed_trtllm(sys.executable) is None  # this venv has no tensorrt_llm


def test_the_build_plan_names_the_checkpoint_by_its_contents(tmp_path):
    def plan(model_dir):
        return json.loads(subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_trtllm_engine.py"), "--dry-run",
             "--model-dir", str(model_dir)],
            check=True, capture_output=True, text=True).stdout)["checkpoint_sha256"]

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    first = plan(tmp_path)
    assert first is not None and plan(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert plan(tmp_path) != first


def test_the_engine_is_built_from_the_default_models_hugging_face_export():
    """The GPU path serves the same model as the CPU one: the build converts the folder that
    `scripts/install_default_model.py --hf-export` writes from the default GGUF file (as the image does at
    build time), and the front reads its tokenizer there; nothing is downloaded."""
    plan = json.loads(subprocess.run([sys.executable, str(ROOT / "scripts" / "build_trtllm_engine.py"), "--dry-run"],
                                     check=True, capture_output=True, text=True).stdout)
    export = "models/SmolLM2-135M-Instruct"
    assert plan["model_dir"] == str(ROOT / export)
    assert TrtllmFrontConfig().model_dir == export
    front = {k: v.string_value for k, v in load("continuous_batching_trtllm").parameters.items()}
    assert front["model_dir"] == export
    image = (ROOT / "docker" / "trtllm" / "Dockerfile").read_text()
    assert f"scripts/install_default_model.py --hf-export {export}" in image


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_the_front_refuses_log_probabilities_naming_the_field(field):
    with pytest.raises(InvalidArgument) as err:
        trtllm_protocol.check_params(SamplingParams(max_tokens=4, **{field: 0}))
    assert err.value.field == field
