"""The models the frontend serves, and what it reads of their checkpoints: each model's config (from
Triton), tokenizer, token texts and chat template, each read once per model.

    models = ServedModels(backend)
    info = await models.info("continuous_batching")     # ApiError 404 for a model not served
    models.tokenizer(info), models.template(info), models.token_texts(info)
    info = await models.info_or_shared(None)            # the one checkpoint every served model shares

Only the event loop's thread uses it (the caches are plain dicts).
"""

from __future__ import annotations

import asyncio

from batchlm.frontend import errors
from batchlm.frontend.token_text import TokenTexts
from batchlm.frontend.tokenize import load_tokenizer, tokenize
from batchlm.frontend.triton_client import ModelInfo, TritonBackend, TritonFailure
from batchlm.model.chat_template import ChatTemplate, load_chat_template
from batchlm.model.tokenizer import Tokenizer


class ServedModels:
    """The configs and checkpoint readers of the models `backend` serves."""

    def __init__(self, backend: TritonBackend) -> None:
        self.backend = backend
        self._tokenizers: dict[str, Tokenizer] = {}
        self._token_texts: dict[str, TokenTexts] = {}
        self._templates: dict[str, ChatTemplate] = {}

    async def info(self, model: str) -> ModelInfo:
        """The config of `model`; ApiError 404 where the frontend does not serve it, or Triton's error."""
        if model not in self.backend.models:
            raise errors.model_not_found(model, self.backend.models)
        try:
            return await self.backend.info(model)
        except TritonFailure as exc:
            raise errors.from_triton(exc.status, exc.message, (), {}) from None

    async def info_or_shared(self, model: str | None) -> ModelInfo:
        """`model`'s config; without one, that of the first model Triton has ready, where every ready
        model serves the same checkpoint (they do in the shipped repository), else ApiError 400 asking
        for `model`."""
        if model is not None:
            return await self.info(model)
        served = await self.backend.served()
        if not served:
            raise errors.not_ready(f"none of the models {', '.join(self.backend.models)} is ready")
        infos = [await self.info(name) for name in served]
        checkpoints = {info.model_dir for info in infos}
        if len(checkpoints) > 1:
            raise errors.invalid("model", f"is required: the served models ({', '.join(served)}) have different "
                                          "checkpoints, so name the one whose tokenizer to use")
        return infos[0]

    def tokenizer(self, info: ModelInfo, purpose: str = "tokenize for it") -> Tokenizer:
        """The model's tokenizer; ApiError 400 naming `model` where its checkpoint cannot be read here
        (the message says what the frontend cannot do then: `purpose`)."""
        if info.name not in self._tokenizers:
            self._tokenizers[info.name] = load_tokenizer(info.name, info.model_dir, purpose)
        return self._tokenizers[info.name]

    def token_texts(self, info: ModelInfo) -> TokenTexts:
        if info.name not in self._token_texts:
            tokenizer = self.tokenizer(info, "show the text of its tokens' log-probabilities")
            self._token_texts[info.name] = TokenTexts(tokenizer)
        return self._token_texts[info.name]

    def template(self, info: ModelInfo) -> ChatTemplate:
        if info.name not in self._templates:
            self._templates[info.name] = load_chat_template(info.model_dir)
        return self._templates[info.name]

    async def rest_of_context(self, info: ModelInfo, prompt: str, default: int) -> int:
        """A chat's default `max_tokens`, as OpenAI's: what is left of the model's context after `prompt`;
        `default` where the model's context or checkpoint is unknown here. A prompt that leaves nothing
        gets 1, which the model refuses naming the prompt."""
        if info.max_model_len is None or info.model_dir is None:
            return default
        ids = await asyncio.to_thread(tokenize, self.tokenizer(info), prompt, True)
        return max(1, info.max_model_len - len(ids))
