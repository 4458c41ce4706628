"""Benchmark: the shared cold tier against a local S3 server (moto's server
mode on 127.0.0.1, a dev dependency, started here).

Three figures, each against a baseline measured in the same run:

- download + restore throughput against a raw GET of the same object (target
  >= 0.8x): `download_entry` (stream, sha256, write and fsync into a fresh SSD
  tier, full `.kvc` verification, adopt) then `restore` (load into MLX),
  against `get_object().read()` of the same bytes; alternating, medians; and
  the store's received path (`receive_entry` into memory, `kvfile.load_image`
  from it while `persist_received` commits the SSD copy on a helper thread),
  which the server's request path does not take yet;
- TTFT of a second server's first request for a prefix the first server
  shared, against a cold prefill of the same prompt on a server without the
  tier; and the fraction of the prompt it reports cached;
- the first server's decode speed while its shared tier has an upload to do
  (a previous request's entry), against the same decode with no shared tier
  (target >= 0.97x: uploads wait for an idle gateway).

Run `python -m kvcellar.bench.shared_tier --help` for the options.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import click
import numpy as np
import trio
from rich.console import Console

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.actors.uploader import SharedCacheConfig
from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    docs_section,
    load_note,
    machine_sentence,
    model_option,
    publish_figures,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.bench.writebehind import prompt_token_ids
from kvcellar.engine.demo_models import DEMO_ARCH
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta
from kvcellar.store import kvfile
from kvcellar.store.s3_objects import S3ObjectStore
from kvcellar.store.shared_tier import SharedKeys, UploadPolicyConfig
from kvcellar.store.shared_transfer import download_entry, fetch_manifest, persist_received, receive_entry
from kvcellar.store.ssd import SsdStore

MODEL_SIZE = "small"
TARGET_RESTORE_RATIO, TARGET_DECODE_RATIO = 0.8, 0.97
DOCS_BEGIN, DOCS_END = docs_markers("shared_tier")
FIGURE_COLUMNS = ("measurement", "median", "range", "note")
BUCKET = "kvcellar-bench"


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's server in its own process, so its CPU time and GIL are not the
    measured server's."""
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    server.kill()
    raise click.ClickException("moto's server did not start within 60 s")


def _shared(endpoint: str, prefix: str) -> SharedCacheConfig:
    return SharedCacheConfig(
        url=f"s3://{BUCKET}/{prefix}",
        endpoint_url=endpoint,
        refresh_s=3600,
        request_timeout_s=60,
        download_min_gain_tokens=1,
        upload=UploadPolicyConfig(min_tokens=1),
    )


async def _generate(system: Any, prompt: tuple[int, ...], new_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, stop_token_ids=frozenset())
    arrivals: list[float] = []
    done: GenerationDone | None = None
    started = time.perf_counter()
    async for item in system.generate(GenerationRequest(prompt_ids=prompt, params=params)):
        if isinstance(item, TokenDelta) and item.token_id >= 0:
            arrivals.append(time.perf_counter())
        elif isinstance(item, GenerationDone):
            done = item
    if done is None or len(arrivals) < 2:
        raise click.ClickException("the generation produced no decode to time")
    return {
        "ttft_s": arrivals[0] - started,
        "decode_tok_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
        "cached_tokens": done.cached_tokens,
    }


def _config(model_dir: Path, ssd_dir: Path, shared: SharedCacheConfig | None) -> SystemConfig:
    return SystemConfig(model_dir=model_dir, ssd_dir=ssd_dir, demote_idle_s=0, shared_cache=shared)


async def _share_prompt(model_dir: Path, workdir: Path, endpoint: str, prompt: tuple[int, ...]) -> str:
    """Server A: a cold run of `prompt`, shared; returns the fingerprint."""
    async with open_system(_config(model_dir, workdir / "a", _shared(endpoint, "bench"))) as system:
        await _generate(system, prompt, 8)
        _, shared = await system.flush_shared(timeout_s=120)
        if not shared["durable"]:
            raise click.ClickException(f"the first server could not share its entries: {shared}")
        assert system.store is not None
        return system.store.fingerprint


