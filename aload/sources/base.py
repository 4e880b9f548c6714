"""What a place that holds checkpoint bytes must do: ``Store`` (a file, a folder, a URL prefix)
and ``Source`` (one object in it). Source methods block; the reader awaits their ``a``-forms,
which run them on the store's threads (``Store.run``), never on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

#: O_DIRECT alignment (and the alignment of every buffer aload allocates).
ALIGN = 4096


def aligned_empty(offset: int, n: int) -> np.ndarray[Any, Any]:
    """A fresh ``n``-byte array whose address is congruent to ``offset`` modulo ``ALIGN``, inside
    an allocation that covers the whole ``ALIGN`` blocks around it (for direct reads into it)."""
    pad = offset % ALIGN
    total = -(-(pad + n) // ALIGN) * ALIGN
    raw = np.empty(total + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip + pad : skip + pad + n]


def byte_tensor(t: Any) -> Any:
    """The bytes of the contiguous tensor ``t`` as a flat uint8 tensor, writable (a parameter too)."""
    import torch

    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def byte_view(t: Any) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, writable (a parameter too)."""
    return memoryview(byte_tensor(t).numpy()).cast("B")


class Source(ABC):
    """One object: a local file, an HTTP URL, an object in a bucket.

    The plain methods block; the reader awaits the ``a``-methods, which run them on the store's
    threads (``run``) unless a source has a native async client (``remote``)."""

    url: str
    #: Reads of buffers from this source should start at file offsets that are multiples of this.
    align: int = 1
    #: ``fn(*args)`` on the store's threads (set by the store that makes the source).
    run: Callable[..., Awaitable[Any]]

    async def abuffer(self, offset: int, n: int) -> np.ndarray[Any, Any]:
        return await self.run(self.buffer, offset, n)  # type: ignore[no-any-return]

    async def afill(self, buf: np.ndarray[Any, Any], offset: int, at: int, n: int) -> None:
        await self.run(self.fill, buf, offset, at, n)

    def read_into(self, offset: int, dest: Any, at: int, n: int) -> None:
        """Bytes ``at .. at + n`` of the tensor stored at ``offset``, straight into the same bytes
        of ``dest`` (a contiguous CPU tensor)."""
        self.readinto(offset + at, byte_view(dest)[at : at + n])

    async def aread_into(self, offset: int, dest: Any, at: int, n: int) -> None:
        await self.run(self.read_into, offset, dest, at, n)

    @abstractmethod
    def size(self) -> int:
        """The object's size in bytes."""

    @abstractmethod
    def read(self, offset: int, n: int) -> bytes:
        """Exactly ``n`` bytes at ``offset`` (headers, small reads), or raise ``SourceError``."""

    def buffer(self, offset: int, n: int) -> np.ndarray[Any, Any]:
        """Memory that will hold bytes ``offset .. offset + n`` once ``fill``ed: fresh memory
        here; a local file's mapping where it is read through the page cache."""
        return aligned_empty(offset, n)

    def fill(self, buf: np.ndarray[Any, Any], offset: int, at: int, n: int) -> None:
        """Put the ``n`` bytes at ``offset + at`` into ``buf[at:at + n]`` (``buf`` from ``buffer(offset, ...)``)."""
        self.readinto(offset + at, memoryview(buf[at : at + n]))  # type: ignore[arg-type]

    @abstractmethod
    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes from ``offset``, or raise ``SourceError``."""

    def release(self, offset: int, n: int) -> None:  # noqa: B027 (optional)
        """No tensor views ``buffer(offset, n)`` any more (called from any thread)."""


class Store(ABC):
    """A checkpoint location, and the threads its blocking reads run on (named ``aload-io``,
    started on first use, joined by ``aclose``)."""

    url: str
    #: The largest single read, unless the caller says (``chunk_bytes``).
    chunk_bytes: int = 16 << 20

    def __init__(self, url: str, concurrency: int) -> None:
        self.url = url
        self.concurrency = concurrency
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: set[concurrent.futures.Future[Any]] = set()

    @abstractmethod
    def source(self, name: str) -> Source:
        """The object ``name`` (relative, already checked to stay inside the store; "" for the
        object the URL names)."""

    @abstractmethod
    def kind(self) -> str:
        """``"file"`` when the URL names one object, ``"folder"`` when it names a location (blocks)."""

    @abstractmethod
    def list(self, suffix: str) -> list[str]:
        """Names of the objects directly inside the location that end with ``suffix`` (blocks)."""

    @abstractmethod
    def get(self, name: str, limit: int) -> bytes | None:
        """A small object's whole body, at most ``limit`` bytes; None when it does not exist (blocks)."""

    def close(self) -> None:  # noqa: B027 (optional)
        """Let go of files and connections (blocks; no read is running)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the store's threads."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="aload-io")
        cf = self._pool.submit(fn, *args)
        self._running.add(cf)
        cf.add_done_callback(self._running.discard)
        return await asyncio.wrap_future(cf)

    async def aclose(self) -> None:
        """Wait for every read still running (a cancelled await does not stop a ``preadv``),
        then close the files and join the threads."""
        while self._running:
            running = [asyncio.wrap_future(cf) for cf in list(self._running)]
            await asyncio.wait(running)
            for fut in running:  # a read that failed after its caller gave up is nobody's error now
                if not fut.cancelled():
                    fut.exception()
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.wrap_future(pool.submit(self.close))  # a file's close may block: not on the loop
            pool.shutdown(wait=True)  # idle threads: a short join
        else:
            self.close()
        # Results the threads sent to the loop are still queued there (a buffer among them):
        # one turn lets them go before this returns, and with them the file they map.
        await asyncio.sleep(0)
