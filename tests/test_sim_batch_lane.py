"""The simulator on the batch lane: the fake model as rows of mlx-lm's
`BatchGenerator`, `BatchLoop`'s non-waiting seam, and simulated runs whose
requests share decode steps."""

from __future__ import annotations

import json
import queue
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

from kvcellar.cli import main
from kvcellar.engine.batch import END_OF_BATCH, BatchLoop, BatchRow, BatchStep, RowDone, model_batch_refusal
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationRequest
from kvcellar.simulations.fake_engine import FakeModel, cache_arrays, fake_loaded_model
from kvcellar.simulations.harness import Lane, RunOptions, lane_for_seed, simulate
from kvcellar.simulations.observer import arrays_equal
from kvcellar.simulations.sweep import SweepPlan

# Lengths that differ (left and right padding), exceed the prefill step (chunks)
# and outnumber the rows (a row joins a running batch).
PROMPTS = tuple(tuple((11 * i + 5 * k) % 60 for i in range(length)) for k, length in enumerate((7, 30, 2, 13, 19)))
MAX_TOKENS = (5, 9, 3, 6, 4)


def _serial(model: FakeModel, prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], list]:
    """Greedy tokens of the model run on its own caches, one call per token, and those caches."""
    caches = model.make_cache()
    logits = np.array(model(mx.array([prompt]), cache=caches))
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        tokens.append(int(logits[0, -1].argmax()))
        logits = np.array(model(mx.array([[tokens[-1]]]), cache=caches))
    return tokens, caches


def _batched(model: FakeModel, seeded_caches: dict[int, list]) -> tuple[dict, dict]:
    """Every prompt as a row (some seeded with caches of their prefix): tokens and extracted caches per row."""
    generator = BatchGenerator(model, completion_batch_size=3, prefill_batch_size=3, prefill_step_size=8)
    uids = []
    for index, prompt in enumerate(PROMPTS):
        seed = seeded_caches.get(index)
        cached = 0 if seed is None else seed[1]
        (uid,) = generator.insert(
            [list(prompt[cached:])],
            max_tokens=[MAX_TOKENS[index]],
            caches=[None if seed is None else seed[0]],
            all_tokens=[list(prompt[:cached])],
        )
        uids.append(uid)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    extracted: dict[int, tuple[list, list[int]]] = {}
    while len(extracted) < len(uids):
        _, responses = generator.next()
        for response in responses:
            tokens[response.uid].append(response.token)
            if response.finish_reason is not None:
                extracted[response.uid] = (response.prompt_cache, list(response.all_tokens))
    generator.close()
    return {i: tokens[uid] for i, uid in enumerate(uids)}, {i: extracted[uid] for i, uid in enumerate(uids)}


@pytest.mark.parametrize("recurrent", [False, True], ids=["plain", "recurrent"])
def test_fake_model_rows_of_a_batch_generate_the_serial_tokens_and_extract_the_exact_serial_caches(recurrent):
    model = FakeModel(recurrent=recurrent)
    assert model_batch_refusal(model) is None
    seeded = {}
    for index in (1, 4):  # rows resumed from caches of a prefix, as the prompt cache lends them
        prefix = PROMPTS[index][:10]
        caches = model.make_cache()
        model(mx.array([prefix]), cache=caches)
        seeded[index] = (caches, len(prefix))
    tokens, extracted = _batched(model, seeded)
    for index, prompt in enumerate(PROMPTS):
        serial_tokens, serial_caches = _serial(model, prompt, MAX_TOKENS[index])
        assert tokens[index] == serial_tokens, f"row {index}"
        caches, all_tokens = extracted[index]
        assert all_tokens == [*prompt, *serial_tokens]
        assert arrays_equal(cache_arrays(caches, len(all_tokens)), model.expected_layer_arrays(all_tokens))
        assert arrays_equal(cache_arrays(serial_caches, len(all_tokens)), model.expected_layer_arrays(all_tokens))


