"""The shared tier's object-store model (`kvcellar simulate --shared-tier`):
the invariant holds over a seed sweep, the run is deterministic, and a
download that skips the manifest's sha256 check is caught by the invariant."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.cli import cli
from kvcellar.simulations.shared_store import simulate_shared, summary
from kvcellar.store.ssd import SsdStore


def test_restored_shared_entries_are_always_committed_verified_uploads():
    first = summary(simulate_shared(1, 6))
    assert first["failures"] == [] and first["restores_checked"] >= 3
    assert first["lost_uploads"] > 0 and first["corrupted"] > 0 and first["races"] > 0 and first["refused"] > 0
    assert summary(simulate_shared(1, 6)) == first


def _unchecked_download(store: SsdStore, objects, manifest) -> str:
    """Trusts the object's bytes without comparing them with the manifest:
    a bit flipped in a `.kvc` file's alignment padding passes every
    checksum the format has, but is not what was uploaded."""
    data = objects.get_bytes(manifest.object_key)
    return store.adopt(manifest.namespace, manifest.tokens, lambda write: write(data))


def test_the_invariant_catches_a_download_that_skips_the_manifest_check():
    result = summary(simulate_shared(1, 4, download=_unchecked_download))
    assert result["failed"] >= 1
    assert "is not the committed upload" in result["failures"][0]


def test_the_cli_runs_the_model_and_prints_its_summary():
    outcome = CliRunner().invoke(cli, ["simulate", "--shared-tier", "--seed", "3", "--runs", "2", "--json"])
    assert outcome.exit_code == 0, outcome.output
    summary_json = json.loads(outcome.output.strip().splitlines()[-1])
    assert summary_json["runs"] == 2 and summary_json["failed"] == 0
