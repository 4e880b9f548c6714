"""Into a model: the sync bridge to a worker thread (``bridge``), the phases of a load and the
built-in loader (``loader``), and ``load`` / ``load_sync`` (``api``)."""

from .api import LoadReport, load, load_sync
from .bridge import LoadCancelled, SyncBridge
from .loader import Hook, Installed, Loader

__all__ = ["Hook", "Installed", "LoadCancelled", "LoadReport", "Loader", "SyncBridge", "load", "load_sync"]
