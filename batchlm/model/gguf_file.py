"""A GGUF file of the llama architecture as a checkpoint: shape, weights, tokenizer and chat template.

One file holds everything a Hugging Face folder spreads over config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. `GGUFFile` reads it with the `gguf` package (the format's own
library, which memory-maps the file) and presents it in the names the rest of the package reads:
`hf_config()` is a config.json dict, `weights()` a name -> float32 tensor mapping in Hugging Face names
(quantized tensors dequantized at load), `tokenizer()` a `tokenizers.Tokenizer`. Writing one, and writing
one as a Hugging Face folder: batchlm/model/gguf_export.py. Anything this package
cannot run is refused with InvalidArgument naming the metadata key or tensor at fault.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchlm.errors import InvalidArgument

SUFFIX = ".gguf"
ARCHITECTURE = "llama"
# Tensor types read (dequantized to float32 at load); the K-quants are the ones llama.cpp's usual
# mixes (Q4_K_M, Q5_K_M, Q6_K) put in a llama file.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`: the regex a word is split with before BPE, and
# whether digits are first split one by one. None: GPT-2's own regex (inside the ByteLevel step).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False), "gpt2": (None, False), "gpt-2": (None, False),
    "smollm": (None, True),
    "llama3": (_LLAMA3_SPLIT, False), "llama-v3": (_LLAMA3_SPLIT, False), "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
}
ROPE_FREQS = "rope_freqs.weight"  # not a weight of the model: its RoPE's per-frequency divisors
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)
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
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = self.metadata("tokenizer.ggml.model")
        if kind != "gpt2":
            raise InvalidArgument("tokenizer.ggml.model",
                                  f"{kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
        pre = self.metadata("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise InvalidArgument("tokenizer.ggml.pre",
                                  f"{pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})")
        tokens = self.metadata("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.metadata("tokenizer.ggml.merges")]
        split, digits = PRE_TOKENIZERS[pre]
        hf = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                  ignore_merges=split is _LLAMA3_SPLIT))
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        if split is None:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        hf.decoder = decoders.ByteLevel()
        types = self.metadata("tokenizer.ggml.token_type", [])
        # NOTE: control tokens (<|im_start|>, ...) are matched whole in text and skipped when decoding;
        # user-defined ones are matched whole and kept, as llama.cpp treats them
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                               for i, kind in enumerate(types) if kind == _CONTROL])
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                       for i, kind in enumerate(types) if kind == _USER_DEFINED])
        return hf


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


# -- the file's layout (GGUF v2/v3, little-endian) ---------------------------------------------------
# NOTE: read here rather than with gguf.GGUFReader, which builds a Python object per array element:
# seconds for the ~98k strings of a 49k-token vocabulary and its merges, where this reads them at once.

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType's name ("Q4_1")
    shape: tuple[int, ...]  # numpy order: (rows, columns) for a matrix
    offset: int  # bytes from the start of the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata (key -> value; arrays as lists) and the tensors' layout, read from `path`."""
    import gguf

    with open(path, "rb") as f:
        data = f.read(1 << 20)
        reader = _Cursor(f, data)
        if reader.take(4) != _MAGIC:
            raise ValueError("no GGUF magic at the start")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_fields = reader.scalar("<Q"), reader.scalar("<Q")
        fields = {}
        for _ in range(n_fields):
            key = reader.string()
            fields[key] = reader.value(reader.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = reader.string()
            dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
            kind, offset = reader.scalar("<I"), reader.scalar("<Q")
            infos.append((name, dims, kind, offset))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-reader.position // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise InvalidArgument(name, f"tensor type {kind} is unknown to the gguf package") from None
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        shape = tuple(int(d) for d in reversed(dims))
        tensors[name] = TensorInfo(name, qtype.name, shape, start + offset, count // block * size)
    return fields, tensors


class _Cursor:
    """Reads GGUF's little-endian values from a file, a buffer at a time."""

    def __init__(self, f, data: bytes) -> None:
        self._f, self._data, self._pos, self._base = f, data, 0, 0

    @property
    def position(self) -> int:
        return self._base + self._pos

    def take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            self._base += self._pos
            self._data = self._data[self._pos:] + self._f.read(max(n, 1 << 20))
            self._pos = 0
            if n > len(self._data):
                raise ValueError("the file ends inside its header")
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                width = struct.calcsize(fmt)
                return np.frombuffer(self.take(width * count), dtype=np.dtype(fmt)).tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"metadata value type {kind} is unknown")
        value = self.scalar(_SCALARS[kind])
        # NOTE: a float32 as the shortest decimal that reads back as it (1e-05, not 9.999999747378752e-06),
        # the number the model's config.json had; equal once cast to float32 again
        return float(str(np.float32(value))) if kind == _FLOAT32 else value
