"""The serve commands' tritonserver arguments: explicit model control, its repository API restricted to
the serve command, unless the caller chose a mode."""

import pytest

from batchlm.triton_server import ADMIN_HEADER, with_model_control


def test_no_mode_given_adds_explicit_control_with_every_model_loaded_and_the_api_restricted():
    extra, drainable, header = with_model_control(["--log-verbose=1"])
    name, token = header
    assert name == ADMIN_HEADER and len(token) == 32 and drainable
    assert extra == ["--model-control-mode=explicit", "--load-model=*",
                     f"--http-restricted-api=model-repository:{name}={token}",
                     f"--grpc-restricted-protocol=model-repository:{name}={token}", "--log-verbose=1"]
    assert with_model_control([])[2][1] != token  # a new value for every server


@pytest.mark.parametrize("extra, drainable", [
    (["--model-control-mode=none"], False),
    (["--model-control-mode=poll", "--repository-poll-secs=5"], False),
    (["--model-control-mode=explicit", "--load-model=dynamic_batching"], True),
    (["--model-control-mode", "explicit", "--load-model=static_batching"], True),
    (["--model-control-mode", "none"], False),
])
def test_a_mode_given_is_kept_as_it_is(extra, drainable):
    assert with_model_control(extra) == (extra, drainable, None)
