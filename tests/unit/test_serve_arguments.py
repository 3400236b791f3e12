"""The serve commands' tritonserver arguments: explicit model control unless the caller chose a mode."""

import pytest

from batchlm.triton_server import with_model_control


def test_no_mode_given_adds_explicit_control_with_every_model_loaded():
    extra, drainable = with_model_control(["--log-verbose=1"])
    assert extra == ["--model-control-mode=explicit", "--load-model=*", "--log-verbose=1"] and drainable


@pytest.mark.parametrize("extra, drainable", [
    (["--model-control-mode=none"], False),
    (["--model-control-mode=poll", "--repository-poll-secs=5"], False),
    (["--model-control-mode=explicit", "--load-model=dynamic_batching"], True),
    (["--model-control-mode", "explicit", "--load-model=static_batching"], True),
    (["--model-control-mode", "none"], False),
])
def test_a_mode_given_is_kept_as_it_is(extra, drainable):
    assert with_model_control(extra) == (extra, drainable)
