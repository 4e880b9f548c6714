"""Where bytes come from: a ``Store`` (a checkpoint folder or prefix) hands out ``Source``s
(one object each) that read byte ranges asynchronously.

Stores are registered by URL scheme and imported lazily, so an optional client is only
needed when its scheme is used. This module holds the base classes, the registry and the
thread pool that blocking reads run in; each store lives in a module of its own (``local``,
``http``, ``s3``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import gc
import importlib
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from ._pool import ReadThreads
from ._threads import read_cores, read_nice, run_in_thread, setup_switches, start_read_thread
from .errors import UsageError

T = TypeVar("T")

#: URL scheme -> "module:Class" of its Store, and the extra that installs its client.
STORES: dict[str, tuple[str, str | None]] = {
    "": ("aload.local:LocalStore", None),
    "file": ("aload.local:LocalStore", None),
    "http": ("aload.http:HttpStore", "http"),
    "https": ("aload.http:HttpStore", "http"),
    "s3": ("aload.s3:S3Store", "s3"),
}


class Source(ABC):
    """One object of bytes (a file, an HTTP resource, an S3 object)."""

    url: str
    #: Whether ``view``/``populate`` work: bytes handed out without a copy (a mapped file).
    can_map: bool = False
    #: The whole object, when the ``head`` probe of a remote source held all of it (an object
    #: under 64 KiB): its reads are served from here, not asked for again.
    _whole: bytes | None = None

    @abstractmethod
    async def size(self) -> int:
        """The object's length in bytes."""

    async def ready(self) -> None:
        """Whatever blocking set-up this source's data reads need, done off the event loop;
        awaited before ``maps`` is asked."""
        return None

    def maps(self, offset: int, length: int) -> bool:
        """Whether the unit of ``length`` bytes at ``offset`` is handed out as a view
        (``view``/``populate``) rather than read into a buffer; asked once ``size`` and ``ready``
        have been awaited."""
        return self.can_map

    def view(self, offset: int, length: int) -> np.ndarray[Any, Any]:
        """A zero-copy, writable (copy-on-write) view of the bytes; valid once ``populate``d."""
        raise NotImplementedError

    async def populate(self, offset: int, length: int) -> None:
        """Bring the bytes of a ``view`` into memory, or raise ``SourceError``."""
        raise NotImplementedError

    def in_memory(self, offset: int, length: int) -> bool:
        """Whether a ``view`` of these bytes needs no read to ``populate`` (a file's pages all in
        the page cache); asked once ``ready`` has been awaited."""
        return False

    def populated(self, offset: int, length: int) -> bool:
        """Whether a ``view`` of these bytes needs no ``populate`` at all, now: in memory, and
        still there (a file not cut short since it was opened; where it was, ``populate`` raises
        the error). Asked on the event loop once ``ready`` has been awaited."""
        return False

    def release(self, offset: int, length: int) -> None:
        """No tensor views these bytes any more: let their memory go (from any thread)."""
        return None

    def on_disk(self, offset: int, length: int) -> bool:
        """Whether reading these bytes waits for a local disk (a file's pages not in the page
        cache, read past it); asked once ``ready`` has been awaited."""
        return False

    def piece_bytes(self, chunk_bytes: int, offset: int, length: int, mapped: bool = False) -> int:
        """The largest single read into a buffer or a destination, or (``mapped``) the largest
        single ``populate`` of a view, for the unit of ``length`` bytes at ``offset``
        (``chunk_bytes`` unless the source knows better); ``size`` has been awaited."""
        return chunk_bytes

    @abstractmethod
    async def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` exactly with the bytes at ``offset``, or raise ``SourceError``."""

    def frame_align(self, offset: int, length: int) -> int:
        """A block size when the ``length`` bytes at ``offset`` are best read by ``read_frame``,
        straight into a buffer laid out in whole blocks of the file, else 0; ``ready`` has been
        awaited."""
        return 0

    async def read_frame(self, offset: int, frame: memoryview, need: int) -> None:
        """Fill ``frame`` (its address, ``offset`` and length multiples of ``frame_align``) with
        the bytes at ``offset``: at least its first ``need`` bytes (the file may end after them),
        or raise ``SourceError``."""
        raise NotImplementedError

    #: Whether ``prefetch`` and ``scatter_into`` work: bytes brought into memory ahead (a local
    #: file's page cache), then one read filling many separate buffers from there.
    scatters: bool = False
    #: Where it ``scatters``: tensors with a destination under this many bytes are read in runs
    #: too, by one scattering read each on a read thread (``scatter_read``), however large (small
    #: ones always are, elsewhere by their consumer's thread). Looked at once ``ready()`` is done.
    scatter_below: int = 0
    #: Coalesced units without a destination may hold up to this many bytes (at most a share of
    #: the budget; 0: ``chunk_bytes``), where they are views that need no read (a file all in the
    #: page cache): each unit costs a round trip through the event loop and the consumer's thread
    #: that no read hides. Looked at once ``ready()`` is done.
    mapped_run_bytes: int = 0

    def scatters_at(self, offset: int, length: int) -> bool:
        """Whether ``scatter_below`` holds for a tensor at these bytes (a local file partly in the
        page cache: where they are in it); asked of tensors of 64 KiB and more only."""
        return True

    async def read_ahead(self, ranges: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """A hint (``checkpoint.ReadAhead``): the byte ranges ``(start, end)`` that ``ranges()``
        gives will be read soon. It never raises for them (the reads that follow do), and calls
        ``ranges`` (a step per tensor) on a thread, only where it acts on them. Nothing here."""
        return None

    async def prefetch(self, offset: int, length: int) -> None:
        """Have the bytes read into memory for a ``scatter_into`` soon, or raise ``SourceError``."""
        raise NotImplementedError

    async def scatter_read(self, offset: int, dests: list[Any]) -> None:
        """``scatter_into`` on one of the source's read threads."""
        raise NotImplementedError

    def scatter_into(self, offset: int, dests: list[Any]) -> None:
        """Fill ``dests`` (CPU tensors, or anything with ``data_ptr()`` and ``nbytes``), laid end
        to end, with the bytes from ``offset``, or raise ``SourceError``; blocking, from any thread."""
        raise NotImplementedError

    def _from_whole(self, offset: int, buf: memoryview) -> bool:
        """Fill ``buf`` from the object kept whole by ``head``, if there is one."""
        whole = self._whole
        if whole is None or offset + len(buf) > len(whole):
            return False
        buf[:] = memoryview(whole)[offset : offset + len(buf)]
        return True

    def _keep_if_whole(self, size: int, data: bytes) -> None:
        if len(data) == size:
            self._whole = data

    async def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        await self.readinto(offset, memoryview(buf))
        return bytes(buf)

    async def head(self, probe: int) -> tuple[int, bytes]:
        """The object's size and its first ``probe`` bytes (all of it, if it is shorter)."""
        size = await self.size()
        return size, await self.read(0, min(size, probe))


class Store(ABC):
    """A checkpoint location: a folder, an HTTP prefix, a bucket prefix."""

    url: str

    @abstractmethod
    def source(self, name: str) -> Source:
        """The object ``name`` (relative, already checked to stay inside the store)."""

    @abstractmethod
    async def kind(self) -> str:
        """``"file"`` when the URL names one object, ``"folder"`` when it names a location."""

    @abstractmethod
    async def list(self, suffix: str) -> list[str]:
        """Names of the objects directly inside the location that end with ``suffix``."""

    @abstractmethod
    async def get(self, name: str, limit: int) -> bytes | None:
        """A small object's whole body, ``None`` when it does not exist."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every file and connection; wait for reads still running."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, blocking Python (a large header's parse, the read plan), off the event
        loop: on a thread of the store's own where it has some, else on a new one."""
        return await run_in_thread(fn, *args)

    async def prepare(self) -> None:
        """Blocking set-up the store needs before its first request (a TLS context from a CA
        bundle), done off the event loop; awaited once, right after ``open_store``."""
        return None


def _store_target(url: str) -> tuple[str, str, str | None]:
    """(module, class, extra that installs its client) of the Store for ``url``'s scheme."""
    scheme = urlparse(url).scheme if "://" in url else ""
    if scheme not in STORES:
        known = ", ".join(sorted(s + "://" for s in STORES if s))
        raise UsageError(f"no source for scheme {scheme!r} (known: {known}, or a local path)", url=url)
    target, extra = STORES[scheme]
    module_name, cls_name = target.split(":")
    return module_name, cls_name, extra


def open_store(url: str, *, concurrency: int, **options: Any) -> Store:
    """The Store for ``url``, chosen by scheme; its module (with any optional client) is imported
    here unless ``import_store`` already did, on a thread."""
    module, cls_name = _store_module(url, url)
    cls: Callable[..., Store] = getattr(module, cls_name)
    return cls(url, concurrency=concurrency, **options)


def _store_module(url: str, named: str | None = None) -> tuple[Any, str]:
    """The module of ``url``'s Store, imported, and the Store's class name; an ImportError becomes
    a UsageError naming the extra to install (and ``named``, the URL asked for, if given)."""
    module_name, cls_name, extra = _store_target(url)
    try:
        return importlib.import_module(module_name), cls_name
    except ImportError as exc:
        hint = f": pip install 'aload[{extra}]'" if extra else ""
        raise UsageError(f"{urlparse(url).scheme}:// needs an optional dependency{hint}", url=named) from exc


async def import_store(url: str) -> None:
    """Import the module of ``url``'s Store on a thread, the first time: importing aiohttp took
    ~150 ms here and aiobotocore ~120 ms more, all of it holding the event loop at a process's
    first ``http://`` or ``s3://`` load. (``open_store`` then finds it imported.)"""
    module_name = _store_target(url)[0]
    if module_name not in sys.modules:
        # open_store reports an ImportError, naming the extra to install
        with setup_switches, contextlib.suppress(ImportError):
            await run_in_thread(importlib.import_module, module_name)


def preload(*schemes: str, collect: bool = True) -> None:
    """Import the clients of these URL schemes (``"http"``, ``"https"``, ``"s3"``; all of them if
    none is named) and load what their first use loads, now, before returning (S3: its models,
    and one client built, used and closed on a thread of its own: ~0.35 s). A serving
    process calls it at start-up, before its event loop serves anything: otherwise its first
    remote load imports them on a thread meanwhile, holding the GIL: a first S3 load left the
    loop over 4 ms late 8-9 times, the worst 54-76 ms, against 1-5 times and 6.8-8.7 ms after
    this (``python benchmarks/loop_stalls.py DIR --source s3://... [--preload]``).

    ``collect``: then run a full garbage collection (``gc.collect()``), here rather than in the
    first load. What the imports leave makes one due: without it, a preloaded process's first
    S3 load had a collection of the whole process in it, 104-116 ms holding the GIL (and so
    the event loop), in 3 of 3 runs of that benchmark with ``--preload``. ``False`` leaves the
    collector alone."""
    for scheme in schemes or tuple(s for s in STORES if s not in ("", "file")):
        module = _store_module(f"{scheme}://x")[0]
        warm = getattr(module, "warm", None)
        if warm is not None:
            warm()
    if collect:
        gc.collect()


class IOPool:
    """A lazily started thread pool for blocking reads; ``aclose`` waits for every read it
    started (a cancelled await does not stop a running ``preadv``) and joins its threads."""

    def __init__(self, threads: int, pin: bool = False) -> None:
        self.threads = threads
        self._nice = read_nice()  # each thread's priority below the process's (``READ_NICE``)
        self._cores = read_cores(threads) if pin else None  # each thread's core (``read_cores``)
        self._executor: ReadThreads | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._starting: asyncio.Future[None] | None = None

    async def start(self, other: IOPool | None = None) -> None:
        """Start every thread of this pool from one of ``other``'s (or from one helper thread),
        not from the event loop: ``Thread.start`` waits until the new thread has run, and with
        the cores busy each start held the loop for milliseconds (16 of them at a cold file's
        first read)."""
        if self._starting is None:
            starter = other.run(self._start_all) if other is not None else run_in_thread(self._start_all)
            self._starting = asyncio.ensure_future(starter)
        await asyncio.shield(self._starting)

    def _start_all(self) -> None:
        self.executor().start_all()

    def executor(self) -> ReadThreads:
        if self._executor is None:
            self._executor = ReadThreads(self.threads, "aload-io", start_read_thread, (self._nice, self._cores))
        return self._executor

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        cf = self.executor().submit(fn, *args)
        self._pending.add(cf)
        cf.add_done_callback(self._pending.discard)
        return await asyncio.wrap_future(cf)

    async def run_all(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> None:
        """``fn(*args)`` for each of ``calls``, taken in order by up to ``threads`` workers that
        each go from one call to the next on their thread; returns when every worker has ended,
        raising the first error (after which no call is started). The event loop submits a few
        workers and is woken once, however many calls there are; cancelled, the calls not yet
        started are dropped."""
        if not calls:
            return
        todo, errors = collections.deque(calls), list[BaseException]()

        def work() -> None:
            while not errors:
                try:
                    args = todo.popleft()
                except IndexError:
                    return
                try:
                    fn(*args)
                except BaseException as exc:  # raised on the loop once every worker has ended
                    errors.append(exc)

        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        workers = min(self.threads, len(calls))
        left, lock = [workers], threading.Lock()

        def finished(_: concurrent.futures.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    done.set_exception(errors[0]) if errors else done.set_result(None)
                except concurrent.futures.InvalidStateError:  # the caller was cancelled: nobody waits
                    pass

        ex = self.executor()
        for _ in range(workers):
            cf = ex.submit(work)
            self._pending.add(cf)
            cf.add_done_callback(self._pending.discard)
            cf.add_done_callback(finished)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            todo.clear()  # the running calls finish (``aclose`` waits for them), no new one starts
            raise

    async def aclose(self) -> None:
        if self._starting is not None:  # its threads are this pool's
            await asyncio.wait([self._starting])
            if not self._starting.cancelled():
                self._starting.exception()  # retrieved: a start that failed is nobody's error now
        running = [asyncio.wrap_future(cf) for cf in list(self._pending) if not cf.done()]
        if running:
            await asyncio.shield(asyncio.wait(running))
            # A read that failed after its caller gave up is nobody's error now: taken here, it is
            # not logged as "Future exception was never retrieved" when collected.
            for fut in running:
                if not fut.cancelled():
                    fut.exception()
        if self._executor is not None:
            # Threads are idle now, so the join is short. (Polling for their exit from the loop
            # instead let the HTTP cancellation test leave two connections open in 13 of 15 runs:
            # not understood yet.)
            self._executor.shutdown(wait=True)
            self._executor = None
