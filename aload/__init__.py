"""aload: stream safetensors checkpoints into PyTorch models with asyncio."""

# The local store comes with aload (the common case: its first load then imports nothing on a
# thread while the loop runs); the remote ones are imported when first used.
from . import local, stages  # noqa: F401
from .bridge import LoadCancelled
from .checkpoint import Checkpoint, Shard, open
from .errors import AloadError, CheckpointError, HeaderError, LoadError, SourceError, UsageError
from .format import TensorSpec
from .install import Installed, Loader
from .loader import LoadReport, load, load_sync
from .pipeline import TensorStream, stream
from .reader import Progress, ReaderStats
from .sources import preload

__version__ = "0.1.0"

__all__ = [
    "AloadError",
    "Checkpoint",
    "CheckpointError",
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
    "open",
    "preload",
    "stages",
    "stream",
]