def _restore_vs_get(workdir: Path, endpoint: str, fingerprint: str, prompt: tuple[int, ...], repeats: int):
    """Alternating raw GETs and download+restores of the longest shared entry."""
    objects = S3ObjectStore.open(BUCKET, endpoint_url=endpoint, connect_timeout_s=2, read_timeout_s=60, max_attempts=3)
    keys = SharedKeys("bench", fingerprint)
    manifests = [fetch_manifest(objects, key) for key in objects.list_keys(keys.directory) if keys.is_manifest_key(key)]
    manifest = max(manifests, key=lambda m: m.object_bytes)
    get_s: list[float] = []
    restore_s: list[float] = []
    received_restore_s: list[float] = []
    received_persisted_s: list[float] = []
    for repeat in range(repeats):
        started = time.perf_counter()
        size = len(objects.get_bytes(manifest.object_key))
        get_s.append(time.perf_counter() - started)
        store = SsdStore.open(workdir / f"restore-{repeat}", fingerprint, journal=False)
        started = time.perf_counter()
        download_entry(store, objects, manifest)
        match = store.find(np.asarray(prompt, dtype=np.uint32))
        caches = store.restore(match) if match is not None else None
        restore_s.append(time.perf_counter() - started)
        store.close()
        if caches is None:
            raise click.ClickException("the downloaded entry did not restore")
        received_s, persisted_s = _receive_restore_persist(
            workdir / f"received-{repeat}", fingerprint, objects, manifest
        )
        received_restore_s.append(received_s)
        received_persisted_s.append(persisted_s)
    return {
        "object_bytes": size,
        "get_s": get_s,
        "download_restore_s": restore_s,
        "received_restore_s": received_restore_s,
        "received_persisted_s": received_persisted_s,
    }


def _receive_restore_persist(directory: Path, fingerprint: str, objects: Any, manifest: Any) -> tuple[float, float]:
    """The store's received path: GET into memory (size and sha256 checked), then a restore from those bytes
    on this thread while a helper thread persists them into a fresh SSD tier. Seconds until the restore is
    done, and until the SSD copy is committed too."""
    store = SsdStore.open(directory, fingerprint, journal=False)
    started = time.perf_counter()
    received = receive_entry(objects, manifest)
    persist = threading.Thread(target=persist_received, args=(store, received), name="bench-persist")
    persist.start()
    entry = kvfile.load_image(received.image)
    restored_s = time.perf_counter() - started
    persist.join()
    persisted_s = time.perf_counter() - started
    store.close()
    if not entry.caches or store.entry_ids() == []:
        raise click.ClickException("the received entry did not restore or persist")
    return restored_s, persisted_s


async def _second_server(model_dir: Path, workdir: Path, endpoint: str, prompt: tuple[int, ...], repeat: int):
    """B's first request with the shared tier, and a cold server's, same prompt."""
    shared = _shared(endpoint, "bench")
    async with open_system(_config(model_dir, workdir / f"b-{repeat}", shared)) as system:
        warm = await _generate(system, prompt, 8)
    async with open_system(_config(model_dir, workdir / f"cold-{repeat}", None)) as system:
        cold = await _generate(system, prompt, 8)
    return {"warm": warm, "cold": cold}


async def _decode_with_upload(model_dir: Path, workdir: Path, endpoint: str, options: dict[str, Any], shared: bool):
    """A first request leaves an entry to upload; the second's decode is timed."""
    first = prompt_token_ids(options["context_tokens"], options["seed"] + 1)
    second = prompt_token_ids(64, options["seed"] + 2)
    tier = _shared(endpoint, f"decode-{uuid.uuid4().hex[:8]}") if shared else None
    async with open_system(_config(model_dir, workdir / f"decode-{uuid.uuid4().hex[:8]}", tier)) as system:
        await _generate(system, first, 8)
        # The entry is on SSD now, so (with the tier) its upload is queued as the timed request arrives.
        await system.flush(timeout_s=120)
        before = _uploads(system)
        timed = await _generate(system, second, options["new_tokens"])
        during = _uploads(system) - before
        if system.shared is not None:
            await system.flush_shared(timeout_s=120)
        after = _uploads(system)
    return {**timed, "uploads_finished_during_decode": during, "uploads_by_close": after}


def _uploads(system: Any) -> int:
    return system.shared.counters.uploads if system.shared is not None else 0


