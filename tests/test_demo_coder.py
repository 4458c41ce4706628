"""The committed demo-coder model: its files, what it writes, and `serve`'s default.

The weights are package data (engine/assets/demo-coder); their sha256 is
pinned so an accidental retrain or edit shows up here. The quality checks use
the same measures as the figures script (`kvcellar.bench.demo_model`), on a
few of its held-out prompts, greedy, so they are deterministic.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import time

import attrs
import httpx
import pytest

from kvcellar.bench.demo_model import chat_request, is_mostly_printable, names_only_offered_tools
from kvcellar.demo import corpus as demo_corpus
from kvcellar.demo.conversations import (
    build_conversation_rows,
    conversation_batch,
    padded_tokens,
    tool_length_classes,
)
from kvcellar.demo.train import TRAINING_LOG_FILE_NAME, train, train_from_model
from kvcellar.demo.train_tokenizer import train_corpus_tokenizer
from kvcellar.demo.training_config import TrainingConfig
from kvcellar.engine.demo_models import DEMO_CODER_DIR, count_parameters, packaged_demo_coder_dir
from kvcellar.errors import ModelError

DEMO_CODER_WEIGHTS_SHA256 = "869c337c22450192d0e139eec30571d1bacfbf5fafdbf68606732523f3aaf546"
# A held-out tool prompt the committed model answers with a call to an offered tool (greedy) even
# with the tool-call grammar off; 3 of the 20 then get a call to a tool that was not offered
# (docs/demo-model.md). The server's default grammar keeps every call to offered tools.
TOOL_PROMPT_INDEX = 2
WEIGHTS_BYTES_MAX = 25 * 10**6


@pytest.fixture(scope="module")
def demo_coder():
    from mlx_lm import load

    return load(str(packaged_demo_coder_dir()))


def test_the_committed_weights_are_pinned_small_and_bfloat16():
    weights_path = DEMO_CODER_DIR / "model.safetensors"
    assert hashlib.sha256(weights_path.read_bytes()).hexdigest() == DEMO_CODER_WEIGHTS_SHA256
    assert weights_path.stat().st_size <= WEIGHTS_BYTES_MAX
    assert 4_500_000 <= count_parameters(DEMO_CODER_DIR) <= 20_000_000
    header_bytes = weights_path.read_bytes()[8 : 8 + int.from_bytes(weights_path.read_bytes()[:8], "little")]
    dtypes = {entry["dtype"] for name, entry in json.loads(header_bytes).items() if name != "__metadata__"}
    assert dtypes == {"BF16"}
    log = json.loads((DEMO_CODER_DIR / TRAINING_LOG_FILE_NAME).read_text())
    assert log["final_held_out_loss_bf16"] < log["held_out"][0]["loss"]


def test_mlx_lm_loads_it_with_tool_calling(demo_coder):
    _, tokenizer = demo_coder
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_call_start == "<tool_call>"
    assert tokenizer.tool_parser('{"name": "f", "arguments": {}}') == {"name": "f", "arguments": {}}


def test_greedy_replies_to_held_out_prompts_are_mostly_printable_words(demo_coder):
    from mlx_lm import generate

    model, tokenizer = demo_coder
    for conversation in demo_corpus.held_out_chat_prompts()[:3]:
        prompt = tokenizer.apply_chat_template(conversation.messages, add_generation_prompt=True)
        reply = generate(model, tokenizer, prompt, max_tokens=48)
        assert is_mostly_printable(reply), reply


def _start_serve_without_model() -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--port", str(port), "--batch", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited: {process.stdout.read() if process.stdout else ''}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    pytest.fail("server did not become healthy")


def test_serve_without_model_serves_demo_coder_and_it_calls_a_tool():
    process, base = _start_serve_without_model()
    try:
        models = httpx.get(f"{base}/v1/models", timeout=5).json()
        assert [model["id"] for model in models["data"]] == ["demo-coder"]
        conversation = demo_corpus.held_out_tool_prompts()[TOOL_PROMPT_INDEX]
        reply = httpx.post(f"{base}/v1/chat/completions", json=chat_request(conversation), timeout=60).json()
        message = reply["choices"][0]["message"]
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
        assert names_only_offered_tools(message, conversation), message
        json.loads(message["tool_calls"][0]["function"]["arguments"])
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def test_tool_conversations_render_to_calls_mlx_lm_parses(demo_coder):
    _, tokenizer = demo_coder
    conversation = demo_corpus.tool_conversation(random.Random(5))
    text = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=False)
    # The last block: the system turn's instructions mention the tags too.
    call_text = text.rsplit("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    call = tokenizer.tool_parser(call_text)
    assert call["name"] in {tool["function"]["name"] for tool in conversation.tools}
    assert call["arguments"] == conversation.messages[-3]["tool_calls"][0]["function"]["arguments"]


def test_held_out_tool_arguments_never_occur_in_training_pools():
    for training_values, held_out_values in demo_corpus.VALUE_POOLS.values():
        assert not set(training_values) & set(held_out_values)
    assert not set(demo_corpus.TRAINING_MODULES) & set(demo_corpus.HELD_OUT_MODULES)
    first = [c.messages for c in demo_corpus.held_out_tool_prompts()]
    assert first == [c.messages for c in demo_corpus.held_out_tool_prompts()]
    assert len(demo_corpus.held_out_chat_prompts()) == 20


TINY_TRAINING = TrainingConfig(
    tokenizer_ids=600,
    steps=2,
    chat_steps=1,
    tool_steps=1,
    tool_restart_steps=1,
    tool_varied_value_share=0.5,
    tool_choice_loss_weight=3.0,
    batch_rows=2,
    window_tokens=32,
    warmup_steps=1,
    chat_conversations=8,
    tool_conversations=8,
    conversation_tokens_max=128,
    # Not the default: so the training and resume tests run the length-class draw too.
    row_tokens_quantum=64,
    tool_rows_by_length=True,
    tool_validation_prompts=2,
    eval_every_steps=1,
    eval_windows=2,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def test_the_corpus_tokenizer_keeps_identifiers_whole_and_the_special_ids():
    from tokenizers import Tokenizer

    texts = ['def get_weather(city):\n    return self.__dict__["city"]\n'] * 50
    texts += ['<tool_call>\n{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}\n</tool_call>'] * 50
    content = train_corpus_tokenizer(texts, 330)
    tokenizer = Tokenizer.from_str(json.dumps(content))
    assert tokenizer.get_vocab_size() == 330 and len(content["model"]["vocab"]) == 330
    assert [tokenizer.token_to_id(token) for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # Pieces are what BPE may merge into one token: an identifier is one piece, underscores and all.
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str('x = get_stock_price(self.__dict__)"')]
    assert pieces == ["x", "Ġ=", "Ġget_stock_price", "(", "self", ".", "__dict__", ')"']
    unseen = "naïve ünïcode 12345 \t tabs\n"
    assert tokenizer.decode(tokenizer.encode(unseen).ids) == unseen
    with pytest.raises(ModelError, match="too few distinct pieces for 600 ids"):
        train_corpus_tokenizer(texts, 600)


def test_model_train_refuses_a_tokenizer_smaller_than_its_byte_alphabet(tmp_path, capsys):
    from kvcellar.cli import main

    assert main(["model", "train", str(tmp_path / "out"), "--tokenizer-ids", "300"]) == 2
    assert "--tokenizer-ids must be 0 or at least 512 (got 300)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_model_train_refuses_no_steps_after_phase_one_warm_up(tmp_path, capsys):
    from kvcellar.cli import main

    assert main(["model", "train", str(tmp_path / "out"), "--steps", "20"]) == 2
    assert "--steps must be more than phase one's 20 warm-up steps (got 20)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_writes_a_model_mlx_lm_loads_and_its_log_and_resuming_phase_three_gives_the_same_weights(tmp_path):
    from mlx_lm import load

    log = train(tmp_path / "model", TINY_TRAINING)
    trained_vocab = json.loads((tmp_path / "model" / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(trained_vocab) == TINY_TRAINING.tokenizer_ids
    assert len(log["train_loss"]) == 5 and [point["step"] for point in log["held_out"]] == [1, 2, 3, 4, 5]
    assert log["phase_one_held_out_loss_bf16"] > 0 and len(log["phase_wall_s"]) == 4
    assert log["phase_two_held_out_loss_bf16"] > 0 and log["held_out"][-1]["assistant_loss"] > 0
    # Each phase-three evaluation scored the validation prompts; the kept step is one of them.
    shares = {point["step"]: point["validation_tool_call_share"] for point in log["held_out"][3:]}
    assert set(shares) == {4, 5} and all(0 <= share <= 1 for share in shares.values())
    assert log["tool_checkpoint"]["validation_tool_call_share"] == shares[log["tool_checkpoint"]["step"]]
    _, tokenizer = load(str(tmp_path / "model"))
    assert tokenizer.has_tool_calling
    assert json.loads((tmp_path / "model" / TRAINING_LOG_FILE_NAME).read_text())["final_held_out_loss_bf16"] > 0

    # Evaluated less often, the same weights: evaluations are forward passes only, and resuming
    # does not ask for the same cadence.
    train(tmp_path / "phase-two", attrs.evolve(TINY_TRAINING, tool_steps=0, eval_every_steps=1000))
    train(tmp_path / "phase-three-round-one", attrs.evolve(TINY_TRAINING, tool_restart_steps=0))
    for source in ("phase-two", "phase-three-round-one"):
        resumed = train_from_model(tmp_path / f"from-{source}", tmp_path / source, TINY_TRAINING)
        weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("model", f"from-{source}")]
        assert weights[0] == weights[1] and resumed["train_loss"] == log["train_loss"]
    with pytest.raises(ModelError, match="did not stop before the end of phase three"):
        train_from_model(tmp_path / "again", tmp_path / "model", TINY_TRAINING)


def test_phase_three_scores_only_what_the_assistant_writes():
    rows = build_conversation_rows(DEMO_CODER_DIR, TINY_TRAINING)
    assert len(rows.tool) == 6 and len(rows.plain) == 2 and len(rows.held_out_tool) == 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_CODER_DIR))
    for row in rows.tool:
        written = tokenizer.decode(row.ids[row.weights > 0].tolist())
        # Each round: the call's turn and the answer's, each closed by `<|im_end|>`.
        rounds = written.count("<tool_call>")
        assert written.startswith("<tool_call>") and written.count("<|im_end|>") == 2 * rounds, written
        assert 1 <= rounds <= TINY_TRAINING.tool_rounds_max
        assert "<tools>" not in written and "<tool_response>" not in written
        chosen = [tokenizer.decode([token]) for token in row.ids[row.weights > 1].tolist()]
        assert chosen[0] == "<tool_call>" and "".join(chosen).count("<tool_call>") == rounds, chosen
        assert "".join(chosen[1:]).startswith(tuple(TOOL_NAMES)), chosen
        assert set(row.weights.tolist()) == {0.0, 1.0, TINY_TRAINING.tool_choice_loss_weight}
    for row in rows.held_out_tool:
        assert set(row.weights.tolist()) == {0.0, 1.0}
    windows, mask = conversation_batch(rows.plain, 64, 64)
    assert windows.shape == (2, 65) and mask.shape == (2, 64)
    assert mask.sum() == sum(min(row.weights[1:65].sum(), 64) for row in rows.plain)


def test_phase_three_groups_tool_chats_by_their_padded_length():
    assert [padded_tokens(n, 64, 768) for n in (1, 64, 65, 700, 769, 5000)] == [64, 64, 128, 704, 768, 768]
    rows = build_conversation_rows(DEMO_CODER_DIR, TINY_TRAINING).tool
    classes = tool_length_classes(rows, 64, TINY_TRAINING.conversation_tokens_max)
    assert sorted(id(row) for group in classes.values() for row in group) == sorted(id(row) for row in rows)
    for tokens, group in classes.items():
        assert {padded_tokens(len(row.ids), 64, TINY_TRAINING.conversation_tokens_max) for row in group} == {tokens}
        windows, _ = conversation_batch(group, TINY_TRAINING.conversation_tokens_max, 64)
        assert windows.shape == (len(group), tokens + 1)


TOOL_NAMES = [spec.name for spec in demo_corpus.TOOL_SPECS]


def test_varied_tool_arguments_are_made_up_and_come_from_the_request():
    rng = random.Random(11)
    for slot, (training_values, held_out_values) in demo_corpus.VALUE_POOLS.items():
        values = {demo_corpus.varied_value(rng, slot) for _ in range(200)}
        assert len(values) > 100 and not values & (set(training_values) | set(held_out_values)), slot
        assert all(value.isascii() and value.strip() == value for value in values)
    for seed in range(20):
        conversation = demo_corpus.tool_conversation(random.Random(seed), varied_value_share=1.0)
        arguments = conversation.messages[-3]["tool_calls"][0]["function"]["arguments"]
        assert all(value in conversation.messages[-4]["content"] for value in arguments.values())
    # At share 0 the draws are those of before: phases one and two's streams stay as they were.
    assert demo_corpus.tool_conversation(random.Random(5), varied_value_share=0.0) == demo_corpus.tool_conversation(
        random.Random(5)
    )


def test_model_train_options_default_to_the_training_config_that_made_the_committed_model():
    from kvcellar.cli.model import train_command

    defaults = {param.name: param.default for param in train_command.params}
    config_defaults = attrs.asdict(TrainingConfig())
    shared = set(defaults) & set(config_defaults)
    assert {"steps", "tool_steps", "tool_varied_value_share", "tool_choice_loss_weight"} <= shared
    assert {name: defaults[name] for name in shared} == {name: config_defaults[name] for name in shared}
