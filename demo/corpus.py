"""The training and evaluation text of the `demo-coder` model, all of it offline.

Two sources, both deterministic for a seed and a Python version:

* the Python standard library's sources (code, comments, docstrings) from a
  fixed list of modules, split into a training part and a held-out part by
  module;
* synthetic chat conversations, rendered with the model's own chat template:
  "write me this function" requests answered with a standard-library
  function (its docstring as the request, its source as the answer), and
  tool-use conversations (tools offered in the system turn, the assistant's
  `<tool_call>` JSON block, a `tool` result, a final answer).

Held-out conversations use functions of the held-out modules and tool
arguments (cities, paths, ...) that no training conversation uses.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

# Training modules first, held-out modules last; a module missing from this
# Python version is skipped (the set differs between versions, so a retrain
# reproduces the committed weights only on the same Python and library versions).
TRAINING_MODULES = (
    "textwrap.py",
    "string.py",
    "functools.py",
    "json/__init__.py",
    "json/encoder.py",
    "json/decoder.py",
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "contextlib.py",
    "shutil.py",
    "email/message.py",
    "http/client.py",
    "logging/__init__.py",
    "csv.py",
    "difflib.py",
    "pathlib.py",
    "os.py",
    "posixpath.py",
    "random.py",
    "statistics.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "base64.py",
    "calendar.py",
    "shlex.py",
    "fnmatch.py",
    "glob.py",
    "tempfile.py",
    "inspect.py",
    "enum.py",
    "typing.py",
    "urllib/parse.py",
    "html/__init__.py",
    "ipaddress.py",
    "locale.py",
    "gettext.py",
    "zipfile.py",
    "tarfile.py",
    "configparser.py",
    "pprint.py",
    "copy.py",
    "operator.py",
    "abc.py",
    "weakref.py",
    "threading.py",
    "queue.py",
    "sched.py",
    "datetime.py",
)
HELD_OUT_MODULES = ("colorsys.py", "getopt.py", "quopri.py", "netrc.py", "cmd.py", "imghdr.py")

SYSTEM_PROMPTS = (
    "You are a helpful coding assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You write Python code.",
)

CODE_REQUEST_FORMS = (
    "Write a Python function {name} that does this: {doc}",
    "Can you write {name}? {doc}",
    "I need a function called {name}. {doc}",
    "Show me how to write {name} in Python. {doc}",
)
CODE_ANSWER_FORMS = (
    "Here is {name}:\n\n```python\n{source}\n```",
    "Sure. This is one way to write it:\n\n```python\n{source}\n```",
    "```python\n{source}\n```\n\nThis defines {name}.",
)
EXPLAIN_REQUEST_FORMS = (
    "What does {module}.{name} do?",
    "Explain {name} from the {module} module.",
)
EXPLAIN_ANSWER_FORMS = (
    "{name} is a function in {module}. {doc}",
    "In the {module} module, {name} works like this: {doc}",
)

FUNCTION_SOURCE_CHARS_MAX = 1200
DOCSTRING_CHARS_MAX = 300


@attrs.frozen(kw_only=True)
class ToolSpec:
    """One synthetic tool: its OpenAI schema, ways to ask for it, how it answers."""

    name: str
    description: str
    parameters: dict[str, str]  # argument name -> the slot (a key of the value pools) it is filled from
    requests: tuple[str, ...]
    result: Callable[[random.Random, dict[str, str]], dict[str, Any]]
    answer: str

    def schema(self) -> dict[str, Any]:
        properties = {name: {"type": "string"} for name in self.parameters}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {"type": "object", "properties": properties, "required": list(self.parameters)},
            },
        }


# Each pool: (training values, held-out values).
VALUE_POOLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "city": (
        ("Paris", "London", "Berlin", "Tokyo", "Madrid", "Rome", "Oslo", "Cairo", "Lima", "Seoul", "Dublin", "Vienna"),
        ("Lisbon", "Prague", "Nairobi", "Quito"),
    ),
    "path": (
        ("README.md", "setup.py", "src/main.py", "docs/index.md", "tests/test_app.py", "config.toml", "notes.txt"),
        ("app/server.py", "CHANGES.md", "data/input.csv"),
    ),
    "pattern": (
        ("TODO", "def main", "import os", "class Config", "return None", "print("),
        ("FIXME", "async def"),
    ),
    "expression": (
        ("2 + 2", "17 * 3", "100 / 4", "2 ** 10", "45 - 12", "9 * 9", "123 + 456"),
        ("8 * 7", "1000 - 1"),
    ),
    "symbol": (("AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "IBM"), ("ORCL", "INTC")),
    "word": (("cache", "kernel", "thread", "socket", "token", "buffer", "lambda"), ("tensor", "daemon")),
    "timezone": (("UTC", "Europe/Paris", "Asia/Tokyo", "America/New_York"), ("Australia/Sydney",)),
    "package": (("numpy", "requests", "flask", "pytest", "attrs", "click"), ("trio", "rich")),
}


def _weather(rng: random.Random, args: dict[str, str]) -> dict[str, Any]:
    return {"city": args["city"], "temperature_c": rng.randint(-5, 35), "sky": rng.choice(["sunny", "cloudy", "rainy"])}


def _evaluate(rng: random.Random, args: dict[str, str]) -> dict[str, Any]:
    left, operator, right = args["expression"].split()
    operations: dict[str, Callable[[float, float], float]] = {
        "+": float.__add__,
        "-": float.__sub__,
        "*": float.__mul__,
        "/": float.__truediv__,
        "**": float.__pow__,
    }
    value = operations[operator](float(left), float(right))
    return {"value": int(value) if value == int(value) else value}


TOOL_SPECS = (
    ToolSpec(
        name="get_weather",
        description="Get the current weather in a city.",
        parameters={"city": "city"},
        requests=("What is the weather in {city}?", "Is it raining in {city} right now?", "How warm is it in {city}?"),
        result=_weather,
        answer="It is {sky} in {city} and {temperature_c} degrees Celsius.",
    ),
    ToolSpec(
        name="read_file",
        description="Read a text file and return its contents.",
        parameters={"path": "path"},
        requests=("Show me the contents of {path}.", "Read {path} for me.", "What is in {path}?"),
        result=lambda rng, args: {"path": args["path"], "lines": rng.randint(3, 400)},
        answer="{path} has {lines} lines.",
    ),
    ToolSpec(
        name="search_code",
        description="Search the project's files for a text pattern.",
        parameters={"pattern": "pattern"},
        requests=("Find where {pattern} appears in the code.", "Search the project for {pattern}."),
        result=lambda rng, args: {"pattern": args["pattern"], "matches": rng.randint(0, 40)},
        answer="I found {matches} matches for {pattern}.",
    ),
    ToolSpec(
        name="calculator",
        description="Evaluate an arithmetic expression.",
        parameters={"expression": "expression"},
        requests=("What is {expression}?", "Compute {expression} for me.", "Calculate {expression}."),
        result=_evaluate,
        answer="The answer is {value}.",
    ),
    ToolSpec(
        name="get_stock_price",
        description="Get the latest price of a stock.",
        parameters={"symbol": "symbol"},
        requests=("What is the price of {symbol} stock?", "How much is {symbol} trading at?"),
        result=lambda rng, args: {"symbol": args["symbol"], "price": rng.randint(10, 900)},
        answer="{symbol} is trading at {price} dollars.",
    ),
    ToolSpec(
        name="define_word",
        description="Look up the meaning of a word.",
        parameters={"word": "word"},
        requests=("What does the word {word} mean?", "Define {word}."),
        result=lambda rng, args: {"word": args["word"], "definition": "a term used in computing"},
        answer="{word} is {definition}.",
    ),
    ToolSpec(
        name="get_time",
        description="Get the current time in a time zone.",
        parameters={"timezone": "timezone"},
        requests=("What time is it in {timezone}?", "Tell me the time in {timezone}."),
        result=lambda rng, args: {
            "timezone": args["timezone"],
            "time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
        },
        answer="It is {time} in {timezone}.",
    ),
    ToolSpec(
        name="install_package",
        description="Install a Python package with pip.",
        parameters={"package": "package"},
        requests=("Install {package} for me.", "Please add the {package} package.", "Can you pip install {package}?"),
        result=lambda rng, args: {"package": args["package"], "installed": True},
        answer="{package} is installed.",
    ),
)


@attrs.frozen(kw_only=True)
class Conversation:
    """A chat as the OpenAI API carries it; `tools` is empty for a plain chat."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@attrs.frozen(kw_only=True)
