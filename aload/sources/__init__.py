"""Where checkpoint bytes come from: local files (``local``), HTTP(S) and object stores
(``remote``, through obstore; ``hub`` for ``hf://``), chosen by URL scheme (``registry``); ``opener`` reads a
checkpoint's index and headers through them."""

from .base import ALIGN, Source, Store, aligned_empty, byte_tensor
from .opener import Opening, open_checkpoint
from .registry import STORES, open_store

__all__ = ["ALIGN", "STORES", "Opening", "Source", "Store", "aligned_empty", "byte_tensor", "open_checkpoint", "open_store"]
