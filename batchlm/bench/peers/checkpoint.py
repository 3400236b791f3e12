"""Where converted copies of the checkpoint go, keyed on its digest."""

from __future__ import annotations

import hashlib
from pathlib import Path

from batchlm.paths import PROJECT_ROOT

CACHE_DIR = PROJECT_ROOT / ".cache" / "peers"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def checkpoint_digest(model_dir: str | Path) -> str:
    """A short digest of the checkpoint's files (config, tokenizer, weights): the key of converted copies."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    names = [n for n in CHECKPOINT_FILES if (root / n).is_file()]
    names += sorted(p.name for p in root.glob("*.safetensors"))
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(root / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]
