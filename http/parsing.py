"""Parsing OpenAI-style request bodies into generation requests.

Every field is validated before anything reaches the engine; a bad one is a
`BadRequest` naming the field (a 400 with an OpenAI-style error body).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcellar.engine.engine import LoadedModel, SamplingParams
from kvcellar.engine.generation import GenerationRequest
from kvcellar.errors import KvCellarError

MAX_TOKENS_DEFAULT = 256
MAX_TOKENS_LIMIT = 32768


class BadRequest(KvCellarError):
    """Raised for a request body the API cannot serve. The client's fault; it
    becomes a 400 naming the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@attrs.frozen(kw_only=True)
class CompletionJob:
    request: GenerationRequest
    stream: bool
    include_usage: bool
    chat: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}", param=name)
    return float(value)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"'{name}' must be an integer between 1 and {MAX_TOKENS_LIMIT}", param=name)
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stop)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}] needs a string 'role'", param=f"messages[{index}].role")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise BadRequest(f"messages[{index}].content must be a string", param=f"messages[{index}].content")
        parsed.append({"role": message["role"], "content": content})
    return parsed


def parse_job(body: Any, loaded: LoadedModel, *, chat: bool, max_tokens_default: int = MAX_TOKENS_DEFAULT,
              model_names: frozenset[str] = frozenset()) -> CompletionJob:
    """Validate a request body into a job; raises `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model_name = body.get("model")
    if model_name is not None and model_name not in model_names | _model_names(loaded):
        raise BadRequest(f"model {model_name!r} is not served here; see GET /v1/models", param="model")
    if body.get("n", 1) != 1:
        raise BadRequest("only 'n' = 1 is supported", param="n")
    tokenizer = loaded.tokenizer
    if chat:
        text = tokenizer.apply_chat_template(_messages(body), add_generation_prompt=True, tokenize=False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("'prompt' must be a non-empty string", param="prompt")
    prompt_ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    max_tokens = _max_tokens(body, max_tokens_default)
    if len(prompt_ids) + max_tokens > loaded.context_tokens_max:
        raise BadRequest(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                         f"model's context of {loaded.context_tokens_max} tokens", param="messages" if chat else "prompt")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", param="seed")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(tokenizer.eos_token_ids),
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    request = GenerationRequest(prompt_ids=prompt_ids, params=params, stop_strings=_stop_strings(body))
    return CompletionJob(request=request, stream=stream, include_usage=bool(stream_options.get("include_usage")),
                         chat=chat)


def _model_names(loaded: LoadedModel) -> frozenset[str]:
    return frozenset({loaded.model_dir.name, str(loaded.model_dir)})
