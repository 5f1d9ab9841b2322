"""minipd/heap.py: the startup heap frozen, the collections a process makes counted, and free heap
pages given back when a worker is idle."""

import ctypes.util
import gc

import pytest

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


def test_free_heap_goes_back_once_per_idle_spell_and_never_while_busy():
    trimmed = []
    idle = heap.IdleTrim(after_s=1.0)
    idle.trim = trimmed.append
    idle.tick(False, now=0.0)
    idle.tick(False, now=5.0)
    assert trimmed == []  # never busy: nothing freed to give back
    for t in (10.0, 10.5, 11.2):
        idle.tick(True, now=t)
    idle.tick(False, now=12.0)
    assert trimmed == []  # idle for 0.8 s only
    idle.tick(False, now=12.2)
    idle.tick(False, now=20.0)
    assert trimmed == [0] and idle.trims == 1  # once, a second after the last busy turn
    idle.tick(True, now=21.0)
    idle.tick(False, now=22.5)
    assert trimmed == [0, 0]


def test_the_trim_calls_glibc_and_can_be_turned_off(monkeypatch):
    if not ctypes.util.find_library("c"):
        pytest.skip("no C library to find")
    assert heap.IdleTrim().trim is not None
    assert heap.IdleTrim().trim(0) in (0, 1)  # glibc: 1 if memory went back, 0 if none could
    monkeypatch.setenv("MINIPD_MALLOC_TRIM", "0")
    assert heap.IdleTrim().trim is None
