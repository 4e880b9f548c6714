"""A copy that writes past the CPU's caches (non-temporal stores), for bytes out of the page
cache into a model's parameters: nothing reads them again soon, and a plain ``memcpy`` first
reads every destination line it writes (a read for ownership), a third more memory traffic.

glibc's ``memcpy`` does the same for copies above a threshold (``x86_non_temporal_threshold``,
114 MiB on the 2-core Xeon measured, 288 MiB on the EPYC of 2026-12-02), which aload's 8 MiB
steps never reach; the threshold can only be lowered for a whole process, at its start
(``GLIBC_TUNABLES``). So aload carries the loop itself: 400 bytes of x86-64 machine code (AVX2),
assembled from the source below and made executable once (``mmap``, then ``mprotect`` to read
and execute), called through ``ctypes`` (the GIL let go meanwhile). Copying 4 GiB in 8 MiB pieces
out of a file's mapping on two threads (2026-12-05, the 2-core Xeon, medians of 3, ad-hoc):
``memcpy`` 9.7-10.7 GB/s, one stream of non-temporal stores 12.5-13.6, four pages side by side as
here (as glibc's own large copy does) 15.5-16.5, glibc with its threshold lowered to 1 MiB 15.2;
``benchmarks/local_reads.py``'s rows for aload's steps: 10.2 against 16.3 (docs/benchmarks.md,
stop 55).

None of it where it cannot be trusted: off Linux on x86-64, without AVX2 (``/proc/cpuinfo``),
where the kernel refuses executable memory, where a copy of a test pattern comes back wrong, or
with ``ALOAD_STREAMING_COPY=0``; the copy is then ``memcpy``.

The two loops (GNU ``as``, Intel syntax; ``rdi`` destination, ``rsi`` source, ``rdx`` bytes)::

    # _FOUR_PAGES: rdx a positive multiple of 16 KiB, rdi 32-byte aligned. Four 4 KiB pages
    # side by side, 128 bytes of each a turn (four streams for the hardware prefetchers).
    outer:  mov ecx, 32
    inner:  prefetcht0 [rsi+0x80]    ; and +0xc0, and both 0x1000, 0x2000, 0x3000 further
            vmovdqu ymm0, [rsi]      ; ymm0-3 from [rsi+0x00..0x60], ymm4-7 from +0x1000,
            ...                      ; ymm8-11 from +0x2000, ymm12-15 from +0x3000
            sub rsi, -128
            vmovntdq [rdi], ymm0     ; the same sixteen, to rdi's four pages
            ...
            sub rdi, -128
            dec ecx
            jnz inner
            add rsi, 0x3000
            add rdi, 0x3000
            sub rdx, 0x4000
            jnz outer
            sfence
            vzeroupper
            ret

    # _LINES: rdx a positive multiple of 128, rdi 32-byte aligned.
    lines:  vmovdqu ymm0, [rsi]      ; ymm0-3 from [rsi+0x00..0x60]
            ...
            vmovntdq [rdi], ymm0     ; ymm0-3 to [rdi+0x00..0x60]
            ...
            sub rsi, -128
            sub rdi, -128
            add rdx, -128
            jnz lines
            sfence
            vzeroupper
            ret
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable

from ._syscalls import libc

#: ``ALOAD_STREAMING_COPY=0`` turns the non-temporal copy off (``memcpy`` throughout).
STREAMING_ENV = "ALOAD_STREAMING_COPY"
#: Copies under this size go by ``memcpy``: the data they write may well be read soon.
STREAMING_MIN_BYTES = 256 << 10

_FOUR_PAGES = bytes.fromhex(
    "b920000000"
    "0f188e80000000"
    "0f188ec0000000"
    "0f188e80100000"
    "0f188ec0100000"
    "0f188e80200000"
    "0f188ec0200000"
    "0f188e80300000"
    "0f188ec0300000"
    "c5fe6f06"
    "c5fe6f4e20"
    "c5fe6f5640"
    "c5fe6f5e60"
    "c5fe6fa600100000"
    "c5fe6fae20100000"
    "c5fe6fb640100000"
    "c5fe6fbe60100000"
    "c57e6f8600200000"
    "c57e6f8e20200000"
    "c57e6f9640200000"
    "c57e6f9e60200000"
    "c57e6fa600300000"
    "c57e6fae20300000"
    "c57e6fb640300000"
    "c57e6fbe60300000"
    "4883ee80"
    "c5fde707"
    "c5fde74f20"
    "c5fde75740"
    "c5fde75f60"
    "c5fde7a700100000"
    "c5fde7af20100000"
    "c5fde7b740100000"
    "c5fde7bf60100000"
    "c57de78700200000"
    "c57de78f20200000"
    "c57de79740200000"
    "c57de79f60200000"
    "c57de7a700300000"
    "c57de7af20300000"
    "c57de7b740300000"
    "c57de7bf60300000"
    "4883ef80"
    "ffc9"
    "0f85d2feffff"
    "4881c600300000"
    "4881c700300000"
    "4881ea00400000"
    "0f85b2feffff"
    "0faef8"
    "c5f877"
    "c3"
)
_LINES = bytes.fromhex(
    "c5fe6f06"
    "c5fe6f4e20"
    "c5fe6f5640"
    "c5fe6f5e60"
    "c5fde707"
    "c5fde74f20"
    "c5fde75740"
    "c5fde75f60"
    "4883ee80"
    "4883ef80"
    "4883c280"
    "75cc"
    "0faef8"
    "c5f877"
    "c3"
)
_LINES_AT = 512  # where _LINES starts in the code's page
_FOUR_PAGES_BYTES = 16 << 10

_Loop = Callable[[int, int, int], None]


def _loops() -> tuple[_Loop, _Loop, mmap.mmap] | None:
    """The two loops, callable, and the page that holds them; None where they cannot be had."""
    if os.environ.get(STREAMING_ENV, "1") == "0" or libc is None:
        return None
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    if "avx2" not in flags:
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    page[: len(_FOUR_PAGES)] = _FOUR_PAGES
    page[_LINES_AT : _LINES_AT + len(_LINES)] = _LINES
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    mprotect = libc.mprotect
    mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if mprotect(base, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        return None  # executable memory refused (SELinux's execmem, a hardened kernel)
    kind = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return kind(base), kind(base + _LINES_AT), page


def _copier() -> _Loop | None:
    loops = _loops()
    if loops is None:
        return None
    four_pages, lines, page = loops
    assert libc is not None
    memcpy = libc.memcpy

    def copy(dst: int, src: int, n: int) -> None:
        """``n`` bytes from address ``src`` to ``dst`` (not overlapping), the bulk by
        non-temporal stores, complete (fenced) when this returns."""
        head = -dst % 64
        if n < head + 128:
            memcpy(dst, src, n)
            return
        if head:
            memcpy(dst, src, head)
            dst, src, n = dst + head, src + head, n - head
        bulk = n - n % _FOUR_PAGES_BYTES
        if bulk:
            four_pages(dst, src, bulk)
            dst, src, n = dst + bulk, src + bulk, n - bulk
        bulk = n - n % 128
        if bulk:
            lines(dst, src, bulk)
            dst, src, n = dst + bulk, src + bulk, n - bulk
        if n:
            memcpy(dst, src, n)

    copy.page = page  # type: ignore[attr-defined]  # the code's memory lives as long as the function
    return copy if _copies_right(copy) else None


def _copies_right(copy: _Loop) -> bool:
    """Whether ``copy`` reproduces a pattern through every path (each loop, a head, a tail)."""
    n = 3 * _FOUR_PAGES_BYTES + 1000
    pattern = bytes(range(251)) * (n // 251 + 1)
    src = ctypes.create_string_buffer(pattern, len(pattern))
    dst = ctypes.create_string_buffer(n + 128)
    copy(ctypes.addressof(dst) + 3, ctypes.addressof(src) + 5, n)
    got = dst.raw
    return got[3 : 3 + n] == pattern[5 : 5 + n] and not got[:3].strip(b"\0") and not got[3 + n :].strip(b"\0")


_lock = threading.Lock()
_made = False
_streaming: _Loop | None = None


def streaming_copy() -> _Loop | None:
    """The non-temporal copy, made at first need (not at import); None where there is none."""
    global _made, _streaming
    if not _made:
        with _lock:
            if not _made:
                _streaming, _made = _copier(), True
    return _streaming


def copy_bytes(dst: int, src: int, n: int) -> None:
    """``n`` bytes from address ``src`` to ``dst`` (not overlapping): by non-temporal stores
    from ``STREAMING_MIN_BYTES`` on where the CPU has them, else ``memcpy``."""
    copy = streaming_copy() if n >= STREAMING_MIN_BYTES else None
    if copy is not None:
        copy(dst, src, n)
    else:
        assert libc is not None
        libc.memcpy(dst, src, n)
