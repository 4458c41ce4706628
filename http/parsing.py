"""Parsing OpenAI-style request bodies into generation requests.

Every field is validated before anything reaches the engine (fields this
server does not know are ignored, as OpenAI does); a bad one is a
`BadRequest` naming the field (a 400 with an OpenAI-style error body): also a
chat template that refuses the messages (param `messages`) and a content part
that is not text (param `messages[i].content[j]`; this server serves text
models only, so an image or audio part is refused rather than dropped).

`parse_body` decodes the JSON, renders the chat template and tokenizes: work
that grows with the prompt, so the HTTP routes run it through
`TokenizerLane.parse_body` on a worker thread and the Trio thread never blocks
on it. The tokenizer is not MLX, so any thread may encode; the lane (a
capacity limiter of 1) keeps the HTTP side's encodes one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import attrs
import trio

from kvcellar.engine.engine import LoadedModel, SamplingParams
from kvcellar.engine.forcing import ForcedTokens
from kvcellar.engine.generation import GenerationRequest
from kvcellar.engine.structured import compile_response_grammar
from kvcellar.engine.tool_calls import offered_tool_names
from kvcellar.errors import BadRequest, GrammarError, PromptRefused, StrictToolsRefused, UnknownModel
from kvcellar.http.inbound import MAX_TOKENS_LIMIT, InboundPolicy, Intake
from kvcellar.http.tenancy import body_namespace
from kvcellar.http.tool_grammar import ToolGrammarPolicy
from kvcellar.http.tools import NO_TOOLS, TOOL_CHOICES, RenderedPrompt, ToolPlan, render_prompt

T = TypeVar("T")

MAX_TOKENS_DEFAULT = 256


@attrs.frozen(kw_only=True)
class CompletionJob:
    request: GenerationRequest
    stream: bool
    include_usage: bool
    chat: bool
    # What the reply shaping needs of the chat (http/tools.py).
    tools: ToolPlan = NO_TOOLS
    reply_in_reasoning: bool = False

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


def _max_tokens(body: dict[str, Any], default: int) -> tuple[int, str]:
    """The reply's upper bound as asked (clamped later, `Intake.grant_max_tokens`), and its field's name."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return default, name
    return positive_bound(value, name), name


