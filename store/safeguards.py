"""The store's durability safeguards as one immutable policy.

Every safeguard is on in `SAFEGUARDS` (the default everywhere; serving never
passes anything else). The simulator passes a policy with some of them off
(`store.mutations.safeguards_without`) to prove that its invariant checkers
notice each loss. The policy travels through constructors: `KvFileWriter`,
`read_header`/`load`, `SsdStore.open`, `Journal.open`/`open_in_memory` and
the `SsdWriter` take it, so no code path consults a process-wide switch.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Safeguards:
    # `KvFileWriter`: fsync an entry file's data before the rename.
    fsync_entry_file: bool = True
    # `KvFileWriter`: a failed fsync fails the write (never retried on the same file).
    fail_on_failed_fsync: bool = True
    # `KvFileWriter`: fsync the directory after the rename (the commit point).
    fsync_entry_dir: bool = True
    # `read_header`/`load`: check the header's and the tensors' checksums.
    verify_checksums: bool = True
    # `SsdWriter`: report a write stored only once its file is renamed into place.
    ack_after_rename: bool = True
    # `SsdStore.open`: redo supersession over the index (a power loss can undo an unlink).
    redo_startup_supersession: bool = True
    # `SsdStore.restore`: read the file outside the index lock.
    restore_outside_index_lock: bool = True
    # `Journal`: an append's transaction runs on the journal's owner, not on the caller's thread.
    append_on_journal_owner: bool = True
    # `Checkpointing`: a checkpoint's request key covers the sampling fields.
    checkpoint_key_has_sampling: bool = True
    # The serial lane: a resumed generation goes on from its saved pending token.
    checkpoint_resumes_pending_token: bool = True
    # `SsdIndex.commit`, `CheckpointStore.commit`: refuse a commit a wipe's tombstone selects
    # (no wiped entry comes back).
    wipe_tombstone_at_commit: bool = True
    # `SsdWriter`: an entry's companion state (the draft's caches) is written in the same file as the
    # target's, under one commit (store/companion.py).
    companion_in_entry_file: bool = True


SAFEGUARDS = Safeguards()
