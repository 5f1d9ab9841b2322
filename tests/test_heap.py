"""minipd/heap.py: the startup heap frozen, and the collections a process makes counted."""

import gc

from minipd import heap


def test_collections_are_counted_and_the_freezes_own_collection_is_not():
    pauses = heap.GcPauses()
    try:
        assert heap.freeze_startup_heap() > 1000  # pytest and minipd are far more
        assert pauses.as_dict()["full_collections"] == 0  # the collection before the freeze is left out
        gc.collect(0)
        gc.collect(2)
        got = pauses.as_dict()
        assert got["collections"] == 2 and got["full_collections"] == 1
        assert 0 < got["longest_full_seconds"] <= got["seconds"] and got["frozen_objects"] > 1000
    finally:
        pauses.close()
        gc.unfreeze()
    gc.collect(2)
    assert pauses.as_dict()["collections"] == 2  # closed: no longer counting


def test_freezing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MINIPD_GC_FREEZE", "0")
    assert heap.freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
