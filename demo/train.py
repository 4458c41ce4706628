"""Train the `demo-coder` model: a ~5M-parameter llama on offline text, with MLX on the CPU.

`kvcellar model train OUT_DIR` runs it. The data (`kvcellar.demo.corpus`)
is the standard library's sources plus synthetic chats, rendered with the
Qwen3-style tools template and tokenized with a byte-level BPE trained on that
training text (`tokenizer_ids` ids, identifiers kept whole) extended by the
tool-format tokens, so mlx-lm's `TokenizerWrapper`
reports `has_tool_calling` and parses `<tool_call>` JSON blocks.

Everything random comes from `seed` (numpy for the batches, MLX for the
initial weights), so the same seed, Python, MLX and BLAS give the same
weights. Training runs in float32 (MLX's CPU matmuls are BLAS calls only in
float32) and the weights are stored in bfloat16. On Linux, the reference BLAS
that the `mlx[cpu]` wheel bundles is ~20x slower than OpenBLAS, so
`kvcellar model train` re-executes itself with the system's OpenBLAS preloaded
when one is installed (`kvcellar.blas_preload`; Debian's `libopenblas0-pthread`),
which is how the committed model was trained.

The output directory gets the model files plus `training-log.json` (the
configuration, the loss at every step, the held-out loss over time and at the
end, measured on the bfloat16 weights) and, when matplotlib is installed,
`loss-curve.png`.
"""

from __future__ import annotations

import importlib
import json
import math
import platform
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from kvcellar.demo import corpus as demo_corpus
from kvcellar.demo.conversations import (
    build_conversation_rows,
    conversation_batch,
    padded_tokens,
    tool_length_classes,
)
from kvcellar.demo.tool_validation import CheckpointScore, ToolCallScorer
from kvcellar.demo.train_tokenizer import train_corpus_tokenizer
from kvcellar.demo.training_config import EVALUATION_SETTINGS, SETTINGS_BEFORE_THEY_EXISTED, TrainingConfig
from kvcellar.engine.attention_window import WINDOW_CONFIG_KEY
from kvcellar.engine.demo_models import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    TOOL_FORMAT_TOKENS,
    VOCAB_SIZE,
    WEIGHTS_FILE_NAME,
    _tokenizer_config,
    _tools_tokenizer_json,
    write_safetensors,
)
from kvcellar.engine.scalars import item_float
from kvcellar.errors import ModelError
from kvcellar.store.fingerprint import mlx_version

TRAINING_LOG_FILE_NAME = "training-log.json"
LOSS_CURVE_FILE_NAME = "loss-curve.png"

ProgressCallback = Callable[[str], None]


# The context kvcellar serves it with (what it reads as the context): 128k, so an agent's
# ~28k-token first prompt fits. Training rows are at most 768 tokens, so past that the
# model is out of its trained range (RoPE extrapolation); the point is that the server
# takes the prompt, not the quality of the reply (docs/demo-model.md, "Context").
CONTEXT_TOKENS = 131072

# Each query reads the last 768 keys (engine/attention_window.py): the training rows' length,
# so replies within it are full attention's, and a 28k prompt prefills in linear time on a CPU.
ATTENTION_WINDOW_TOKENS = 768