class FunctionDoc:
    module: str
    name: str
    doc: str
    source: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_modules(relative_paths: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module name, source text) of each listed standard-library file that exists."""
    modules = []
    for relative_path in relative_paths:
        path = stdlib_dir() / relative_path
        if path.is_file():
            module_name = relative_path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            modules.append((module_name, path.read_text(encoding="utf-8", errors="replace")))
    return modules


def function_docs(modules: list[tuple[str, str]]) -> list[FunctionDoc]:
    """Top-level and method functions with a docstring and a short enough source, in file order."""
    docs = []
    for module_name, text in modules:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = _split_source_lines(text)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            docstring = ast.get_docstring(node)
            source = _source_segment(lines, node)
            if not docstring or source is None or len(source) > FUNCTION_SOURCE_CHARS_MAX:
                continue
            first_paragraph = " ".join(docstring.split("\n\n")[0].split())[:DOCSTRING_CHARS_MAX]
            if first_paragraph.isascii():
                docs.append(FunctionDoc(module=module_name, name=node.name, doc=first_paragraph, source=source))
    return docs


_LINE_END = re.compile(r"(\r\n|\r|\n)")


def _split_source_lines(text: str) -> list[str]:
    """`text`'s lines with their ends, split only at \\r\\n, \\r and \\n: the lines
    `ast.get_source_segment` indexes (it splits the whole file again at every call, in a
    character loop, which made reading the corpus take minutes)."""
    parts = _LINE_END.split(text)
    lines = [parts[index] + parts[index + 1] for index in range(0, len(parts) - 1, 2)]
    return [*lines, parts[-1]] if parts[-1] else lines


def _source_segment(lines: list[str], node: ast.FunctionDef) -> str | None:
    """What `ast.get_source_segment(text, node)` returns, from `text`'s split lines."""
    if node.end_lineno is None or node.end_col_offset is None:
        return None
    first_line, last_line = node.lineno - 1, node.end_lineno - 1
    if first_line == last_line:
        return lines[first_line].encode()[node.col_offset : node.end_col_offset].decode()
    first = lines[first_line].encode()[node.col_offset :].decode()
    last = lines[last_line].encode()[: node.end_col_offset].decode()
    return "".join([first, *lines[first_line + 1 : last_line], last])


