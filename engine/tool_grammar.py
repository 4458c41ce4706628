"""The tool-call grammar: a lazy llguidance constraint on a reply's tool calls.

llama.cpp calls the idea "lazy grammars": the reply runs free until the
model writes the tool-call start marker; from there on every token must keep
the text inside the grammar of one call in mlx-lm's JSON tool format
(`mlx_lm.tool_parsers.json_tools`)::

    <tool_call>
    {"name": NAME, "arguments": {...}}
    </tool_call>

where NAME is one of the offered tools' names (a `const` per tool, an
`anyOf` over the tools, `name` first) and the arguments follow that tool's
`parameters` JSON schema; the end marker closes it. Then the constraint is
released: free text again, where another call may start (constrained the
same way), or, when the request allows one call only, nothing but the
end-of-turn tokens.

`compile_tool_call_grammar` (the HTTP worker thread) makes llguidance's
serialized grammar (an immutable string, validated against the token table)
and keeps the last few in a small LRU keyed by (tokenizer, tools JSON,
function name): agents send the same tools on every turn.
`ToolCallGrammarMask` is a logits processor with mlx-lm's
`(tokens, logits) -> logits` shape, built per generation on the engine
thread from a `ToolCallGrammar`, so it runs unchanged in the serial lane and
as a batch row's processor. Its phases are an Enum with one transition
table; its matcher is its own, never shared.

The start marker is found in the decoded text of the generated tail (the
token table's bytes, special tokens included), so a marker that is several
tokens triggers as well as a single added token. A marker whose last token
carries more text after it (a merge such as `<tool_call>\\n` in one token) is
not found; the call is then parsed as the model wrote it.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask

from kvcellar.engine.scalars import item_int
from kvcellar.engine.structured import masked_logits, matcher_allowed_tokens, token_table
from kvcellar.errors import GrammarError

log = logging.getLogger("kvcellar.engine.tool_grammar")

JSON_TOOLS_MODULE = "mlx_lm.tool_parsers.json_tools"
# The separators of mlx-lm's and the templates' `json.dumps` (and of the forced
# prefix, http/tools.py): a fixed layout, so a small model spends no tokens on whitespace.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# OpenAI: a function without `parameters` takes an empty parameter list.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
GRAMMAR_CACHE_ENTRIES = 16


@attrs.frozen(kw_only=True)
class ToolCallGrammar:
    """What a generation's `ToolCallGrammarMask` is built from: the grammar of
    one call after the start marker (body and end marker), the start marker's
    text, and whether another call may follow the first."""

    grammar: str
    start_marker: str
    parallel: bool


def uses_json_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's tool parser is mlx-lm's JSON format (the one this grammar writes)."""
    parser = getattr(tokenizer, "tool_parser", None)
    markers = (getattr(tokenizer, "tool_call_start", ""), getattr(tokenizer, "tool_call_end", ""))
    return getattr(parser, "__module__", "") == JSON_TOOLS_MODULE and all(markers)