def llama_config(config: TrainingConfig) -> dict[str, Any]:
    """The model's `config.json` (an mlx-lm llama with tied embeddings)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": (config.tokenizer_ids or VOCAB_SIZE) + len(TOOL_FORMAT_TOKENS),
        "rope_theta": 10000.0,
        "max_position_embeddings": CONTEXT_TOKENS,
        "tie_word_embeddings": True,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "bfloat16",
        WINDOW_CONFIG_KEY: ATTENTION_WINDOW_TOKENS,
    }


TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_tokenizer_files(model_dir: Path, base_tokenizer: dict[str, Any] | None = None) -> None:
    """The tool-capable tokenizer (`base_tokenizer`, by default the shared one, plus the tool-format
    tokens), its config (with the tools chat template) and special tokens."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _tools_tokenizer_json(base_tokenizer)
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    files = {
        # The tokenizer's own length limit follows the context (transformers warns past it).
        "tokenizer_config.json": {**_tokenizer_config("tools"), "model_max_length": CONTEXT_TOKENS},
        "special_tokens_map.json": {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    }
    for name, content in files.items():
        (model_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@attrs.frozen(kw_only=True)
class TokenStreams:
    """Token ids of each text source, documents separated by `<|endoftext|>`."""

    code_train: np.ndarray
    chat_train: np.ndarray
    code_held_out: np.ndarray
    chat_held_out: np.ndarray


@attrs.frozen(kw_only=True)
class CorpusTexts:
    """The text of each source before tokenizing: one string per module or rendered chat."""

    code_train: list[str]
    chat_train: list[str]
    code_held_out: list[str]
    chat_held_out: list[str]


def build_streams(model_dir: Path, config: TrainingConfig) -> TokenStreams:
    """Tokenize the corpus with the tokenizer and template written into `model_dir`."""
    return encode_streams(model_dir, corpus_texts(model_dir, config))


def corpus_texts(model_dir: Path, config: TrainingConfig) -> CorpusTexts:
    """The corpus, chats rendered with the template in `model_dir` (text only: the rendering
    does not depend on the tokenizer's vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(config.seed)
    training_modules = demo_corpus.read_modules(demo_corpus.TRAINING_MODULES)
    held_out_modules = demo_corpus.read_modules(demo_corpus.HELD_OUT_MODULES)
    functions = demo_corpus.function_docs(training_modules)
    held_out_functions = demo_corpus.function_docs(held_out_modules)

    def render(conversation: demo_corpus.Conversation) -> str:
        tools: Any = conversation.tools or None
        return str(tokenizer.apply_chat_template(conversation.messages, tools=tools, tokenize=False))

    chats = [render(c) for c in demo_corpus.conversations(rng, functions, config.chat_conversations)]
    held_out_rng = random.Random(config.seed + 1)
    held_out_chats = [
        render(demo_corpus.code_conversation(held_out_rng, function)) for function in held_out_functions
    ] + [render(demo_corpus.tool_conversation(held_out_rng, held_out=True)) for _ in range(200)]
    return CorpusTexts(
        code_train=[text for _, text in training_modules],
        chat_train=chats,
        code_held_out=[text for _, text in held_out_modules],
        chat_held_out=held_out_chats,
    )


def encode_streams(model_dir: Path, texts: CorpusTexts) -> TokenStreams:
    """`texts` tokenized with the tokenizer in `model_dir`, each document closed by `<|endoftext|>`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def stream(documents: list[str]) -> np.ndarray:
        ids: list[int] = []
        for encoded in tokenizer(documents, add_special_tokens=False)["input_ids"]:
            ids.extend(encoded)
            ids.append(PAD_TOKEN_ID)
        return np.asarray(ids, dtype=np.int32)

    return TokenStreams(
        code_train=stream(texts.code_train),
        chat_train=stream(texts.chat_train),
        code_held_out=stream(texts.code_held_out),
        chat_held_out=stream(texts.chat_held_out),
    )


def sample_windows(rng: np.random.Generator, stream: np.ndarray, rows: int, tokens: int) -> np.ndarray:
    if rows == 0:
        return np.empty((0, tokens + 1), dtype=stream.dtype)
    starts = rng.integers(0, len(stream) - tokens - 1, size=rows)
    return np.stack([stream[start : start + tokens + 1] for start in starts])


def fixed_windows(stream: np.ndarray, count: int, tokens: int) -> np.ndarray:
    """`count` evenly spaced windows of `stream`: the same held-out tokens at every evaluation."""
    starts = np.linspace(0, len(stream) - tokens - 2, num=count).astype(np.int64)
    return np.stack([stream[start : start + tokens + 1] for start in starts])


def token_loss(model: nn.Module, windows: mx.array) -> mx.array:
    logits = model(windows[:, :-1])
    return nn.losses.cross_entropy(logits.astype(mx.float32), windows[:, 1:]).mean()


def learning_rate_schedule(config: TrainingConfig) -> optim.schedulers.Callable:
    warmup = optim.linear_schedule(config.learning_rate_peak / 100, config.learning_rate_peak, config.warmup_steps)
    decay = optim.cosine_decay(
        config.learning_rate_peak, config.steps - config.warmup_steps, end=config.learning_rate_final
    )
    return optim.join_schedules([warmup, decay], [config.warmup_steps])


def held_out_loss(model: nn.Module, windows: list[np.ndarray]) -> float:
    return item_float(token_loss(model, mx.array(np.concatenate(windows))))


def train(out_dir: Path, config: TrainingConfig, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Train the model into `out_dir` and return the training log.

    Three phases: `steps` on the mixed stream (chats and code), then, when
    `chat_steps` is non-zero, `train_chat_phase` on chats alone, starting from
    the bfloat16 weights phase one stored, then, when `tool_steps` is
    non-zero, `train_tool_phase` from the weights phase two stored. The model files are rewritten at
    every evaluation, so an interrupted run leaves a usable (less trained)
    model behind. Raises `ModelError` when mlx-lm cannot build the model.
    """
    report = progress or (lambda line: None)
    out_dir = Path(out_dir)
    write_tokenizer_files(out_dir)
    texts = corpus_texts(out_dir, config)
    if config.tokenizer_ids:
        # Trained on the training text only: the held-out text stays unseen by the vocabulary too.
        base_tokenizer = train_corpus_tokenizer(texts.code_train + texts.chat_train, config.tokenizer_ids)
        write_tokenizer_files(out_dir, base_tokenizer)
        report(f"tokenizer: {config.tokenizer_ids:,} ids trained on the training text")
    streams = encode_streams(out_dir, texts)
    report(
        f"tokens: code {len(streams.code_train):,}, chats {len(streams.chat_train):,}; held out: "
        f"code {len(streams.code_held_out):,}, chats {len(streams.chat_held_out):,}"
    )
    model_config = llama_config(config)
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    mx.random.seed(config.seed)
    model = _build_model(model_config)
    parameters = sum(weight.size for _, weight in _flat_parameters(model))
    report(f"parameters: {parameters:,}")
    log: dict[str, Any] = {
        "config": attrs.asdict(config),
        "model_config": model_config,
        "parameters": parameters,
        "versions": _versions(),
        "tokens_per_step": config.batch_rows * config.window_tokens,
        "train_loss": [],
        "held_out": [],
    }
    rng = np.random.default_rng(config.seed)
    chat_rows = round(config.batch_rows * config.chat_row_share)

    def mixed_batch() -> tuple[np.ndarray]:
        windows = np.concatenate(
            [
                sample_windows(rng, streams.chat_train, chat_rows, config.window_tokens),
                sample_windows(rng, streams.code_train, config.batch_rows - chat_rows, config.window_tokens),
            ]
        )
        return (windows,)

    schedule = learning_rate_schedule(config)
    _train_loop(
        out_dir, model, schedule, mixed_batch, config, streams, log, first_step=1, steps=config.steps, report=report
    )
    log["phase_one_held_out_loss_bf16"] = log["final_held_out_loss_bf16"]
    if config.chat_steps:
        log = train_chat_phase(out_dir, config, progress, streams=streams, log=log)
    if config.tool_steps:
        log = train_tool_phase(out_dir, config, progress, streams=streams, log=log)
    if config.tool_steps and config.tool_restart_steps:
        log = train_tool_phase(out_dir, config, progress, streams=streams, log=log, restart=True)
    _plot_loss_curve(log, out_dir / LOSS_CURVE_FILE_NAME)
    return log


def train_chat_phase(
    out_dir: Path,
    config: TrainingConfig,
    progress: ProgressCallback | None = None,
    *,
    streams: TokenStreams | None = None,
    log: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Phase two: `chat_steps` on chat windows only, from the bfloat16 weights in `out_dir`.

    Always starts from the stored file (also inside `train`), so resuming a
    finished phase one in a new process gives the same weights as one run.
    """
    report = progress or (lambda line: None)
    out_dir = Path(out_dir)
    streams = streams if streams is not None else build_streams(out_dir, config)
    if log is None:
        log = json.loads((out_dir / TRAINING_LOG_FILE_NAME).read_text(encoding="utf-8"))
        log["phase_one_held_out_loss_bf16"] = log["final_held_out_loss_bf16"]
        log["config"] = attrs.asdict(config)
        if "train_wall_s" in log and "phase_wall_s" not in log:
            log["phase_wall_s"] = [log["train_wall_s"]]
    model = _build_model(llama_config(config))
    model.load_weights(str(out_dir / WEIGHTS_FILE_NAME))
    model.set_dtype(mx.float32)
    rng = np.random.default_rng(config.seed + 1)

    def chat_batch() -> tuple[np.ndarray]:
        return (sample_windows(rng, streams.chat_train, config.batch_rows, config.window_tokens),)

    schedule = optim.cosine_decay(config.chat_learning_rate, config.chat_steps, end=config.learning_rate_final)
    first_step = config.steps + 1
    _train_loop(
        out_dir,
        model,
        schedule,
        chat_batch,
        config,
        streams,
        log,
        first_step=first_step,
        steps=config.chat_steps,
        report=report,
    )
    return log


def masked_token_loss(model: nn.Module, windows: mx.array, mask: mx.array) -> mx.array:
    """Next-token cross-entropy averaged over the tokens `mask` marks (the assistant's), by their weights."""
    logits = model(windows[:, :-1])
    losses = nn.losses.cross_entropy(logits.astype(mx.float32), windows[:, 1:]) * mask
    return losses.sum() / mx.maximum(mask.sum(), 1.0)


def train_tool_phase(
    out_dir: Path,
    config: TrainingConfig,
    progress: ProgressCallback | None = None,
    *,
    streams: TokenStreams | None = None,
    log: dict[str, Any] | None = None,
    restart: bool = False,
) -> dict[str, Any]:
    """Phase three: `tool_steps` (`tool_restart_steps` when `restart`) on whole conversations with
    the loss on the assistant's tokens, from the bfloat16 weights in `out_dir` (like phase two, so
    resuming gives the same weights).

    Phases one and two train on windows cut anywhere in a stream of chats
    longer than a window, so few windows hold a tool list, the request and
    the call together; here each row is one whole chat and only what the
    model must write is scored.
    """
    report = progress or (lambda line: None)
    out_dir = Path(out_dir)
    streams = streams if streams is not None else build_streams(out_dir, config)
    rows = build_conversation_rows(out_dir, config)
    if log is None:
        log = json.loads((out_dir / TRAINING_LOG_FILE_NAME).read_text(encoding="utf-8"))
        log["config"] = attrs.asdict(config)
    if not restart:
        log["phase_two_held_out_loss_bf16"] = log["final_held_out_loss_bf16"]
    model = _build_model(llama_config(config))
    model.load_weights(str(out_dir / WEIGHTS_FILE_NAME))
    model.set_dtype(mx.float32)
    rng = np.random.default_rng(config.seed + (1002 if restart else 2))
    tool_batch = _tool_batches(rows, config, rng)
    held_out_batch = [
        mx.array(array) for array in conversation_batch(rows.held_out_tool, 10**6, config.row_tokens_quantum)
    ]
    choice = None
    if config.tool_validation_prompts:
        choice = _CheckpointChoice(config, out_dir, log, start=model if restart else None)

    def assistant_eval(model: nn.Module, step_index: int) -> dict[str, float]:
        figures = {"assistant_loss": item_float(masked_token_loss(model, *held_out_batch))}
        if choice is not None:
            figures["validation_tool_call_share"] = choice.offer(model, step_index, figures["assistant_loss"])
        return figures

    steps = config.tool_restart_steps if restart else config.tool_steps
    _train_loop(
        out_dir,
        model,
        _tool_schedule(config, steps),
        tool_batch,
        config,
        streams,
        log,
        first_step=config.steps + config.chat_steps + (config.tool_steps if restart else 0) + 1,
        steps=steps,
        report=report,
        loss_function=masked_token_loss,
        assistant_eval=assistant_eval,
        eval_every_steps=config.tool_eval_every_steps,
    )
    if choice is not None:
        choice.adopt(out_dir, model, _eval_windows(config, streams), report)
    return log


def _tool_batches(rows: Any, config: TrainingConfig, rng: np.random.Generator) -> Callable[[], tuple[Any, Any]]:
    """Phase three's batch source: `tool_row_share` of each batch from the tool
    chats (all of one padded length class when `tool_rows_by_length`), the rest plain chats."""
    tool_rows = round(config.batch_rows * config.tool_row_share)
    quantum, tokens_max = config.row_tokens_quantum, config.conversation_tokens_max
    length_classes = tool_length_classes(rows.tool, quantum, tokens_max) if config.tool_rows_by_length else {}

    def tool_batch() -> tuple[np.ndarray, np.ndarray]:
        if length_classes:
            first = rows.tool[int(rng.integers(0, len(rows.tool)))]
            same_class = length_classes[padded_tokens(len(first.ids), quantum, tokens_max)]
            picked = [first] + [same_class[index] for index in rng.integers(0, len(same_class), tool_rows - 1)]
        else:
            picked = [rows.tool[index] for index in rng.integers(0, len(rows.tool), tool_rows)]
        picked += [rows.plain[index] for index in rng.integers(0, len(rows.plain), config.batch_rows - tool_rows)]
        return conversation_batch(picked, tokens_max, quantum)

    return tool_batch


def _tool_schedule(config: TrainingConfig, steps: int) -> Any:
    """Phase three's learning rate: a 10-step linear warm-up, then a cosine decay."""
    warmup_steps = min(10, steps)
    warmup = optim.linear_schedule(config.tool_learning_rate / 10, config.tool_learning_rate, warmup_steps)
    decay = optim.cosine_decay(config.tool_learning_rate, steps, end=config.learning_rate_final / 3)
    return optim.join_schedules([warmup, decay], [warmup_steps])


class _CheckpointChoice:
    """Phase three's checkpoint choice (`TrainingConfig.tool_validation_prompts`): scores each
    evaluation's weights and keeps the best in memory; `adopt` ends the round on them.

    A restart round starts from the weights its first round kept (the file it loads), with their
    score from the log as the one to beat, so resuming in a new process keeps the same weights.
    """

    def __init__(self, config: TrainingConfig, model_dir: Path, log: dict[str, Any], start: nn.Module | None):
        self._log = log
        self._scorer = ToolCallScorer(
            model_dir, lambda: _build_model(llama_config(config)), config.tool_validation_prompts
        )
        kept = log.get("tool_checkpoint") if start is not None else None
        self._best = CheckpointScore(**kept) if kept is not None else None
        self._best_weights = _bfloat16_weights(start) if start is not None else {}

    def offer(self, model: nn.Module, step_index: int, assistant_loss: float) -> float:
        share = self._scorer.share(model)
        score = CheckpointScore(step=step_index, validation_tool_call_share=share, assistant_loss=assistant_loss)
        if score.beats(self._best):
            self._best, self._best_weights = score, _bfloat16_weights(model)
            self._log["tool_checkpoint"] = attrs.asdict(score)
        return share

    def adopt(self, out_dir: Path, model: nn.Module, eval_windows: list[np.ndarray], report: ProgressCallback) -> None:
        """Put the kept weights into `model` (left in bfloat16), measure their held-out loss and
        save them as the model."""
        assert self._best is not None, "a round evaluates at least at its last step"
        model.load_weights(list(self._best_weights.items()))
        final_loss = held_out_loss(model, eval_windows)
        self._log["final_held_out_loss_bf16"] = round(final_loss, 4)
        self._log["final_held_out_perplexity_bf16"] = round(math.exp(final_loss), 2)
        _save(out_dir, model, self._log)
        report(
            f"kept step {self._best.step}'s weights: validation tool-call share "
            f"{self._best.validation_tool_call_share:.2f}, held-out loss {final_loss:.3f}"
        )


def _bfloat16_weights(model: nn.Module) -> dict[str, mx.array]:
    weights = {name: weight.astype(mx.bfloat16) for name, weight in _flat_parameters(model)}
    mx.eval(weights)
    return weights


def train_from_model(
    out_dir: Path, source_dir: Path, config: TrainingConfig, progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """The rest of phase three, from a model whose earlier phases ran with this `config`: its
    files and training log are copied into `out_dir` first. From a phase-two model (e.g. the
    demo-coder committed before phase three) both rounds of phase three run; from one that
    finished phase three's first round, the warm restart alone.

    Gives the same weights as `train(out_dir, config)` when `source_dir` holds that run's output
    of the earlier phases. Raises `ModelError` when `source_dir`'s log shows other settings for
    them, or no phase of phase three is left to run.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    try:
        source_log = json.loads((source_dir / TRAINING_LOG_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{source_dir} has no readable {TRAINING_LOG_FILE_NAME}: {e}") from e
    phases_done = len(source_log.get("phase_wall_s", [None]))
    later_keys = {"tool_restart_steps", *EVALUATION_SETTINGS}
    if phases_done == 2:
        later_keys |= {"tool_steps", "tool_learning_rate", "tool_conversations", "tool_row_share"}
        later_keys |= {"conversation_tokens_max", "row_tokens_quantum", "tool_rows_by_length"}
        later_keys |= {"tool_varied_value_share", "tool_choice_loss_weight", "tool_rounds_max"}
        later_keys |= {"tool_validation_prompts"}
    wanted = {key: value for key, value in attrs.asdict(config).items() if key not in later_keys}
    # A log written before a setting existed ran with its neutral value.
    found = {key: source_log["config"].get(key, SETTINGS_BEFORE_THEY_EXISTED.get(key)) for key in wanted}
    if (
        found != wanted
        or phases_done not in (2, 3)
        or not config.tool_steps
        or (phases_done == 3 and not config.tool_restart_steps)
    ):
        raise ModelError(
            f"{source_dir} did not stop before the end of phase three with this configuration "
            f"({phases_done} phases done; its log: {found})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    # The tokenizer comes with the weights: it was trained (or chosen) by the earlier phases.
    for name in ("config.json", WEIGHTS_FILE_NAME, *TOKENIZER_FILE_NAMES):
        (out_dir / name).write_bytes((source_dir / name).read_bytes())

    source_log["config"] = attrs.asdict(config)
    log = source_log
    if phases_done == 2:
        log = train_tool_phase(out_dir, config, progress, log=log)
    if config.tool_restart_steps:
        log = train_tool_phase(out_dir, config, progress, log=log, restart=True)
    _plot_loss_curve(log, out_dir / LOSS_CURVE_FILE_NAME)
    return log


def _build_model(model_config: dict[str, Any]) -> nn.Module:
    try:
        module = importlib.import_module("mlx_lm.models.llama")
        return module.Model(module.ModelArgs.from_dict(model_config))
    except (ImportError, TypeError, ValueError) as e:
        raise ModelError(f"mlx-lm cannot build the demo-coder llama: {e}") from e


def _train_loop(
    out_dir: Path,
    model: nn.Module,
    schedule: Callable[[mx.array], mx.array],
    next_batch: Callable[[], tuple[np.ndarray, ...]],
    config: TrainingConfig,
    streams: TokenStreams,
    log: dict[str, Any],
    *,
    first_step: int,
    steps: int,
    report: ProgressCallback,
    loss_function: Callable[..., mx.array] = token_loss,
    assistant_eval: Callable[[nn.Module, int], dict[str, float]] | None = None,
    eval_every_steps: int | None = None,
) -> None:
    """`steps` AdamW steps of `loss_function(model, *next_batch())`, evaluating and saving every
    `eval_every_steps` (`assistant_eval` adds a second held-out figure), then the held-out loss
    of the bfloat16 weights (the model is left in bfloat16)."""
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=config.weight_decay)
    loss_and_grad = nn.value_and_grad(model, loss_function)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*arrays: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, *arrays)
        optimizer.update(model, grads)
        return loss

    eval_windows = _eval_windows(config, streams)
    last_step = first_step + steps - 1
    eval_every_steps = eval_every_steps or config.eval_every_steps
    started_s = time.monotonic()
    for step_index in range(first_step, last_step + 1):
        loss = step(*(mx.array(array) for array in next_batch()))
        mx.eval(loss, state)
        log["train_loss"].append(round(item_float(loss), 4))
        if (step_index - first_step + 1) % eval_every_steps == 0 or step_index == last_step:
            loss_now = held_out_loss(model, eval_windows)
            elapsed_s = time.monotonic() - started_s
            point = {"step": step_index, "loss": round(loss_now, 4), "elapsed_s": round(elapsed_s, 1)}
            losses = f"train {item_float(loss):.3f}, held-out {loss_now:.3f}"
            if assistant_eval is not None:
                figures = assistant_eval(model, step_index)
                point.update({name: round(value, 4) for name, value in figures.items()})
                losses += f", held-out assistant tokens {figures['assistant_loss']:.3f}"
                if "validation_tool_call_share" in figures:
                    losses += f", validation tool calls {figures['validation_tool_call_share']:.2f}"
            log["held_out"].append(point)
            total_steps = config.steps + config.chat_steps + config.tool_steps + config.tool_restart_steps
            report(f"step {step_index}/{total_steps}: {losses}, {elapsed_s:.0f} s")
            _save(out_dir, model, log)
    model.set_dtype(mx.bfloat16)
    final_loss = held_out_loss(model, eval_windows)
    log.setdefault("phase_wall_s", []).append(round(time.monotonic() - started_s, 1))
    log["train_wall_s"] = round(sum(log["phase_wall_s"]), 1)
    log["final_held_out_loss_bf16"] = round(final_loss, 4)
    log["final_held_out_perplexity_bf16"] = round(math.exp(final_loss), 2)
    _save(out_dir, model, log)
    report(f"held-out loss (bfloat16 weights): {final_loss:.3f}, perplexity {math.exp(final_loss):.1f}")


def _eval_windows(config: TrainingConfig, streams: TokenStreams) -> list[np.ndarray]:
    return [
        fixed_windows(streams.code_held_out, config.eval_windows // 2, config.window_tokens),
        fixed_windows(streams.chat_held_out, config.eval_windows // 2, config.window_tokens),
    ]


def _save(out_dir: Path, model: nn.Module, log: dict[str, Any]) -> None:
    weights = {name: weight.astype(mx.bfloat16) for name, weight in _flat_parameters(model)}
    write_safetensors(out_dir / WEIGHTS_FILE_NAME, weights)
    (out_dir / TRAINING_LOG_FILE_NAME).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")


def _flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    return list(tree_flatten(model.parameters()))  # type: ignore[arg-type]  # stubs type the leaves loosely


def _versions() -> dict[str, str]:
    import mlx_lm
    import tokenizers

    from kvcellar.blas_preload import loaded_blas, openblas_core

    return {
        "blas": loaded_blas(),
        "blas_core": openblas_core(),
        "python": platform.python_version(),
        "mlx": mlx_version(),
        "mlx_lm": mlx_lm.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }


def _plot_loss_curve(log: dict[str, Any], path: Path) -> None:
    """The training and held-out loss against the step (and phase three's validation tool-call
    share, when it was measured), when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(range(1, len(log["train_loss"]) + 1), log["train_loss"], label="training batch", linewidth=0.8)
    axes.plot(
        [point["step"] for point in log["held_out"]],
        [point["loss"] for point in log["held_out"]],
        label="held out",
        marker="o",
    )
    if log["config"].get("chat_steps"):
        axes.axvline(log["config"]["steps"] + 0.5, color="grey", linestyle="--", linewidth=0.8)
        axes.text(log["config"]["steps"] + 2, 0.02, "chats only", color="grey", transform=axes.get_xaxis_transform())
    if log["config"].get("tool_steps"):
        phase_three_start = log["config"]["steps"] + log["config"]["chat_steps"]
        axes.axvline(phase_three_start + 0.5, color="grey", linestyle="--", linewidth=0.8)
        axes.text(
            phase_three_start + 2,
            0.02,
            "whole chats,\nassistant tokens",
            color="grey",
            transform=axes.get_xaxis_transform(),
        )
        if log["config"].get("tool_restart_steps"):
            restart_step = phase_three_start + log["config"]["tool_steps"]
            axes.axvline(restart_step + 0.5, color="grey", linestyle=":", linewidth=0.8)
        assistant = [point for point in log["held_out"] if "assistant_loss" in point]
        axes.plot(
            [point["step"] for point in assistant],
            [point["assistant_loss"] for point in assistant],
            label="held-out tool chats, assistant tokens",
            marker="s",
        )
    _plot_validation_share(axes, log)
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats/token)")
    axes.set_title(f"demo-coder: {log['parameters']:,} parameters, {log['tokens_per_step']} tokens/step")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def _plot_validation_share(axes: Any, log: dict[str, Any]) -> None:
    """Phase three's validation tool-call shares on a right-hand axis, the kept step circled."""
    scored = [point for point in log["held_out"] if "validation_tool_call_share" in point]
    if not scored:
        return
    share_axes = axes.twinx()
    share_axes.plot(
        [point["step"] for point in scored],
        [point["validation_tool_call_share"] for point in scored],
        color="tab:red",
        marker="^",
        linewidth=0.8,
        label="validation tool-call share (right)",
    )
    kept = log.get("tool_checkpoint")
    if kept is not None:
        kept_point = ([kept["step"]], [kept["validation_tool_call_share"]])
        share_axes.scatter(*kept_point, s=160, facecolors="none", edgecolors="k", label="kept")
    share_axes.set_ylim(0, 1)
    share_axes.set_ylabel("share of validation tool prompts")
    share_axes.legend(fontsize="small", loc="upper center")
