"""What the server accepts, clamps and rewrites of what agents send (docs/agents.md).

Every API's body parser (on the tokenizer lane's worker thread) opens one
`Intake` per request from the server's `InboundPolicy` and tells it what it
changed on the way in:

- `grant_max_tokens`: `max_tokens` / `max_completion_tokens` /
  `max_output_tokens` are upper bounds. The reply gets the least of what was
  asked, `MAX_TOKENS_LIMIT`, and what the context leaves after the prompt;
  a clamp below what was asked is logged (INFO) and recorded. A prompt that
  alone fills the context is `PromptTooLong` (each API words it its own way).
- `hosted_tool`: a hosted or server tool the server cannot run (OpenAI
  Responses `web_search`, `namespace`, ...; Anthropic `web_search_…`,
  `bash_…`, ...) is left out of the prompt (`--hosted-tools omit`, the
  default: one WARNING per kind for the server's life, the names recorded),
  or refused with a 400 naming it (`--hosted-tools reject`).
- `normalize_system`: the prompt-normalisation rules (http/prompt_rules.py)
  over a system text, unless `--prompt-normalize off`.

`notes(api)` is the request's `RequestNotes`, carried by its
`GenerationRequest` to its `/stats/requests` record. `InboundCounts` holds
the totals `/stats` shows (`inbound`) and `/metrics` exports; it is written
by the worker thread and read by the Trio thread, so a lock guards only the
integer updates and the snapshot copy.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

import attrs

from kvcellar.engine.generation import RequestNotes
from kvcellar.errors import HostedToolRefused, PromptTooLong
from kvcellar.http.prompt_rules import PROMPT_RULES, PromptRule, normalize_text

log = logging.getLogger("kvcellar.http.inbound")

HostedTools = Literal["omit", "reject"]
HOSTED_TOOLS_CHOICES: tuple[HostedTools, ...] = ("omit", "reject")
# The most tokens one reply generates, whatever a request asks.
MAX_TOKENS_LIMIT = 32768


class InboundCounts:
    """Totals since start: clamped replies, hosted tools left out per kind, rewrites per rule."""

    def __init__(self, rules: tuple[PromptRule, ...] = PROMPT_RULES) -> None:
        self._lock = threading.Lock()
        self._clamped = 0
        self._hosted: dict[str, int] = {}
        self._rewrites: dict[str, int] = {rule.name: 0 for rule in rules}

    def add(self, *, clamped: bool, hosted_kinds: list[str], rewrites: list[str]) -> None:
        with self._lock:
            self._clamped += clamped
            for kind in hosted_kinds:
                self._hosted[kind] = self._hosted.get(kind, 0) + 1
            for name in rewrites:
                self._rewrites[name] = self._rewrites.get(name, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "max_tokens_clamped": self._clamped,
                "hosted_tools_left_out": dict(self._hosted),
                "prompt_rewrites": dict(self._rewrites),
            }


class InboundPolicy:
    """The server's switches (`--hosted-tools`, `--prompt-normalize`), its
    counts, and the hosted-tool kinds already warned about."""

    def __init__(
        self,
        *,
        hosted_tools: HostedTools = "omit",
        prompt_normalize: bool = True,
        rules: tuple[PromptRule, ...] = PROMPT_RULES,
    ) -> None:
        self.hosted_tools = hosted_tools
        self.rules = rules if prompt_normalize else ()
        self.counts = InboundCounts(rules)
        self._warned_lock = threading.Lock()
        self._warned_kinds: set[str] = set()

    def intake(self) -> Intake:
        return Intake(policy=self)

    def warn_once(self, kind: str, name: str) -> None:
        with self._warned_lock:
            if kind in self._warned_kinds:
                return
            self._warned_kinds.add(kind)
        log.warning(
            "a request offers a %r tool (%s), which this server cannot run: left out of the prompt "
            "(warned once per kind; `kvcellar serve --hosted-tools reject` refuses such requests instead)",
            kind,
            name,
        )


DEFAULT_POLICY = InboundPolicy()


@attrs.define
class Intake:
    """One request's changes on the way in (see the module doc)."""

    policy: InboundPolicy
    max_tokens_requested: int | None = None
    hosted_names: list[str] = attrs.Factory(list)
    hosted_kinds: list[str] = attrs.Factory(list)
    rewrites: list[str] = attrs.Factory(list)

    def grant_max_tokens(
        self, requested: int, *, prompt_tokens: int, context_tokens_max: int, field: str, prompt_param: str
    ) -> int:
        """The reply's bound: `requested`, clamped to the context's room after the prompt."""
        room = context_tokens_max - prompt_tokens
        if room < 1:
            raise PromptTooLong(prompt_tokens=prompt_tokens, context_tokens_max=context_tokens_max, param=prompt_param)
        granted = min(requested, MAX_TOKENS_LIMIT, room)
        if granted < requested:
            self.max_tokens_requested = requested
            log.info(
                "%s %d clamped to %d: the %d-token prompt leaves %d tokens of the model's %d-token context "
                "(one reply is at most %d)",
                field,
                requested,
                granted,
                prompt_tokens,
                room,
                context_tokens_max,
                MAX_TOKENS_LIMIT,
            )
        return granted

    def hosted_tool(self, kind: str, name: str, *, param: str) -> None:
        """A tool the server cannot run: left out (recorded, warned once per
        kind), or `HostedToolRefused` under `--hosted-tools reject`."""
        if self.policy.hosted_tools == "reject":
            raise HostedToolRefused(
                f"{param} is a {kind!r} tool, which runs on the provider's side; this server runs only the "
                "client's own function tools (start it with `--hosted-tools omit` to leave such tools out)",
                param=param,
            )
        self.policy.warn_once(kind, name)
        self.hosted_names.append(name)
        self.hosted_kinds.append(kind)

    def normalize_system(self, text: str) -> str:
        """`text` (a system block or message) after the prompt-normalisation rules."""
        normalized, applied = normalize_text(text, self.policy.rules)
        self.rewrites.extend(applied)
        return normalized

    def notes(self, api: str, *, schema_keywords_relaxed: tuple[str, ...] = ()) -> RequestNotes:
        """The request's notes; counts them into the server's totals (call once per request)."""
        self.policy.counts.add(
            clamped=self.max_tokens_requested is not None, hosted_kinds=self.hosted_kinds, rewrites=self.rewrites
        )
        return RequestNotes(
            api=api,
            max_tokens_requested=self.max_tokens_requested,
            hosted_tools_left_out=tuple(self.hosted_names),
            schema_keywords_relaxed=schema_keywords_relaxed,
            prompt_rewrites=tuple(self.rewrites),
        )
