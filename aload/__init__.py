"""aload: stream safetensors checkpoints into PyTorch models with asyncio.

The flow, one subpackage each: ``format`` (what a checkpoint is) -> ``sources`` (where its
bytes come from) -> ``read`` (plan and budgeted reader) -> ``stages`` -> ``stream`` ->
``load`` (the bridge to ``model.load_weights`` and post-processing)."""

from . import stages
from .errors import AloadError, CheckpointError, GroupError, HeaderError, LoadError, SourceError, UsageError
from .format import Checkpoint, Shard, TensorSpec
from .load import Installed, LoadCancelled, Loader, LoadReport, load, load_sync
from .read import Progress, ReaderStats
from .sources import Opening, open_checkpoint
from .stream import TensorStream, stream

__version__ = "0.2.0"


def open(url: str, *, concurrency: int | None = None, **options: object) -> Opening:
    """Open the checkpoint at ``url`` (a path, ``file://``, ``http(s)://``, ``hf://``, ``s3://``,
    ``gs://`` or ``az://``), reading
    only its index and headers: ``await aload.open(url)`` or ``async with aload.open(url) as ckpt``."""
    from .read import DEFAULT_CONCURRENCY

    return Opening(open_checkpoint(str(url), concurrency=concurrency or DEFAULT_CONCURRENCY, **options))


# ``open`` is left out of ``__all__``: ``from aload import *`` must not shadow the built-in.
__all__ = [
    "AloadError",
    "Checkpoint",
    "CheckpointError",
    "GroupError",
    "HeaderError",
    "Installed",
    "LoadCancelled",
    "LoadError",
    "LoadReport",
    "Loader",
    "Progress",
    "ReaderStats",
    "Shard",
    "SourceError",
    "TensorSpec",
    "TensorStream",
    "UsageError",
    "load",
    "load_sync",
    "stages",
    "stream",
]
