"""The serve commands' tritonserver arguments: explicit model control, its repository API restricted to
the serve command, unless the caller chose a mode; and whether a server so started can be drained."""

import os

import pytest

from batchlm.server import triton_server
from batchlm.server.triton_server import ADMIN_HEADER, TritonServer, model_control_mode, with_model_control


def test_no_mode_given_adds_explicit_control_with_every_model_loaded_and_the_api_restricted():
    extra, header = with_model_control(["--log-verbose=1"])
    name, token = header
    assert name == ADMIN_HEADER and len(token) == 32
    assert extra == ["--model-control-mode=explicit", "--load-model=*",
                     f"--http-restricted-api=model-repository:{name}={token}",
                     f"--grpc-restricted-protocol=model-repository:{name}={token}", "--log-verbose=1"]
    assert with_model_control([])[1][1] != token  # a new value for every server
    assert TritonServer(extra_args=tuple(extra)).drainable


@pytest.mark.parametrize("extra, drainable", [
    (["--model-control-mode=none"], False),
    (["--model-control-mode=poll", "--repository-poll-secs=5"], False),
    (["--model-control-mode=explicit", "--load-model=dynamic_batching"], True),
    (["--model-control-mode", "explicit", "--load-model=static_batching"], True),
    (["--model-control-mode", "none"], False),
    (["--model-control-mode=explicit", "--model-control-mode", "poll"], False),  # the last one counts
    (["--model-control-mode"], False),
])
def test_a_mode_given_is_kept_as_it_is_and_only_explicit_control_is_drained(extra, drainable):
    assert with_model_control(extra) == (extra, None)
    assert TritonServer(extra_args=tuple(extra)).drainable is drainable


def test_no_mode_is_tritonservers_default_none():
    assert model_control_mode(["--log-verbose=1"]) == "none"
    assert not TritonServer().drainable


def _fake_triton(base):
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "tritonserver").write_text("#!/bin/sh\n")
    (base / "bin" / "tritonserver").chmod(0o755)
    (base / "backends" / "python").mkdir(parents=True)
    return base


def test_tritonserver_is_looked_for_as_setup_does_home_then_path_then_the_extracted_one(tmp_path, monkeypatch):
    """$TRITON_HOME, then NGC's on PATH, then .triton/ (before, .triton/ came before PATH: a checkout set
    up outside an NGC container served the extracted 2.51 inside it)."""
    ngc = _fake_triton(tmp_path / "ngc")
    monkeypatch.setattr(triton_server, "NGC_BACKENDS", ngc / "backends")
    monkeypatch.setenv("PATH", f"{ngc / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("TRITON_HOME", raising=False)
    assert triton_server.TritonInstall.find().binary == ngc / "bin" / "tritonserver"
    home = _fake_triton(tmp_path / "home")
    monkeypatch.setenv("TRITON_HOME", str(home))
    assert triton_server.TritonInstall.find().binary == home / "bin" / "tritonserver"
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="TRITON_HOME=.*nowhere has no bin/tritonserver"):
        triton_server.TritonInstall.find()
    monkeypatch.delenv("TRITON_HOME")
    checkout = tmp_path / "checkout"
    extracted = _fake_triton(checkout / ".triton")
    monkeypatch.setattr(triton_server, "PROJECT_ROOT", checkout)
    (ngc / "backends" / "python").rmdir()  # a tritonserver without the Python backend: not one to serve with
    assert triton_server.TritonInstall.find().binary == extracted / "bin" / "tritonserver"
    monkeypatch.setattr(triton_server, "NGC_BACKENDS", tmp_path / "absent")  # no NGC container: the extracted one
    assert triton_server.TritonInstall.find().binary == extracted / "bin" / "tritonserver"
