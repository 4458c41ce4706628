"""`kvcellar calibrate`: measure the restore policy's cost model now and print its curve (issue 44).

The same measurement `serve` makes in about a second at its first start with
a model on a device (engine/restore_policy.py `calibrate`), run longer and
further: the prefill's tokens per second along the context up to
`--context-max` (or until `--seconds` pass), the host copy rate, and, with
`--ssd-cache`, that directory's read rate. The result replaces the persisted
model `serve` reads beside its digest memo, for this model on this device.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvcellar.cli.serve import resolve_model_dir, shard_digest_memo_dir

# The prefill's share: the copy and disk probes take about a second more, so a run stays under 20 s.
CALIBRATE_PREFILL_SECONDS_MAX = 18.0


@click.command("calibrate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help="A model directory or hub id (default: the demo-coder model).")
@click.option(
    "--seconds",
    default=15.0,
    show_default=True,
    type=click.FloatRange(min=1, max=CALIBRATE_PREFILL_SECONDS_MAX),
    help="About how long the prefill is measured (the whole run stays under 20 s beyond the model load).",
)
@click.option(
    "--context-max",
    "context_tokens_max",
    default=32768,
    show_default=True,
    type=click.IntRange(min=256),
    help="The longest context measured (capped at the model's own).",
)
@click.option(
    "--ssd-cache",
    "ssd_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also measure this directory's read rate (serve probes it again at each start).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the model as one JSON object as the last line.")
def calibrate_command(
    model: str | None, seconds: float, context_tokens_max: int, ssd_dir: Path | None, as_json: bool
) -> None:
    """Measure prefill throughput along the context and the tiers' restore rates; print and persist them."""
    from mlx_lm import load

    from kvcellar.engine.restore_policy import calibrate, cost_model_stats, prefill_curve_lines
    from kvcellar.store.cost_memo import CostKey, save_costs
    from kvcellar.store.disk import RealDisk
    from kvcellar.store.fingerprint import ShardDigestMemo, compute_fingerprint

    model_dir = resolve_model_dir(model)
    memo_dir = shard_digest_memo_dir()
    fingerprint = compute_fingerprint(model_dir, memo=ShardDigestMemo(memo_dir))
    loaded_model, tokenizer = load(str(model_dir))[:2]
    context_max = getattr(getattr(loaded_model, "args", None), "max_position_embeddings", None) or context_tokens_max
    if ssd_dir is not None:
        ssd_dir.mkdir(parents=True, exist_ok=True)
    costs = calibrate(
        loaded_model,
        int(tokenizer.vocab_size),
        disk=RealDisk() if ssd_dir is not None else None,
        directory=ssd_dir,
        context_tokens_max=min(context_tokens_max, int(context_max)),
        budget_s=seconds,
    )
    saved = save_costs(memo_dir, CostKey.of(fingerprint), costs)
    for line in prefill_curve_lines(costs):
        click.echo(line)
    click.echo(f"{'saved to' if saved else 'could not save to'} {memo_dir}")
    if as_json:
        click.echo(json.dumps(cost_model_stats(costs), sort_keys=True))