def code_conversation(rng: random.Random, function: FunctionDoc) -> Conversation:
    """A "write this function" or "explain this function" chat about `function`."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    fields = {"module": function.module, "name": function.name, "doc": function.doc, "source": function.source}
    if rng.random() < 0.7:
        request, answer = rng.choice(CODE_REQUEST_FORMS), rng.choice(CODE_ANSWER_FORMS)
    else:
        request, answer = rng.choice(EXPLAIN_REQUEST_FORMS), rng.choice(EXPLAIN_ANSWER_FORMS)
    messages.append({"role": "user", "content": request.format(**fields)})
    messages.append({"role": "assistant", "content": answer.format(**fields)})
    return Conversation(messages=messages, tools=[])


# fmt: off
_SYLLABLE_STARTS = (
    "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
    "br", "ch", "dr", "kr", "pl", "st", "tr",
)
# fmt: on
_SYLLABLE_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ou")
_DIRECTORIES = ("", "src/", "docs/", "tests/", "app/")
_FILE_SUFFIXES = (".py", ".md", ".txt", ".toml", ".json", ".csv", ".cfg")
_OPERATORS = ("+", "-", "*", "/")
_REGIONS = ("Europe", "Asia", "America", "Africa", "Pacific")


def _pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up lowercase word of 2 to 4 syllables."""
    syllables = rng.randint(2, 4)
    return "".join(rng.choice(_SYLLABLE_STARTS) + rng.choice(_SYLLABLE_VOWELS) for _ in range(syllables))


def _varied_expression(rng: random.Random) -> str:
    return f"{rng.randint(1, 999)} {rng.choice(_OPERATORS)} {rng.randint(1, 99)}"


def _varied_pattern(rng: random.Random) -> str:
    word = _pseudo_word(rng)
    return rng.choice((word, f"def {word}", f"import {word}", f"class {word.title()}", word.upper()))


# Argument values made up afresh for each phase-three tool chat: with values drawn from the
# small training pools the model memorises the pools, and then cannot write a held-out value
# (it never copies from the request); values it cannot have seen teach it to copy.
VARIED_VALUE_MAKERS: dict[str, Callable[[random.Random], str]] = {
    "city": lambda rng: _pseudo_word(rng).title(),
    "path": lambda rng: rng.choice(_DIRECTORIES) + _pseudo_word(rng) + rng.choice(_FILE_SUFFIXES),
    "pattern": _varied_pattern,
    "expression": _varied_expression,
    "symbol": lambda rng: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(2, 5))),
    "word": _pseudo_word,
    "timezone": lambda rng: f"{rng.choice(_REGIONS)}/{_pseudo_word(rng).title()}",
    "package": lambda rng: _pseudo_word(rng) + rng.choice(("", "", "py", "-tools", "lib")),
}


def varied_value(rng: random.Random, slot: str) -> str:
    """A made-up value for `slot` that is none of its pools' values (held-out ones included)."""
    known = set(VALUE_POOLS[slot][0]) | set(VALUE_POOLS[slot][1])
    while True:
        value = VARIED_VALUE_MAKERS[slot](rng)
        if value not in known:
            return value