def run_benchmark(model_dir: Path, options: dict[str, Any], workdir: Path, progress: Console) -> dict[str, Any]:
    server, endpoint = _moto()
    try:
        S3ObjectStore.open(
            BUCKET, endpoint_url=endpoint, connect_timeout_s=2, read_timeout_s=60, max_attempts=3
        )._client.create_bucket(Bucket=BUCKET)
        prompt = prompt_token_ids(options["context_tokens"], options["seed"])
        progress.print(f"server A shares a {len(prompt)}-token prefix")
        fingerprint = trio.run(_share_prompt, model_dir, workdir, endpoint, prompt)
        progress.print("download + restore against raw GET")
        transfer = _restore_vs_get(workdir, endpoint, fingerprint, prompt, options["repeats"])
        progress.print("second server's first request against a cold prefill")
        second = [trio.run(_second_server, model_dir, workdir, endpoint, prompt, r) for r in range(options["repeats"])]
        progress.print("decode with an upload pending against no shared tier")
        decode: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for repeat in range(options["repeats"]):
            for mode in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                decode[mode].append(trio.run(_decode_with_upload, model_dir, workdir, endpoint, options, mode == "on"))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return _figures(prompt, transfer, second, decode, options)


def _figures(prompt, transfer, second, decode, options) -> dict[str, Any]:
    get_s, restore_s = statistics.median(transfer["get_s"]), statistics.median(transfer["download_restore_s"])
    warm_ttft = statistics.median(run["warm"]["ttft_s"] for run in second)
    cold_ttft = statistics.median(run["cold"]["ttft_s"] for run in second)
    cached = min(run["warm"]["cached_tokens"] for run in second)
    on = statistics.median(run["decode_tok_s"] for run in decode["on"])
    off = statistics.median(run["decode_tok_s"] for run in decode["off"])
    received_s = statistics.median(transfer["received_restore_s"])
    result = {
        "restore_vs_get_ratio": get_s / restore_s,
        "received_restore_vs_get_ratio": get_s / received_s,
        "received_restore_s": received_s,
        "received_persisted_s": statistics.median(transfer["received_persisted_s"]),
        "second_server_cached_fraction": cached / len(prompt),
        "decode_ratio": on / off,
        "object_bytes": transfer["object_bytes"],
        "get_s": get_s,
        "download_restore_s": restore_s,
        "ttft_s_second_server": warm_ttft,
        "ttft_s_cold": cold_ttft,
        "decode_tok_s_upload_pending": on,
        "decode_tok_s_no_shared_tier": off,
        "uploads_by_close": sum(run["uploads_by_close"] for run in decode["on"]),
        "uploads_finished_during_decode": sum(run["uploads_finished_during_decode"] for run in decode["on"]),
        "context_tokens": len(prompt),
        "new_tokens": options["new_tokens"],
        "repeats": options["repeats"],
        "runs": {"transfer": transfer, "second": second, "decode": decode},
    }
    result["targets_met"] = {
        "restore_vs_get_ratio_ge_0.8": result["restore_vs_get_ratio"] >= TARGET_RESTORE_RATIO,
        "received_restore_vs_get_ratio_ge_0.8": result["received_restore_vs_get_ratio"] >= TARGET_RESTORE_RATIO,
        "second_server_cached_ge_prompt_minus_1": cached >= len(prompt) - 1,
        "decode_ratio_ge_0.97": result["decode_ratio"] >= TARGET_DECODE_RATIO,
    }
    return result


