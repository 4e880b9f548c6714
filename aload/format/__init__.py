"""What a safetensors checkpoint is, as data: the dtype table, the header, the index and the
checkpoint they make up. Nothing here reads a byte: ``aload.sources`` does."""

from .checkpoint import INDEX_NAME, Checkpoint, Shard, assemble
from .header import DTYPES, ITEMSIZE, MAX_HEADER_BYTES, TensorSpec, header_length, parse_header
from .index import MAX_INDEX_BYTES, parse_index

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "ITEMSIZE",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "Checkpoint",
    "Shard",
    "TensorSpec",
    "assemble",
    "header_length",
    "parse_header",
    "parse_index",
]
