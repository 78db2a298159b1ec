"""Files a process opened are closed before it forks.

Why: HDF5 (and netCDF, which reads through it) must not be used across a
fork. A child that inherits an open file shares its descriptor, offset and
the library's record of open files with the parent; a reader process forked
from a training process that had read a netCDF file through xarray hung in
CI. The training process opens a source's files when it reads in the caller
(``prefetch=0``, or adaptive prefetch while the consumer asks at once) or
through a reader thread, and it forks later: a second pipe's reader process,
``DataLoader`` workers.

So every source that opens handles in a process is tracked here, and an
``os.register_at_fork`` hook closes them all just before any fork; they
reopen lazily on the next read (see :meth:`datapipes.source.Source._handles`).
Reads hold :func:`reading` so the hook never closes a file under a read in
another thread: it waits for that read, and no read starts until the fork is
done. The child starts with nothing open and nothing tracked.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref

__all__ = ["reading", "track"]

_lock = threading.RLock()  # re-entrant: a fork from inside a read (a transform's) must not deadlock
_open_here: weakref.WeakSet = weakref.WeakSet()  # sources with handles open in this process


def track(source) -> None:
    """``source`` has opened handles in this process: close them before the next fork."""
    _open_here.add(source)


def reading():
    """Hold while reading: a fork waits for the read, and closes files only between reads."""
    return _lock


def _before_fork() -> None:
    _lock.acquire()
    for source in list(_open_here):
        try:
            source.close()
        except Exception as err:  # one source failing to close must not leave the others open
            warnings.warn(f"datapipes: closing {source!r} before a fork failed: {err!r}", RuntimeWarning, stacklevel=1)
    _open_here.clear()


def _in_child() -> None:
    global _lock, _open_here
    _lock = threading.RLock()  # the parent's is held by the forking thread
    _open_here = weakref.WeakSet()


os.register_at_fork(before=_before_fork, after_in_parent=lambda: _lock.release(), after_in_child=_in_child)
