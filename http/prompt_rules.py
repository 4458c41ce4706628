"""Prompt normalisation: rules, as data, applied to system text before templating.

Some clients put text into their system prompt that changes from request to
request without changing its meaning; it sits at the very start of the
prompt, so two sessions share no cached prefix at all. Each rule here
rewrites such text into one fixed form. The rules run on system blocks and
system messages (every API) before the chat template renders the prompt and
before anything is tokenized, so the model sees exactly the text that is
cached: there is never one text cached and another shown. `kvcellar serve
--prompt-normalize off` turns them all off; `/stats` `inbound.prompt_rewrites`
counts the texts each rule rewrote.

Rules (add one by appending a `PromptRule`; docs/agents.md lists them):

- `claude_code_billing_header`: Claude Code opens its system prompt with a
  line such as `x-anthropic-billing-header: cc_version=2.1.197.8a5;
  cc_entrypoint=sdk-cli;` (some versions add `cch=<5 hex>`), whose fields
  change with the prompt. The whole line, whatever its fields, becomes
  `x-anthropic-billing-header: normalized-by-kvcellar;`.
"""

from __future__ import annotations

import re

import attrs


@attrs.frozen(kw_only=True)
class PromptRule:
    """Every match of `pattern` in a system text is replaced by `replacement`
    (a fixed text: a rule must map every variant to one form)."""

    name: str
    pattern: re.Pattern[str]
    replacement: str
    why: str


PROMPT_RULES: tuple[PromptRule, ...] = (
    PromptRule(
        name="claude_code_billing_header",
        # The whole line: the header's fields vary (cc_version, cc_entrypoint, cch, ...).
        pattern=re.compile(r"^[ \t]*x-anthropic-billing-header:[^\r\n]*", re.MULTILINE | re.IGNORECASE),
        replacement="x-anthropic-billing-header: normalized-by-kvcellar;",
        why="Claude Code's billing header changes per prompt and opens the system prompt",
    ),
)


def normalize_text(text: str, rules: tuple[PromptRule, ...] = PROMPT_RULES) -> tuple[str, list[str]]:
    """`text` after `rules`, and the names of the rules that changed it."""
    applied = []
    for rule in rules:
        rewritten = rule.pattern.sub(rule.replacement, text)
        if rewritten != text:
            applied.append(rule.name)
            text = rewritten
    return text, applied
