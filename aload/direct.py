"""Reads past the page cache: a local file opened a second time with ``O_DIRECT``.

A file on disk is read in whole aligned blocks with ``O_DIRECT`` (past the page cache, as Run:ai's
streamer does), in pieces of ``DIRECT_PIECE_BYTES``, ``max(concurrency, DIRECT_DEPTH)`` in flight:
straight into a buffer aligned as the file is, or through a small buffer of each thread, in a huge
page of its own (``bounce_buffer``), and copied out.
A filesystem that refuses a read's alignment gets buffered reads of that file from then on.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from ._ntcopy import copy_bytes
from ._syscalls import bounce_buffer, pread_into
from .errors import SourceError

#: Measured on this VM, 4 GiB cold: 1 MiB pieces did best (2 MiB: as fast or slower, 4 MiB x 16:
#: 2.1 GB/s against 2.9-3.1); buffered reads through the page cache 1.3-2.1, with the vCPUs busier.
#: The disk is as busy with 4 in flight as with 16 (its latency grows with the queue: 1.5 ms a
#: read at 3.4 in flight, 5 ms at 10.8), and 16 threads coming back for the GIL held the event loop
#: up: a cold 4 GiB load built-in 1.56-1.75 s at loop lateness p99 1.3-1.6 ms with 4, 1.88-2.22 s at
#: 7.7-9.2 ms with 16. Since reads yield their core (``aload.local``), 8 in flight beat 4 in 14 of
#: 16 alternating pairs of cold 4 and 8 GiB loads, built-in and through ``load_weights`` (8 GiB
#: built-in 4.60-5.60 s against 4.68-7.59; p99 lateness 1.1-2.4 ms against 1.1-2.8); 12 no better
#: than 8 (docs/benchmarks.md). On the Intel host of stop 55 on (its disk ~1.7-2.4 GB/s cold), 16
#: beat 8 in 6 of 8 alternating pairs of cold 8 GiB built-in loads (medians 1.85-1.92 GB/s
#: against 1.76-1.77; loop lateness p99 1.1-1.2 ms either way), where Run:ai's streamer keeps ~55
#: reads of 4 MiB in flight and aload kept 7.7 (``benchmarks/disk_queue.py``). The reads in flight
#: are ``max(concurrency, DIRECT_DEPTH)``: ``concurrency`` raises it for a deeper device.
DIRECT_PIECE_BYTES = 1 << 20
DIRECT_DEPTH = 16
#: Reads smaller than this (headers, coalesced small tensors) stay buffered, even from a cold file.
O_DIRECT_MIN_BYTES = 256 << 10
ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in multiples of the block size


class DirectFile:
    """The file open as ``fd`` (buffered), opened again with ``O_DIRECT``; ``ok`` until a read is
    refused, after which every read of it is buffered."""

    __slots__ = ("dfd", "fd", "ok", "url")

    def __init__(self, fd: int, dfd: int, url: str) -> None:
        self.fd, self.dfd, self.url = fd, dfd, url
        self.ok = True

    @classmethod
    def open(cls, fd: int, url: str) -> DirectFile | None:
        """None where the file cannot be: no procfs, or a filesystem without ``O_DIRECT`` (tmpfs)."""
        try:  # the very file open as fd, even if its path now names another
            dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            return None
        return cls(fd, dfd, url)

    def read_aligned(self, offset: int, buf: memoryview, need: int, wanted: tuple[int, int] | None = None) -> None:
        """At least the first ``need`` bytes of the aligned ``buf`` from the aligned ``offset``,
        with ``O_DIRECT`` into ``buf`` itself; its rest is slack the file may end in. Errors name
        ``wanted``, the bytes asked for (by default those ``need``)."""
        wanted = wanted or (offset, offset + need)
        got = 0
        while got < need:
            if not self.ok:  # refused by an earlier read
                return pread_into(self.fd, buf[got:need], offset + got, self.url)
            try:
                r = os.preadv(self.dfd, [buf[got:]], offset + got)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise SourceError(f"read failed: {exc.strerror}", url=self.url, byte_range=wanted) from exc
                self.ok = False  # not for this file after all
                continue
            if r == 0:
                raise SourceError(f"file ended at byte {offset + got}", url=self.url, byte_range=wanted)
            got += r
            if got % ALIGN and got < need:  # a short read mid-file: finish buffered
                return pread_into(self.fd, buf[got:need], offset + got, self.url)
        return None

    def read_bounced(self, offset: int, buf: memoryview) -> None:
        """``buf`` from the file: the aligned range around it into this thread's buffer with
        ``O_DIRECT``, then copied out."""
        n = len(buf)
        if not self.ok:  # refused by an earlier read
            return pread_into(self.fd, buf, offset, self.url)
        lo = offset - offset % ALIGN
        span = -(-(offset + n - lo) // ALIGN) * ALIGN
        bounce, addr = bounce_buffer(span)
        self.read_aligned(lo, bounce[:span], offset + n - lo, (offset, offset + n))
        copy_bytes(np.frombuffer(buf, dtype=np.uint8).ctypes.data, addr + (offset - lo), n)
        return None

    def close(self) -> None:
        os.close(self.dfd)
