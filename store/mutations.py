"""Deliberate durability bugs, switched on only by `kvcellar simulate --mutate`.

Each name turns one safeguard of the store off (a `Safeguards` field), so the
simulator's sweep can prove that its invariant checkers notice the loss (a
checker that never fails proves nothing). The simulator passes the resulting
policy to the store, the journal and the writer it builds; serving never
builds one.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvcellar.errors import UsageError
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards

MUTATIONS = {
    "skip-file-fsync": "commit renames the entry file without fsyncing its data",
    "skip-dir-fsync": "commit does not fsync the directory after the rename",
    "trust-failed-fsync": "a failed fsync of an entry file is ignored and the write reported stored",
    "skip-header-check": "restore and the startup scan trust every byte they read (no checksums)",
    "ack-before-rename": "a write is reported stored before its file is renamed into place",
    "skip-startup-supersession": "startup does not redo a supersession whose unlink a power loss undid",
    "restore-holds-index-lock": "a restore reads its file while holding the store's index lock (the Trio thread's "
    "find, covers and stats then wait on disk)",
    "journal-unowned-append": "a journal append runs its transaction on the caller's thread instead of the "
    "journal's owner (the shared-connection race)",
}

# Bugs of the cache wipe (issue 39): the default workload never wipes, so these are caught by
# the `wipes` workload instead.
WIPE_MUTATIONS = {
    "wipe-skips-tombstone": "a commit is not checked against the wipes' tombstones, so a spill of a wiped "
    "entry taken before the wipe lands after its removal",
}

# The `Safeguards` field each mutation switches off.
SAFEGUARD_OFF = {
    "skip-file-fsync": "fsync_entry_file",
    "skip-dir-fsync": "fsync_entry_dir",
    "trust-failed-fsync": "fail_on_failed_fsync",
    "skip-header-check": "verify_checksums",
    "ack-before-rename": "ack_after_rename",
    "skip-startup-supersession": "redo_startup_supersession",
    "restore-holds-index-lock": "restore_outside_index_lock",
    "journal-unowned-append": "append_on_journal_owner",
}


# Bugs of in-flight generation checkpoints (spec §5.7): the default workload
# never checkpoints, so these are caught by the `checkpoints` workload instead.
CHECKPOINT_MUTATIONS = {
    "checkpoint-drops-pending-token": "a resumed generation ignores its saved pending token and feeds its last "
    "emitted token again",
    "checkpoint-key-without-sampling": "a checkpoint's request key leaves out the sampling fields, so a request "
    "with other sampling resumes it",
}
# Bugs of method companion state (issue 42): the default workload has no draft model, so these are
# caught by the `companion` workload instead.
COMPANION_MUTATIONS = {
    "split-companion": "the writer commits an entry's target caches in a file of their own before the entry "
    "with its companion state (two commits), so a crash between them leaves the target without its draft state",
}
SAFEGUARD_OFF.update(
    {
        "checkpoint-drops-pending-token": "checkpoint_resumes_pending_token",
        "checkpoint-key-without-sampling": "checkpoint_key_has_sampling",
        "wipe-skips-tombstone": "wipe_tombstone_at_commit",
        "split-companion": "companion_in_entry_file",
    }
)
ALL_MUTATIONS = {**MUTATIONS, **CHECKPOINT_MUTATIONS, **WIPE_MUTATIONS, **COMPANION_MUTATIONS}


def safeguards_without(names: Iterable[str]) -> Safeguards:
    """Every safeguard on except those the named bugs switch off; raises
    `UsageError` for an unknown name."""
    wanted = frozenset(names)
    unknown = sorted(wanted - ALL_MUTATIONS.keys())
    if unknown:
        raise UsageError(f"unknown mutation {', '.join(unknown)}; choose from {', '.join(ALL_MUTATIONS)}")
    return attrs.evolve(SAFEGUARDS, **{SAFEGUARD_OFF[name]: False for name in wanted})
