"""Config overrides: a dotted path into Triton's ModelConfig set to a value, checked against the schema."""

import re
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm.bench.served.config_override import ConfigOverride, overridden_config, overridden_repository

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def parsed(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def override(*texts: str, model: str = "dynamic_batching") -> model_config_pb2.ModelConfig:
    shipped = (REPO / model / "config.pbtxt").read_text()
    return parsed(overridden_config(shipped, [ConfigOverride.parse(t) for t in texts]))


def test_sets_scalars_enums_and_parameters_and_keeps_the_rest():
    shipped = parsed((REPO / "dynamic_batching" / "config.pbtxt").read_text())
    config = override("dynamic_batching.max_queue_delay_microseconds=200000", "max_batch_size=4",
                      "dynamic_batching.preserve_ordering=true", "parameters.num_threads=1",
                      "dynamic_batching.default_queue_policy.timeout_action=DELAY",
                      "parameters.new_key=x")
    assert config.dynamic_batching.max_queue_delay_microseconds == 200000
    assert config.max_batch_size == 4 and config.dynamic_batching.preserve_ordering
    assert config.dynamic_batching.default_queue_policy.timeout_action == \
        model_config_pb2.ModelQueuePolicy.DELAY
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 64  # untouched sibling
    assert config.parameters["num_threads"].string_value == "1" and config.parameters["new_key"].string_value == "x"
    shipped.dynamic_batching.max_queue_delay_microseconds = 200000
    shipped.max_batch_size = 4
    shipped.dynamic_batching.preserve_ordering = True
    shipped.dynamic_batching.default_queue_policy.timeout_action = model_config_pb2.ModelQueuePolicy.DELAY
    shipped.parameters["num_threads"].string_value = "1"
    shipped.parameters["new_key"].string_value = "x"
    assert config == shipped  # nothing else moved


def test_sets_a_field_of_a_list_entry_and_replaces_a_list_of_scalars():
    config = override("instance_group.0.count=2", "instance_group.0.kind=KIND_CPU",
                      "dynamic_batching.preferred_batch_size=4 8")
    assert len(config.instance_group) == 1 and config.instance_group[0].count == 2
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert list(override("dynamic_batching.preferred_batch_size=4 8", "dynamic_batching.preferred_batch_size=2")
                .dynamic_batching.preferred_batch_size) == [2]  # replaced whole, not appended to


@pytest.mark.parametrize("text, message", [
    ("dynamic_batching.max_queue_delay=1", "dynamic_batching.max_queue_delay: ModelDynamicBatching has no such field"),
    ("max_batch_size=eight", "max_batch_size: expects an integer, got 'eight'"),
    ("dynamic_batching.preserve_ordering=yes", "expects true or false"),
    ("dynamic_batching.default_queue_policy.timeout_action=WAIT", "expects one of REJECT, DELAY"),
    ("dynamic_batching=1", "dynamic_batching: a message; set one of its fields"),
    ("max_batch_size.value=1", "max_batch_size: an integer, not a message"),
    ("instance_group.count=2", "instance_group.count: instance_group is a list; name an entry by its index"),
    ("instance_group.1.count=2", "instance_group.1: instance_group has entries 0 to 0; overrides change entries"),
    ("instance_group.0=2", "instance_group.0: an entry of instance_group; set one of its fields"),
    ("instance_group=2", "instance_group: a list of messages; set one of its fields (instance_group.0.<field>)"),
    ("instance_group.0.cnt=2", "instance_group.0.cnt: ModelInstanceGroup has no such field"),
    ("instance_group.0.count=two", "instance_group.0.count: expects an integer, got 'two'"),
    ("dynamic_batching.preferred_batch_size=4 x", "dynamic_batching.preferred_batch_size: expects an integer, got 'x'"),
    ("dynamic_batching.priority_queue_policy.1.max_queue_size=2", "dynamic_batching.priority_queue_policy: a map"),
    ("parameters.a.b=1", "a parameter is parameters.<key>"),
])
def test_a_bad_override_names_its_field(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        override(text)


@pytest.mark.parametrize("text", ["max_batch_size", "=4", "max_batch_size=", " = "])
def test_an_override_needs_a_path_and_a_value(text):
    with pytest.raises(ValueError, match="PATH=VALUE"):
        ConfigOverride.parse(text)


def test_overridden_repository_holds_the_one_model_and_leaves_the_project_alone(tmp_path):
    shipped = (REPO / "dynamic_batching" / "config.pbtxt").read_text()
    repo = overridden_repository(REPO, "dynamic_batching",
                                 [ConfigOverride.parse("dynamic_batching.max_queue_delay_microseconds=0")], tmp_path)
    assert [p.name for p in repo.iterdir()] == ["dynamic_batching"]
    assert (repo / "dynamic_batching" / "1" / "model.py").read_text() == \
        (REPO / "dynamic_batching" / "1" / "model.py").read_text()
    assert not list(repo.rglob("__pycache__"))  # Triton would take it for a model
    written = (repo / "dynamic_batching" / "config.pbtxt").read_text()
    assert "# override: dynamic_batching.max_queue_delay_microseconds=0" in written
    assert parsed(written).dynamic_batching.max_queue_delay_microseconds == 0
    assert parsed(written).HasField("dynamic_batching")  # set to 0, still a dynamic batcher
    assert (REPO / "dynamic_batching" / "config.pbtxt").read_text() == shipped
