"""Where the OpenAI frontend's API key comes from (batchlm/api_key.py): the option over the variable, an
empty or unsendable key refused at start naming its source, and the launcher handing it to the frontend
alone, in its environment. The key at work against a real frontend: tests/functional/test_openai_frontend.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchlm.api_key import API_KEY_ENV, bearer_headers, client_api_key, resolve_api_key
from batchlm.frontend.__main__ import parse_args
from batchlm.launcher.frontend_process import FrontendProcess
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import PROJECT_ROOT


def test_the_option_wins_over_the_variable_and_neither_is_no_key():
    assert resolve_api_key("from-option", {API_KEY_ENV: "from-env"}) == "from-option"
    assert resolve_api_key(None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key(None, {}) is None


@pytest.mark.parametrize("option, environ, named", [
    ("", {}, "--api-key"),
    ("", {API_KEY_ENV: "fine"}, "--api-key"),      # the option wins, and it is empty
    (None, {API_KEY_ENV: ""}, API_KEY_ENV),
    (None, {API_KEY_ENV: "key\n"}, API_KEY_ENV),    # read from a file with its newline
    ("two words", {}, "--api-key"),
    ("clé", {}, "--api-key"),
])
def test_a_key_no_client_could_send_is_refused_naming_where_it_came_from(option, environ, named):
    with pytest.raises(ValueError) as refused:
        resolve_api_key(option, environ)
    assert str(refused.value).startswith(f"{named}: the API key")


def test_the_frontend_refuses_an_empty_key_at_start_naming_the_option(capsys, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    with pytest.raises(SystemExit) as exited:
        parse_args(["--api-key", ""])
    assert exited.value.code == 2
    assert "error: --api-key: the API key is empty" in capsys.readouterr().err
    assert parse_args([]).api_key == "from-env"
    assert parse_args(["--api-key", "from-option"]).api_key == "from-option"
    monkeypatch.delenv(API_KEY_ENV)
    assert parse_args([]).api_key is None


def test_the_serve_command_refuses_an_empty_key_before_starting_anything():
    """In a process of its own: the variable is read from its environment, as `make serve` passes it."""
    done = subprocess.run([sys.executable, "scripts/serve.py", "--frontend-port", "0"], cwd=PROJECT_ROOT,
                          env={**os.environ, API_KEY_ENV: ""}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {API_KEY_ENV}: the API key is empty" in done.stderr
    assert "tritonserver" not in done.stdout


def test_the_key_reaches_the_frontend_in_its_environment_only(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "the-callers")
    keyed = FrontendProcess("127.0.0.1:8001", api_key="s3cret")
    assert keyed.environment()[API_KEY_ENV] == "s3cret"
    assert not any("s3cret" in a for a in keyed.command()) and "s3cret" not in repr(keyed)
    assert API_KEY_ENV not in FrontendProcess("127.0.0.1:8001").environment()  # its own key, not the caller's
    assert API_KEY_ENV not in TritonServer().environment()                     # no model needs it


def test_clients_send_the_option_else_the_variable():
    assert client_api_key("opt", {API_KEY_ENV: "env"}) == "opt"
    assert client_api_key(None, {API_KEY_ENV: "env"}) == "env"
    assert client_api_key(None, {API_KEY_ENV: ""}) is None and client_api_key(None, {}) is None
    assert bearer_headers("k") == {"Authorization": "Bearer k"} and bearer_headers(None) == {}

