"""Local files: a file in the page cache is read into its destinations by preadv in steps (or
handed out as views of its mapping); a file on disk is read with O_DIRECT (past the page cache)
through small aligned buffers; the read threads run below the process's priority. Real files on this
machine's filesystem; the file is made cold with fsync + POSIX_FADV_DONTNEED."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

import aload
from aload import _ntcopy, _syscalls, _threads, local, mapping, pagecache, reader, warmcopy
from aload._syscalls import all_cached, libc, window_pages
from aload.arena import byte_view
from aload.direct import DIRECT_PIECE_BYTES, DirectFile
from aload.local import WARM_PIECE_BYTES, LocalSource
from aload.sources import IOPool
from aload.warmcopy import MAP, PREAD, CopyChoice

from .conftest import collect, count_copies, drop_cache, llama_like

MiB = 1 << 20


def needs_cachestat(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if window_pages(fd, path.stat().st_size, MiB) is None:
            pytest.skip("no cachestat(2) here")
    finally:
        os.close(fd)


def cached(path: Path) -> bool:
    return all_cached(np.memmap(path, mode="r"))


def resident(path: Path, lo: int, hi: int) -> float:
    """The share of the pages of bytes ``lo``..``hi`` of ``path`` in the page cache (mincore)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = lo // page, -(-hi // page)
    m = np.memmap(path, mode="r")
    vec = np.zeros(last - first, dtype=np.uint8)
    assert libc is not None
    assert libc.mincore(m.ctypes.data + first * page, min(hi, m.nbytes) - first * page, vec.ctypes.data) == 0
    return float(np.count_nonzero(vec & 1)) / len(vec)


def cold(path: Path) -> Path:
    """``path`` out of the page cache, or the test skipped where the filesystem keeps it (tmpfs)
    or refuses O_DIRECT."""
    drop_cache(path)
    if cached(path):
        pytest.skip("this filesystem keeps the file cached (tmpfs?)")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (OSError, AttributeError):
        pytest.skip("no O_DIRECT on this filesystem")
    return path


def cold_blob(tmp_path: Path, n: int, seed: int) -> tuple[bytes, Path]:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.safetensors"
    path.write_bytes(data)
    return data, cold(path)


@contextlib.asynccontextmanager
async def opened(path: Path, copy: CopyChoice | None = None) -> AsyncIterator[LocalSource]:
    """The file as a load reads it, copying out of the page cache by ``preadv`` unless ``copy``
    says otherwise."""
    pool, direct = IOPool(2), IOPool(4)
    src = LocalSource(str(path), pool, "map", direct, copy or CopyChoice("pread"))
    try:
        await src.size()
        yield src
    finally:
        src.close()
        await pool.aclose()
        await direct.aclose()


def placed(like: torch.Tensor, at: int) -> torch.Tensor:
    """Zeros shaped as ``like`` at ``at`` bytes into a 4 KiB page: where a destination sits
    against its source in the page decides how a large copy out of the page cache is made."""
    memory = torch.zeros(like.nbytes + 3 * 4096, dtype=torch.uint8)
    first = 4096 - memory.data_ptr() % 4096 + at % 4096
    return memory[first : first + like.nbytes].view(like.dtype).view(like.shape)


