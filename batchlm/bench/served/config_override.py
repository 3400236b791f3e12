"""Config overrides: one field of a model's config.pbtxt set to another value, for a benchmark run.

A tuning run changes one knob and keeps the rest of the model as shipped, so an override is a dotted
path into Triton's ModelConfig and a value, written as on a command line:

    dynamic_batching.max_queue_delay_microseconds=200000
    max_batch_size=4
    parameters.max_num_seqs=16          # a `parameters { key: ... }` entry's string_value
    instance_group.0.count=2            # a field of entry 0 of a list of messages
    dynamic_batching.preferred_batch_size=4 8   # a list of scalars, replaced whole (space-separated)

`overridden_repository` writes a one-model repository with the overrides applied, which a server can
load instead of the project's; the project's own files are never edited. Fields are checked against
Triton's protobuf schema here, with the field named in the error; whether Triton accepts the
combination (say, `dynamic_batching` with `max_batch_size: 0`) is Triton's to say when it loads.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2

_INTS = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
         FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
         FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32,
         FieldDescriptor.TYPE_SFIXED64}
_FLOATS = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE}


@dataclass(frozen=True)
class ConfigOverride:
    path: str   # dotted field path in ModelConfig; `parameters.<key>` for a parameter
    value: str  # as written; converted to the field's type by `apply`

    @classmethod
    def parse(cls, text: str) -> ConfigOverride:
        """`PATH=VALUE`; raises ValueError when either side is missing."""
        path, sep, value = text.partition("=")
        path = path.strip()
        if not sep or not path or not value.strip():
            raise ValueError(f"{text!r}: an override is PATH=VALUE, e.g. "
                             "dynamic_batching.max_queue_delay_microseconds=200000")
        return cls(path, value.strip())

    def apply(self, config: model_config_pb2.ModelConfig) -> None:
        """Set the field in `config`; raises ValueError naming the path when it cannot be set."""
        names = self.path.split(".")
        if names[0] == "parameters":
            if len(names) != 2 or not names[1]:
                raise ValueError(f"{self.path}: a parameter is parameters.<key>, e.g. parameters.max_num_seqs")
            config.parameters[names[1]].string_value = self.value
            return
        message = config
        i = 0
        while i < len(names):
            name = names[i]
            field = message.DESCRIPTOR.fields_by_name.get(name)
            where = ".".join(names[:i + 1])
            if field is None:
                known = ", ".join(sorted(message.DESCRIPTOR.fields_by_name))
                raise ValueError(f"{where}: {message.DESCRIPTOR.name} has no such field; it has {known}")
            last = i == len(names) - 1
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if last:
                    what = "a list of messages" if field.is_repeated else "a message"
                    hint = f"{where}.0.<field>" if field.is_repeated else f"{where}.<field>"
                    raise ValueError(f"{where}: {what}; set one of its fields ({hint})")
                if field.is_repeated:
                    if field.message_type.GetOptions().map_entry:
                        raise ValueError(f"{where}: a map; overrides set parameters.<key> only")
                    message = _entry(getattr(message, name), names[i + 1], where)
                    if i + 1 == len(names) - 1:
                        raise ValueError(f"{where}.{names[i + 1]}: an entry of {name}; set one of its "
                                         f"fields ({where}.{names[i + 1]}.<field>)")
                    i += 2
                    continue
                message = getattr(message, name)
                i += 1
                continue
            if not last:
                raise ValueError(f"{where}: {_type_name(field, article=True)}, not a message: {self.path} goes past it")
            if field.is_repeated:
                values = self.value.split()
                target = getattr(message, name)
                converted = [self._converted(field, where, v) for v in values]
                del target[:]
                target.extend(converted)
            else:
                setattr(message, name, self._converted(field, where, self.value))
            return

    @staticmethod
    def _converted(field: FieldDescriptor, where: str, value: str):
        try:
            if field.type in _INTS:
                return int(value)
            if field.type in _FLOATS:
                return float(value)
        except ValueError:
            raise ValueError(f"{where}: expects {_type_name(field, article=True)}, got {value!r}") from None
        if field.type == FieldDescriptor.TYPE_BOOL:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"{where}: expects true or false, got {value!r}")
            return value.lower() == "true"
        if field.type == FieldDescriptor.TYPE_ENUM:
            names = [v.name for v in field.enum_type.values]
            if value not in names:
                raise ValueError(f"{where}: expects one of {', '.join(names)}, got {value!r}")
            return field.enum_type.values_by_name[value].number
        if field.type == FieldDescriptor.TYPE_STRING:
            return value
        raise ValueError(f"{where}: {_type_name(field, article=True)} field; overrides cannot set it")


def _entry(entries, index: str, where: str):
    """Entry `index` (a decimal string) of a repeated message field; raises ValueError naming it."""
    if not index.isdigit():
        raise ValueError(f"{where}.{index}: {where} is a list; name an entry by its index ({where}.0)")
    if int(index) >= len(entries):
        have = f"entries 0 to {len(entries) - 1}" if entries else "no entries"
        raise ValueError(f"{where}.{index}: {where} has {have}; overrides change entries, they do not add them")
    return entries[int(index)]


def _type_name(field: FieldDescriptor, article: bool = False) -> str:
    if field.type in _INTS:
        name = "integer"
    elif field.type in _FLOATS:
        name = "number"
    else:
        name = {FieldDescriptor.TYPE_BOOL: "boolean", FieldDescriptor.TYPE_STRING: "string",
                FieldDescriptor.TYPE_ENUM: "enum", FieldDescriptor.TYPE_MESSAGE: "message"}.get(field.type, "bytes")
    if not article:
        return name
    return ("an " if name[0] in "aeiou" else "a ") + name


def overridden_config(config_text: str, overrides: list[ConfigOverride]) -> str:
    """`config_text` (config.pbtxt) with `overrides` applied, in protobuf text format."""
    config = text_format.Parse(config_text, model_config_pb2.ModelConfig())
    for override in overrides:
        override.apply(config)
    return text_format.MessageToString(config)


def overridden_repository(repository: Path, model: str, overrides: list[ConfigOverride], dest: Path) -> Path:
    """Write `dest`/`model`: the model's folder from `repository`, its config.pbtxt with `overrides` applied.

    Returns `dest`, a repository holding that one model. Raises ValueError before writing anything when
    an override does not fit the config. `dest` must not hold the model already.
    """
    source = repository / model
    text = overridden_config((source / "config.pbtxt").read_text(), overrides)
    target = dest / model
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    header = "".join(f"# override: {o.path}={o.value}\n" for o in overrides)
    (target / "config.pbtxt").write_text(f"# {model} from {source}, with overrides\n{header}{text}")
    return dest
