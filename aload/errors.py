"""The one exception tree of aload.

Every error names the checkpoint file or URL, and where it applies the tensor and
the byte range. Library errors are translated where they are caught, with ``from exc``.

    AloadError                      base; .url, .tensor, .byte_range
    ├── UsageError (ValueError)     a bad argument: budget, concurrency, stage, calling context
    ├── SourceError (OSError)       bytes could not be read: missing file, short read, I/O error
    ├── CheckpointError             the checkpoint is malformed or inconsistent
    │   └── HeaderError             a safetensors header is refused
    ├── LoadError                   the weights do not fit the model: missing, unexpected, shapes
    └── GroupError                  another rank of the process group failed, or did not answer in time

Errors raised by user code (``model.load_weights``, a stage, a hook) are not wrapped:
they propagate unchanged. Any error out of ``aload.load`` (cancellation included) carries
``.aload_delivered``, the names handed to the loader before it, and a note saying how far the
load got.
"""

from __future__ import annotations


class AloadError(Exception):
    """Base of every aload error."""

    #: Set by ``aload.load``: the tensors handed to the loader before the error, in order.
    aload_delivered: list[str] | None = None

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        tensor: str | None = None,
        byte_range: tuple[int, int] | None = None,
    ) -> None:
        self.message = message
        self.url = url
        self.tensor = tensor
        self.byte_range = byte_range
        super().__init__(self._render())

    def locate(self, url: str) -> None:
        """Name the checkpoint when the error was raised where only the tensor was known."""
        if self.url is None:
            self.url = url
            self.args = (self._render(),)

    def _render(self) -> str:
        where = []
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        if self.byte_range is not None:
            where.append(f"bytes [{self.byte_range[0]}, {self.byte_range[1]})")
        text = f"{self.url}: {self.message}" if self.url else self.message
        return f"{text} ({', '.join(where)})" if where else text


class UsageError(AloadError, ValueError):
    """An argument or calling context aload refuses."""


class SourceError(AloadError, OSError):
    """Bytes could not be read from a file or URL."""


class CheckpointError(AloadError):
    """A checkpoint (index, shards, headers) is malformed or inconsistent."""


class HeaderError(CheckpointError):
    """A safetensors header is refused."""


class LoadError(AloadError):
    """The checkpoint's weights do not fit the model."""


class GroupError(AloadError):
    """A load shared by the ranks of a ``torch.distributed`` group ended because another rank
    failed or did not answer in time; ``.rank`` is that rank (in the group), None where unknown."""

    rank: int | None = None


def add_note(exc: BaseException, note: str) -> None:
    """Attach context to an exception raised by user code without wrapping it."""
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)
