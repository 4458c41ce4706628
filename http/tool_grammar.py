"""Which requests get the tool-call grammar (engine/tool_grammar.py), and its counts.

`ToolGrammarPolicy` is the server's switch (`kvcellar serve
--tool-call-grammar on|off`, default on) and its counters; every API's body
parser asks it, on the tokenizer lane's worker thread, for the request's
logits-processor factories (`processors(tokenizer, plan)`). A request gets
the grammar when it offers function tools, the model's tool parser is
mlx-lm's JSON format, and either the switch is on or a tool says
`strict: true` (which forces it on for that request). A schema llguidance
cannot compile as sent gets a relaxed copy for the grammar only
(`compile_relaxed_tool_call_grammar`: what llguidance cannot take is
dropped, the rest kept; the prompt shows the tools as sent), counted in
`relaxed` and named in the request's `/stats/requests` record; a strict
request gets a 400 for it instead (`BadRequest`, param `tools`): the client
asked for the schema as written. Should even the relaxed grammar not
compile, the reply is unconstrained, loudly: a WARNING naming why, counted
in `fallbacks`.

`ToolGrammarCounts` is written by the worker thread (requests, relaxed, fallbacks)
and by the engine thread (each constrained call, through the processor's
`on_call`) and read by `/stats` and `/metrics`; a lock guards only the
integer updates and the snapshot copy.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Any

from kvcellar.engine.tool_grammar import (
    RelaxedToolGrammar,
    ToolCallGrammar,
    ToolCallGrammarMask,
    compile_relaxed_tool_call_grammar,
    compile_tool_call_grammar,
    uses_json_tools,
)
from kvcellar.errors import GrammarError, StrictToolsRefused
from kvcellar.http.tools import ToolPlan

log = logging.getLogger("kvcellar.http.tool_grammar")


class ToolGrammarCounts:
    """Requests served with the grammar, calls it constrained, requests that
    fell back to unconstrained output, and the last compile's time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0
        self._calls = 0
        self._fallbacks = 0
        self._relaxed = 0
        self._compile_ms_last = 0.0

    def add_request(self, compile_ms: float, *, relaxed: bool = False) -> None:
        with self._lock:
            self._requests += 1
            self._relaxed += relaxed
            self._compile_ms_last = compile_ms

    def add_call(self) -> None:
        with self._lock:
            self._calls += 1

    def add_fallback(self) -> None:
        with self._lock:
            self._fallbacks += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                "requests": self._requests,
                "calls": self._calls,
                "fallbacks": self._fallbacks,
                "relaxed": self._relaxed,
                "compile_ms_last": self._compile_ms_last,
            }


class ToolGrammarPolicy:
    def __init__(self, *, enabled: bool = True, counts: ToolGrammarCounts | None = None) -> None:
        self.enabled = enabled
        self.counts = counts or ToolGrammarCounts()

    def processors(self, tokenizer: Any, plan: ToolPlan) -> tuple[Any, ...]:
        """The grammar's processor factory for this request, or () when it gets
        none; raises `StrictToolsRefused` for a strict request it cannot serve."""
        return self.grammar_for(tokenizer, plan)[0]

    def grammar_for(self, tokenizer: Any, plan: ToolPlan) -> tuple[tuple[Any, ...], tuple[str, ...]]:
        """(`processors`, the schema keywords relaxed to compile the grammar)."""
        if not plan.parses_calls or not (self.enabled or plan.strict) or not uses_json_tools(tokenizer):
            return (), ()
        started = time.perf_counter()
        try:
            if plan.strict:
                compiled = RelaxedToolGrammar(
                    grammar=compile_tool_call_grammar(tokenizer, plan.tools or (), plan.function_name), relaxed=()
                )
            else:
                compiled = compile_relaxed_tool_call_grammar(tokenizer, plan.tools or (), plan.function_name)
        except GrammarError as e:
            if plan.strict:
                raise StrictToolsRefused(f"a strict tool's schema cannot be enforced: {e}") from e
            log.warning("tool-call grammar off for this request (the reply is unconstrained): %s", e)
            self.counts.add_fallback()
            return (), ()
        self.counts.add_request((time.perf_counter() - started) * 1000, relaxed=bool(compiled.relaxed))
        spec = ToolCallGrammar(grammar=compiled.grammar, start_marker=tokenizer.tool_call_start, parallel=plan.parallel)
        return (partial(ToolCallGrammarMask, tokenizer, spec, self.counts.add_call),), compiled.relaxed
