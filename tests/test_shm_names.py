"""Shared-memory names that cannot collide, and segments that outlive nobody (no processes here)."""

import os

from minipd.server.worker_pool import WorkerPool
from minipd.transfer import shm


def test_every_start_gets_its_own_tag():
    """Defect: names came from the main process's pid; in containers every server is pid 1."""
    assert shm.new_tag() != shm.new_tag()


def test_segments_of_a_killed_server_are_removed_at_the_next_start_and_a_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    alive = shm.Owner("1-alive")
    (tmp_path / shm.cache_segment_name("1-alive", 0, 0)).write_bytes(b"kv")
    dead = shm.Owner("1-dead")
    (tmp_path / shm.cache_segment_name("1-dead", 0, 0)).write_bytes(b"kv")
    worker = shm.join_owner("1-dead")
    os.close(dead.fd)  # what a SIGKILL does to its lock; its files stay
    assert shm.remove_orphans() == []  # its worker still holds the claim
    os.close(worker)
    removed = shm.remove_orphans()
    assert removed == [shm.cache_segment_name("1-dead", 0, 0)]
    assert sorted(os.listdir(tmp_path)) == sorted([shm.cache_segment_name("1-alive", 0, 0),
                                                   shm.segment_name("1-alive", "owner")])  # fmt: skip
    alive.release()
    assert os.listdir(tmp_path) == [shm.cache_segment_name("1-alive", 0, 0)]


def test_a_worker_that_dies_before_it_is_ready_leaves_no_segment(tmp_path, monkeypatch):
    """Defect: the segment was found through the worker's Ready message, which it never sent."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    pool = WorkerPool([{"device": "cpu"}])
    try:
        w = pool.workers[0]
        w.incarnation = 3  # as if spawned for the fourth time, dying while it loads
        segment = tmp_path / shm.cache_segment_name(pool.tag, 0, 3)
        segment.write_bytes(b"kv")
        assert w.info is None
        pool.remove_segments_of(w)
        assert not segment.exists()
    finally:
        pool.kill()
    assert os.listdir(tmp_path) == []


def test_the_last_worker_of_a_killed_server_removes_what_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    main = shm.Owner("7-x")
    workers = [shm.join_owner("7-x"), shm.join_owner("7-x")]
    (tmp_path / shm.cache_segment_name("7-x", 1, 0)).write_bytes(b"kv")  # say worker 1 could not unlink it
    shm.leave_owner(workers[0], "7-x")  # the main process still holds its claim: nothing removed
    assert len(os.listdir(tmp_path)) == 2
    os.close(main.fd)  # SIGKILL
    shm.leave_owner(workers[1], "7-x")
    assert os.listdir(tmp_path) == []
