"""Atomic file and directory publication for everything zerotron/data writes.

Why: token files, index caches and the default corpus are read by many ranks, often while
another job is still writing them. A reader must see either nothing or a complete file, never a
half-written one, so every output is written under a temporary name in the *same* directory,
fsynced, and published with ``os.replace`` / ``os.rename`` (atomic on POSIX within one file
system). A crash leaves only ``*.tmp-*`` debris, which is never mistaken for a finished file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from typing import Iterator

import numpy as np


_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_path(path: str) -> None:
    """Flush a file (or directory entry table) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: str) -> str:
    """A unique sibling of ``path`` (same directory, hence same file system) to write into."""
    d, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-", dir=d)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide shared caches from other users
    return tmp


def publish(tmp: str, path: str) -> None:
    """fsync ``tmp`` and atomically rename it onto ``path``. Only a regular file is replaced: a
    rename onto ``/dev/full`` (or a FIFO, a socket) would swap the device node for our file."""
    fsync_path(tmp)
    refuse_special(path)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def refuse_special(path: str | os.PathLike) -> None:
    """Raise ``IsADirectoryError`` / ``OSError`` if ``path`` exists and is not a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not replaced", str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EEXIST, "is not a regular file (a device, FIFO or socket), not "
                      "replaced", str(path))


def save_npy(path: str, array: np.ndarray) -> None:
    """``np.save`` atomically; readers load with ``allow_pickle=False``."""
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(final: str) -> Iterator[str]:
    """Yield a fresh temporary directory; on success rename it to ``final``.

    If ``final`` appeared meanwhile (a concurrent builder won the race) ours is discarded: both
    builds are deterministic, so the winner's content is as good as ours. On error nothing is
    published.
    """
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_UMASK)
    try:
        yield tmp
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                raise
        fsync_path(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def nearest_existing(path: str | os.PathLike) -> str:
    """``path`` itself, or the nearest of its parents that exists: where writing ``path`` (and any
    directories missing above it) would begin."""
    where = os.path.abspath(path)
    while not os.path.exists(where) and where != os.path.dirname(where):
        where = os.path.dirname(where)
    return where


def write_probe(directory: str | os.PathLike) -> str | None:
    """None if this process can create a file in ``directory`` (tried, not inferred from
    permission bits: a read-only mount or a root-squashed NFS share says no only when written);
    otherwise why not, the OS's words."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".zerotron-write-probe-")
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return None


def check_output_prefix(flag: str, prefix: str, suffixes: str) -> None:
    """``prefix`` names files (``PREFIX.bin``, ``PREFIX.model``...) in a directory that exists or
    can be made, and that this process can write in: checked before hours of work, not at the
    end. Raises ``ValueError`` naming ``flag``."""
    base = os.path.basename(prefix)
    if not base or os.path.isdir(prefix):
        raise ValueError(f"{flag} {prefix}: names a directory; give a file prefix inside it, e.g. "
                         f"{os.path.join(prefix, 'corpus' if '.bin' in suffixes else 'tokenizer')} (writes {suffixes})")
    where = nearest_existing(os.path.dirname(os.path.abspath(prefix)))
    if not os.path.isdir(where):
        raise ValueError(f"{flag} {prefix}: {where} is a file, not a directory; put the output elsewhere")
    if write_probe(where) is not None:
        raise ValueError(f"{flag} {prefix}: cannot write in {where}; choose a writable directory")
