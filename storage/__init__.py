"""On-disk format of extracted hidden states: Parquet format v2.

``storage.schema`` names every column and metadata key, ``storage.writer``
writes one shard file atomically, ``storage.reader`` reads samples back as
torch tensors. For training: ``storage.run_index`` indexes a run's files from
their footers, ``training.dataset`` is the PyTorch dataset over it,
``training.peer_formats`` what SpecForge and speculators read, and
``training.destination`` writes files that appear whole. Nothing here imports
SGLang or Ray; the writer side imports no torch (the reader and the training
modules do, loaded on first use: writer processes never need it).
"""

from typing import Any

from storage.schema import FORMAT_VERSION, ShardMetadata
from storage.writer import ShardFileInfo, ShardWriter, shard_file_name

__all__ = ["FORMAT_VERSION", "Sample", "ShardFileInfo", "ShardMetadata", "ShardReader", "ShardWriter", "shard_file_name"]


def __getattr__(name: str) -> Any:
    if name in ("Sample", "ShardReader"):
        from storage import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