def _range(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}"


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    runs, met = result["runs"], result["targets_met"]
    mib = result["object_bytes"] / (1 << 20)
    second = runs["second"]
    return [
        ("raw GET of the entry object (baseline)", f"{result['get_s'] * 1000:.1f} ms",
         _range(runs["transfer"]["get_s"], 1000, 1) + " ms", f"{mib:.1f} MiB"),
        ("download + verify + adopt + restore", f"{result['download_restore_s'] * 1000:.1f} ms",
         _range(runs["transfer"]["download_restore_s"], 1000, 1) + " ms",
         f"{result['restore_vs_get_ratio']:.3f}x GET throughput (target >= {TARGET_RESTORE_RATIO}x: "
         f"{'met' if met['restore_vs_get_ratio_ge_0.8'] else 'MISSED'})"),
        ("receive + restore from the received bytes (store path)", f"{result['received_restore_s'] * 1000:.1f} ms",
         _range(runs["transfer"]["received_restore_s"], 1000, 1) + " ms",
         f"{result['received_restore_vs_get_ratio']:.3f}x GET throughput (target >= {TARGET_RESTORE_RATIO}x: "
         f"{'met' if met['received_restore_vs_get_ratio_ge_0.8'] else 'MISSED'}); SSD copy committed behind it "
         f"at {result['received_persisted_s'] * 1000:.1f} ms; the server's request path does not take it yet"),
        ("TTFT, cold prefill, no shared tier (baseline)", f"{result['ttft_s_cold']:.3f} s",
         _range([run["cold"]["ttft_s"] for run in second], 1, 3), f"{result['context_tokens']} tokens"),
        ("TTFT, second server's first request", f"{result['ttft_s_second_server']:.3f} s",
         _range([run["warm"]["ttft_s"] for run in second], 1, 3),
         f"{result['ttft_s_cold'] / result['ttft_s_second_server']:.2f}x faster; cached fraction "
         f"{result['second_server_cached_fraction']:.4f}"),
        ("decode, no shared tier (baseline)", f"{result['decode_tok_s_no_shared_tier']:.1f} tok/s",
         _range([run["decode_tok_s"] for run in runs["decode"]["off"]], 1, 1), "baseline"),
        ("decode, an upload pending", f"{result['decode_tok_s_upload_pending']:.1f} tok/s",
         _range([run["decode_tok_s"] for run in runs["decode"]["on"]], 1, 1),
         f"{result['decode_ratio']:.3f}x (target >= {TARGET_DECODE_RATIO}x: "
         f"{'met' if met['decode_ratio_ge_0.97'] else 'MISSED'}); uploads finished during the decodes / "
         f"by close: {result['uploads_finished_during_decode']} / {result['uploads_by_close']}"),
    ]  # fmt: skip


def summary_lines(result: dict[str, Any]) -> list[str]:
    decode = [run["decode_tok_s"] for mode in ("on", "off") for run in result["runs"]["decode"][mode]]
    spread_pct = 100 * (max(decode) - min(decode)) / statistics.median(decode)
    return [
        f"decode rates of all {len(decode)} decode runs spread over {spread_pct:.0f}% of their median: a "
        f"smaller difference between the modes cannot be told from noise; uploads finished during the timed "
        f"decodes: {result['uploads_finished_during_decode']} (an upload started while the gateway was idle "
        f"holds before each chunk once it is busy)",
        f"model: {result['model']}; prompt {result['context_tokens']} random token ids, greedy; decode runs "
        f"generate {result['new_tokens']} tokens right after a {result['context_tokens']}-token request whose "
        f"entry was flushed to SSD, so its upload is queued as the decode starts (it waits for an idle "
        f"gateway); on and off alternate; median of {result['repeats']}",
        f"object store: moto {result['moto']} server mode on 127.0.0.1 (its own process, over HTTP, boto3 "
        f"{result['boto3']}); whole run {result['wall_s']:.0f} s; {load_note()}",
    ]


def figures(result: dict[str, Any]) -> Figures:
    title = f"Shared cold tier, median of {result['repeats']}"
    return Figures(title=title, columns=FIGURE_COLUMNS, rows=figure_rows(result), summary=summary_lines(result))


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    return docs_section(
        "Shared cold tier: restore against GET, a second server's TTFT, decode with uploads",
        [
            f"Run {run_date} with `{command}`.",
            machine_sentence(machine, f" (CPU); SSD tiers on {machine['filesystem']}."),
        ],
        figures(result),
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--context-tokens", type=click.IntRange(min=16), default=2048, show_default=True, help="Prompt tokens.")
@click.option("--new-tokens", type=click.IntRange(min=2), default=128, show_default=True, help="Timed decode tokens.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Runs per figure.")
@model_option(f"An mlx-lm model directory; default: a fresh offline demo {DEMO_ARCH} {MODEL_SIZE}.")
@scratch_dir_option("the runs' SSD tiers")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts' random token ids.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, directory: Path | None, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Time the shared tier's restores, a second server's first TTFT and decode beside uploads."""
    import boto3
    import moto

    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    progress = Console(stderr=True)
    with scratch_with_model("shared-tier", directory, model_dir, progress, size=MODEL_SIZE) as scratch:
        result = run_benchmark(scratch.model_dir, options, scratch.workdir, progress)
    result.update(
        model=scratch.model_described,
        machine=describe_machine(scratch.base),
        wall_s=time.perf_counter() - started,
        moto=moto.__version__,
        boto3=boto3.__version__,
    )
    publish_figures(
        "shared_tier",
        result,
        figures(result),
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