def positive_bound(value: Any, name: str) -> int:
    """A reply bound field: any positive integer (an upper bound, clamped to what the context leaves)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(
            f"'{name}' must be a positive integer (an upper bound: the reply gets at most what the context "
            f"leaves after the prompt, and at most {MAX_TOKENS_LIMIT})",
            param=name,
        )
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


def _text_parts(parts: list[Any], index: int) -> str:
    """The text of a content given as a list of parts; any part that is not
    text (`image_url`, `input_audio`, ...) is refused, naming it."""
    texts = []
    for part_index, part in enumerate(parts):
        param = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, dict):
            raise BadRequest(f"{param} must be an object", param=param)
        kind = part.get("type", "text")
        if kind != "text":
            raise BadRequest(
                f"{param} is a {kind!r} part; this server serves a text-only model and accepts only 'text' parts",
                param=param,
            )
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{param} needs a string 'text'", param=param)
        texts.append(part["text"])
    return "".join(texts)


def parse_job(
    body: Any,
    loaded: LoadedModel,
    *,
    chat: bool,
    max_tokens_default: int = MAX_TOKENS_DEFAULT,
    model_names: frozenset[str] = frozenset(),
    tool_grammar: ToolGrammarPolicy | None = None,
    intake: Intake | None = None,
    api: str = "",
    namespace: str = "",
) -> CompletionJob:
    """Validate a request body into a job; raises `BadRequest` naming the field.
    `tool_grammar`: the server's tool-call grammar policy (None: none);
    `intake`: what this request's parsing changed so far (http/inbound.py);
    `namespace`: the caller's cache namespace, which the body's `cache_salt` splits (http/tenancy.py)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request_namespace = body_namespace(body, namespace)
    _check_model(body.get("model"), loaded, model_names)
    if body.get("n", 1) != 1:
        raise BadRequest("only 'n' = 1 is supported", param="n")
    tokenizer = loaded.tokenizer
    intake = intake or InboundPolicy().intake()
    rendered, tool_plan = None, NO_TOOLS
    if chat:
        rendered, tool_plan = chat_prompt(body, tokenizer, intake)
        prompt_ids = rendered.prompt_ids
    else:
        prompt_ids = _completion_prompt_ids(body, tokenizer)
    max_tokens_asked, max_tokens_field = _max_tokens(body, max_tokens_default)
    max_tokens = intake.grant_max_tokens(
        max_tokens_asked,
        prompt_tokens=len(prompt_ids),
        context_tokens_max=loaded.context_tokens_max,
        # The Responses API hands its `max_output_tokens` over as `max_tokens`.
        field="max_output_tokens" if api == "responses" else max_tokens_field,
        prompt_param="messages" if chat else "prompt",
    )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", param="seed")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(tokenizer.eos_token_ids),
        **sampling_fields(body, loaded, chat=chat),
    )
    stream, include_usage = _stream_fields(body)
    processors, relaxed = reply_processors(tool_grammar, tokenizer, tool_plan, rendered)
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        params=params,
        stop_strings=_stop_strings(body),
        logits_processors=processors,
        snapshot_at_tokens=rendered.snapshot_at_tokens if rendered else None,
        notes=intake.notes(api or ("chat.completions" if chat else "completions"), schema_keywords_relaxed=relaxed),
        namespace=request_namespace,
    )
    return CompletionJob(
        request=request,
        stream=stream,
        include_usage=include_usage,
        chat=chat,
        tools=tool_plan,
        reply_in_reasoning=bool(rendered and rendered.in_reasoning),
    )


def _check_model(model_name: Any, loaded: LoadedModel, model_names: frozenset[str]) -> None:
    """A 404 (`UnknownModel`, as OpenAI answers it) for a model this server does not serve."""
    if model_name is not None and model_name not in model_names | _model_names(loaded):
        raise UnknownModel(
            f"model {model_name!r} is not served here: this server serves {loaded.model_dir.name!r} "
            "(GET /v1/models); set your client's model to that name (Codex: model = ... in config.toml)",
            served=(loaded.model_dir.name,),
        )


def _completion_prompt_ids(body: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    text = body.get("prompt")
    if not isinstance(text, str) or not text:
        raise BadRequest("'prompt' must be a non-empty string", param="prompt")
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    """`stream` and `stream_options.include_usage`, checked."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return stream, bool(stream_options.get("include_usage"))


# -- sampling and output fields (engine/sampling.py applies them) -------------------

TOP_LOGPROBS_MAX = 20
COMPLETION_LOGPROBS_MAX = 5
LOGIT_BIAS_MAX = 100.0
PENALTY_MAX = 2.0


def sampling_fields(body: dict[str, Any], loaded: LoadedModel, *, chat: bool) -> dict[str, Any]:
    """The `SamplingParams` fields beyond temperature/top_p/seed: top-k, min-p,
    the penalties, `logit_bias`, log-probabilities and `response_format`.
    `user` is accepted and ignored (it must still be a string)."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", param="user")
    vocab_tokens = _vocab_tokens(loaded)
    logprobs, top_logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    return {
        "top_k": _top_k(body, vocab_tokens),
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "repetition_penalty": _repetition_penalty(body),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -PENALTY_MAX, PENALTY_MAX),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -PENALTY_MAX, PENALTY_MAX),
        "logit_bias": _logit_bias(body, vocab_tokens),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "grammar": _response_format(body, loaded.tokenizer),
    }


def _vocab_tokens(loaded: LoadedModel) -> int:
    """The width of the model's logits (its embedding rows), else the tokenizer's vocabulary."""
    vocab = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else len(loaded.tokenizer.get_vocab())


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    return value