def call_schema(tools: Sequence[dict[str, Any]], function_name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call's object: an `anyOf` with one branch per
    tool (only `function_name`'s when named), `name` a const, then `arguments`."""
    branches = []
    for tool in tools:
        function = tool["function"]
        if function_name is not None and function["name"] != function_name:
            continue
        parameters = function.get("parameters") or _NO_PARAMETERS
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"x-guidance": _JSON_LAYOUT, "anyOf": branches}


def _marker_terminal(tokenizer: Any, table: llguidance.LLTokenizer, marker: str) -> str:
    """The Lark terminal for a marker: a special token by id (its bytes are not
    text to llguidance), anything else as a string literal."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) == 1 and table.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(marker)


def compile_tool_call_grammar(tokenizer: Any, tools: Sequence[dict[str, Any]], function_name: str | None = None) -> str:
    """The grammar of the text after the start marker: a newline, one call
    object, a newline, the end marker. Raises `GrammarError` saying why a
    schema cannot be compiled. Cached (bounded LRU)."""
    tools_json = json.dumps(list(tools), sort_keys=True)
    return _compile_cached(tokenizer, tools_json, function_name, False)


@attrs.frozen(kw_only=True)
class RelaxedToolGrammar:
    """A tool-call grammar and what was relaxed to compile it: the JSON-schema
    keywords llguidance does not implement (dropped, the rest of each schema
    kept), `pattern` for regexes it cannot take, and `parameters` for a tool
    whose schema it could not take at all (its arguments then any JSON
    object, its name still one of the offered ones). () when nothing was."""

    grammar: str
    relaxed: tuple[str, ...]


def compile_relaxed_tool_call_grammar(
    tokenizer: Any, tools: Sequence[dict[str, Any]], function_name: str | None = None
) -> RelaxedToolGrammar:
    """`compile_tool_call_grammar`, relaxing what llguidance cannot take
    instead of failing (see `RelaxedToolGrammar`); raises `GrammarError` only
    when even the relaxed grammar does not compile. Cached (bounded LRU)."""
    tools_json = json.dumps(list(tools), sort_keys=True)
    return _relaxed_cached(tokenizer, tools_json, function_name)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_ENTRIES)
def _relaxed_cached(tokenizer: Any, tools_json: str, function_name: str | None) -> RelaxedToolGrammar:
    try:
        return RelaxedToolGrammar(grammar=_compile_cached(tokenizer, tools_json, function_name, False), relaxed=())
    except GrammarError as e:
        strict_error = e
    table = token_table(tokenizer)
    relaxed_tools, relaxed = [], set()
    for tool in json.loads(tools_json):
        function = tool["function"]
        parameters, dropped = _relaxed_parameters(table, function.get("parameters") or _NO_PARAMETERS)
        relaxed.update(dropped)
        relaxed_tools.append({**tool, "function": {**function, "parameters": parameters}})
    grammar = _compile_cached(tokenizer, json.dumps(relaxed_tools, sort_keys=True), function_name, True)
    log.warning(
        "the tool-call grammar relaxed the tools' schemas (dropped: %s) because llguidance could not compile "
        "them as sent (%s); the rest of each schema is still enforced",
        ", ".join(sorted(relaxed)),
        str(strict_error).splitlines()[0],
    )
    return RelaxedToolGrammar(grammar=grammar, relaxed=tuple(sorted(relaxed)))


def _relaxed_parameters(table: llguidance.LLTokenizer, schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A tool's parameters as llguidance takes them in lenient mode, and what
    was dropped: its unimplemented keywords (llguidance's warnings name
    them), else its regex patterns too, else the whole schema."""
    error, warnings = _check_schema(table, schema)
    dropped = [key for warning in warnings for key in _unimplemented_keys(warning)]
    if error is None:
        return schema, dropped
    without_patterns = _without_patterns(schema)
    error, warnings = _check_schema(table, without_patterns)
    if error is None:
        return without_patterns, [*dropped, *(k for w in warnings for k in _unimplemented_keys(w)), "pattern"]
    return {"type": "object"}, ["parameters"]


def _check_schema(table: llguidance.LLTokenizer, schema: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(the error or None, the warnings) of one schema under llguidance's lenient mode."""
    lenient = {**schema, "x-guidance": {**_JSON_LAYOUT, "lenient": True}}
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(f"start: %json {json.dumps(lenient)}\n")
    except (ValueError, TypeError) as e:
        return str(e), []
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
    return (messages[0] if messages else "unknown") if is_error else None, list(messages)


def _unimplemented_keys(warning: str) -> list[str]:
    """The keywords in llguidance's `Unimplemented keys: ["propertyNames"]` warning."""
    match = _UNIMPLEMENTED_KEYS.search(warning)
    if match is None:
        return []
    try:
        keys = json.loads(match.group(1))
    except json.JSONDecodeError:
        return []
    return [key for key in keys if isinstance(key, str)]


_UNIMPLEMENTED_KEYS = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
# Keywords whose value maps names (not keywords) to schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _without_patterns(schema: Any) -> Any:
    """`schema` without its `pattern` keywords (regexes llguidance may not take, e.g. look-arounds)."""
    if isinstance(schema, list):
        return [_without_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            kept[key] = {name: _without_patterns(sub) for name, sub in value.items()}
        else:
            kept[key] = _without_patterns(value)
    return kept


@functools.lru_cache(maxsize=GRAMMAR_CACHE_ENTRIES)
def _compile_cached(tokenizer: Any, tools_json: str, function_name: str | None, lenient: bool) -> str:
    table = token_table(tokenizer)
    schema = call_schema(json.loads(tools_json), function_name)
    if lenient:
        schema["x-guidance"] = {**_JSON_LAYOUT, "lenient": True}
    end = _marker_terminal(tokenizer, table, tokenizer.tool_call_end)
    lark = f'start: "\\n" call "\\n" {end}\ncall: %json {json.dumps(schema)}\n'
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the tools' schemas are not JSON schemas llguidance accepts: {e}") from e
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
    if is_error:
        raise GrammarError(f"llguidance cannot compile the tools' schemas: {messages[0] if messages else 'unknown'}")
    return grammar


class Phase(enum.Enum):
    FREE = "free"
    IN_CALL = "in_call"
    TURN_OVER = "turn_over"


class Event(enum.Enum):
    START_MARKER = "start_marker"
    CALL_CLOSED = "call_closed"
    REFUSED = "refused"


def _transitions(parallel: bool) -> dict[tuple[Phase, Event], Phase]:
    """The phase table: a closed call frees the text again, or ends the turn
    when only one call is allowed; a refused token (another processor forced
    text the grammar forbids) frees the text without constraint."""
    return {
        (Phase.FREE, Event.START_MARKER): Phase.IN_CALL,
        (Phase.IN_CALL, Event.CALL_CLOSED): Phase.FREE if parallel else Phase.TURN_OVER,
        (Phase.IN_CALL, Event.REFUSED): Phase.FREE,
    }


class ToolCallGrammarMask:
    """A stateful logits processor for one generation (see the module doc).
    From the second call on it first observes the previously sampled token
    (the last of `tokens`); then FREE leaves the logits alone, IN_CALL masks
    every token the call's grammar forbids, TURN_OVER keeps only the
    end-of-turn tokens. `on_call` is called each time a call starts."""

    def __init__(self, tokenizer: Any, spec: ToolCallGrammar, on_call: Callable[[], None] = lambda: None) -> None:
        self._table = token_table(tokenizer)
        self._matcher = llguidance.LLMatcher(self._table, spec.grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"llguidance rejected the tool-call grammar: {self._matcher.get_error()}")
        self._marker = spec.start_marker.encode("utf-8")
        self._transitions = _transitions(spec.parallel)
        self._on_call = on_call
        self._vocab_tokens = self._table.vocab_size
        self._end_token_ids = sorted(i for i in tokenizer.eos_token_ids if i < self._vocab_tokens)
        self._bitmask = allocate_token_bitmask(1, self._vocab_tokens)
        self._tail = b""
        self._calls = 0
        self.phase = Phase.FREE
        self.calls_constrained = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._calls > 0:
            self.observe(item_int(tokens[-1]))
        self._calls += 1
        if self.phase is Phase.FREE:
            return logits
        return masked_logits(logits, self.allowed_tokens())

    def observe(self, token_id: int) -> None:
        """Advance the phase by one generated token."""
        if self.phase is Phase.IN_CALL:
            if not self._matcher.consume_token(token_id):
                log.warning(
                    "the tool-call grammar refused token %d (%s); the rest of the reply is unconstrained",
                    token_id,
                    self._matcher.get_error(),
                )
                self._move(Event.REFUSED)
            elif self._matcher.is_stopped():
                self._move(Event.CALL_CLOSED)
        elif self.phase is Phase.FREE:
            self._tail = (self._tail + self._table.decode_bytes([token_id]))[-len(self._marker) :]
            if self._tail == self._marker:
                self._move(Event.START_MARKER)

    def allowed_tokens(self) -> np.ndarray:
        """A 0/1 vector over the vocabulary of the tokens the phase allows next."""
        if self.phase is Phase.IN_CALL:
            return matcher_allowed_tokens(self._matcher, self._bitmask, self._vocab_tokens)
        allowed = np.zeros(self._vocab_tokens, dtype=np.uint8)
        if self.phase is Phase.TURN_OVER:
            allowed[self._end_token_ids] = 1
        else:
            allowed[:] = 1
        return allowed

    def _move(self, event: Event) -> None:
        self.phase = self._transitions[(self.phase, event)]
        if event is Event.START_MARKER:
            self.calls_constrained += 1
            self._on_call()
        else:
            self._matcher.reset()
            self._tail = b""
