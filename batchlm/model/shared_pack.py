"""SharedPack: a GGUF file's packed blocks (batchlm/model/quantized.py) written once beside the file and
mapped read-only by every process that loads it, so the three models of one server hold them once.

The pack lies at `<dir>/.<file name>.packed-<key>` (the blocks, each at a 64-byte offset) with a `.json`
index (each tensor's offset and shape), where the key covers the file (its resolved path, size and
modification time), the kernel library (whose name changes with the tiles' layout) and which tensors are
packed, as which type, for which kernel (`layouts`: "float32" for linear_q, "int8" for linear_q8). The first
process to take the lock packs and writes it (to a temporary name, renamed into place: no reader sees half a
pack); the others wait on the lock, then map it. Packs of the same file under other keys are removed when a
new one is written. Where the folder is not writable the caller
packs in its own memory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from batchlm import kernels

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: each tensor starts on a cache line


class SharedPack:
    def __init__(self, path: Path, targets: Sequence[tuple[object, str, tuple[str, ...]]],
                 layouts: Sequence[str]) -> None:
        path = Path(path).resolve()
        st = path.stat()
        what = [str(path), st.st_size, st.st_mtime_ns, kernels.library_path().name,
                [[qtype, layout, list(names)] for (_, qtype, names), layout in zip(targets, layouts)]]
        key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
        self.prefix = path.parent / f".{path.name}.packed-"
        self.data = Path(f"{self.prefix}{key}")
        self.index = self.data.with_name(self.data.name + ".json")

    def load(self, pack: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor] | None:
        """The packed tensors mapped from the shared file, writing it first (`pack()`) if no process has;
        None where the folder cannot hold it."""
        try:
            lock = open(self.prefix.with_name(self.prefix.name + "lock"), "w")
        except OSError as exc:
            log.info("weights not shared between processes: %s", exc)
            return None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: released when the file closes, however this ends
            if not (self.data.exists() and self.index.exists()):
                try:
                    self._write(pack())
                except OSError as exc:
                    log.info("weights not shared between processes: %s", exc)
                    return None
            return self._map()

    def _write(self, tensors: list[torch.Tensor]) -> None:
        entries, offset = [], 0
        tmp = self.data.with_name(self.data.name + f".{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for t in tensors:
                    offset = -(-offset // ALIGN) * ALIGN
                    f.seek(offset)
                    f.write(t.contiguous().numpy().tobytes())
                    entries.append({"offset": offset, "shape": list(t.shape)})
                    offset += t.numel()
            self.index.write_text(json.dumps(entries))
            os.replace(tmp, self.data)  # NOTE: atomic; readers look for the data file, written last
        finally:
            tmp.unlink(missing_ok=True)
        for other in self.data.parent.glob(self.prefix.name + "*"):
            if other.name.startswith(self.data.name) or other.name.endswith("lock"):
                continue
            other.unlink(missing_ok=True)  # NOTE: this file's packs under another key: stale

    def _map(self) -> list[torch.Tensor]:
        entries = json.loads(self.index.read_text())
        mapped = np.memmap(self.data, dtype=np.uint8, mode="r")
        with warnings.catch_warnings():  # NOTE: read-only on purpose: the kernels only read the blocks
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            whole = torch.from_numpy(mapped)
        return [whole[e["offset"]:e["offset"] + int(np.prod(e["shape"]))].view(e["shape"]) for e in entries]
