"""The tokenizer routes, in vLLM's shapes, at the server's root: the ids a model's engine makes of a prompt
(BOS included where the checkpoint asks for it, as the engine adds it), the text of ids, and the
tokenizer's special tokens and chat template.

    POST /tokenize    {"model": M, "prompt": "Hi"}       -> {"count": 2, "max_model_len": 1024, "tokens": [1, 9]}
    POST /tokenize    {"model": M, "messages": [...]}    -> the same for the chat template's prompt
    POST /detokenize  {"model": M, "tokens": [1, 9]}     -> {"prompt": "Hi"}
    GET  /tokenizer_info[?model=M]                       -> {"eos_token", "bos_token", "pad_token",
                                                             "chat_template", "model_max_length", ...}

`model` may be left out (lm-evaluation-harness' remote tokenizer sends none): then the tokenizer is that
of the checkpoint every served model shares, and a 400 names `model` where they do not share one
(served_models.py). The tokenizer is the checkpoint's that the model's config names, read where this
process can read it (as the chat template is); a model served from a checkpoint the frontend cannot
read is a 400 naming `model`. With an API key, these routes ask for it as the `/v1` routes do.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Request

from batchlm.errors import InvalidArgument
from batchlm.frontend.errors import invalid
from batchlm.frontend.protocol import DetokenizeRequest, TokenizeRequest, template_messages
from batchlm.model.tokenizer import Tokenizer

router = APIRouter()


def load_tokenizer(model: str, model_dir: Path | None, purpose: str = "tokenize for it") -> Tokenizer:
    """The tokenizer of the checkpoint at `model_dir`; ApiError 400 naming `model` where there is none
    this process can read (its message says what the frontend cannot do then: `purpose`)."""
    if model_dir is None:
        raise invalid("model", f"{model}'s checkpoint cannot be read where the frontend runs, so it cannot "
                               f"{purpose}")
    return Tokenizer.from_dir(model_dir)


def tokenize(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    ids = tokenizer.encode(text)
    return ids if add_special_tokens or not tokenizer.add_bos else ids[1:]


def detokenize(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens`; ApiError 400 naming `tokens` for an id outside the vocabulary."""
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise invalid("tokens", f"ids must be in [0, {tokenizer.vocab_size}), got {bad[:8]}")
    return tokenizer.decode(tokens)


def tokenizer_info(tokenizer: Tokenizer, model_dir: Path, max_model_len: int | None) -> dict:
    """vLLM's `/tokenizer_info`: the special tokens' texts (None where the checkpoint has none), the chat
    template's source (None: the frontend renders its plain one) and the context length."""
    from batchlm.model.tokenizer import chat_template_of

    template, bos, eos = chat_template_of(model_dir)
    hf = tokenizer.hf
    if not bos and tokenizer.bos_token_id is not None:
        bos = hf.id_to_token(tokenizer.bos_token_id)
    if not eos and tokenizer.eos_token_ids:
        eos = hf.id_to_token(min(tokenizer.eos_token_ids))
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos or None, "eos_token": eos or None,
            "pad_token": _pad_token(model_dir), "add_bos_token": tokenizer.add_bos, "chat_template": template,
            "model_max_length": max_model_len}


def _pad_token(model_dir: Path) -> str | None:
    from batchlm.model.gguf_file import is_gguf, open_gguf

    if is_gguf(model_dir):
        gguf = open_gguf(model_dir)
        pad = gguf.metadata("tokenizer.ggml.padding_token_id", None)
        return None if pad is None else gguf.special_token(int(pad))
    try:
        pad = json.loads((model_dir / "tokenizer_config.json").read_text()).get("pad_token")
    except (OSError, ValueError):
        return None
    if isinstance(pad, dict):  # older tokenizer_config.json: {"content": "<pad>", ...}
        pad = pad.get("content")
    return pad if isinstance(pad, str) else None


@router.post("/tokenize")
async def tokenize_route(request: Request, body: TokenizeRequest) -> dict:
    models = request.app.state.models
    info = await models.info_or_shared(body.model)
    tokenizer = models.tokenizer(info)
    text = body.prompt
    if body.messages is not None:
        try:
            text = models.template(info).render(template_messages(body.messages))
        except InvalidArgument as exc:
            raise invalid(exc.field, exc.message) from None
    tokens = await asyncio.to_thread(tokenize, tokenizer, text, body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens, "token_strs": None}


@router.post("/detokenize")
async def detokenize_route(request: Request, body: DetokenizeRequest) -> dict:
    models = request.app.state.models
    info = await models.info_or_shared(body.model)
    return {"prompt": detokenize(models.tokenizer(info), body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info_route(request: Request, model: str | None = None) -> dict:
    models = request.app.state.models
    info = await models.info_or_shared(model)
    tokenizer = models.tokenizer(info, "describe its tokenizer")
    return await asyncio.to_thread(tokenizer_info, tokenizer, info.model_dir, info.max_model_len)
