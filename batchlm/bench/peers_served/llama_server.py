"""llama.cpp's own `llama-server` as a peer: the binaries scripts/build_llama_server.sh builds, the Q8_0 file
its `llama-quantize` writes, and one server process started and stopped around a run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from batchlm.bench.peers.checkpoint import CACHE_DIR
from batchlm.launcher.ports import LOOPBACK, free_port
from batchlm.launcher.processes import die_with_parent, kill_group

LLAMA_CPP_DIR = CACHE_DIR / "llama.cpp"
BUILD_HINT = "scripts/build_llama_server.sh (make bench-peers-served runs it)"
# NOTE: without --no-repack, llama.cpp 0.3.36's CPU backend repacks Q4_1 weights for AMX on CPUs that have
# it and then crashes in its warm-up (Sapphire Rapids: SIGSEGV with flash attention, SIGILL without).
DEFAULT_FLAGS = ("--no-repack",)


def binary(name: str) -> Path | None:
    """A built llama.cpp tool (`llama-server`, `llama-quantize`), or None where it is not built."""
    path = LLAMA_CPP_DIR / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def q8_0_file(f32_gguf: Path) -> Path:
    """`f32_gguf` quantized to Q8_0 by llama-quantize, once, beside it in .cache/peers/."""
    out = f32_gguf.with_name(f32_gguf.name.replace("-f32.gguf", "") + "-q8_0.gguf")
    if out.is_file():
        return out
    quantize = binary("llama-quantize")
    if quantize is None:
        raise FileNotFoundError(f"llama-quantize is not built: {BUILD_HINT}")
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    proc = subprocess.run([str(quantize), str(f32_gguf), str(tmp), "Q8_0", "2"], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    tmp.rename(out)
    return out


@dataclass
class LlamaServer:
    """One llama-server on 127.0.0.1 with `parallel` slots, each with room for `slot_tokens` tokens."""

    model: Path
    parallel: int
    slot_tokens: int
    threads: int = 2
    extra_args: tuple[str, ...] = DEFAULT_FLAGS
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        server = binary("llama-server")
        if server is None:
            raise FileNotFoundError(f"llama-server is not built: {BUILD_HINT}")
        return [str(server), "-m", str(self.model), "--host", LOOPBACK, "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "--parallel", str(self.parallel),
                "-c", str(self.parallel * self.slot_tokens), "--no-webui", *self.extra_args]

    def start(self, timeout: float = 120.0) -> "LlamaServer":
        """Start it and wait until /health answers 200 (the model loaded and warmed up)."""
        out = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=die_with_parent)
        finally:
            if self.log_path is not None:
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                crash = f" (signal {signal.Signals(-code).name})" if code < 0 else ""
                raise RuntimeError(f"llama-server exited with {code}{crash} before it was ready; its log: "
                                   f"{self.log_path}")
            if self._healthy():
                return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"llama-server not ready within {timeout:.0f} s")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s, then its process group. Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        kill_group(self.process.pid)
        self.process = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