def flat(tensors: dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Module()
    for k, v in tensors.items():
        model.register_buffer(k.replace(".", "__"), torch.zeros(v.shape, dtype=v.dtype))
    return model


async def load_warm(write: Callable[..., Path], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors``, bring the file into the page cache, load it into ``flat(tensors)`` with
    the built-in loader, and check that every tensor arrived, straight into its parameter."""
    path = write(tensors)
    path.read_bytes()
    needs_cachestat(path)
    if not cached(path):
        pytest.skip("the page cache did not keep the file")
    model = flat(tensors)
    report = await aload.load(model, path)
    assert report.direct_bytes == sum(t.nbytes for t in tensors.values())  # straight into the model
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())


async def test_a_cold_file_is_read_past_the_page_cache_straight_into_the_parameters(
    write: Callable[..., Path],
) -> None:
    tensors = llama_like(hidden=1024, dtype=torch.bfloat16)
    path = cold(write(tensors))
    rename = aload.stages.rename(r"\.", "__")
    model = flat(tensors)
    async with aload.open(path) as ckpt:
        specs = ckpt.specs
    report = await aload.load(model, path, stages=rename)
    assert report.direct_bytes == sum(t.nbytes for t in tensors.values())  # no buffer, no copy_
    assert all(torch.equal(getattr(model, k.replace(".", "__")), v) for k, v in tensors.items())
    large = [s for s in specs.values() if s.nbytes >= MiB]
    # O_DIRECT: the large tensors never went through the page cache (but for pages they share
    # with a neighbour, and what the read of the header brought in after it); the runs of small
    # ones did, each copied out of it by one scattering read.
    assert large and all(resident(path, s.start, s.end) < 0.5 for s in large)
    assert sum(resident(path, s.start, s.end) for s in large[1:]) < 0.1
    assert all(resident(path, s.start, s.end) == 1 for s in specs.values() if s.nbytes < 256 << 10)


async def test_a_file_read_past_the_page_cache_gets_no_read_ahead(tmp_path: Path) -> None:
    """Its buffered reads (the header, runs of small tensors) bring in their own pages only: the
    kernel's read-ahead from them had brought megabytes of the large tensors after them into the
    page cache (one cold load in ~25), each then read again with ``O_DIRECT``."""
    page = os.sysconf("SC_PAGE_SIZE")
    data, path = cold_blob(tmp_path, 4 << 20, seed=5)
    async with opened(path) as src:
        assert (await src.head(page))[1] == data[:page]
        buf = bytearray(100 << 10)
        await src.readinto(MiB, memoryview(buf))  # under O_DIRECT_MIN_BYTES: a buffered read
    assert bytes(buf) == data[MiB : MiB + len(buf)]
    assert resident(path, 0, page) == 1 and resident(path, MiB, MiB + len(buf)) == 1
    assert resident(path, page, MiB) == 0 and resident(path, MiB + len(buf) + page, len(data)) == 0


async def test_a_prefetch_asks_for_every_byte_of_a_range_larger_than_the_kernel_reads_at_once(
    tmp_path: Path,
) -> None:
    """One ``POSIX_FADV_WILLNEED`` reads no more than its device's ``read_ahead_kb`` or
    ``max_sectors_kb``, whichever is larger, and drops the rest of its range: a run's prefetch
    asks in pieces of that size, so that all of the run comes in ahead of its copy."""
    data, path = cold_blob(tmp_path, 24 << 20, seed=6)
    async with opened(path) as src:
        assert src._piece >= os.sysconf("SC_PAGE_SIZE")
        await src.prefetch(0, len(data))
        for _ in range(500):  # queued reads: each lands in its own time
            if resident(path, 0, len(data)) == 1:
                break
            await asyncio.sleep(0.01)
    assert resident(path, 0, len(data)) == 1


async def test_a_warm_file_fills_tensors_under_16_mib_by_scattering_reads(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a file all in the page cache, tensors with a destination under ``SCATTER_BELOW_BYTES``
    (a LoRA adapter's, a small model's: 1-16 MiB) are read in runs by one scattering ``preadv``
    each, not one by one through the file's mapping (populating and dropping the pages of each
    cost more than the copy: 320 MB of ~1 MiB tensors, 2.4 -> 3.6 GB/s here). Larger tensors
    go in steps, by ``preadv`` where the load's choice says so: the file is then never mapped."""
    monkeypatch.setenv(warmcopy.COPY_ENV, "pread")
    mapped: list[str] = []
    real = mapping.map_private
    monkeypatch.setattr(mapping, "map_private", lambda fd, size, url: mapped.append(url) or real(fd, size, url))
    scattered: list[int] = []
    scatter = LocalSource.scatter_into
    monkeypatch.setattr(
        LocalSource,
        "scatter_into",
        lambda self, offset, dests: scattered.append(len(dests)) or scatter(self, offset, dests),
    )
    tensors = {f"w{i:02d}": torch.full((512 + i, 1024), float(i)) for i in range(12)}  # ~2 MiB each
    await load_warm(write, tensors)
    assert mapped == [] and sum(scattered) == len(tensors) and max(scattered) > 1  # in runs, unmapped
    big = {"big": torch.ones(5 << 20)}  # 20 MiB: read in two steps
    path = write(big, name="big.safetensors")
    model = nn.Module()
    model.register_buffer("big", torch.zeros(5 << 20))
    await aload.load(model, path)
    assert mapped == [] and torch.equal(model.big, big["big"])


async def test_runs_from_a_warm_file_are_filled_on_the_read_threads_beside_its_large_tensors(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a file all in the page cache, the tensors of 64 KiB to 16 MiB with a destination are
    read in runs of up to ``FILLED_RUN_BYTES`` by the read threads, even where the file also
    holds larger tensors: one unit, and one trip through the event loop, per run instead of per
    tensor, and the loader's thread copies none of them beside the read threads. Tiny tensors
    (norms) join such a run, or else stay in runs of their own that the loader's thread fills."""
    fills: list[tuple[str, int]] = []
    scatter = LocalSource.scatter_into

    def spy(self: LocalSource, offset: int, dests: list[Any]) -> None:
        fills.append((threading.current_thread().name, len(dests)))
        scatter(self, offset, dests)

    monkeypatch.setattr(LocalSource, "scatter_into", spy)
    tensors: dict[str, torch.Tensor] = {"embed": torch.ones(5 << 20)}  # 20 MiB: its own unit
    for i in range(4):
        tensors |= {f"l{i}_q": torch.full((384, 1024), float(i)), f"l{i}_norm": torch.full((64,), float(i))}
        tensors |= {f"l{i}_mlp": torch.full((2048, 1024), float(i))}  # 8 MiB
    await load_warm(write, tensors)
    on_read_threads = [n for name, n in fills if name.startswith("aload-io")]
    assert sum(n for _, n in fills) == len(tensors) - 1
    assert sum(on_read_threads) >= 8 and max(on_read_threads) >= 3  # q, mlp and a norm between


async def test_a_partly_evicted_file_fills_runs_where_it_is_cached_and_reads_alone_where_not(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs are decided per range: in a file whose first part was evicted, the 1-16 MiB tensors
    past it are filled in runs on the read threads as from a warm file, those in it are read one
    unit each (from the disk, with ``O_DIRECT`` where it can). The whole file had been taken as
    cold, and its 8 MiB tensors all read one unit each (the Qwen-shaped checkpoint, partly
    evicted: 0.73-0.75x the fastest peer)."""
    fills: list[tuple[str, int, int]] = []
    scatter = LocalSource.scatter_into

    def spy(self: LocalSource, offset: int, dests: list[Any]) -> None:
        fills.append((threading.current_thread().name, offset, len(dests)))
        scatter(self, offset, dests)

    monkeypatch.setattr(LocalSource, "scatter_into", spy)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(8):
        tensors |= {f"l{i}_q": torch.full((384, 1024), float(i)), f"l{i}_norm": torch.full((64,), float(i))}
        tensors |= {f"l{i}_mlp": torch.full((2048, 1024), float(i))}  # 8 MiB
    path = write(tensors)
    path.read_bytes()
    needs_cachestat(path)
    async with aload.open(path) as ckpt:
        specs = sorted(ckpt.specs.values(), key=lambda s: s.start)
    evicted = specs[6].end  # the first two layers
    drop_cache(path, 0, evicted)
    model = flat(tensors)
    await aload.load(model, path)
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    at = {s.start: i for i, s in enumerate(specs)}
    filled = {s.name for name, off, n in fills if name.startswith("aload-io") for s in specs[at[off] : at[off] + n]}
    mid = [s for s in specs if s.nbytes >= 64 << 10]
    # The page cache drops whole folios (up to 2 MiB), and is looked at in 4 MiB windows.
    assert {s.name for s in mid if s.start >= evicted + (4 << 20)} <= filled
    assert not {s.name for s in mid if s.end <= evicted - (2 << 20)} & filled


async def test_a_warm_load_into_parameters_makes_no_torch_op_or_fstat_per_unit_on_the_loop(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each torch op and each system call on the event loop lets go of the GIL and waits to take
    it back while the read threads copy (~0.3 ms a unit read into a parameter, ~70 us a run of
    small tensors here): units read straight into parameters, and runs of small ones from the
    page cache, take neither on the loop (the file's open does, once)."""
    tensors = {f"w{i}": torch.full((384, 1024), float(i)) for i in range(6)}  # 1.5 MiB: own units
    tensors |= {f"n{i}": torch.full((64,), float(i)) for i in range(40)}  # runs of small ones
    tensors["big"] = torch.ones(5 << 20)  # 20 MiB
    path = write(tensors)
    path.read_bytes()
    if not cached(path):
        pytest.skip("the page cache did not keep the file")
    loop = threading.get_ident()
    on_loop: list[str] = []
    detach, fstat = torch.Tensor.detach, os.fstat

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if threading.get_ident() == loop:
                on_loop.append(name)
            return fn(*args)

        return call

    model = flat(tensors)
    monkeypatch.setattr(torch.Tensor, "detach", spy("detach", detach))
    monkeypatch.setattr(os, "fstat", spy("fstat", fstat))
    report = await aload.load(model, path)
    monkeypatch.undo()
    assert report.direct_bytes == sum(t.nbytes for t in tensors.values())
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    assert on_loop == ["fstat"]  # once per file: opened on the loop to read its header from the page cache


def test_a_byte_view_writes_into_its_tensor_and_keeps_it_alive() -> None:
    """``byte_view`` (the bytes a read fills, from the tensor's address) holds the tensor while
    the view lives, a parameter that requires grad included, and lets it go after."""
    t = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    ref = weakref.ref(t)
    view = byte_view(t)
    del t
    gc.collect()
    view[:2] = torch.ones(1, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    alive = ref()
    assert alive is not None and alive.tolist() == [1.0, 0.0, 0.0, 0.0] and len(view) == 8
    del alive, view
    gc.collect()
    assert ref() is None
    assert len(byte_view(torch.zeros(0))) == 0


async def test_a_cold_file_streams_through_buffers_within_the_budget(write: Callable[..., Path]) -> None:
    """Without known destinations (load_weights, streams) a cold file is read into the budget's
    buffers rather than mapped: same bytes, the bound kept, the page cache left alone."""
    tensors = {f"w{i}": torch.randn(512, 1024 + i) for i in range(8)}  # ~2 MiB each, odd sizes
    path = cold(write(tensors))
    async with aload.stream(path, max_inflight_bytes=5 * MiB, chunk_bytes=MiB) as s:
        got = {name: t.clone() async for name, t in s}
        stats = s.stats
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert stats.peak_inflight_bytes <= 5 * MiB
    assert not cached(path)


@pytest.mark.parametrize("into", ["parameters", "stream"])
async def test_read_shared_brings_a_cold_file_in_through_the_page_cache(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """``read="shared"``: bytes on disk come in through the page cache, never with O_DIRECT, so
    processes loading the same files at once read each page from the disk once between them."""
    tensors = llama_like(hidden=1024, dtype=torch.bfloat16)
    path = cold(write(tensors))

    def direct(*args: Any) -> None:
        raise AssertionError("an O_DIRECT read")

    monkeypatch.setattr(DirectFile, "read_aligned", direct)
    monkeypatch.setattr(DirectFile, "read_bounced", direct)
    if into == "parameters":
        model = flat(tensors)
        await aload.load(model, path, stages=aload.stages.rename(r"\.", "__"), read="shared")
        got = {k: getattr(model, k.replace(".", "__")) for k in tensors}
    else:  # chosen by the operator, for loads that do not say
        monkeypatch.setenv("ALOAD_READ", "shared")
        async with aload.stream(path, max_inflight_bytes=4 * MiB) as s:
            got = {name: t.clone() async for name, t in s}
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    # The whole file, left in the page cache for the next reader (O_DIRECT leaves none of it):
    # a few scattered pages of 9,347 were sometimes missing here (3 runs in 40) however read.
    assert resident(path, 0, path.stat().st_size) > 0.99


async def test_a_read_mode_from_the_environment_is_checked(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write({"w": torch.ones(4)})
    monkeypatch.setenv("ALOAD_READ", "direct")
    with pytest.raises(aload.UsageError, match="ALOAD_READ must be one of"):
        async with aload.open(path):
            pass
    async with aload.open(path, read="pread") as ckpt:  # an explicit mode is not the environment's
        assert list(ckpt.specs) == ["w"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice per thread is Linux's")
@pytest.mark.parametrize("said", [None, "0", "4"])
async def test_read_threads_run_below_the_process_s_priority(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, said: str | None
) -> None:
    """The read threads yield the cores to the event loop (``READ_NICE``); the operator can say
    by how much, or not at all."""
    tensors = llama_like(hidden=256)
    path = write(tensors)
    if said is not None:
        monkeypatch.setenv("ALOAD_READ_NICE", said)
    seen: list[int] = []
    pread_into = local.pread_into

    def recorded(*args: Any) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        pread_into(*args)

    monkeypatch.setattr(local, "pread_into", recorded)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    async with aload.stream(path, read="pread", chunk_bytes=MiB) as s:
        got = {name: t.clone() async for name, t in s}
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    by = {None: 10, "0": 0, "4": 4}[said]
    assert seen and set(seen) == {min(19, base + by)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the loop's own is untouched


async def test_a_read_priority_from_the_environment_is_checked(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write({"w": torch.ones(4)})
    monkeypatch.setenv("ALOAD_READ_NICE", "-5")
    with pytest.raises(aload.UsageError, match="ALOAD_READ_NICE must be a whole number from 0 to 19, got '-5'"):
        await aload.load(nn.Module(), path)


async def test_direct_reads_at_unaligned_ranges_give_the_file_s_bytes(tmp_path: Path) -> None:
    data, path = cold_blob(tmp_path, 5 * MiB + 12345, seed=0)
    async with opened(path) as src:
        size = len(data)
        assert not src._cached() and src.piece_bytes(16 * MiB, 0, size) == 16 * MiB and not src.maps(0, size)
        ranges = [
            (0, 300_000),
            (4095, MiB + 3),  # straddles pages at both ends
            (DIRECT_PIECE_BYTES - 1, 2 * DIRECT_PIECE_BYTES + 2),  # several pieces, none aligned
            (size - MiB - 777, MiB + 777),  # up to the end of the file, which is not aligned
        ]
        for offset, n in ranges:
            buf = bytearray(n)
            await src.readinto(offset, memoryview(buf))
            assert bytes(buf) == data[offset : offset + n], (offset, n)
        with pytest.raises(aload.SourceError, match="file ended") as info:
            await src.readinto(size - MiB, memoryview(bytearray(2 * MiB)))
        lo, hi = info.value.byte_range or (0, 0)
        assert info.value.url == str(path) and size - MiB <= lo <= size < hi == size + MiB  # the piece that ran out


def mapping_of(addr: int) -> tuple[str, list[str]]:
    """The permissions and the kernel's flags (``VmFlags``) of the mapping holding ``addr``
    (/proc/self/smaps)."""
    inside, perms = False, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, *rest = line.split()
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside, perms = lo <= addr < hi, rest[0]
        elif inside and head == "VmFlags:":
            return perms, rest
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no huge pages here")
def test_a_bounce_buffer_lies_in_huge_pages_of_its_own() -> None:
    """A direct read into 4 KiB pages is one segment per page, and a virtio disk takes 254 in one
    request: each 1 MiB piece went to the disk as two requests whenever its buffer's pages lay
    scattered (a cold 8 GiB load made 11,600-13,800 requests, averaging 600-710 KiB). Private
    memory: an anonymous mapping shared (``mmap.mmap``'s default) gets no huge pages."""
    got: list[tuple[int, int, str, list[str]]] = []

    def on_a_thread() -> None:  # one buffer per thread
        buf, addr = _syscalls.bounce_buffer(DIRECT_PIECE_BYTES + 4096)
        assert _syscalls.bounce_buffer(MiB)[1] == addr  # kept for the thread's life
        got.append((len(buf), addr, *mapping_of(addr)))

    t = threading.Thread(target=on_a_thread)
    t.start()
    t.join()
    [(size, addr, perms, flags)] = got
    assert size == _syscalls.HUGE and addr % _syscalls.HUGE == 0
    assert perms == "rw-p" and "hg" in flags  # private, MADV_HUGEPAGE


async def test_a_filesystem_refusing_direct_reads_gets_buffered_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where O_DIRECT opens but a read is refused (EINVAL: an alignment the filesystem does not
    take), that file is read buffered from then on, with the same bytes."""
    data, path = cold_blob(tmp_path, 3 * MiB + 5, seed=1)
    refused: list[int] = []
    real = os.preadv
    async with opened(path) as src:
        assert src._dio is not None
        dfd = src._dio.dfd

        def preadv(fd: int, buffers: Any, offset: int) -> int:
            if fd == dfd:
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", preadv)
        buf = bytearray(len(data) - 10)
        await src.readinto(10, memoryview(buf))
        assert bytes(buf) == data[10:] and refused
        again = bytearray(MiB)
        n = len(refused)
        await src.readinto(2 * MiB, memoryview(again))
        assert bytes(again) == data[2 * MiB : 3 * MiB] and len(refused) == n  # not asked again
        monkeypatch.undo()


async def test_a_warm_file_is_copied_in_large_pieces(write: Callable[..., Path]) -> None:
    path = write({"w": torch.ones(256, 1024)})
    path.read_bytes()  # in the page cache
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    async with opened(path) as src:
        n = path.stat().st_size
        assert src._cached() and src.maps(0, n) and src.piece_bytes(16 * MiB, 0, n) == WARM_PIECE_BYTES
        buf = bytearray(MiB)
        await src.readinto(8 + int.from_bytes(path.read_bytes()[:8], "little"), memoryview(buf))
        with safe_open(str(path), "pt") as st:
            assert bytes(buf) == st.get_tensor("w").numpy().tobytes()


async def test_a_large_warm_tensor_is_read_by_preadv_in_steps(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of the page cache, a large tensor with a destination is read by ``preadv`` in steps of
    ``PREAD_STEP_BYTES`` across the read threads, each thread offering its core after each step
    (the event loop's thread waited up to a scheduler tick for one), wherever the destination
    sits in its page (a copy out of the mapping aliased at some), with nothing mapped or asked
    for ahead."""
    path = write({"w": torch.ones(5 * 1024, 1024)})  # 20 MiB
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    n = path.stat().st_size - start
    preads: list[tuple[int, str]] = []
    asked: list[int] = []
    real_pread = local.pread_into

    def pread_into(fd: int, buf: memoryview, offset: int, url: str) -> None:
        preads.append((len(buf), threading.current_thread().name))
        real_pread(fd, buf, offset, url)

    yields: list[str] = []
    real_yield = os.sched_yield
    monkeypatch.setattr(local, "pread_into", pread_into)
    monkeypatch.setattr(local, "willneed", lambda fd, offset, length: asked.append(length))
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(threading.current_thread().name) or real_yield())
    with safe_open(str(path), "pt") as st:
        want = st.get_tensor("w").numpy().tobytes()
    async with opened(path) as src:
        await src.ready()
        for delta in (64, 2048):
            dest = placed(torch.empty(n, dtype=torch.uint8), start + delta).numpy()  # delta past the source
            preads.clear()
            yields.clear()
            await src.readinto(start, memoryview(dest))
            assert dest.tobytes() == want
            step = local.PREAD_STEP_BYTES
            assert sorted(size for size, _ in preads) == sorted([step] * (n // step) + ([n % step] if n % step else []))
            assert sorted(yields) == sorted(name for _, name in preads)  # each step then offers its core
            assert threading.main_thread().name not in {name for _, name in preads}
        assert src._map is not None and src._map._array is None and asked == []  # never mapped


@pytest.mark.skipif(libc is None or not _syscalls.IOVEC_OK, reason="scattering reads need Linux's preadv")
def test_a_scattering_read_goes_in_steps_and_offers_the_core_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of tensors filled by one scattering read is read ``step`` bytes a call at most (a
    tensor larger than that alone), with ``os.sched_yield()`` between calls: on a kernel without
    preemption one call over a 64 MiB run kept its core ~10 ms while the event loop waited."""
    sizes = [3 * MiB, 3 * MiB, 10 * MiB, MiB, MiB]
    data = np.random.default_rng(0).integers(0, 256, sum(sizes) + 100, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    calls: list[int] = []
    yields: list[int] = []
    real_yield = os.sched_yield

    class Counting:
        def preadv(self, fd: int, iov: int, count: int, offset: int) -> int:
            calls.append(count)
            return int(libc.preadv(fd, iov, count, offset))

    monkeypatch.setattr(_syscalls, "libc", Counting())
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(len(calls)) or real_yield())
    fd = os.open(path, os.O_RDONLY)
    try:
        _syscalls.preadv_scatter(fd, 100, dests, str(path), 4 * MiB)
    finally:
        os.close(fd)
    assert torch.equal(torch.cat(dests), torch.from_numpy(data[100:]))
    assert calls == [1, 1, 1, 2]  # 3 MiB, 3 MiB, then 10 MiB alone, then both 1 MiB ones
    assert yields == [1, 2, 3]  # between calls, not before the first or after the last


def warm_file(write: Callable[..., Path], tensors: dict[str, torch.Tensor]) -> tuple[Path, int]:
    """``tensors`` written, the file brought into the page cache (the test skipped where it did
    not stay), and where its data starts."""
    path = write(tensors)
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    return path, 8 + int.from_bytes(path.read_bytes()[:8], "little")


def rss_file() -> int:
    """This process's resident pages of files, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) << 10
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")
async def test_a_large_warm_tensor_can_be_copied_out_of_the_mapping_which_then_lets_its_pages_go(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the load's choice says so, a large tensor out of the page cache is copied out of the
    file's mapping in the same steps across the read threads (a tail under ``CHOOSE_MIN_BYTES``
    by ``preadv``), each step's pages dropped from the process after its copy, so the process
    does not keep the file resident; a file that shrank is named with the step's bytes."""
    path, start = warm_file(write, {"w": torch.ones(5 * 1024, 1024)})  # 20 MiB: steps of 8, 8 and 4 MiB
    size = path.stat().st_size
    n = size - start
    preads: list[int] = []
    real_pread = local.pread_into
    monkeypatch.setattr(
        local, "pread_into", lambda fd, buf, offset, url: preads.append(len(buf)) or real_pread(fd, buf, offset, url)
    )
    with safe_open(str(path), "pt") as st:
        want = st.get_tensor("w").numpy().tobytes()
    choice = CopyChoice("map")
    async with opened(path, choice) as src:
        await src.ready()
        before = rss_file()
        for delta in (64, 2048):
            dest = placed(torch.empty(n, dtype=torch.uint8), start + delta).numpy()
            await src.readinto(start, memoryview(dest))
            assert dest.tobytes() == want
        assert src._map is not None and src._map._array is not None  # mapped
        assert rss_file() - before < 4 * MiB  # 20 MiB copied twice, its pages let go
        assert preads == [] and choice.counts == [0, 6] and choice.chosen == "map"
        n_small = 3 * MiB
        await src.readinto(start, memoryview(dest)[:n_small])  # under CHOOSE_MIN_BYTES: preadv, untimed
        assert dest[:n_small].tobytes() == want[:n_small] and preads == [n_small] and choice.counts == [0, 6]
    path.read_bytes()
    async with opened(path, CopyChoice("map")) as src:
        await src.ready()
        os.truncate(path, size - 100)
        with pytest.raises(aload.SourceError, match="shrank") as info:
            await src.readinto(start, memoryview(dest))
    last = start + (n - 1) // local.PREAD_STEP_BYTES * local.PREAD_STEP_BYTES  # the step the file ends in
    assert info.value.url == str(path) and info.value.byte_range == (last, start + n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")
def test_steps_copied_out_of_the_mapping_let_their_pages_go_a_span_at_a_time(write: Callable[..., Path]) -> None:
    """Steps copied without a populate, in any order: each span's pages stay mapped until its
    last step is done (whichever step that is), then go; the bytes are the file's."""
    path, start = warm_file(write, {"w": torch.ones(10 * 1024, 1024)})  # 40 MiB: two spans of 16, one of 8
    n, step, span = path.stat().st_size - start, 4 * MiB, 16 * MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mapping.FileMapping(fd, path.stat().st_size, str(path))
        spans = mapping.Spans(m, start, n, span)
        dest = torch.zeros(n, dtype=torch.uint8).numpy()
        order = [o for o in range(0, n, step) if o // span == 1] + [o for o in range(0, n, step) if o // span != 1]
        before = rss_file()
        for i, o in enumerate(order):
            buf = memoryview(dest)[o : o + step]
            if not m.copy_into(start + o, buf, cached=True, release=False):
                pytest.skip("the kernel cannot populate a mapping")
            spans.done(start + o, len(buf))
            if i == 2:  # three of the middle span's four steps: all mapped still
                assert rss_file() - before >= 3 * step - 2 * 4096
            if i == 3:  # its last: let go (but for pages it shares with a neighbour at its ends)
                assert rss_file() - before < 5 * MiB
        assert rss_file() - before < 5 * MiB
        assert dest.tobytes() == path.read_bytes()[start:]
    finally:
        m.drop()
        os.close(fd)


async def test_a_load_times_both_copies_and_takes_the_faster(write: Callable[..., Path]) -> None:
    """On "auto" the first steps go both ways (concurrent steps different ways), both timed; the
    load then takes the faster, and says which."""
    path, start = warm_file(write, {"w": torch.ones(16 * 1024, 1024)})  # 64 MiB: eight steps
    n = path.stat().st_size - start
    choice = CopyChoice("auto")
    async with opened(path, choice) as src:
        dest = torch.zeros(n, dtype=torch.uint8).numpy()
        await src.readinto(start, memoryview(dest))
        assert dest.tobytes() == path.read_bytes()[start:]
    assert choice.counts[PREAD] >= 1 and choice.counts[MAP] >= 1 and sum(choice.counts) == 8
    model = flat({"w": torch.zeros(16 * 1024, 1024)})
    report = await aload.load(model, path)
    assert report.warm_copy in ("pread", "map") and torch.equal(model.w, torch.ones(16 * 1024, 1024))


def test_the_choice_alternates_then_prefers_the_faster_and_looks_at_the_other_now_and_then() -> None:
    step, every = 8 * MiB, warmcopy.EXPLORE

    def others(preferred: int) -> int:  # steps sent the other way in the next ``every`` picks
        return sum(choice.pick(step) != preferred for _ in range(every))

    choice = CopyChoice("auto")
    first = [choice.pick(step) for _ in range(4)]
    assert first == [PREAD, MAP, PREAD, MAP]
    for way, ns in ((PREAD, 100), (MAP, 60), (PREAD, 110), (MAP, 70), (PREAD, 90), (MAP, 65)):
        choice.record(way, step, ns * step)
    assert others(MAP) == 4  # the mapping preferred; the other way looked at often at first
    # Each step of the other way is judged against the preferred way's latest steps, not by its
    # own old timings: slower than the mapping's, the preference stays, and once it has been
    # looked at SWITCH_AFTER times, it is looked at one step in EXPLORE.
    for way, ns in ((PREAD, 120), (MAP, 70), (PREAD, 130), (MAP, 80), (PREAD, 140)):
        choice.record(way, step, ns * step)
    assert others(MAP) == 1
    for _ in range(warmcopy.WINDOW):  # the mapping turns slow
        choice.record(MAP, step, 300 * step)
    choice.record(PREAD, step, 200 * step)  # one of the last three says so (130/67.5, 140/70, 200/300)
    assert others(MAP) == 1
    choice.record(PREAD, step, 250 * step)  # two of them: the preference turns
    assert others(PREAD) == 4
    for _ in range(warmcopy.WINDOW):
        choice.record(PREAD, step, 200 * step)
    for _ in range(warmcopy.SWITCH_AFTER):  # the mapping a twentieth faster: not worth a turn
        choice.record(MAP, step, 190 * step)
    assert others(PREAD) == 1
    assert choice.pick(warmcopy.CHOOSE_MIN_BYTES - 1) == PREAD  # a small step: preadv
    choice.record(MAP, MiB, 1)  # and it is not timed
    assert choice.counts == [13, 13] and choice.chosen == "pread"
    assert CopyChoice("map").pick(step) == MAP and CopyChoice("pread").pick(step) == PREAD


async def test_a_copy_mode_not_known_is_refused_naming_the_variable(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write({"w": torch.ones(4, 4)})
    monkeypatch.setenv(warmcopy.COPY_ENV, "mmap")
    with pytest.raises(aload.UsageError, match="ALOAD_WARM_COPY must be one of"):
        await aload.load(flat({"w": torch.zeros(4, 4)}), path)


async def test_a_partly_evicted_warm_tensor_asks_for_its_pages_once_and_a_shrunk_file_is_named(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large tensor mostly in the page cache is read by ``preadv`` in steps too, its bytes
    asked for once ahead (``WILLNEED``), not read step by step from the disk; a file that shrank
    since it was opened fails with its name and the bytes asked for."""
    # 20 MiB: five of the windows the cache is judged by
    path, start = warm_file(write, {"w": torch.ones(5 * 1024, 1024)})
    size = path.stat().st_size
    n = size - start
    asked: list[tuple[int, int]] = []
    real = local.willneed
    monkeypatch.setattr(
        local,
        "willneed",
        lambda fd, offset, length, piece: asked.append((offset, length)) or real(fd, offset, length, piece),
    )
    with safe_open(str(path), "pt") as st:
        want = st.get_tensor("w").numpy().tobytes()
    dest = torch.zeros(n, dtype=torch.uint8).numpy()
    async with opened(path) as src:
        await src.ready()
        await src.readinto(start, memoryview(dest))
        assert dest.tobytes() == want and asked == []
    drop_cache(path, 0, 4 * MiB)  # the first window out
    async with opened(path) as src:
        await src.ready()
        if not src._in_cache(start, n) or src._share_at(start, n) == 1.0:
            pytest.skip("the page cache kept the range, or dropped more")
        dest[:] = 0
        steps: list[tuple[int, bool]] = []
        run_all = src._pool.run_all

        async def spy(fn: Callable[..., None], args: list[tuple[Any, ...]]) -> None:
            steps.extend((offset, whole) for _, offset, whole, _ in args)
            await run_all(fn, args)

        src._pool.run_all = spy  # type: ignore[method-assign]
        await src.readinto(start, memoryview(dest))
        assert dest.tobytes() == want and asked == [(start, n)]
        # The steps in the page cache go first, while the disk brings in the evicted one; only
        # those are copied without a populate first.
        assert sorted(o for o, _ in steps) == list(range(start, start + n, local.PREAD_STEP_BYTES))
        assert steps[-1] == (start, False) and all(whole for _, whole in steps[:-1])
    path.read_bytes()
    async with opened(path) as src:
        await src.ready()
        os.truncate(path, size - 100)
        with pytest.raises(aload.SourceError, match="ended") as info:
            await src.readinto(start, memoryview(dest))
    last = start + (n - 1) // local.PREAD_STEP_BYTES * local.PREAD_STEP_BYTES  # the step the file ends in
    assert info.value.url == str(path) and info.value.byte_range == (last, size)


async def test_a_view_partly_evicted_is_populated_in_chunks(write: Callable[..., Path]) -> None:
    """A tensor mostly in the page cache is mapped, but the part of it on disk is brought in by
    several populates at once: in one large piece, one thread read it in."""
    path = write({"w": torch.ones(4096, 1024)})  # 16 MiB: four of the windows the cache is judged by
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    n = path.stat().st_size - start
    drop_cache(path, 0, 4 * MiB)  # the first window out, the header with it
    async with opened(path) as src:
        await src.ready()
        if src._share_at(start, n) >= 0.99:
            pytest.skip("the page cache kept the range")
        assert src.maps(start, n)  # three quarters cached: mapped
        assert src.piece_bytes(MiB, start, n, mapped=True) == MiB
        assert src.piece_bytes(MiB, 8 * MiB, 4 * MiB, mapped=True) == WARM_PIECE_BYTES  # a cached part alone
        assert src.piece_bytes(MiB, start, n) == WARM_PIECE_BYTES  # read in steps: its misses asked for ahead


async def test_a_view_partly_evicted_has_its_missing_pages_asked_for_before_its_chunks(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view (no destination: ``load_weights``' path) larger than a chunk and partly on disk
    asks for all its missing pages at once, before its chunks are populated two at a time: the
    disk has them queued (the Qwen-shaped checkpoint partly evicted through ``load_weights``,
    5.54 -> 6.17 GB/s)."""
    asked: list[tuple[int, int]] = []
    real = LocalSource.prefetch

    async def spy(self: LocalSource, offset: int, length: int) -> None:
        asked.append((offset, length))
        await real(self, offset, length)

    monkeypatch.setattr(LocalSource, "prefetch", spy)
    tensors = {"w": torch.arange(4096 * 1024, dtype=torch.float32).view(4096, 1024)}  # 16 MiB
    path = write(tensors)
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    drop_cache(path, 0, 4 * MiB)  # the first window out
    async with aload.open(path) as ckpt:
        spec = ckpt.specs["w"]
    got = {}
    async with aload.stream(path, chunk_bytes=MiB) as s:
        async for name, t in s:
            got[name] = t.clone()
    assert torch.equal(got["w"], tensors["w"])
    assert (spec.start, spec.nbytes) in asked


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore"])
async def test_whether_each_shard_is_cached_is_worked_out_once_and_never_mapped_on_the_event_loop(
    sharded: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, cachestat: bool
) -> None:
    """Each shard's page cache is looked at once however many reads ask at once: by ``cachestat``
    right on the loop within its budget (``LocalSource._look_now``), else on a read thread; mapping
    a shard and asking ``mincore`` about all of it (3-9 ms of lateness per shard on the loop)
    happen on a read thread only."""
    tensors = {f"layers.{i}.w": torch.full((64, 1024), float(i)) for i in range(8)}
    folder = sharded(tensors, 4)
    if cachestat:
        needs_cachestat(next(folder.glob("*.safetensors")))
    else:  # the kernel refuses it: mincore over a mapping
        monkeypatch.setattr(pagecache, "window_pages", lambda *a, **k: None)
    decided: list[tuple[str, str]] = []
    real, real_now = LocalSource._cached, LocalSource._look_now

    def cached(self: LocalSource) -> bool:
        if self._warm is None:
            decided.append((self.url, "loop" if threading.current_thread() is threading.main_thread() else "thread"))
        return real(self)

    def look_now(self: LocalSource) -> bool:
        done = real_now(self)
        if done:
            decided.append((self.url, "now"))
        return done

    monkeypatch.setattr(LocalSource, "_cached", cached)
    monkeypatch.setattr(LocalSource, "_look_now", look_now)
    async with aload.stream(folder) as s:
        got = await collect(s)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert len(decided) == 4 and len({u for u, _ in decided}) == 4  # each shard once
    assert "loop" not in {how for _, how in decided}, decided
    # Four small shards: the loop's budget holds the first look at least.
    assert ("now" in {how for _, how in decided}) == cachestat


def test_the_page_cache_is_sampled_at_each_windows_end(write: Callable[..., Path]) -> None:
    """A load looks at the last ``CACHE_SAMPLE_BYTES`` of each window (a whole walk of the page
    cache was 9 ms a GB before the first read): a window out of the cache reads 0 pages, one in it
    all of its pages, and the pages a header read brings in at a cold file's start do not make its
    first window look cached."""
    path = write({"t": torch.arange(14 * MiB // 4, dtype=torch.float32)})  # 3 windows and a part
    path.read_bytes()
    needs_cachestat(path)
    size, w, sample = path.stat().st_size, 4 * MiB, pagecache.CACHE_SAMPLE_BYTES
    full = [-(-min(w, size - off) // 4096) for off in range(0, size, w)]
    fd = os.open(path, os.O_RDONLY)
    try:
        if window_pages(fd, size, w) != full:
            pytest.skip("the file did not stay in the page cache")
        assert window_pages(fd, size, w, sample) == full
        drop_cache(path, w, w)  # the second window out
        drop_cache(path, 2 * w, 2 * MiB)  # the first half of the third, which is not looked at
        if resident(path, w, 2 * w) > 0 or resident(path, 2 * w + 2 * MiB, 3 * w) < 1:
            pytest.skip("the page cache did not drop just those pages")
        exact = window_pages(fd, size, w)
        assert exact is not None and exact[1] == 0 and exact[2] == full[2] // 2
        assert window_pages(fd, size, w, sample) == [full[0], 0, full[2], full[3]]
        cold(path)
        os.pread(fd, 4096, 0)  # the header, and the kernel's readahead after it
        assert window_pages(fd, size, w, sample) == [0, 0, 0, 0]
    finally:
        os.close(fd)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_small_tensors_without_a_destination_come_in_large_views_from_the_page_cache(
    write: Callable[..., Path], warm: bool
) -> None:
    """From a file in the page cache, small tensors without a destination (a stream, a model's own
    ``load_weights``) come in mapped views of up to ``MAPPED_RUN_BYTES``, at most a quarter of the
    budget, not ``chunk_bytes``: nothing is read, and each unit cost the consumer a wait for the
    event loop. A file on disk keeps ``chunk_bytes``, so that its first tensors come after a short read."""
    tensors = {f"t{i:02d}": torch.full((MiB // 4,), float(i)) for i in range(48)}  # 1 MiB each
    path = write(tensors)
    if warm:
        path.read_bytes()
        needs_cachestat(path)
    else:
        cold(path)
    async with aload.stream(path, chunk_bytes=2 * MiB, max_inflight_bytes=32 * MiB) as s:
        got = {name: t.clone() async for name, t in s}
        assert s.reader is not None
        sizes = [u.nbytes for u in s.reader.plan.units]
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert sum(sizes) == 48 * MiB
    if warm:
        assert max(sizes) == 8 * MiB  # a quarter of the budget
    else:
        assert max(sizes) == 2 * MiB


@pytest.mark.parametrize("how", ["cachestat", "mincore"])
async def test_what_the_page_cache_holds_decides_and_a_cold_file_is_never_mapped(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``cachestat(2)`` (Linux 6.5+) says how much of a file the page cache holds without mapping
    it, so a file read from the disk is never mapped; where the kernel or a seccomp filter refuses
    the call, ``mincore`` over a mapping of the file says it instead. A file partly cached is not
    cached as a whole (its parts are decided one by one: the test below)."""
    if how == "mincore":
        monkeypatch.setattr(_syscalls, "_cachestat_ok", False)
    mapped: list[str] = []
    real = mapping.map_private
    monkeypatch.setattr(mapping, "map_private", lambda fd, size, url: mapped.append(url) or real(fd, size, url))
    tensors = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    path = write(tensors)
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    if how == "cachestat":
        needs_cachestat(path)
    async with opened(path) as src:
        assert src._cached()
    drop_cache(path, path.stat().st_size // 2)  # the second half out of the cache, the first still in
    async with opened(path) as src:
        assert not src._cached()
    cold(path)
    mapped.clear()
    async with aload.stream(path, chunk_bytes=MiB) as s:
        got = {name: t.clone() async for name, t in s}
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert mapped == ([] if how == "cachestat" else [str(path)])  # mincore needs a mapping to ask


@pytest.mark.parametrize("into", ["stream", "model"])
async def test_a_file_partly_evicted_is_read_from_the_cache_where_it_is_and_from_the_disk_where_not(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """Other work on a host evicts part of a checkpoint from the page cache (a file read in order
    loses its oldest pages first). Each window of the file is decided on its own: the cached half
    comes from the mapping, the evicted half with O_DIRECT, past the page cache (before, the
    whole file counted as on disk and every byte came from the disk)."""
    mapped: list[str] = []
    real = mapping.map_private
    monkeypatch.setattr(mapping, "map_private", lambda fd, size, url: mapped.append(url) or real(fd, size, url))
    tensors = {f"w{i:02d}": torch.full((256, 1024), float(i)) for i in range(16)}  # 1 MiB each
    path = write(tensors)
    size = path.stat().st_size
    path.read_bytes()
    needs_cachestat(path)
    drop_cache(path, size // 2)
    front, back = (0, size // 2 - pagecache.CACHE_WINDOW_BYTES), (size // 2 + 4096, size)  # whole pages only
    if resident(path, *front) < 1 or resident(path, *back) > 0:
        pytest.skip("the page cache did not keep the first half and drop the second")
    if into == "stream":
        async with aload.stream(path, chunk_bytes=MiB) as s:
            got = {name: t.clone() async for name, t in s}
    else:
        model = flat(tensors)
        report = await aload.load(model, path)
        assert report.direct_bytes == 16 * MiB  # each tensor read straight into its buffer
        got = dict(model.named_buffers())
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    # The cached half from the page cache: views of its mapping for the stream, copied into the
    # model's 1 MiB tensors by preadv (under COPY_OUT_MIN_BYTES: no mapping).
    assert mapped == ([str(path)] if into == "stream" else [])
    assert resident(path, *back) == 0  # the evicted half, from the disk past the page cache
    assert resident(path, *front) == 1


@pytest.mark.parametrize("into", ["stream", "model"])
@pytest.mark.parametrize("hole_mib", [2, 22], ids=["a-few-pages", "a-third"])
async def test_a_tensor_partly_evicted_comes_from_the_cache_and_the_rest_through_it(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, into: str, hole_mib: int
) -> None:
    """A large tensor with ``WARM_SHARE`` (half) of its pages cached or more is not read whole from
    the disk: it is mapped, or copied out into its parameter, and the pages it misses are read into
    the page cache on a read thread first (whole-unit O_DIRECT cost more here; the 250 MiB
    embedding of a warm run missing 6 MiB was read from the disk whole). Below that share it is read
    from the disk (the test above)."""
    direct: list[int] = []
    real = DirectFile.read_bounced
    monkeypatch.setattr(
        DirectFile, "read_bounced", lambda self, offset, buf: direct.append(offset) or real(self, offset, buf)
    )
    tensors = {"big": torch.arange(16 * MiB, dtype=torch.float32), "small": torch.ones(8)}  # 64 MiB
    path = write(tensors)
    path.read_bytes()
    needs_cachestat(path)
    hole = (20 * MiB, (20 + hole_mib) * MiB)  # whole 2 MiB folios: the page cache drops no less
    drop_cache(path, hole[0], hole[1] - hole[0])
    if resident(path, *hole) > 0 or resident(path, 0, hole[0]) < 1:
        pytest.skip("the page cache did not drop just the hole")
    assert pagecache.WARM_SHARE <= 0.6  # 66% of the tensor stays cached at worst
    if into == "stream":
        async with aload.stream(path) as s:
            got = {name: t.clone() async for name, t in s}
    else:
        model = flat(tensors)
        await aload.load(model, path)
        got = dict(model.named_buffers())
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert direct == []  # nothing read past the page cache
    assert resident(path, *hole) == 1  # the hole read in through it


async def test_run_all_raises_the_first_error_and_starts_no_call_after_it() -> None:
    pool = IOPool(3)
    ran: list[int] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        with lock:
            ran.append(i)
        if i in (3, 7):
            raise ValueError(f"call {i}")

    try:
        await pool.run_all(call, [(i,) for i in range(10) if i not in (3, 7)])
        assert sorted(ran) == [0, 1, 2, 4, 5, 6, 8, 9]
        ran.clear()
        with pytest.raises(ValueError, match=r"call [37]"):
            await pool.run_all(call, [(i,) for i in range(10)])
        assert len(ran) == len(set(ran))  # no call taken twice (which ones ran before the error is up to the threads)
        await pool.run_all(call, [])
        single = IOPool(1)
        try:
            ran.clear()
            with pytest.raises(ValueError, match="call 3"):
                await single.run_all(call, [(i,) for i in range(10)])
            assert ran == [0, 1, 2, 3]  # one worker: in order, and nothing after the error
        finally:
            await single.aclose()
    finally:
        await pool.aclose()


async def test_run_all_goes_through_its_calls_on_a_few_workers_and_drops_the_rest_when_cancelled() -> None:
    """A unit's steps are taken by at most ``threads`` workers, each going from one to the next
    on its thread (not one task per step for the event loop to submit); a cancelled read starts
    no step after the running ones."""
    pool = IOPool(2)
    ran: list[int] = []
    gate, both = threading.Event(), threading.Barrier(3)

    def step(i: int) -> None:
        ran.append(i)
        if i < 2:  # the first two hold both workers until the read is cancelled
            both.wait(5)
            gate.wait(5)

    try:
        task = asyncio.ensure_future(pool.run_all(step, [(i,) for i in range(100)]))
        await asyncio.to_thread(both.wait, 5)
        assert len(pool._pending) == 2  # two workers for 100 calls, not 100 tasks
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gate.set()
        await pool.aclose()  # waits for the two running calls
        assert sorted(ran) == [0, 1]  # none started after the cancel
    finally:
        gate.set()
        await pool.aclose()


async def test_a_pools_threads_after_its_first_are_started_by_the_pool_not_by_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Thread.start`` waits for the new thread to run, which took the loop 2-9 ms where the cores
    and the GIL were busy. The loop starts a pool's first thread; once the first call's result is
    out, that thread starts the others, so later calls find them there."""
    starts: list[tuple[str, bool]] = []  # (starting thread, a result out already)
    real_start, real_set_result = threading.Thread.start, concurrent.futures.Future.set_result
    out = threading.Event()

    def start(t: threading.Thread) -> None:
        if t.name.startswith("aload-io"):
            starts.append((threading.current_thread().name, out.is_set()))
        real_start(t)

    def set_result(fut: concurrent.futures.Future[Any], result: Any) -> None:
        real_set_result(fut, result)
        out.set()

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(concurrent.futures.Future, "set_result", set_result)
    pool, all_three = IOPool(3), threading.Barrier(3)
    try:
        assert await pool.run(lambda: 1) == 1
        await asyncio.gather(*(pool.run(all_three.wait, 5) for _ in range(3)))  # three at once
    finally:
        await pool.aclose()
    loop_thread = threading.current_thread().name
    assert starts[0] == (loop_thread, False)
    assert len(starts) == 3 and all(who.startswith("aload-io") and done for who, done in starts[1:]), starts


async def test_a_pool_whose_first_call_runs_on_still_starts_a_thread_for_the_next() -> None:
    """Calls that wait for each other cannot share a thread: while the first call runs, the next
    one starts a thread where it is submitted, as ``ThreadPoolExecutor`` does, and never waits."""
    pool = IOPool(2)
    both = threading.Barrier(2)
    try:
        await asyncio.gather(pool.run(both.wait, 5), pool.run(both.wait, 5))
    finally:
        await pool.aclose()


def test_a_pool_left_unclosed_lets_its_threads_go() -> None:
    """Its threads hold it weakly: collected, it wakes them and they end."""
    pool = IOPool(2)
    assert pool.executor().submit(lambda: 2).result(5) == 2
    threads = [t for t in threading.enumerate() if t.name.startswith("aload-io")]
    assert threads
    del pool
    gc.collect()
    for t in threads:
        t.join(5)
        assert not t.is_alive()


async def _thread_cores(pool: IOPool) -> list[list[int]]:
    """The cores each of ``pool``'s threads may run on, every thread started."""
    seen: list[list[int]] = []
    everyone = threading.Barrier(pool.threads)

    def where() -> None:
        everyone.wait(5)  # one call per thread: each waits until all have started
        seen.append(sorted(os.sched_getaffinity(0)))

    try:
        await asyncio.gather(*(pool.run(where) for _ in range(pool.threads)))
    finally:
        await pool.aclose()
    return seen


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux: thread affinity")
async def test_a_local_stores_read_threads_keep_to_a_core_each_where_they_fill_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As many read threads as cores: each on its own core (left to the scheduler, two warm copying
    threads sometimes shared one core for a whole load); more threads than cores, a pool that does
    not ask, or ``ALOAD_READ_PIN=0``: every core, as the process."""
    monkeypatch.delenv(_threads.READ_PIN_ENV, raising=False)
    cores = sorted(os.sched_getaffinity(0))
    pinned = await _thread_cores(IOPool(len(cores), pin=True))
    assert sorted(core for (core,) in pinned) == cores  # one core each, every core once
    assert await _thread_cores(IOPool(len(cores) + 1, pin=True)) == [cores] * (len(cores) + 1)
    assert await _thread_cores(IOPool(len(cores))) == [cores] * len(cores)
    monkeypatch.setenv(_threads.READ_PIN_ENV, "0")
    assert await _thread_cores(IOPool(len(cores), pin=True)) == [cores] * len(cores)
    assert local.LocalStore("x.safetensors", concurrency=len(cores))._pool._cores is None
    monkeypatch.delenv(_threads.READ_PIN_ENV)
    assert local.LocalStore("x.safetensors", concurrency=len(cores))._pool._cores == cores


async def test_a_read_that_fails_after_its_caller_gave_up_is_not_logged_as_never_retrieved() -> None:
    """A read still running when the load was cancelled, failing afterwards (a file truncated under
    it): the pool's close waits for it and takes its error, so asyncio does not log "Future
    exception was never retrieved" at the next collection (seen once after a full test run)."""
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    started = threading.Event()

    def fails_later() -> None:
        started.set()
        threading.Event().wait(0.2)
        raise OSError(errno.EIO, "gone")

    pool = IOPool(2)
    try:
        task = asyncio.ensure_future(pool.run(fails_later))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool.aclose()
        del task
        gc.collect()
        await asyncio.sleep(0)
        assert not logged, logged
    finally:
        loop.set_exception_handler(before)


async def test_a_pool_starts_all_its_threads_from_another_pool() -> None:
    """The direct-read pool's threads are started by a thread of the file pool, each start
    waiting there rather than on the event loop; then every read finds a thread ready."""
    helper, pool = IOPool(1), IOPool(6)
    try:
        await asyncio.gather(pool.start(helper), pool.start(helper))  # once, however asked
        threads = list(pool.executor()._threads)  # type: ignore[attr-defined]
        assert len(threads) == 6 and all(t.is_alive() for t in threads)
        assert threading.current_thread() not in threads
        await pool.run_all(lambda: None, [() for _ in range(12)])
        assert len(pool.executor()._threads) == 6  # type: ignore[attr-defined]
    finally:
        await pool.aclose()
        await helper.aclose()


async def test_a_cold_file_comes_into_host_parameters_in_pieces_through_the_reader_s_frames(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes on disk bound for a parameter on the CPU: each piece read with ``O_DIRECT``, from where
    the file's blocks begin, into one of the reader's page-aligned frames, then copied into its part
    of the parameter, never through a read thread's bounce buffer (read into the parameter that
    way, the reads here took ~4 ms each against ~2.7 into a frame: docs/benchmarks.md, stop 51).
    Tensors start and end mid-block and span several pieces; the budget bounds the frames."""
    g = torch.Generator().manual_seed(5)
    tensors = {
        "a": torch.randn(3, generator=g),
        "b": torch.randn(2_500_001, generator=g),  # ~10 MB: pieces of 1 MiB under this budget
        "c": torch.randn(5, generator=g),
        "d": torch.randn(700_003, generator=g),  # ends the file, not on a block boundary
    }
    path = cold(write(tensors))
    frames: list[tuple[int, int]] = []
    read_frame = LocalSource.read_frame

    async def counted(self: LocalSource, offset: int, frame: memoryview, need: int) -> None:
        assert offset % 4096 == 0 and len(frame) % 4096 == 0 and need <= len(frame)
        assert np.frombuffer(frame, dtype=np.uint8).ctypes.data % 4096 == 0
        frames.append((np.frombuffer(frame, dtype=np.uint8).ctypes.data, len(frame)))
        await read_frame(self, offset, frame, need)

    def bounced(*args: Any) -> None:
        raise AssertionError("read through the bounce buffer")

    monkeypatch.setattr(LocalSource, "read_frame", counted)
    monkeypatch.setattr(DirectFile, "read_bounced", bounced)
    model = flat(tensors)
    report = await aload.load(model, path, max_inflight_bytes=8 * MiB)
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    assert report.direct_bytes == sum(t.nbytes for t in tensors.values())  # none through the budget
    assert len(frames) >= 13  # b's 10 MB and d's 2.8 in pieces of 1 MiB (the budget's eighth)
    assert max(n for _, n in frames) <= MiB
    assert len({addr for addr, _ in frames}) <= reader.THROUGH_FRAMES  # the same few frames, reused


@pytest.mark.parametrize("into", ["stream", "parameters"])
async def test_a_cold_file_truncated_under_a_load_names_the_file_and_range(
    write: Callable[..., Path], into: str
) -> None:
    """Read with O_DIRECT into the budget's buffers (a stream) or through the reader's frames
    into the model's parameters: either way the error names the file and the range."""
    tensors = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 1 MiB each: read with O_DIRECT
    path = write(tensors)
    async with aload.open(path) as ckpt:
        os.truncate(path, os.path.getsize(path) - 100)
        cold(path)
        with pytest.raises(aload.SourceError, match="file ended") as info:
            if into == "parameters":
                await aload.load(flat(tensors), ckpt)
            else:
                async with aload.stream(ckpt) as s:
                    async for _ in s:
                        pass
    assert info.value.url == str(path) and info.value.byte_range is not None
    assert info.value.byte_range[1] > os.path.getsize(path)


@pytest.mark.parametrize("read", ["map", "pread"])
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_runs_of_small_tensors_are_scattered_into_their_parameters(
    write: Callable[..., Path], warm: bool, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3,000 tensors of 16 bytes (more than one preadv's 1,024 buffers), each read straight into
    its parameter, in both read modes; the ones the model cannot take that way (another dtype, a
    parameter that is not contiguous, a name it lacks) around them are copied or reported as
    before. The built-in loader takes the rest of each run already in place by name, in one go."""
    from aload.bridge import SyncBridge

    taken: list[str] = []
    real = SyncBridge.in_place_rest

    def spy(self: SyncBridge) -> list[str]:
        got = real(self)
        taken.extend(got)
        return got

    monkeypatch.setattr(SyncBridge, "in_place_rest", spy)
    g = torch.Generator().manual_seed(7)
    tensors = {f"t.{i}": torch.randint(-(2**15), 2**15, (8,), generator=g, dtype=torch.int16) for i in range(3000)}
    tensors["t.1500"] = torch.randn(8, generator=g)  # float32 into a bfloat16 parameter: converted
    tensors["t.1501"] = torch.randn(3, 2, generator=g)  # into a transposed (not contiguous) buffer
    tensors["t.1502"] = torch.ones(8, dtype=torch.int16)  # no such parameter
    path = write(tensors)
    if not warm:
        cold(path)
    model = nn.Module()
    for k, v in tensors.items():
        if k == "t.1500":
            model.register_buffer(k.replace(".", "__"), torch.zeros(8, dtype=torch.bfloat16))
        elif k == "t.1501":
            model.register_buffer(k.replace(".", "__"), torch.zeros(2, 3).t())
        elif k != "t.1502":
            model.register_buffer(k.replace(".", "__"), torch.zeros_like(v))
    report = await aload.load(model, path, stages=aload.stages.rename(r"\.", "__"), strict=False, read=read)
    assert report.unexpected == ["t__1502"] and report.missing == []
    assert 2900 <= len(taken) == len(set(taken)) and {"t__1500", "t__1501", "t__1502"}.isdisjoint(taken)
    in_place = sum(v.nbytes for k, v in tensors.items() if k not in ("t.1500", "t.1501", "t.1502"))
    assert report.direct_bytes == in_place
    for k, v in tensors.items():
        if k != "t.1502":
            got = getattr(model, k.replace(".", "__"))
            assert torch.equal(got, v.to(got.dtype)), k


async def test_a_scattering_read_past_the_end_names_the_file_and_range(write: Callable[..., Path]) -> None:
    """A read into many buffers that the file ends in the middle of (one of them half filled)."""
    path = write({"a": torch.arange(64, dtype=torch.int32)})
    size = os.path.getsize(path)
    dests = [torch.zeros(100, dtype=torch.uint8) for _ in range(3)]
    async with opened(path) as src:
        await src.size()
        with pytest.raises(aload.SourceError, match="file ended") as info:
            src.scatter_into(size - 150, dests)
    assert info.value.url == str(path) and info.value.byte_range == (size - 150, size + 150)
    assert bytes(dests[0].numpy()) == path.read_bytes()[size - 150 : size - 50]
    assert bytes(dests[1][:50].numpy()) == path.read_bytes()[size - 50 :]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_a_file_truncated_under_a_load_of_small_tensors_names_the_file_and_range(
    write: Callable[..., Path], warm: bool
) -> None:
    tensors = {f"t.{i}": torch.full((64,), float(i)) for i in range(2000)}
    path = write(tensors)
    model = nn.Module()
    for k, v in tensors.items():
        model.register_buffer(k.replace(".", "__"), torch.zeros_like(v))
    async with aload.open(path) as ckpt:
        os.truncate(path, os.path.getsize(path) - 100)
        if not warm:
            cold(path)
        with pytest.raises(aload.SourceError) as info:
            await aload.load(model, ckpt, stages=aload.stages.rename(r"\.", "__"))
    assert info.value.url == str(path) and info.value.byte_range is not None
    assert info.value.byte_range[1] > os.path.getsize(path)
    # Out of order (a load's default) the failed read may be the first to finish, before any
    # tensor reached the model: the note says which it was.
    notes = " ".join(info.value.__notes__)
    if info.value.aload_delivered:  # type: ignore[attr-defined]
        assert "partly loaded" in notes
    else:
        assert "no tensor had been delivered" in notes


async def test_a_file_shrinking_under_a_run_filled_on_a_read_thread_names_the_file_and_range(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run filled on a read thread from a file all in the page cache, which shrinks just
    before the read: the error names the file and the bytes asked for, and the load stops."""
    tensors = {f"t{i:02d}": torch.full((64, 1024), float(i)) for i in range(24)}  # 256 KiB each
    path = write(tensors)
    path.read_bytes()
    needs_cachestat(path)
    if not cached(path):
        pytest.skip("the page cache did not keep the file")
    size = path.stat().st_size
    real = LocalSource.scatter_into
    threads: list[str] = []

    def shrink_first(self: LocalSource, offset: int, dests: list[Any]) -> None:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            os.truncate(path, size - 100)
        real(self, offset, dests)

    monkeypatch.setattr(LocalSource, "scatter_into", shrink_first)
    with pytest.raises(aload.SourceError) as info:
        await aload.load(flat(tensors), path)
    assert threads[0].startswith("aload-io")
    assert info.value.url == str(path) and info.value.byte_range is not None
    assert info.value.byte_range[1] > size - 100


async def test_a_cold_run_of_small_tensors_is_mapped_for_load_weights_and_the_large_read_past_the_cache(
    write: Callable[..., Path],
) -> None:
    """Through ``load_weights`` (no destinations) a cold file's runs of small tensors are brought
    into the page cache, exactly their bytes, and handed out as views of the mapping; its large
    tensors are read with O_DIRECT into the budget's buffers."""
    g = torch.Generator().manual_seed(3)
    tensors = {f"norm.{i}": torch.randn(1024, generator=g) for i in range(512)}  # 4 KiB each
    tensors.update({f"big.{i}": torch.randn(1024, 1024, generator=g) for i in range(3)})  # 4 MiB
    path = cold(write(tensors))
    async with aload.open(path) as ckpt:
        specs = ckpt.specs
    seen: dict[str, torch.Tensor] = {}

    class Engine(nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                seen[name] = t.clone()
            return set()

    report = await aload.load(Engine(), path, chunk_bytes=MiB)
    assert all(torch.equal(seen[k], v) for k, v in tensors.items())
    small = [s for s in specs.values() if s.name.startswith("norm.")]
    large = [s for s in specs.values() if s.name.startswith("big.")]
    assert all(resident(path, s.start, s.end) == 1 for s in small)
    assert sum(resident(path, s.start, s.end) for s in large) < 0.1
    assert report.peak_inflight_bytes >= 4 * MiB  # a large tensor's buffer


@pytest.mark.parametrize("numel", [16, 32 << 10], ids=["tiny", "128KiB"])
async def test_a_stream_with_destinations_scatters_off_the_loop(write: Callable[..., Path], numel: int) -> None:
    """Pairs (no bridge): a run of small tensors with destinations is scattered on a thread (the
    helper's, or a read thread's for a run it fills), and each pair is its destination, filled."""
    from aload.pipeline import TensorStream

    tensors = {f"t{i}": torch.full((numel,), float(i)) for i in range(300 if numel < 1024 else 40)}
    path = write(tensors)
    dests = {k: torch.zeros_like(v) for k, v in tensors.items()}
    async with TensorStream(path, destinations=lambda name, spec: dests[name]) as s:
        got = {name: t async for name, t in s}
        assert s.stats.direct_bytes == sum(v.nbytes for v in tensors.values())
    assert all(got[k] is dests[k] and torch.equal(dests[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("budget", [64 * MiB, 2 * MiB], ids=["arena", "outside"])
async def test_a_file_on_disk_is_read_straight_into_the_buffer(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    """O_DIRECT into the unit's buffer itself, laid out as the file's blocks are (the unit starts
    and ends mid-block), not through a bounce buffer copied out after: ~2 CPU s less per 8 GiB
    through load_weights here. In chunks, from the arena or, for a unit over the budget, from a
    buffer of its own; the file's last block is short."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(3, generator=g),
        "b": torch.randn(300_001, generator=g),
        "c": torch.randn(5, generator=g),
        "d": torch.randn(700_003, generator=g),  # ends the file, not on a block boundary
    }
    path = cold(write(tensors))
    assert os.path.getsize(path) % 4096
    frames: list[int] = []
    read_frame = LocalSource.read_frame

    async def counted(self: LocalSource, offset: int, frame: memoryview, need: int) -> None:
        assert offset % 4096 == 0 and len(frame) % 4096 == 0
        assert np.frombuffer(frame, dtype=np.uint8).ctypes.data % 4096 == 0
        frames.append(need)
        await read_frame(self, offset, frame, need)

    def bounced(*args: Any) -> None:
        raise AssertionError("read through the bounce buffer")

    monkeypatch.setattr(LocalSource, "read_frame", counted)
    monkeypatch.setattr(DirectFile, "read_bounced", bounced)
    async with aload.stream(path, chunk_bytes=MiB, max_inflight_bytes=budget) as s:
        got = await collect(s)
        assert s.stats.bytes_read == sum(t.nbytes for t in tensors.values())
    assert len(frames) >= 4  # 4 MB in chunks of 1 MiB
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k


def test_small_runs_are_the_runs_of_small_tensors_and_nothing_large() -> None:
    """Adjacent small tensors make a run; a large one ends it and is never part of one; runs under
    the least worth asking for are left out; ``limit`` caps the bytes in all."""
    from aload.checkpoint import _LEAST_RUN_BYTES, small_runs
    from aload.format import TensorSpec

    least = _LEAST_RUN_BYTES // 4096
    sizes = [4096] * (least + 8) + [1 << 20] + [4096] * 4 + [1 << 20] + [4096] * least  # over, under, at
    specs, at = [], 100
    for i, n in enumerate(sizes):
        specs.append(TensorSpec(f"t{i}", "U8", (n,), "f", at, at + n))
        at += n
    runs = small_runs(specs, 64 << 10, 1 << 40)
    big0, big1 = specs[least + 8], specs[least + 13]
    assert runs == [(100, big0.start), (big1.end, at)]
    assert all(b - a >= _LEAST_RUN_BYTES for a, b in runs)
    assert small_runs(specs, 64 << 10, 100 << 10) == [(100, 100 + (100 << 10))]  # the limit
    assert small_runs(specs, 1 << 30, 1 << 40) == [(100, at)]  # nothing large: one run
    assert small_runs([], 64 << 10, 1 << 40) == []


@pytest.mark.parametrize("how", ["all", "keep", "warm"])
async def test_a_cold_load_asks_for_its_small_tensors_before_reading_and_never_the_large(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Opening and planning a cold file, the runs of small tensors are asked for (WILLNEED) as
    each header is parsed, and the large tensors not. Not when a stage drops names (their bytes
    are never read), nor for a file all in the page cache."""
    from aload.pipeline import TensorStream

    tensors = {f"a.{i}": torch.full((1024,), float(i)) for i in range(300)}  # 4 KiB each, 1.2 MiB
    tensors["b"] = torch.zeros(1 << 20)  # 4 MiB, between the two runs (safetensors lays them out by name)
    tensors.update({f"c.{i}": torch.full((1024,), float(i)) for i in range(300)})
    path = write(tensors)
    if how != "warm":
        cold(path)
    asked: list[tuple[int, int]] = []
    real = local.LocalSource._prefetch

    def spy(self: local.LocalSource, offset: int, length: int) -> None:
        asked.append((offset, offset + length))
        real(self, offset, length)

    monkeypatch.setattr(local.LocalSource, "_prefetch", spy)
    stages = [aload.stages.keep("a.*")] if how == "keep" else []
    async with TensorStream(path, stages=stages) as s:
        ahead = s._ahead
        if ahead is not None and ahead._task is not None:
            await asyncio.wait_for(asyncio.shield(ahead._task), 30)
        specs = s.checkpoint.specs if s.checkpoint is not None else {}
        if how == "all":
            big = specs["b"]
            a = [v for k, v in specs.items() if k.startswith("a.")]
            c = [v for k, v in specs.items() if k.startswith("c.")]
            assert max(s.end for s in a) == big.start and big.end == min(s.start for s in c)
            assert asked == [(min(s.start for s in a), big.start), (big.end, max(s.end for s in c))]
        else:
            assert asked == []
        got = {name: t.clone() async for name, t in s}
    assert all(torch.equal(got[k], tensors[k]) for k in got) and len(got) == (300 if how == "keep" else 601)


@pytest.mark.parametrize("in_order", [False, True])
async def test_a_tensor_waiting_for_the_disk_lets_cached_ones_behind_it_go_first_unless_in_order(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, in_order: bool
) -> None:
    """``aload.load`` hands a model's ``load_weights`` a tensor that sits in the page cache before
    one ahead of it in the file whose bytes must come from the disk: the model copies it while the
    disk works (a checkpoint a tenth evicted through ``load_weights``, 1 GiB: 6.6 -> 9.9 GB/s).
    ``in_order=True`` keeps file order. The first tensor's read here waits until the second is
    delivered, or 0.5 s: out of order it never waits that long. One read at a time: a view all in
    the page cache needs no read, so it does not queue behind the one on disk."""
    tensors = {
        "first": torch.arange(4096 * 1024, dtype=torch.float32).view(4096, 1024),  # 16 MiB
        "second": torch.full((2048, 1024), 2.0),  # 8 MiB
    }
    path = write(tensors)
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    async with aload.open(path) as ckpt:
        first = ckpt.specs["first"]
    drop_cache(path, 0, first.start + first.nbytes)
    if local.cached_share(str(path)) == 1.0:
        pytest.skip("the page cache kept the file (a filesystem in memory)")
    second_seen, waited = threading.Event(), []
    real = LocalSource.read_frame

    async def read_frame(self: LocalSource, offset: int, frame: memoryview, need: int) -> None:
        for _ in range(50):  # 0.5 s at most
            if second_seen.is_set():
                break
            await asyncio.sleep(0.01)
        waited.append(not second_seen.is_set())
        await real(self, offset, frame, need)

    monkeypatch.setattr(LocalSource, "read_frame", read_frame)
    order, got = [], {}

    class Engine(nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                order.append(name)
                got[name] = t.clone()
                if name == "second":
                    second_seen.set()
            return set(got)

    await aload.load(Engine(), path, chunk_bytes=4 * MiB, concurrency=1, in_order=in_order)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    if not waited:
        pytest.skip("the first tensor was not read with O_DIRECT here")
    if in_order:
        assert order == ["first", "second"]
    else:
        assert order == ["second", "first"]
        assert not any(waited)


async def test_a_view_all_in_the_page_cache_needs_no_read(tmp_path: Path) -> None:
    """``in_memory``: a range whose pages all sat in the page cache when the file was looked at
    takes no read slot in the reader (only the length check), so it is not held up behind the
    reads of a unit on disk (a 250 MiB tensor a tenth evicted, 16 populates queued: the cached
    units behind it came 23 ms later). A range partly out of the cache needs its read."""
    path = tmp_path / "blob.safetensors"
    path.write_bytes(bytes(16 * MiB))
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    drop_cache(path, 0, 4 * MiB)
    if local.cached_share(str(path)) == 1.0:
        pytest.skip("the page cache kept the file (a filesystem in memory)")
    async with opened(path) as src:
        await src.ready()
        assert src.in_memory(8 * MiB, 8 * MiB)
        assert not src.in_memory(0, 8 * MiB)
        assert not src.in_memory(2 * MiB, MiB)
        # ``populated``: in memory and the file still that long, so no populate at all.
        assert src.populated(8 * MiB, 8 * MiB) and not src.populated(0, 8 * MiB)
        os.truncate(path, 12 * MiB)
        assert src.in_memory(8 * MiB, 8 * MiB) and not src.populated(8 * MiB, 8 * MiB)  # populate says why


async def test_views_all_in_the_page_cache_are_handed_out_without_a_read_task(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit handed out as a view of pages all in the page cache needs nothing read: no task is
    made for it (``Reader._read``), its bytes are counted as read all the same."""
    from aload.reader import Reader

    reads = [0]
    real = Reader._read

    async def read(self: Reader, *args: Any) -> None:
        reads[0] += 1
        await real(self, *args)

    monkeypatch.setattr(Reader, "_read", read)
    tensors = {f"t{i}": torch.full((64 * 1024,), float(i)) for i in range(8)}  # 256 KiB each
    path = write(tensors)
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    async with aload.stream(path, chunk_bytes=64 * 1024) as s:  # a unit each
        got = {name: t.clone() async for name, t in s}
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert reads[0] == 0 and s.stats.bytes_read == sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("in_order", [False, True])
async def test_a_stretch_on_disk_lets_the_cached_units_behind_it_be_read_meanwhile(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, in_order: bool
) -> None:
    """Out of order (a load's default), units read from the disk take read slots of their own
    and do not count among the few units read ahead: the units in the page cache behind a stretch
    on disk longer than that are read while the disk works (each shard of the 4 GiB checkpoint a
    tenth evicted, built-in: 12.7 -> 17.2 GB/s). The reads from the disk here wait until every
    cached unit is read, or 1 s: out of order they never wait that long. In order, the cached
    units wait their turn."""
    cold_n, warm_n = 3, 2  # 16 MiB tensors (smaller ones with a destination go in filled runs), 4 units each
    tensors = {f"a{i}": torch.full((1 << 22,), float(i)) for i in range(cold_n)}
    tensors.update({f"b{i}": torch.full((1 << 22,), -float(i)) for i in range(warm_n)})
    path = write(tensors)
    path.read_bytes()
    if not cached(path):
        pytest.skip("the file did not stay in the page cache")
    async with aload.open(path) as ckpt:
        specs = ckpt.specs
    warm_start = min(specs[f"b{i}"].start for i in range(warm_n))
    drop_cache(path, 0, warm_start - 4096)
    if local.cached_share(str(path)) == 1.0:
        pytest.skip("the page cache kept the file (a filesystem in memory)")
    if resident(path, warm_start, path.stat().st_size) < 1.0:
        pytest.skip("the page cache dropped more than asked")
    all_warm_read, warm_read, waited = threading.Event(), [0], []
    deadline: list[float] = []  # one wait of 1 s for all the reads from the disk
    real_readinto, real_aligned = LocalSource.readinto, DirectFile.read_aligned

    async def readinto(self: LocalSource, offset: int, buf: memoryview) -> None:
        await real_readinto(self, offset, buf)
        if offset >= warm_start:
            warm_read[0] += len(buf)
            if warm_read[0] == warm_n * (16 << 20):
                all_warm_read.set()

    def read_aligned(self: DirectFile, offset: int, buf: memoryview, need: int, wanted: Any = None) -> None:
        if not deadline:
            deadline.append(time.monotonic() + 1.0)
        waited.append(not all_warm_read.wait(max(0.0, deadline[0] - time.monotonic())))
        real_aligned(self, offset, buf, need, wanted)

    monkeypatch.setattr(LocalSource, "readinto", readinto)
    monkeypatch.setattr(DirectFile, "read_aligned", read_aligned)
    model = flat(tensors)
    await aload.load(model, path, chunk_bytes=4 * MiB, concurrency=1, in_order=in_order)
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    if not waited:
        pytest.skip("nothing was read with O_DIRECT here")
    if in_order:
        assert any(waited)
    else:
        assert not any(waited)


def test_a_read_that_must_not_wait_takes_only_what_the_page_cache_holds(tmp_path: Path) -> None:
    """``read_cached`` (``RWF_NOWAIT``) fills the buffer from the page cache or says it cannot:
    never a read past the file's end, never a wait for the disk."""
    path = tmp_path / "f.bin"
    data = os.urandom(1 * MiB)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(len(data))
        if not _syscalls.read_cached(fd, memoryview(buf), 0):
            pytest.skip("RWF_NOWAIT not taken here")
        assert buf == data
        assert not _syscalls.read_cached(fd, memoryview(bytearray(len(data) + 1)), 0)  # past the end
        drop_cache(path)
        if resident(path, 512 << 10, 576 << 10) > 0:
            pytest.skip("the page cache kept the file")
        # A miss starts the kernel's readahead, and a fast disk may finish it within the call
        # (seen once in CI): then the bytes are there, and they must be the file's.
        got = bytearray(64 << 10)
        if _syscalls.read_cached(fd, memoryview(got), 512 << 10):
            assert got == data[512 << 10 : 576 << 10]
            assert resident(path, 512 << 10, 576 << 10) == 1.0
    finally:
        os.close(fd)


async def test_the_loop_budget_allows_work_for_a_while_each_turn() -> None:
    budget = _threads.LoopBudget()
    assert budget.allows()
    time.sleep(_threads.PAUSE_AFTER_S * 1.5)  # work on the loop, in the same turn
    assert not budget.allows()
    await asyncio.sleep(0)  # the next turn
    assert budget.allows()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_an_index_and_headers_are_read_on_the_loop_only_from_the_page_cache(
    sharded: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, warm: bool
) -> None:
    """A checkpoint's index and headers in the page cache are read right on the event loop (a trip
    to a read thread cost 1-7 ms before a load's first read); not there, on a read thread, so the
    loop never waits for the disk."""
    tensors = {f"layers.{i}.w": torch.full((64, 1024), float(i)) for i in range(8)}
    folder = sharded(tensors, 4)
    files = sorted(folder.iterdir())
    for f in files:
        f.read_bytes() if warm else drop_cache(f)
    if not warm and any(cached(f) for f in files):
        pytest.skip("the page cache kept a file")
    if warm:  # not when cold: a no-wait read that misses starts the kernel's readahead
        probe = os.open(files[0], os.O_RDONLY)
        try:
            if not _syscalls.read_cached(probe, memoryview(bytearray(8)), 0):
                pytest.skip("RWF_NOWAIT not taken here")
        finally:
            os.close(probe)
    on_thread: list[str] = []
    #: per file, whether a no-wait read on the loop gave all it asked for
    answered: dict[str, bool] = {}
    real_head, real_small, real_cached = LocalSource._head, local._small_cached, local.read_cached

    def nowait(fd: int, buf: memoryview, offset: int) -> bool:
        got = real_cached(fd, buf, offset)
        if threading.current_thread() is threading.main_thread():
            answered[os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))] = got
        return got

    def head(self: LocalSource, probe: int) -> tuple[int, bytes]:
        assert threading.current_thread() is not threading.main_thread()
        on_thread.append(os.path.basename(self.url))
        return real_head(self, probe)

    def small(path: str, limit: int) -> bytes | None:
        got = real_small(path, limit)
        if got is None:
            on_thread.append(os.path.basename(path))
        return got

    monkeypatch.setattr(LocalSource, "_head", head)
    monkeypatch.setattr(local, "_small_cached", small)
    monkeypatch.setattr(local, "read_cached", nowait)
    async with aload.stream(folder) as s:
        got = await collect(s)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # Each file read once: on the loop where the page cache gave all of it, else on a thread.
    on_loop = sorted(name for name, ok in answered.items() if ok)
    assert sorted(on_loop + on_thread) == sorted(f.name for f in files), (on_loop, on_thread)
    if warm:  # the first header at least within the loop's budget
        assert "model.safetensors.index.json" in on_loop and len(on_thread) < 4, on_thread
    elif not on_thread:  # a miss starts readahead, which a fast disk may finish within the call
        pytest.skip("the kernel's readahead answered every no-wait read")


async def test_a_file_read_without_its_mapping_is_decided_without_a_thread(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read="pread"`` maps nothing, so nothing is looked at: no trip to a read thread for it."""
    tensors = {f"w{i}": torch.full((256, 256), float(i)) for i in range(4)}
    path = write(tensors)
    monkeypatch.setattr(LocalSource, "_cached", lambda self: pytest.fail("a trip to decide"))
    async with aload.stream(path, read="pread") as s:
        got = await collect(s)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("n", [1, 127, 128, 300, 16 * 1024 - 1, 16 * 1024, 3 * 16 * 1024 + 200, MiB + 77])
@pytest.mark.parametrize("shift", [(0, 0), (5, 3), (33, 64)])
def test_the_streaming_copy_copies_every_byte_and_nothing_around_them(n: int, shift: tuple[int, int]) -> None:
    """Each path of the copy past the caches (a head to align the destination, the loop of four
    pages, the loop of lines, a tail) gives the bytes back exactly, at any alignment, and writes
    nothing before or after them; ``copy_bytes`` likewise (by ``memcpy`` under its minimum)."""
    copy = _ntcopy.streaming_copy()
    if copy is None:
        pytest.skip("no non-temporal copy here (not x86-64 Linux with AVX2, or no executable memory)")
    src_at, dst_at = shift
    src = np.random.default_rng(n).integers(0, 256, n + 64, dtype=np.uint8)
    for fn in (copy, _ntcopy.copy_bytes):
        dst = np.zeros(n + 192, dtype=np.uint8)
        fn(dst.ctypes.data + dst_at, src.ctypes.data + src_at, n)
        assert np.array_equal(dst[dst_at : dst_at + n], src[src_at : src_at + n])
        assert not dst[:dst_at].any() and not dst[dst_at + n :].any()


def test_the_streaming_copy_is_off_where_asked_and_memcpy_copies_then(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_ntcopy.STREAMING_ENV, "0")
    assert _ntcopy._copier() is None
    monkeypatch.setattr(_ntcopy, "_made", True)
    monkeypatch.setattr(_ntcopy, "_streaming", None)
    src = np.arange(MiB, dtype=np.uint8)
    dst = np.zeros(MiB, dtype=np.uint8)
    _ntcopy.copy_bytes(dst.ctypes.data, src.ctypes.data, MiB)
    assert np.array_equal(dst, src)


async def test_a_warm_load_copies_past_the_caches_where_it_can_and_gets_the_same_bytes(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of the mapping (``ALOAD_WARM_COPY=map``) a warm tensor comes through the streaming
    copy where there is one; the parameter holds the checkpoint's bytes either way."""
    w = torch.randn(4 * 1024, 1024)  # 16 MiB: two steps
    path, _ = warm_file(write, {"w": w})
    monkeypatch.setenv(warmcopy.COPY_ENV, "map")
    calls = count_copies(monkeypatch, mapping)
    model = flat({"w": torch.zeros(4 * 1024, 1024)})
    report = await aload.load(model, path)
    assert torch.equal(model.w, w) and report.warm_copy == "map"
    assert sum(calls) == w.nbytes


@pytest.mark.parametrize("mode", ["map", "pread"])
async def test_a_warm_run_of_mid_sized_tensors_comes_out_of_the_mapping_where_the_load_prefers_it(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Tensors of 1 MiB, read in runs by one scattering read each: with the mapping's copies
    preferred (and a copy past the caches here) each run is copied out of the mapping, tensor by
    tensor; by ``preadv`` otherwise. The parameters hold the checkpoint's bytes either way, and
    the run's mapped pages are let go after."""
    if _ntcopy.streaming_copy() is None and mode == "map":
        pytest.skip("no non-temporal copy here")
    tensors = {f"w{i}": torch.randn(256, 1024) for i in range(24)}  # 1 MiB each
    path, _ = warm_file(write, tensors)
    monkeypatch.setenv(warmcopy.COPY_ENV, mode)
    copied = count_copies(monkeypatch, local)
    model = flat({k: torch.zeros_like(v) for k, v in tensors.items()})
    before = rss_file()
    await aload.load(model, path)
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    assert sum(copied) == (24 * MiB if mode == "map" else 0)
    assert rss_file() - before < 8 * MiB


async def test_a_warm_run_of_small_tensors_stays_one_scattering_read(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors under the streaming copy's minimum come by ``preadv`` even where the load prefers
    the mapping: out of it they would be a call each."""
    tensors = {f"w{i}": torch.randn(4096) for i in range(64)}  # 16 KiB each
    path, _ = warm_file(write, tensors)
    monkeypatch.setenv(warmcopy.COPY_ENV, "map")
    copied = count_copies(monkeypatch, local)
    model = flat({k: torch.zeros_like(v) for k, v in tensors.items()})
    await aload.load(model, path)
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    assert copied == []