def _top_k(body: dict[str, Any], vocab_tokens: int) -> int:
    """0 (or -1, as vLLM spells it) keeps every token; k at or past the vocabulary too."""
    top_k = _integer(body, "top_k")
    if top_k is None:
        return 0
    if top_k < -1:
        raise BadRequest("'top_k' must be a positive integer, or 0 or -1 for no limit", param="top_k")
    return top_k if 0 < top_k < vocab_tokens else 0


def _repetition_penalty(body: dict[str, Any]) -> float | None:
    value = body.get("repetition_penalty")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 10:
        raise BadRequest(
            "'repetition_penalty' must be a number > 0 and at most 10 (1 is none)", param="repetition_penalty"
        )
    return None if value == 1 else float(value)


def _logit_bias(body: dict[str, Any], vocab_tokens: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must map token ids to numbers", param="logit_bias")
    entries = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token_id < vocab_tokens:
            raise BadRequest(
                f"'logit_bias' token id {token_id} is outside the vocabulary (0..{vocab_tokens - 1})",
                param="logit_bias",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX
        ):
            raise BadRequest(
                f"'logit_bias' value for {key!r} must be a number between -100 and 100", param="logit_bias"
            )
        entries.append((token_id, float(value)))
    return tuple(sorted(entries))


def _chat_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("'logprobs' must be a boolean", param="logprobs")
    top_logprobs = _integer(body, "top_logprobs")
    if top_logprobs is None:
        return bool(logprobs), 0
    if not 0 <= top_logprobs <= TOP_LOGPROBS_MAX:
        raise BadRequest(f"'top_logprobs' must be an integer between 0 and {TOP_LOGPROBS_MAX}", param="top_logprobs")
    if not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return True, top_logprobs


def _completion_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """The legacy completions field: an integer, the number of alternatives per token."""
    logprobs = _integer(body, "logprobs")
    if logprobs is None:
        return False, 0
    if not 0 <= logprobs <= COMPLETION_LOGPROBS_MAX:
        raise BadRequest(f"'logprobs' must be an integer between 0 and {COMPLETION_LOGPROBS_MAX}", param="logprobs")
    return True, logprobs


def _response_format(body: dict[str, Any], tokenizer: Any) -> str | None:
    """llguidance's grammar for `json_object` (any JSON object) or
    `json_schema` (JSON valid against `json_schema.schema`); None for text."""
    response_format = body.get("response_format")
    if response_format is None:
        return None
    param = "response_format"
    if not isinstance(response_format, dict):
        raise BadRequest("'response_format' must be an object", param=param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = None
    elif kind == "json_schema":
        schema = _json_schema(response_format.get("json_schema"))
    else:
        raise BadRequest(
            f"'response_format.type' {kind!r} is not one of 'text', 'json_object', 'json_schema'", param=param
        )
    try:
        return compile_response_grammar(tokenizer, schema)
    except GrammarError as e:
        raise BadRequest(f"'response_format' cannot be served: {e}", param=param) from e


def _json_schema(spec: Any) -> dict[str, Any]:
    param = "response_format"
    if not isinstance(spec, dict):
        raise BadRequest("'response_format.json_schema' must be an object", param=param)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise BadRequest("'response_format.json_schema.name' must be a non-empty string", param=param)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadRequest("'response_format.json_schema.strict' must be a boolean", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object", param=param)
    return schema


def parse_body(
    raw: bytes,
    loaded: LoadedModel,
    *,
    chat: bool,
    max_tokens_default: int = MAX_TOKENS_DEFAULT,
    model_names: frozenset[str] = frozenset(),
    tool_grammar: ToolGrammarPolicy | None = None,
    inbound: InboundPolicy | None = None,
    namespace: str = "",
) -> CompletionJob:
    """Decode a raw request body and validate it into a job; raises `BadRequest`."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest("the request body is not valid UTF-8") from e
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    return parse_job(
        body,
        loaded,
        chat=chat,
        max_tokens_default=max_tokens_default,
        model_names=model_names,
        tool_grammar=tool_grammar,
        intake=(inbound or InboundPolicy()).intake(),
        namespace=namespace,
    )


class TokenizerLane:
    """The worker-thread lane for `parse_body`. One at a time: the Hugging Face
    tokenizer is not documented as safe for concurrent encodes. `tool_grammar`
    is the server's tool-call grammar policy, which every API's parser asks;
    `inbound` what the server accepts, clamps and rewrites (http/inbound.py)."""

    def __init__(self, tool_grammar: ToolGrammarPolicy | None = None, inbound: InboundPolicy | None = None) -> None:
        self._limiter = trio.CapacityLimiter(1)
        self.tool_grammar = tool_grammar
        self.inbound = inbound or InboundPolicy()

    async def parse_body(
        self,
        raw: bytes,
        loaded: LoadedModel,
        *,
        chat: bool,
        max_tokens_default: int = MAX_TOKENS_DEFAULT,
        namespace: str = "",
    ) -> CompletionJob:
        """`parse_body` on a worker thread; `BadRequest` comes back as raised."""
        return await self.run(
            partial(
                parse_body,
                raw,
                loaded,
                chat=chat,
                max_tokens_default=max_tokens_default,
                tool_grammar=self.tool_grammar,
                inbound=self.inbound,
                namespace=namespace,
            )
        )

    async def run(self, work: Callable[[], T]) -> T:
        """Any parsing, rendering or tokenizer work (another API's body parser,
        a decode) on the lane's worker thread; what it raises comes back raised."""
        return await trio.to_thread.run_sync(work, limiter=self._limiter)


def _model_names(loaded: LoadedModel) -> frozenset[str]:
    return frozenset({loaded.model_dir.name, str(loaded.model_dir)})


# -- chat messages and tools (http/tools.py renders and parses) -------------------


def chat_prompt(body: dict[str, Any], tokenizer: Any, intake: Intake) -> tuple[RenderedPrompt, ToolPlan]:
    """The chat's messages and tools rendered through the model's template,
    and the tool plan the reply is parsed with; raises `BadRequest`."""
    plan = tool_plan(body, intake)
    try:
        # The template probe finds where the prompt-boundary snapshot goes (engine/generation.py).
        return render_prompt(tokenizer, chat_messages(body, intake), plan, probe=True), plan
    except PromptRefused as e:
        raise BadRequest(str(e), param=e.param) from e


def forced_reply_start(rendered: RenderedPrompt | None) -> tuple[Any, ...]:
    """The logits processor a `required` or named tool choice forces the reply's start with."""
    if rendered is None or not rendered.forced_ids:
        return ()
    return (partial(ForcedTokens, rendered.forced_ids),)


def tool_grammar_processors(
    policy: ToolGrammarPolicy | None, tokenizer: Any, plan: ToolPlan
) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """The tool-call grammar's processor for a request (() when it gets none)
    and the schema keywords relaxed to compile it; a strict tool whose schema
    cannot be enforced is a 400 naming `tools`."""
    if policy is None:
        return (), ()
    try:
        return policy.grammar_for(tokenizer, plan)
    except StrictToolsRefused as e:
        raise BadRequest(str(e), param="tools") from e


def reply_processors(
    policy: ToolGrammarPolicy | None, tokenizer: Any, plan: ToolPlan, rendered: RenderedPrompt | None
) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """The reply's own processors: the forced start of a `required` or named
    tool choice, and the tool-call grammar. With the grammar only the start
    marker is forced and the grammar writes the rest (a named choice allows one
    name): llguidance allows a forced stretch only in its own tokenization,
    which need not be the tokenizer's encoding of the forced text. Also the
    schema keywords relaxed to compile the grammar."""
    grammar, relaxed = tool_grammar_processors(policy, tokenizer, plan)
    if not grammar:
        return forced_reply_start(rendered), relaxed
    if rendered is not None and rendered.forced_ids:
        marker_ids = tuple(tokenizer.encode(tokenizer.tool_call_start, add_special_tokens=False))
        return (partial(ForcedTokens, marker_ids), *grammar), relaxed
    return grammar, relaxed


def chat_messages(body: dict[str, Any], intake: Intake) -> list[dict[str, Any]]:
    """OpenAI chat messages in the chat-template shape: content as text (a
    string or text parts; null for an assistant turn), an assistant's
    `tool_calls` with their arguments as objects, its `reasoning_content`,
    a tool result's `tool_call_id`. System (and developer) messages may come
    anywhere (render_prompt places them); the normalisation rules rewrite
    their text (http/prompt_rules.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    parsed = [_chat_message(message, index) for index, message in enumerate(messages)]
    for message in parsed:
        if message["role"] == "system":
            message["content"] = intake.normalize_system(message["content"])
    return parsed


def _chat_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{index}] needs a string 'role'", param=f"messages[{index}].role")
    role = message["role"]
    content = message.get("content")
    if isinstance(content, list):
        content = _text_parts(content, index)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise BadRequest(
            f"messages[{index}].content must be a string or a list of text parts", param=f"messages[{index}].content"
        )
    parsed: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            parsed["tool_calls"] = _message_tool_calls(message["tool_calls"], index)
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            parsed["reasoning_content"] = reasoning
    elif role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(
                f"messages[{index}] is a tool result and needs a string 'tool_call_id'",
                param=f"messages[{index}].tool_call_id",
            )
        parsed["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            parsed["name"] = message["name"]
    return parsed


def _message_tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant turn's calls; arguments arrive as a JSON string (OpenAI's
    shape) and go to the template as an object (templates apply `tojson`)."""
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise BadRequest(f"{param} must be a list", param=param)
    parsed = []
    for call_index, call in enumerate(calls):
        where = f"{param}[{call_index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{where} needs a 'function' with a string 'name'", param=f"{where}.function")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise BadRequest(
                    f"{where}.function.arguments is not valid JSON: {e}", param=f"{where}.function.arguments"
                ) from e
        if not isinstance(arguments, dict):
            raise BadRequest(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments")
        parsed.append(
            {
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{index}_{call_index}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return parsed


def tool_plan(body: dict[str, Any], intake: Intake) -> ToolPlan:
    """`tools`, `tool_choice` and `parallel_tool_calls`; `tool_choice: "none"`
    renders no tools (the template never shows them to the model)."""
    tools = _function_tools(body.get("tools"), intake)
    choice, function_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if not tools or choice == "none":
        return ToolPlan(choice="none")
    strict = any(tool["function"].get("strict") is True for tool in tools)
    return ToolPlan(
        tools=tools, choice=choice, function_name=function_name, parallel=parallel is not False, strict=strict
    )


def _function_tools(tools: Any, intake: Intake) -> tuple[dict[str, Any], ...]:
    """The function tools; any other type (a hosted tool) goes to `intake.hosted_tool`."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", param="tools")
    parsed = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise BadRequest(
                f"{param} must be a function tool ({{'type': 'function', 'function': {{...}}}})", param=param
            )
        kind = tool.get("type", "function")
        if kind != "function":
            intake.hosted_tool(str(kind), str(tool.get("name") or kind), param=param)
            continue
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"{param}.function needs a non-empty string 'name'", param=f"{param}.function.name")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise BadRequest(
                f"{param}.function.parameters must be a JSON schema object", param=f"{param}.function.parameters"
            )
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise BadRequest(f"{param}.function.strict must be a boolean", param=f"{param}.function.strict")
        parsed.append({"type": "function", "function": function})
    return tuple(parsed)


def _tool_choice(choice: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    """("auto" | "none" | "required" | "function", the named function or None)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise BadRequest(
                f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a named function", param="tool_choice"
            )
        if choice == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs 'tools'", param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise BadRequest(
            "a named 'tool_choice' is {'type': 'function', 'function': {'name': ...}}", param="tool_choice"
        )
    if name not in offered_tool_names(tools):
        raise BadRequest(f"tool_choice names {name!r}, which is not one of 'tools'", param="tool_choice")
    return "function", name
