"""Run blocking work on a dedicated thread that is joined when it ends, so no thread
outlives the call (the loop's default executor keeps its threads alive)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def start_thread(
    fn: Callable[..., T], *args: Any, name: str = "aload-worker"
) -> tuple[asyncio.Future[T], threading.Thread]:
    """Start ``fn(*args)`` on a new thread; the future resolves on the current loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def body() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # delivered to the awaiting task, re-raised there
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(deliver, result, error)
        except RuntimeError:  # the loop closed while we ran: nobody is waiting
            pass

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return fut, thread


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``await`` a blocking call on its own thread; the thread has ended when this returns."""
    fut, thread = start_thread(fn, *args)
    try:
        return await asyncio.shield(fut)
    finally:
        if not fut.done():
            await asyncio.wait([fut])
        while thread.is_alive():  # it is exiting; joining here could hold the loop for ms
            await asyncio.sleep(0.0005)
