"""Chat messages -> one prompt: the checkpoint's chat template where it has one, else a plain one.

The checkpoint's template is `tokenizer.chat_template` in a GGUF file's metadata, or, in a Hugging Face
folder, `chat_template.jinja` (where transformers 5 saves it) or `chat_template` in tokenizer_config.json;
it is rendered with jinja2 in a sandbox, with `messages`, `add_generation_prompt=True`, `bos_token` and
`eos_token`, as Hugging Face renders it. The default model (SmolLM2-135M-Instruct) has ChatML's, the tiny
test checkpoint a small one of its own (batchlm/model/checkpoint.py, `DEFAULT_CHAT_TEMPLATE`).
A checkpoint without one, or one this process
cannot read (Triton on another machine), gets the plain template: one line `<role>: <content>` per
message, then `assistant:`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchlm.errors import InvalidArgument


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """The plain template: `system: Be brief.\\nuser: Hi\\nassistant:`."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template (`source` None: the plain template) and its special tokens."""

    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for `messages` (dicts with `role` and `content`); InvalidArgument naming `messages`
        if the template refuses them (its `raise_exception`) or cannot render."""
        if self.source is None:
            return plain_prompt(messages)
        import jinja2

        try:
            return _compiled(self.source).render(messages=messages, add_generation_prompt=True,
                                                 bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as exc:
            raise InvalidArgument("messages", f"the model's chat template refused them: {exc}") from None


def load_chat_template(model_dir: Path | None) -> ChatTemplate:
    """The template of the checkpoint at `model_dir` (a folder or a GGUF file; batchlm.model.tokenizer.
    chat_template_of); the plain one when there is none to read."""
    from batchlm.model.tokenizer import chat_template_of

    if model_dir is None:
        return ChatTemplate()
    source, bos, eos = chat_template_of(model_dir)
    return ChatTemplate() if source is None else ChatTemplate(source, bos, eos)


@lru_cache(maxsize=8)
def _compiled(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        from jinja2 import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
