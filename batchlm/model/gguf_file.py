"""A GGUF file of the llama architecture as a checkpoint: shape, weights, tokenizer and chat template.

One file holds everything a Hugging Face folder spreads over config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. `GGUFFile` reads it with the `gguf` package (the format's own
library, which memory-maps the file) and presents it in the names the rest of the package reads:
`hf_config()` is a config.json dict, `weights()` a name -> float32 tensor mapping in Hugging Face names
(quantized tensors dequantized at load), `tokenizer()` a `tokenizers.Tokenizer`. The header is read by
gguf_header.py, the tokenizer rebuilt by gguf_tokenizer.py. Writing one, and writing one as a Hugging
Face folder: batchlm/model/gguf_export.py. Anything this package cannot run is refused with
InvalidArgument naming the metadata key or tensor at fault.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from batchlm.errors import InvalidArgument
from batchlm.model.gguf_header import TensorInfo, read_header
from batchlm.model.gguf_tokenizer import build_tokenizer

SUFFIX = ".gguf"
ARCHITECTURE = "llama"
# Tensor types read (dequantized to float32 at load); the K-quants are the ones llama.cpp's usual
# mixes (Q4_K_M, Q5_K_M, Q6_K) put in a llama file.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# The types batchlm::linear_q multiplies as stored (batchlm/model/quantized.py), by ggml's numbers.
QUANTIZED_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "BF16": 30}
ROPE_FREQS = "rope_freqs.weight"  # not a weight of the model: its RoPE's per-frequency divisors
_REQUIRED = object()


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; a folder is a Hugging Face checkpoint)."""
    return str(path).endswith(SUFFIX) and not Path(path).is_dir()


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> "GGUFFile":  # noqa: ARG001 - the key: a changed file is read anew
    return GGUFFile(path)


