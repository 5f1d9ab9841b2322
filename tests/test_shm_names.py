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


def test_another_users_owner_file_stops_no_start(tmp_path, monkeypatch):
    """Defect: an owner file this user cannot open (another user's, mode 0600) made every start raise."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    theirs = tmp_path / shm.segment_name("9-theirs", "owner")
    theirs.write_bytes(b"")
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: _as_uid(real_stat(p, *a, **k), os.getuid() + 1)
                        if str(p) == str(theirs) else real_stat(p, *a, **k))  # fmt: skip
    assert shm.remove_orphans() == []
    assert theirs.exists()
    theirs.chmod(0)  # unreadable: skipped, not raised (root can read it anyway)
    monkeypatch.setattr(os, "stat", real_stat)
    shm.remove_orphans()


def _as_uid(st: os.stat_result, uid: int) -> os.stat_result:
    fields = list(st)
    fields[4] = uid
    return os.stat_result(fields)


def test_an_owner_file_appears_only_once_locked(tmp_path, monkeypatch):
    """Defect: the file was created, then locked: another start's clean-up could take it between."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        seen.append(os.listdir(tmp_path))
        assert shm.remove_orphans() == []  # the half-made claim is invisible to a clean-up
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    owner = shm.Owner("5-new")
    assert seen and shm.segment_name("5-new", "owner") not in seen[0]
    assert os.listdir(tmp_path) == [shm.segment_name("5-new", "owner")]
    owner.release()
