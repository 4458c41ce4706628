"""Train the byte-level BPE tokenizers: the one every random-weight demo model shares, and
demo-coder's own (`train_corpus_tokenizer`, trained on its training corpus by `kvcellar model train`).

This script was run ONCE and its output is committed as
`kvcellar/engine/assets/tokenizer.json`; demo models copy that file, so every
machine gets the same token ids. Re-running it is not part of any build: the
corpus is read from the running interpreter's standard library (whose files
differ between Python versions) and the BPE trainer's output may differ
between `tokenizers` versions, which is exactly why the JSON is committed
instead of regenerated.

The tokenizer: byte-level BPE (ByteLevel pre-tokenizer, decoder and
post-processor) whose initial alphabet holds all 256 byte symbols, so no text
is ever unknown; 1024 ids in total, of which the first three are the special
tokens `<|endoftext|>`, `<|im_start|>` and `<|im_end|>`.

Usage: python -m kvcellar.demo.train_tokenizer OUT_PATH
"""

from __future__ import annotations

import json
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvcellar.errors import ModelError

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# A fixed list keeps the corpus deterministic for a given Python version;
# files missing from another version are skipped.
STDLIB_CORPUS_FILES = (
    "textwrap.py",
    "string.py",
    "functools.py",
    "json/__init__.py",
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
)

CHAT_SAMPLE_LINES = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nWhat is a key-value cache?<|im_end|>\n",
    "<|im_start|>assistant\nIt stores the attention keys and values of a prompt.<|im_end|>\n",
)


def iter_corpus_texts() -> Iterator[str]:
    """Yield the training texts: the fixed stdlib files, then chat samples."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    for relative_path in STDLIB_CORPUS_FILES:
        path = stdlib_dir / relative_path
        if path.is_file():
            yield path.read_text(encoding="utf-8", errors="replace")
    yield from CHAT_SAMPLE_LINES


def _trained_byte_level_bpe(texts: Iterable[str], vocab_size: int, pre_tokenizer: Any) -> Tokenizer:
    """A byte-level BPE (all 256 byte symbols in its alphabet, the special tokens first) trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_tokenizer() -> Tokenizer:
    """Train and return the byte-level BPE tokenizer described in the module docstring."""
    return _trained_byte_level_bpe(iter_corpus_texts(), VOCAB_SIZE, pre_tokenizers.ByteLevel(add_prefix_space=False))


# demo-coder's pre-tokenizer: GPT-2's split, except that an identifier (letters, digits and
# underscores, not starting with a digit) is one piece, as in a code tokenizer. So BPE can learn
# `get_weather` or `__init__` as one token; GPT-2's split would cut at every underscore.
IDENTIFIER_SPLIT_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[\p{L}_][\p{L}\p{N}_]*| ?\p{N}+| ?[^\s\p{L}\p{N}_]+|\s+(?!\S)|\s+"
)


def train_corpus_tokenizer(texts: Iterable[str], vocab_size: int) -> dict[str, Any]:
    """A byte-level BPE of `vocab_size` ids (the three special tokens first, so their ids are
    those of the shared tokenizer) trained on `texts`, split by `IDENTIFIER_SPLIT_PATTERN`;
    returned as the content of a `tokenizer.json`. Deterministic for the same texts and
    `tokenizers` version. Raises `ModelError` when the texts yield fewer merges than that."""
    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(IDENTIFIER_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer = _trained_byte_level_bpe(texts, vocab_size, split)
    if tokenizer.get_vocab_size() != vocab_size:
        # The model's embedding is sized from `vocab_size`: a short vocabulary would leave rows no id uses.
        raise ModelError(
            f"the texts hold too few distinct pieces for {vocab_size} ids (trained {tokenizer.get_vocab_size()})"
        )
    content: dict[str, Any] = json.loads(tokenizer.to_str())
    return content


def main(argv: list[str] | None = None) -> int:
    """Train and write the tokenizer to the one path given; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvcellar.demo.train_tokenizer OUT_PATH", file=sys.stderr)
        return 2
    tokenizer = train_tokenizer()
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        print(f"trained {tokenizer.get_vocab_size()} ids, expected {VOCAB_SIZE}", file=sys.stderr)
        return 1
    tokenizer.save(args[0], pretty=False)
    print(f"wrote {args[0]} ({VOCAB_SIZE} ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