def open_gguf(path: str | Path) -> "GGUFFile":
    """The parsed file, shared by the callers of one process (config, tokenizer and weights each ask)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InvalidArgument("model_dir", f"no GGUF file at {path}") from None
    return _open(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._fields, self._tensors = read_header(self.path)
        except (ValueError, OSError, struct.error) as err:
            raise InvalidArgument("model_dir", f"{self.path} is not a readable GGUF file: {err}") from None
        arch = self.metadata("general.architecture")
        if arch != ARCHITECTURE:
            raise InvalidArgument("general.architecture",
                                  f"{arch!r} is not supported (supported: {ARCHITECTURE!r}) in {self.path.name}")

    def metadata(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of one metadata key; InvalidArgument naming it where it is missing and required."""
        if key not in self._fields:
            if default is _REQUIRED:
                raise InvalidArgument(key, f"missing from {self.path.name}")
            return default
        return self._fields[key]

    def _arch(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.metadata(f"{ARCHITECTURE}.{key}", default)

    # -- shape ------------------------------------------------------------------------------------

    @functools.cached_property
    def hf_config(self) -> dict:
        """The Hugging Face config.json this file stands for."""
        hidden, heads = int(self._arch("embedding_length")), int(self._arch("attention.head_count"))
        head_dim = int(self._arch("attention.key_length", hidden // heads))
        rope_dim = int(self._arch("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise InvalidArgument(f"{ARCHITECTURE}.rope.dimension_count",
                                  f"{rope_dim}: only RoPE over the whole head ({head_dim}) is supported")
        if int(self._arch("attention.value_length", head_dim)) != head_dim:
            raise InvalidArgument(f"{ARCHITECTURE}.attention.value_length", "must equal the key length")
        if int(self._arch("expert_count", 0)):
            raise InvalidArgument(f"{ARCHITECTURE}.expert_count", "mixture-of-experts models are not supported")
        tokens = self.metadata("tokenizer.ggml.tokens")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "vocab_size": int(self._arch("vocab_size", len(tokens))),
            "max_position_embeddings": int(self._arch("context_length")),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "rope_freq_factors": self._rope_freq_factors(),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon")),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": "silu",
        }

    def _rope_freq_factors(self) -> list[float] | None:
        """llama.cpp's converter writes llama3 RoPE scaling as a tensor of per-frequency divisors."""
        tensor = self._tensors.get(ROPE_FREQS)
        if tensor is None:
            return None
        if tensor.type_name != "F32":
            raise InvalidArgument(ROPE_FREQS, f"must be F32, got {tensor.type_name}")
        return self.tensor_bytes(tensor).view(np.float32).reshape(-1).astype(float).tolist()

    def _rope_scaling(self) -> dict | None:
        kind = self._arch("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise InvalidArgument(f"{ARCHITECTURE}.rope.scaling.type", f"{kind!r} is not supported (supported: linear)")
        return {"rope_type": "linear", "factor": float(self._arch("rope.scaling.factor"))}

    # -- weights ----------------------------------------------------------------------------------

    def weights(self) -> "GGUFWeights":
        return GGUFWeights(self)

    @functools.cached_property
    def _map(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def unmap(self) -> None:
        """Drop the file's mapping (mapped again if a tensor is read later): a loaded model holds copies, and
        the pages it touched would otherwise stay in the process's resident set."""
        self.__dict__.pop("_map", None)

    def tensor_bytes(self, tensor: "TensorInfo") -> np.ndarray:
        """The tensor's stored bytes (a read-only view of the mapped file), one row of blocks per row."""
        rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
        raw = self._map[tensor.offset:tensor.offset + tensor.nbytes]
        if raw.size != tensor.nbytes:
            raise InvalidArgument(tensor.name, f"the file ends inside its data ({raw.size} of {tensor.nbytes} bytes)")
        return raw.reshape(rows, tensor.nbytes // rows)

    def tensor_types(self) -> dict[str, int]:
        """Tensor type name -> how many tensors of it the file holds."""
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    # -- tokenizer --------------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        value = self.metadata("tokenizer.ggml.bos_token_id", None)
        return None if value is None else int(value)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation: EOS, and the end-of-turn and end-of-message tokens where named."""
        ids = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.metadata(f"tokenizer.ggml.{key}", None)
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        return tuple(ids)

    @property
    def add_bos(self) -> bool:
        """Whether encode puts BOS first: the file says, else llama.cpp's default for its tokenizer kind."""
        default = self.metadata("tokenizer.ggml.model") == "llama"
        return bool(self.metadata("tokenizer.ggml.add_bos_token", default)) and self.bos_token_id is not None

    @property
    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template", None)

    def special_token(self, token_id: int | None) -> str | None:
        tokens = self.metadata("tokenizer.ggml.tokens")
        return None if token_id is None or not 0 <= token_id < len(tokens) else tokens[token_id]

    def tokenizer(self):
        """A `tokenizers.Tokenizer` (byte-level BPE) with the file's vocabulary, merges and specials."""
        return build_tokenizer(self.metadata)


class GGUFWeights(Mapping):
    """Hugging Face tensor name -> float32 tensor, dequantized when read (one tensor at a time)."""

    def __init__(self, file: GGUFFile) -> None:
        self._file = file
        cfg = file.hf_config
        self._heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        self._names: dict[str, str] = {}
        for name in file._tensors:
            if name == ROPE_FREQS:  # read into the config (hf_config's rope_freq_factors)
                continue
            hf_name = _hf_name(name)
            if hf_name is None:
                raise InvalidArgument(name, f"tensor not part of a {ARCHITECTURE} model")
            self._names[hf_name] = name

    def __getitem__(self, hf_name: str) -> "torch.Tensor":  # noqa: F821 - torch is imported where a tensor is made
        if hf_name not in self._names:
            raise KeyError(f"tensor {hf_name!r} missing from {self._file.path.name}")
        import gguf

        tensor = self._file._tensors[self._names[hf_name]]
        if tensor.type_name not in SUPPORTED_TYPES:
            raise InvalidArgument(tensor.name, f"tensor type {tensor.type_name} is not supported "
                                               f"(supported: {', '.join(SUPPORTED_TYPES)})")
        values = gguf.quants.dequantize(self._file.tensor_bytes(tensor), gguf.GGMLQuantizationType[tensor.type_name])
        values = values.reshape(tensor.shape).astype(np.float32, copy=not values.flags.writeable)
        proj = hf_name.rsplit(".", 2)[-2]
        if proj in self._heads:
            values = _unpermute_rope_rows(values, self._heads[proj])
        import torch  # NOTE: here, not at the top: the tokenizer and config readers (Locust users) need no torch

        return torch.from_numpy(np.ascontiguousarray(values))

    def unmap(self) -> None:
        """See GGUFFile.unmap: once the model holds what it read."""
        self._file.unmap()

    def kept_type(self, hf_name: str) -> str | None:
        """The tensor's type if it is one of QUANTIZED_TYPES with rows of a multiple of 32 values (what
        `quantized` returns blocks for), else None."""
        if hf_name not in self._names:
            raise KeyError(f"tensor {hf_name!r} missing from {self._file.path.name}")
        tensor = self._file._tensors[self._names[hf_name]]
        return tensor.type_name if tensor.type_name in QUANTIZED_TYPES and tensor.shape[-1] % 32 == 0 else None

    @property
    def path(self) -> Path:
        return self._file.path

    def quantized(self, hf_name: str) -> tuple[str, np.ndarray] | None:
        """(type name, the stored blocks as a (rows, row bytes) uint8 copy in Hugging Face row order) where
        the tensor's type is one of QUANTIZED_TYPES; None for any other type."""
        if self.kept_type(hf_name) is None:  # not a type linear_q reads, or rows it cannot take 32 at a time
            return None
        tensor = self._file._tensors[self._names[hf_name]]
        # NOTE: read, not mapped: the mapped file's pages would stay resident beside the packed copy
        raw = np.fromfile(self._file.path, np.uint8, count=tensor.nbytes, offset=tensor.offset)
        if raw.size != tensor.nbytes:
            raise InvalidArgument(tensor.name, f"the file ends inside its data ({raw.size} of {tensor.nbytes} bytes)")
        raw = raw.reshape(tensor.shape[0], -1)  # (N, K / 32 blocks)
        proj = hf_name.rsplit(".", 2)[-2]
        if proj in self._heads:
            raw = np.ascontiguousarray(_unpermute_rope_rows(raw, self._heads[proj]))
        return tensor.type_name, raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Q and K rows back in Hugging Face order. llama.cpp's converter stores each head's rows as
    interleaved (even, odd) pairs, the order of its own RoPE, where this package (as Hugging Face) rotates
    the two halves of a head against each other."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.weight"
    return None
