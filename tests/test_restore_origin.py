"""store/restore_origin.py: a restore is "shared_tier" exactly when its entry was downloaded and not dropped since."""

from __future__ import annotations

from kvcellar.store.events import EVENT_TYPES
from kvcellar.store.restore_origin import LOCAL_SSD, SHARED_TIER, RestoreOrigins


def test_origins_follow_downloads_and_forget_dropped_entries():
    origins = RestoreOrigins()
    assert origins.restored("local", 100).origin == LOCAL_SSD
    origins.downloaded("moved", "team/fp/ns/abc.manifest")
    sourced = origins.restored("moved", 900)
    assert (sourced.origin, sourced.key, sourced.usable_tokens) == (SHARED_TIER, "team/fp/ns/abc.manifest", 900)
    origins.forget("moved")
    assert origins.restored("moved", 900).origin == LOCAL_SSD, "a dropped id is not the download any more"
    stats = origins.stats()
    assert (stats["restores_local_ssd"], stats["restores_shared_tier"]) == (2, 1)
    assert (stats["restored_tokens_local_ssd"], stats["restored_tokens_shared_tier"]) == (1000, 900)
    assert [r["origin"] for r in stats["recent_restores"]] == [LOCAL_SSD, SHARED_TIER, LOCAL_SSD]
    assert EVENT_TYPES["restore.sourced"] is type(sourced), "journaled like every other event"
