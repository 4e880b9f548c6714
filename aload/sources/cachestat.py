"""How much of a file sits in the page cache: Linux's ``cachestat(2)`` (6.5+), which the
standard library lacks, through ctypes. None wherever it is unavailable; aload then reads
through the page cache, as it would for a cached file."""

from __future__ import annotations

import ctypes
import os
import platform

_SYSCALL = {"x86_64": 451, "aarch64": 451}.get(platform.machine())


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def _libc() -> ctypes.CDLL | None:
    if os.name != "posix" or _SYSCALL is None:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def cached_share(fd: int, size: int) -> float | None:
    """The share of the file open as ``fd`` (``size`` bytes) in the page cache, 0.0 to 1.0; None
    where the kernel cannot tell."""
    if _LIBC is None:
        return None
    if size <= 0:
        return 1.0
    stat = _Stat()
    if _LIBC.syscall(_SYSCALL, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    return float(min(1.0, stat.cache * page / size))