def tool_prompt(
    rng: random.Random, *, held_out: bool, varied_value_share: float = 0.0
) -> tuple[Conversation, ToolSpec, dict[str, str]]:
    """The opening of a tool conversation (system, tools, user request), the
    tool that answers it and the call's arguments. With `varied_value_share`
    > 0, that share of the training chats' arguments are made-up values
    (`varied_value`); at 0 the draws are exactly those of before it existed."""
    spec = rng.choice(TOOL_SPECS)
    others = [other for other in TOOL_SPECS if other is not spec]
    offered = [spec, *rng.sample(others, rng.randint(0, 2))]
    rng.shuffle(offered)
    arguments = {name: rng.choice(VALUE_POOLS[slot][1 if held_out else 0]) for name, slot in spec.parameters.items()}
    if varied_value_share > 0 and not held_out and rng.random() < varied_value_share:
        arguments = {name: varied_value(rng, slot) for name, slot in spec.parameters.items()}
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": rng.choice(spec.requests).format(**arguments)})
    return Conversation(messages=messages, tools=[tool.schema() for tool in offered]), spec, arguments


def tool_conversation(
    rng: random.Random, *, held_out: bool = False, varied_value_share: float = 0.0, rounds: int = 1
) -> Conversation:
    """A whole tool-use chat: request, the assistant's call, the result, the final answer; with
    `rounds` > 1, that many requests in one chat, each after the previous answer and each for
    one of the offered tools (so one rendering of the tool list teaches several choices)."""
    opening, spec, arguments = tool_prompt(rng, held_out=held_out, varied_value_share=varied_value_share)
    messages = [*opening.messages, *_tool_round(rng, spec, arguments)]
    offered = [tool for tool in TOOL_SPECS if tool.name in {schema["function"]["name"] for schema in opening.tools}]
    for _ in range(rounds - 1):
        # Another tool than the last one whenever there is one: copying the previous call's
        # name must not be a way to choose.
        spec = rng.choice([tool for tool in offered if tool is not spec] or offered)
        arguments = _arguments(rng, spec, held_out=held_out, varied_value_share=varied_value_share)
        messages.append({"role": "user", "content": rng.choice(spec.requests).format(**arguments)})
        messages.extend(_tool_round(rng, spec, arguments))
    return Conversation(messages=messages, tools=opening.tools)


def _arguments(rng: random.Random, spec: ToolSpec, *, held_out: bool, varied_value_share: float) -> dict[str, str]:
    """A later round's arguments. `tool_prompt` draws the pool values before deciding whether to
    replace them, this draws only what it uses: the two orders stay apart because the committed
    model's training chats were drawn so (`kvcellar model train` must reproduce them)."""
    if varied_value_share > 0 and not held_out and rng.random() < varied_value_share:
        return {name: varied_value(rng, slot) for name, slot in spec.parameters.items()}
    return {name: rng.choice(VALUE_POOLS[slot][1 if held_out else 0]) for name, slot in spec.parameters.items()}


def _tool_round(rng: random.Random, spec: ToolSpec, arguments: dict[str, str]) -> list[dict[str, Any]]:
    """The assistant's call of `spec`, its result and the final answer."""
    result = spec.result(rng, arguments)
    call = {"type": "function", "function": {"name": spec.name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": json.dumps(result)},
        {"role": "assistant", "content": spec.answer.format(**{**arguments, **result})},
    ]


def conversations(rng: random.Random, functions: list[FunctionDoc], count: int) -> Iterator[Conversation]:
    """`count` chats, about half of them tool-use chats."""
    for _ in range(count):
        if rng.random() < 0.5:
            yield tool_conversation(rng)
        else:
            yield code_conversation(rng, rng.choice(functions))


def held_out_chat_prompts(count: int = 20) -> list[Conversation]:
    """The fixed held-out plain prompts (user turns about held-out modules' functions)."""
    rng = random.Random(1_000_003)
    functions = function_docs(read_modules(HELD_OUT_MODULES))
    prompts = []
    for function in rng.sample(functions, min(count, len(functions))):
        conversation = code_conversation(rng, function)
        prompts.append(Conversation(messages=conversation.messages[:-1], tools=[]))
    return prompts


def held_out_tool_prompts(count: int = 20) -> list[Conversation]:
    """The fixed held-out tool prompts, with arguments no training chat uses."""
    return [conversation for conversation, _ in held_out_tool_cases(count)]


def held_out_tool_cases(count: int = 20) -> list[tuple[Conversation, str]]:
    """The fixed held-out tool prompts and, for each, the name of the tool its request asks for."""
    rng = random.Random(2_000_003)
    cases = []
    for _ in range(count):
        conversation, spec, _ = tool_prompt(rng, held_out=True)
        cases.append((conversation, spec.name))
    return cases
