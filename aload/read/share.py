"""Sharing one read of each byte between the ranks of a ``torch.distributed`` process group.

Every rank plans the same units. With ``share="broadcast"`` the shared units are split between
the ranks in plan order, balanced by bytes; each rank reads its own from storage, and each unit
reaches every rank by a broadcast from its reader, in plan order, in pieces of at most the
chunk size. Units that hold a rank's own slice of a tensor (``Unit.local``) are read by every
rank for itself. ``share="prefetch"`` splits a page-cache warm-up of a local checkpoint between
the ranks instead, then every rank reads all of it; ``share="none"`` shares nothing.

The collectives run on one thread of the stream's (``aload-share``), never on the event loop,
one unit at a time and in the same order on every rank. Each unit's broadcast is preceded by a
small all-reduce in which every rank says whether it is still in (and if not, why): a rank that
fails or is cancelled says so at its next step, every rank then raises a ``GroupError`` naming
it, and no rank waits in a collective its peers will never join. A peer that never comes (a
crashed process) is waited for ``timeout`` seconds at most.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
from collections.abc import Callable
from typing import Any

import torch

from ..errors import GroupError, UsageError
from .plan import Plan, Unit

MODES = ("broadcast", "none", "prefetch")
#: Seconds a rank waits for its peers in one step before it gives up (``group_timeout``).
DEFAULT_GROUP_TIMEOUT_S = 300.0
#: Bytes of a rank's status in a step: a code, then the reason, UTF-8, cut to fit.
_STATUS = 256
_OK, _FAILED = 0, 1


def _reason(error: BaseException | None) -> str:
    """What the other ranks are told this rank stopped for."""
    if error is None:
        return "it stopped before the end"
    if isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)):
        return "it was cancelled"
    return f"{type(error).__name__}: {error}"


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class Share:
    """The ranks' agreement for one stream: who reads which unit, and the steps in order."""

    def __init__(self, group: Any, mode: str = "broadcast", timeout: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
        if mode not in MODES:
            raise UsageError(f"share must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise UsageError(f"group_timeout must be a positive number of seconds, got {timeout!r}")
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "group= needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group); aload never creates one"
            )
        self.group = None if group is True else group
        backend = str(dist.get_backend(self.group))
        if "gloo" not in backend:
            raise UsageError(
                f"sharing needs a process group with a CPU backend (gloo), not {backend!r}: pass "
                "torch.distributed.new_group(backend='gloo') as group="
            )
        self.mode = mode
        self.timeout = datetime.timedelta(seconds=float(timeout))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._global = [dist.get_global_rank(self.group, r) if self.group is not None else r for r in range(self.world)]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aload-share")
        self.owners: list[int] = []  # per unit of the plan: the rank that reads it, -1: every rank
        self._seq: list[int] = []
        self._steps = 0  # steps submitted, in order
        self._turn: asyncio.Condition | None = None
        self._over = False  # a step said a rank is out, or the end was agreed: no more steps
        self._last: concurrent.futures.Future[Any] | None = None

    # -- the plan ----------------------------------------------------------------------------
    def bind(self, plan: Plan) -> None:
        """Who reads each unit: shared units in plan order, split into ``world`` runs of about
        equal bytes; units of a rank's own slice by every rank."""
        total = sum(u.nbytes for u in plan.units if not u.local) or 1
        done = steps = 0
        self.owners, self._seq = [], []  # _seq: each unit's step number (shared units before it)
        for u in plan.units:
            self._seq.append(steps)
            if u.local:
                self.owners.append(-1)
                continue
            self.owners.append(min(self.world - 1, (2 * done + u.nbytes) * self.world // (2 * total)))
            done += u.nbytes
            steps += 1

    def owned(self, plan: Plan) -> list[Unit]:
        return [u for u, r in zip(plan.units, self.owners, strict=True) if r == self.rank]

    def reads(self, index: int) -> bool:
        """Whether this rank reads unit ``index`` from storage itself."""
        return self.mode != "broadcast" or self.owners[index] in (-1, self.rank)

    # -- the steps ---------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """``fn(*args)`` queued on the share thread, which runs the steps in the order queued."""
        fut = self._last = self._pool.submit(fn, *args)
        self._steps += 1
        return fut

    async def exchange(self, index: int, unit: Unit, data: torch.Tensor | None, error: BaseException | None = None) -> None:
        """Unit ``index`` from its reader to every rank: ``data`` is its bytes (uint8) on every
        rank, read on the owner, to be filled elsewhere. With ``error``, this rank (the owner)
        could not read it: every rank raises, naming it."""
        if self._turn is None:
            self._turn = asyncio.Condition()
        seq = self._seq[index]
        async with self._turn:
            await self._turn.wait_for(lambda: self._steps == seq or self._over)
            if self._over:
                raise GroupError("the load was stopped by another rank")
            reason = _reason(error) if error is not None else None
            work = self._submit(self._exchange, data, self._global[self.owners[index]], reason, unit.nbytes)
            self._turn.notify_all()
        await asyncio.wrap_future(work)

    def _exchange(self, data: torch.Tensor | None, src: int, reason: str | None, n: int) -> None:
        self._agree(reason)
        assert data is not None
        piece = self.piece_bytes
        for at in range(0, n, piece):
            self._wait(_dist().broadcast(data[at : at + piece], src=src, group=self.group, async_op=True), "a broadcast")

    piece_bytes = 16 << 20

    def _agree(self, reason: str | None) -> None:
        """One step: every rank says whether it is in; raises if any is not."""
        status = torch.zeros(self.world, _STATUS, dtype=torch.uint8)
        if reason is not None:
            said = reason.encode()[: _STATUS - 1]
            status[self.rank, 0] = _FAILED
            status[self.rank, 1 : 1 + len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
        self._wait(_dist().all_reduce(status, group=self.group, async_op=True), "a step")
        out = [(r, bytes(status[r, 1:].numpy()).rstrip(b"\0").decode(errors="replace")) for r in range(self.world) if status[r, 0]]
        if out:
            self._over = True
            first = next(((r, why) for r, why in out if r != self.rank), out[0])
            err = GroupError(f"rank {first[0]} of {self.world} failed: {first[1]}")
            err.rank = first[0]
            raise err

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            self._over = True
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise GroupError(
                    f"no answer from the other ranks within {self.timeout.total_seconds():g} s in {what} "
                    "(group_timeout=); a rank may have died. The process group may be unusable now"
                ) from None
            said = str(exc).split("] ", 1)[-1].split(". This is typically")[0]  # gloo's own words, without its source path
            raise GroupError(f"the process group failed in {what} (another rank may have crashed): {said}") from None

    async def barrier(self) -> None:
        """Every rank is here (after a prefetch), or some rank failed."""
        await self._step(None)

    async def finish(self) -> None:
        """The end: every rank got every unit. Raises if another rank did not."""
        await self._step(None)
        self._over = True

    async def farewell(self, error: BaseException | None) -> None:
        """This rank stops before the end (for ``error``, if any): its next step says so, so that
        no peer waits for it."""
        if self._over:
            return
        try:
            await self._step(_reason(error))
        except GroupError:
            pass

    async def _step(self, reason: str | None) -> None:
        """A step of its own (not a unit's), after whatever this rank submitted before it."""
        if self._over:
            return
        work = self._submit(self._agree, reason)
        if self._turn is not None:
            async with self._turn:
                self._turn.notify_all()
        await asyncio.wrap_future(work)

    async def aclose(self) -> None:
        """Wait for the last step submitted (a collective cannot be interrupted), then end the thread."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.wait([asyncio.wrap_future(last)])
        self._pool.shutdown(wait=True)
