"""An exclusive lock on a lock file that its holder may remove (flock on `path`, created when missing).

Removing a lock file while holding it (so the next build or cache user starts clean) races with a waiter that
opened the old file: that waiter would lock an inode no one else sees. So after locking, the file at `path` is
checked to be the one locked (same device and inode); if not, the lock is taken again on the current file.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_file(path: str | Path, wait: bool = True) -> int | None:
    """Open `path` (created when missing) and hold an exclusive flock on it; the open descriptor (close it to
    release), or None without waiting when `wait` is false and another process holds it.

    Raises:
        OSError: the file cannot be created or opened.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the holder before us may have removed the file after we opened it: lock the current one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