def test_rows_removed_mid_prefill_and_mid_decode_hand_back_exactly_the_tokens_they_ran():
    model = FakeModel(recurrent=True)
    generator = BatchGenerator(model, completion_batch_size=3, prefill_batch_size=3, prefill_step_size=8)
    prefilling, decoding, _ = generator.insert(
        [list(PROMPTS[1]), list(PROMPTS[3]), list(PROMPTS[0])], max_tokens=[50, 50, 50]
    )
    removed = {}
    for step in range(8):
        generator.next()
        if step == 1:
            removed.update(generator.remove([prefilling], return_prompt_caches=True))
    removed.update(generator.remove([decoding], return_prompt_caches=True))
    generator.close()
    assert len(removed[prefilling][1]) < len(PROMPTS[1])
    assert len(removed[decoding][1]) > len(PROMPTS[3])
    for caches, tokens in removed.values():
        assert arrays_equal(cache_arrays(caches, len(tokens)), model.expected_layer_arrays(list(tokens)))


def _row(row_id: int, prompt: tuple[int, ...]) -> BatchRow:
    request = GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=2), use_prompt_cache=False)
    return BatchRow(row_id=row_id, request=request, cancelled=threading.Event())


def test_a_batch_loop_that_may_not_wait_yields_empty_steps_until_rows_arrive():
    inbox: queue.Queue = queue.Queue()
    loop = BatchLoop(None, inbox, rows_max=2, cancelled=threading.Event(), wait_for_rows=False)
    steps = loop.run(fake_loaded_model())
    assert next(steps) == BatchStep(events=(), decode_rows=0)
    inbox.put(_row(1, PROMPTS[0]))
    inbox.put(_row(2, PROMPTS[2]))
    ends = []
    while len(ends) < 2:
        ends += [event for event in next(steps).events if isinstance(event, RowDone)]
    assert {(end.row_id, end.outcome) for end in ends} == {(1, "completed"), (2, "completed")}
    assert next(steps) == BatchStep(events=(), decode_rows=0)
    inbox.put(END_OF_BATCH)
    assert list(steps) == []


def test_about_half_the_seeds_draw_the_batch_lane_and_forcing_rows_keeps_the_seeds_budget():
    lanes = [lane_for_seed(seed) for seed in range(200)]
    batched = [lane for lane in lanes if lane.rows > 1]
    assert 70 < len(batched) < 130
    assert {lane.rows for lane in batched} == {2, 3, 4}
    assert len({lane.kv_budget_bytes for lane in batched}) > 1
    assert lane_for_seed(15, 1) == Lane(rows=1, kv_budget_bytes=lanes[15].kv_budget_bytes)


def test_a_run_forced_onto_the_batch_lane_holds_every_invariant_and_its_rows_share_decode_steps():
    result = simulate(RunOptions(seed=7, batch_rows=3, faults=frozenset({"fsync", "enospc"})))
    assert result.ok, result.violations
    assert result.batch_rows == 3
    assert sum(steps for rows, steps in result.decode_steps_by_rows.items() if rows > 1) > 0
    assert result.claims_checked > 0 and result.crashes > 0


def test_seed_10_a_batch_row_cut_off_by_a_crash_is_not_a_failed_request():
    # Found by the simulator: a crash during a burst cancels the batch job, whose
    # rows then fail with BatchAborted (a serial request is only cancelled); the
    # process is dead by then, so no client is left to see that failure.
    result = simulate(RunOptions(seed=10, batch_rows=3, faults=frozenset({"enospc"})))
    assert result.ok, result.violations
    assert result.crashes > 0


def test_the_same_batch_lane_seed_gives_the_same_journal_byte_for_byte():
    first = simulate(RunOptions(seed=12, batch_rows=4))
    second = simulate(RunOptions(seed=12, batch_rows=4))
    assert first.decode_steps_by_rows == second.decode_steps_by_rows
    assert (first.journal_digest, first.disk_digest) == (second.journal_digest, second.disk_digest)


def test_a_forced_lane_is_part_of_the_replay_command_and_a_drawn_one_is_not():
    assert "--batch-rows 3" in SweepPlan(seed=1, batch_rows=3).replay_command(1, 40)
    assert "--batch-rows" not in SweepPlan(seed=1).replay_command(1, 40)


def test_cli_batch_rows_puts_every_run_on_that_lane_and_counts_shared_decode_steps(capsys):
    assert main(["simulate", "--seed", "7", "--runs", "2", "--faults", "none", "--batch-rows", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["batch_lane_runs"], summary["serial_lane_runs"]) == (2, 0)
    assert summary["shared_decode_steps"] > 0
    assert main(["simulate", "--seed", "7", "--runs", "2", "--faults", "none", "--batch-rows", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["batch_lane_runs"], summary["serial_lane_runs"], summary["shared_decode_steps"]) == (0, 2, 0)
