#!/usr/bin/env bash
# Installs optimum-intel, the exporter of OpenVINO IR, into a folder of its own for
# `batchlm-bench peers-served` (its OpenVINO GenAI rows on a float32 IR). It pins transformers < 5.6, the
# project pins a newer one: so it lives in DEST, put first on PYTHONPATH only for the export, and .venv is
# left as it is. Everything else it imports (torch, numpy, openvino) is .venv's.
# Cached: a second run with the same pins does nothing.
#
# Usage: scripts/install_optimum_intel.sh [DEST]   (default: .cache/peers/optimum-intel-site)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.cache/peers/optimum-intel-site}"
pip="$root/.venv/bin/pip"
# NOTE: --no-deps: each of these is chosen to run beside .venv's packages: transformers 5.5 asks for
# tokenizers <= 0.23.0 and huggingface-hub < 2, and breaks on the newer `kernels` that .venv may hold
pins=("optimum-intel==2.2.0" "optimum==2.3.0" "transformers==5.5.4" "tokenizers==0.22.2" "huggingface-hub==1.33.0"
      "kernels==0.12.3" "httpx==0.29.0" "httpcore==1.0.9")

log() { printf '[install_optimum_intel] %s\n' "$*" >&2; }

stamp="$dest/.batchlm-pins"
if [[ -f "$stamp" && "$(cat "$stamp")" == "${pins[*]}" ]]; then
  log "optimum-intel already in $dest"
  exit 0
fi
"$root/.venv/bin/python" -c "import openvino" 2>/dev/null || {
  log "openvino is not in .venv: install the peers-served extra first (pip install -e '.[peers-served]')"
  exit 1
}
log "installing ${pins[*]} into $dest"
rm -rf "$dest"
"$pip" install -q --disable-pip-version-check --no-deps --target "$dest" "${pins[@]}"
echo "${pins[*]}" >"$stamp"
