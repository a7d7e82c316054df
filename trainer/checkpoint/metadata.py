"""DCP's `.metadata`, read as data: a checkpoint from elsewhere cannot run code when it is loaded.

DCP pickles its metadata, its reader unpickles it with a plain pickle.load, and its load planner
torch.load()s, with weights_only=False, any entry the metadata declares as bytes. Here the pickle is
read by an unpickler that builds only the (module, name) pairs listed below, each matched exactly
(no prefix, no dotted name), and what it builds must describe tensors only, stored in the folder's
own files, before DCP plans a single read. A tensor's bytes are then read by DCP with
torch.load(weights_only=True).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from trainer.errors import ConfigError

_DCP = "torch.distributed.checkpoint"
# What DCP's metadata is made of: its own records (BytesStorageMetadata is built only to be refused
# by name below), torch's sizes, layouts and dtypes, the saving run's path.
ALLOWED = frozenset({
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
})
_ENUMS = (_MEM_FORMAT_ENCODING,)


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, damaged or refused."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):  # how some Pythons pickle an enum member
            return _enum_member
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} does not belong in checkpoint metadata")
        return super().find_class(module, name)


def _enum_member(cls, name: str):
    if cls in _ENUMS and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) does not belong in checkpoint "
                                 "metadata")


def read_metadata(folder: Path) -> Metadata:
    """Checkpoint `folder`'s metadata, refused (a CheckpointError naming the folder and what was
    refused) unless it describes tensors only, in files of the folder."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    # (what the allowed constructors raise on arguments a crafted file gives them, too)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{folder} is not a readable checkpoint: {path.name}: {e}") from None
    problem = _not_tensors_only(metadata)
    if problem is not None:
        raise CheckpointError(f"checkpoint {folder} is refused, nothing of it loaded: {problem}")
    return metadata


def _not_tensors_only(metadata) -> str | None:
    """What in unpickled `metadata` is not a description of tensors in the folder's files."""
    if not isinstance(metadata, Metadata):
        return f".metadata holds a {type(metadata).__name__}, not DCP's metadata"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not (isinstance(entries, dict) and isinstance(storage, dict)
            and isinstance(metadata.storage_meta, (StorageMeta, type(None)))):
        return ".metadata's parts are not what DCP writes"
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            return (f"entry {key!r} is declared as {type(entry).__name__}, not a tensor (this "
                    "trainer saves tensors only; DCP would unpickle such an entry's bytes, running "
                    "what they name)")
        props = entry.properties
        if not (isinstance(props.dtype, torch.dtype) and isinstance(entry.size, torch.Size)
                and isinstance(entry.chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks)):
            return f"entry {key!r} is not a well-formed tensor description"
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)):
            return "its storage index holds something other than file ranges"
        name = info.relative_path
        if not (isinstance(name, str) and name and "/" not in name and "\\" not in name
                and name not in (".", "..")):
            return f"entry {index.fqn!r} is stored in {name!r}, which is not a file of the folder"
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"entry {index.fqn!r} has a byte range that is not two counts"
        if info.transform_descriptors:  # (written only by DCP's experimental stream extensions)
            return (f"entry {index.fqn!r} is stored through {list(info.transform_descriptors)}, "
                    "which this trainer never writes")
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by read_metadata above."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
