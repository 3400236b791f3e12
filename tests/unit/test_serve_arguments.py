"""The tritonserver arguments of every server the project starts: loopback unless asked, the
administrative APIs restricted to a header only the starter holds (its key on the command line unless
argv_secret is asked for); the serve commands' explicit model control unless the caller chose a mode;
and whether a server so started can be drained."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchlm.launcher import argv_secret, triton_install
from batchlm.launcher.admin_key import ADMIN_HEADER, RESTRICTED_APIS
from batchlm.launcher.model_control import model_control_mode, with_model_control
from batchlm.launcher.triton_server import TritonServer


def _fake_install(tmp_path):
    _fake_triton(tmp_path)
    return triton_install.TritonInstall(tmp_path / "bin" / "tritonserver", tmp_path / "backends")


def test_every_server_binds_loopback_and_restricts_the_administrative_apis(tmp_path, monkeypatch):
    def refuse():
        raise AssertionError("the argv_secret library was built or looked up for a server that did not ask")

    monkeypatch.setattr(argv_secret, "library", refuse)
    monkeypatch.setattr(argv_secret, "build", refuse)
    server = TritonServer(install=_fake_install(tmp_path))
    command = server.command()
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in command
    name, token = server.admin_header
    assert name == ADMIN_HEADER and len(token) == 32 and server.admin_headers == {name: token}
    apis = ",".join(RESTRICTED_APIS)
    # by default the token is tritonserver's argument, as tritonserver takes it; nothing is preloaded
    assert not server.token_hidden
    assert f"--http-restricted-api={apis}:{name}={token}" in command
    assert f"--grpc-restricted-protocol={apis}:{name}={token}" in command
    env = server.environment()
    assert argv_secret.SECRET not in env and argv_secret.PLACEHOLDER not in env
    assert env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")
    assert TritonServer(install=server.install).token_placeholder != server.token_placeholder  # random
    assert set(RESTRICTED_APIS) == {"model-repository", "shared-memory", "logging", "trace"}
    assert TritonServer(install=server.install).admin_token != token  # a new value for every server
    assert server.http_url == "127.0.0.1:8000" and server.metrics_url == "http://127.0.0.1:8002/metrics"


def test_asked_for_the_key_goes_through_the_environment_and_a_placeholder_is_on_the_command_line(tmp_path):
    server = TritonServer(install=_fake_install(tmp_path), hide_admin_key=True)
    command = server.command()
    name, token = server.admin_header
    apis = ",".join(RESTRICTED_APIS)
    # the token reaches tritonserver through its environment; its command line holds a placeholder
    assert server.token_hidden
    placeholder = server.token_placeholder
    assert f"--http-restricted-api={apis}:{name}={placeholder}" in command
    assert f"--grpc-restricted-protocol={apis}:{name}={placeholder}" in command
    assert not [a for a in command if token in a]
    env = server.environment()
    assert env[argv_secret.SECRET] == token and env[argv_secret.PLACEHOLDER] == placeholder
    assert env["LD_PRELOAD"].split(":")[0] == str(argv_secret.library_path())


def test_without_a_c_compiler_the_token_goes_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(argv_secret, "library", lambda: None)
    server = TritonServer(install=_fake_install(tmp_path), hide_admin_key=True)
    name, token = server.admin_header
    assert not server.token_hidden
    assert f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{name}={token}" in server.command()
    assert argv_secret.SECRET not in server.environment()


def test_the_argv_secret_library_builds_once_for_concurrent_builders(tmp_path, monkeypatch):
    monkeypatch.setattr(argv_secret, "BUILD_DIR", tmp_path / "build")
    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: argv_secret.build(), range(4)))
    assert paths == {argv_secret.library_path()} and argv_secret.library_path().exists()
    assert [p.name for p in (tmp_path / "build").iterdir()] == [argv_secret.library_path().name]  # no temp left
    assert (tmp_path / "build").stat().st_mode & 0o777 == 0o700


def test_a_library_others_can_write_or_a_path_the_loader_would_split_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(argv_secret, "BUILD_DIR", tmp_path / "build")
    built = argv_secret.build()
    built.chmod(0o775)  # whoever could replace it would run code in tritonserver with the key
    assert argv_secret.library() is None
    built.chmod(0o755)
    (tmp_path / "build").chmod(0o777)
    assert argv_secret.library() is None
    (tmp_path / "build").chmod(0o700)
    assert argv_secret.library() == built
    monkeypatch.setattr(argv_secret, "BUILD_DIR", tmp_path / "my cache")
    assert argv_secret.library() is None


def test_the_preloaded_library_puts_the_secret_in_argv_and_nowhere_a_local_user_can_read(tmp_path):
    """A process started as the servers are: its arguments hold the secret, its command line in /proc
    the placeholder, its environment in /proc not the secret, and a child it starts neither the
    variable nor the library."""
    probe = (
        "import os, sys, subprocess\n"
        "cmdline = open(f'/proc/{os.getpid()}/cmdline', 'rb').read()\n"
        "environ = open(f'/proc/{os.getpid()}/environ', 'rb').read()\n"
        "child = subprocess.run(['env'], capture_output=True, text=True).stdout\n"
        "secret = sys.argv[1].split(':')[1].encode()  # NOTE: not a literal: this text is on the command line\n"
        "print(sys.argv[1]); print(secret in cmdline, secret in environ)\n"
        "print('BATCHLM_ARGV_' in child, 'argv_secret' in child, os.environ.get('LD_PRELOAD'))\n"
    )
    placeholder = argv_secret.new_placeholder()
    env = argv_secret.environment({"PATH": os.environ["PATH"], "LD_PRELOAD": "/lib/other.so"}, "sesame-42",
                                  placeholder, argv_secret.build())
    out = subprocess.run([sys.executable, "-c", probe, f"--key=k:{placeholder}"], env=env,
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert out == ["--key=k:sesame-42", "False False", "False False /lib/other.so"], out


def test_another_address_is_bound_only_when_asked(tmp_path):
    everywhere = TritonServer(install=_fake_install(tmp_path), address="0.0.0.0")
    assert "--http-address=0.0.0.0" in everywhere.command() and everywhere.http_url == "127.0.0.1:8000"
    one = TritonServer(install=everywhere.install, address="10.1.2.3")
    assert "--grpc-address=10.1.2.3" in one.command() and one.grpc_url == "10.1.2.3:8001"


def test_restrictions_given_by_the_caller_replace_the_defaults_and_none_can_be_asked(tmp_path):
    own = ("--http-restricted-api=model-repository:k=v",)
    server = TritonServer(install=_fake_install(tmp_path), extra_args=own)
    assert server.admin_header is None and server.admin_headers == {}
    assert [a for a in server.command() if "restricted" in a] == list(own)
    assert not [a for a in TritonServer(install=server.install, restricted_apis=()).command() if "restricted" in a]


def test_no_mode_given_adds_explicit_control_with_every_model_loaded():
    extra = with_model_control(["--log-verbose=1"])
    assert extra == ["--model-control-mode=explicit", "--load-model=*", "--log-verbose=1"]
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
    assert with_model_control(extra) == extra
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
    """$TRITON_HOME, then NGC's on PATH, then .triton/ (with .triton/ before PATH, a checkout set up
    outside an NGC container would serve the extracted 2.51 inside it)."""
    ngc = _fake_triton(tmp_path / "ngc")
    monkeypatch.setattr(triton_install, "NGC_BACKENDS", ngc / "backends")
    monkeypatch.setenv("PATH", f"{ngc / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("TRITON_HOME", raising=False)
    assert triton_install.TritonInstall.find().binary == ngc / "bin" / "tritonserver"
    home = _fake_triton(tmp_path / "home")
    monkeypatch.setenv("TRITON_HOME", str(home))
    assert triton_install.TritonInstall.find().binary == home / "bin" / "tritonserver"
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="TRITON_HOME=.*nowhere has no bin/tritonserver"):
        triton_install.TritonInstall.find()
    monkeypatch.delenv("TRITON_HOME")
    checkout = tmp_path / "checkout"
    extracted = _fake_triton(checkout / ".triton")
    monkeypatch.setattr(triton_install, "PROJECT_ROOT", checkout)
    (ngc / "backends" / "python").rmdir()  # a tritonserver without the Python backend: not one to serve with
    assert triton_install.TritonInstall.find().binary == extracted / "bin" / "tritonserver"
    monkeypatch.setattr(triton_install, "NGC_BACKENDS", tmp_path / "absent")  # no NGC container: the extracted one
    assert triton_install.TritonInstall.find().binary == extracted / "bin" / "tritonserver"


@pytest.mark.parametrize("flags, hidden", [([], False), (["--hide-admin-key"], True)])
def test_the_serve_command_hides_the_key_only_when_asked(flags, hidden, monkeypatch):
    from batchlm.launcher import serve

    started = []
    monkeypatch.setattr(serve, "serve_until_signalled", lambda server, *a, **k: started.append(server) or 0)
    assert serve.main(["--no-frontend", *flags]) == 0
    assert started[0].hide_admin_key is hidden
