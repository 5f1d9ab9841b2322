"""Named POSIX shared-memory segments (torch-free): with the shm transport each worker's KV cache
lives in one, so that a prefill worker can write a prompt's KV straight into a decode worker's
cache. The worker that creates a segment unlinks it; the server removes what a dead one left.

Names carry a tag new at every start (the pid alone collides: in containers every server is
pid 1). The main process and its workers hold shared locks on the tag's owner file: the last of
them to go (a worker whose main process was SIGKILLed) removes what is left, and a later start
removes the segments of any tag that nobody holds."""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import secrets
from multiprocessing import resource_tracker, shared_memory

log = logging.getLogger("minipd.shm")
PREFIX = "minipd_"
SHM_DIR = "/dev/shm"
OWNER = "owner"


def new_tag() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def cache_segment_name(tag: str, worker_id: int, incarnation: int) -> str:
    return segment_name(tag, f"cache{worker_id}-{incarnation}")


class Owner:
    """This server's claim on its tag: a file beside its segments, locked while any of its processes lives."""

    def __init__(self, tag: str):
        self.tag = tag
        self.path = os.path.join(SHM_DIR, segment_name(tag, OWNER))
        locking = f"{self.path}.{secrets.token_hex(4)}"  # locked before it has the name others look for
        self.fd = os.open(locking, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        os.rename(locking, self.path)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            _remove(self.path)


def join_owner(tag: str) -> int | None:
    """A worker shares its server's claim (None where the server made none)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, segment_name(tag, OWNER)), os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def leave_owner(fd: int | None, tag: str) -> None:
    """A worker leaves; if it was the last of its server's processes, nothing of the tag stays."""
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        unlink_all(tag)
    except BlockingIOError:
        pass  # the main process (or another worker) is still there and cleans up
    finally:
        os.close(fd)


def remove_orphans() -> list[str]:
    """Segments of servers that died without cleaning up: their owner file is no longer locked."""
    removed = []
    for owner in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*_{OWNER}")):
        try:
            if os.stat(owner).st_uid != os.getuid():
                continue  # another user's server: not ours to judge (nor could we remove its files)
            fd = os.open(owner, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its server is alive
        finally:
            os.close(fd)
        tag = os.path.basename(owner)[len(PREFIX) : -len(OWNER) - 1]
        removed += [n for n in unlink_all(tag) if not n.endswith(OWNER)]
    return removed


def segment_name(tag: str, name: str) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in name)
    return f"{PREFIX}{tag}_{safe}"[:250]


def create(name: str, num_bytes: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(num_bytes, 1))
    # we unlink it ourselves (or the server does if we die): the tracker must not do it again
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def open_segment(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def unlink(segment: shared_memory.SharedMemory) -> None:
    """Remove a segment's name (SharedMemory.unlink would also tell the resource tracker, which
    no longer tracks it)."""
    unlink_name(segment.name)


def unlink_all(tag: str) -> list[str]:
    """Remove every segment a server's workers left behind. Returns their names."""
    left = glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{tag}_*"))
    for path in left:
        _remove(path)
    return [os.path.basename(p) for p in left]


def unlink_name(name: str) -> None:
    _remove(os.path.join(SHM_DIR, name))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # another user's file in the sticky /dev/shm
        log.warning("could not remove %s: %s", path, err.strerror)
