"""Prefix-cache snapshots on disk: one safetensors file per snapshot.

Each file holds the token path, the last logits row and the model state arrays, plus in
its metadata the format version, the identity (fingerprint) of the model the state
belongs to and a SHA-256 over every array. Files are written to a temporary name, synced
and renamed, so a crash leaves either the old set or the new file, never half a file.
A per-token array the snapshot hands over as ``RowBlocks`` (the MLA latent cache,
model/snapshot_arrays.py) keeps its frozen blocks: each is stored once under ``blocks/``
by content hash and only the partial block goes into the file, so a conversation's
successive snapshots share their prefix blocks on disk as they do in memory, and a turn
at 12K tokens writes ~20 MB of new state instead of the whole 180 MB latent again. A
block this process has already hashed is known by identity (``KnownBlocks``): it is not
hashed again, and reading it back gives the array already in memory.
At start-up only headers and token paths are read (the index); arrays are read and their
checksums verified when a request first needs them. Anything that fails a check (not
safetensors, truncated, foreign fingerprint, wrong checksum, wrong shapes) is deleted.

safetensors is used instead of a home-made container because it is already a runtime
dependency, refuses malformed headers and out-of-bounds offsets itself, and reads the
token path without touching the (large) state arrays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from ling3_rknn.model.snapshot_arrays import RowBlocks, SnapshotArrays

from .known_blocks import KnownBlocks

log = logging.getLogger(__name__)

FORMAT = "ling3-rknn-prefix-snapshot/1"
SUFFIX = ".l3snap"
_TMP_SUFFIX = ".tmp"
_TOKENS = "tokens"
_LOGITS = "logits"
_STATE_PREFIX = "state."
_BLOCKS_DIR = "blocks"
_BLOCK_SUFFIX = ".blk"


class SnapshotFileError(Exception):
    """A snapshot file that must not be trusted (reason in the message)."""


def model_fingerprint(config: Any, weights_identity: str) -> str:
    """Identity of the model a snapshot belongs to: its config plus the caller's
    identity of the weights (e.g. the bundle manifest hash) plus our file format."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        fields = dict(config)
    else:
        fields = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    text = json.dumps(
        {"format": FORMAT, "config": fields, "weights": weights_identity},
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def arrays_checksum(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of every array, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.asarray(arrays[name], order="C")
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        if a.size:  # memoryview cannot cast an empty array
            h.update(a.data.cast("B"))
    return h.hexdigest()


def _note_checksum(note: str, tokens: tuple[int, ...]) -> str:
    """Notes are read at start-up, before the arrays' checksum is ever checked."""
    h = hashlib.sha256(note.encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


def block_hash(a: np.ndarray) -> str:
    """A block's content hash (its file name): dtype, shape and bytes."""
    h = hashlib.sha256(f"{a.dtype.str}|{a.shape}|".encode())
    h.update(np.ascontiguousarray(a).data.cast("B"))
    return h.hexdigest()


def _file_checksum(arrays: Mapping[str, np.ndarray], blocks_json: str) -> str:
    """Checksum of a snapshot file: its arrays plus the list of blocks it references
    (each block is verified against its own name when read)."""
    return hashlib.sha256((arrays_checksum(arrays) + blocks_json).encode()).hexdigest()


@dataclass(frozen=True)
class StoredSnapshot:
    """Index entry of one file: enough to place it in the trie without reading arrays."""

    path: Path
    tokens: tuple[int, ...]
    nbytes: int  # size of the file (blocks not included)
    note: str = ""  # caller's annotation (the engine keeps its turn transcript here)
    blocks: tuple[str, ...] = ()  # content hashes of the shared blocks it references


@dataclass(frozen=True)
class LoadedSnapshot:
    tokens: tuple[int, ...]
    logits: np.ndarray
    state: dict[str, np.ndarray | RowBlocks]  # the arrays as they were handed to ``write``


class SnapshotStore:
    """A directory of snapshot files belonging to one model fingerprint."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self._known = KnownBlocks(block_hash)

    def path_for(self, tokens: tuple[int, ...]) -> Path:
        digest = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()
        return self.directory / f"{digest[:40]}{SUFFIX}"

    @property
    def blocks_directory(self) -> Path:
        return self.directory / _BLOCKS_DIR

    def block_path(self, digest: str) -> Path:
        return self.blocks_directory / f"{digest}{_BLOCK_SUFFIX}"

    def block_nbytes(self, digest: str) -> int:
        try:
            return self.block_path(digest).stat().st_size
        except OSError:
            return 0

    def block_exists(self, digest: str) -> bool:
        return self.block_path(digest).is_file()

    def delete_block(self, digest: str) -> None:
        self.block_path(digest).unlink(missing_ok=True)

    # -- writing -------------------------------------------------------------------

    def write(
        self,
        tokens: tuple[int, ...],
        logits: np.ndarray,
        state: SnapshotArrays,
        note: str = "",
    ) -> StoredSnapshot:
        """Write one snapshot atomically; returns its index entry."""
        arrays: dict[str, np.ndarray] = {
            _TOKENS: np.asarray(tokens, dtype=np.int64),
            _LOGITS: np.ascontiguousarray(logits, dtype=np.float32),
        }
        blocks: dict[str, dict[str, Any]] = {}
        for name, value in state.items():
            if isinstance(value, RowBlocks):
                if value.frozen:
                    blocks[name] = self._write_blocks(name, value)
                value = value.partial
            arrays[_STATE_PREFIX + name] = np.asarray(value, order="C")
        if blocks:
            self._sync_directory(self.blocks_directory)
        blocks_json = json.dumps(blocks, sort_keys=True)
        metadata = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "checksum": _file_checksum(arrays, blocks_json),
            "blocks": blocks_json,
        }
        if note:
            metadata["note"] = note
            metadata["note_checksum"] = _note_checksum(note, tokens)
        final = self.path_for(tokens)
        tmp = final.with_name(f"{final.name}.{os.getpid()}{_TMP_SUFFIX}")
        try:
            save_file(arrays, str(tmp), metadata=metadata)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._sync_directory(self.directory)
        digests = tuple(h for spec in blocks.values() for h in spec["hashes"])
        return StoredSnapshot(final, tuple(tokens), final.stat().st_size, note, digests)

    def _write_blocks(self, name: str, value: RowBlocks) -> dict[str, Any]:
        """Store an array's frozen blocks; returns their entry in the ``blocks`` metadata."""
        first = value.frozen[0]
        if first.ndim != 2 or any(
            b.dtype != first.dtype or b.shape[1:] != first.shape[1:] for b in value.frozen
        ):
            raise ValueError(f"the blocks of {name!r} are not 2-D with one dtype and width")
        hashes = [self._write_block(b) for b in value.frozen]
        return {"dtype": first.dtype.str, "cols": first.shape[1], "hashes": hashes}

    def _write_block(self, rows: np.ndarray) -> str:
        """Store one block under its content hash (once); returns the hash."""
        digest = self._known.digest(rows)
        final = self.block_path(digest)
        if final.is_file():
            return digest
        final.parent.mkdir(exist_ok=True)
        tmp = final.with_name(f"{final.name}.{os.getpid()}{_TMP_SUFFIX}")
        # Renamed into place (never half a block under its name) but not fsynced one by
        # one: a block lost in a crash fails its hash check on load and only costs that
        # snapshot, while syncing hundreds of blocks per write would cost seconds.
        try:
            with open(tmp, "wb") as f:
                f.write(np.ascontiguousarray(rows).data.cast("B"))
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest

    @staticmethod
    def _sync_directory(directory: Path) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:  # platforms without directory fds
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    # -- reading -------------------------------------------------------------------

    def scan(self) -> list[StoredSnapshot]:
        """Index every valid file (headers and token paths only); delete the rest."""
        found: list[StoredSnapshot] = []
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(_TMP_SUFFIX):
                path.unlink(missing_ok=True)  # left behind by a crash mid-write
                continue
            if not path.name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                found.append(self._read_index(path))
            except SnapshotFileError as exc:
                log.warning("prefix cache: deleting %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
        self._collect_blocks({h for entry in found for h in entry.blocks})
        return found

    def _collect_blocks(self, referenced: set[str]) -> None:
        """Delete blocks no valid snapshot references (and crash leftovers)."""
        if not self.blocks_directory.is_dir():
            return
        for path in self.blocks_directory.iterdir():
            name = path.name
            if name.endswith(_BLOCK_SUFFIX) and name[: -len(_BLOCK_SUFFIX)] in referenced:
                continue
            if path.is_file():
                path.unlink(missing_ok=True)

    def _read_index(self, path: Path) -> StoredSnapshot:
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                self._check_metadata(meta)
                names = set(f.keys())
                if _TOKENS not in names or _LOGITS not in names:
                    raise SnapshotFileError("missing tokens or logits")
                tokens = f.get_tensor(_TOKENS)
        except SnapshotFileError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise SnapshotFileError(f"unreadable: {exc}") from exc
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype != np.int64:
            raise SnapshotFileError("bad token path")
        key = tuple(int(t) for t in tokens)
        if self.path_for(key).name != path.name:
            raise SnapshotFileError("file name does not match its token path")
        note = meta.get("note", "")
        if note and meta.get("note_checksum") != _note_checksum(note, key):
            raise SnapshotFileError("note checksum mismatch")
        digests = tuple(h for spec in _parse_blocks(meta).values() for h in spec["hashes"])
        return StoredSnapshot(path, key, path.stat().st_size, note, digests)

    def _check_metadata(self, meta: Mapping[str, str]) -> None:
        if meta.get("format") != FORMAT:
            raise SnapshotFileError(f"unknown format {meta.get('format')!r}")
        if meta.get("fingerprint") != self.fingerprint:
            raise SnapshotFileError("belongs to another model or bundle")
        if not meta.get("checksum"):
            raise SnapshotFileError("no checksum")

    def load(self, entry: StoredSnapshot) -> LoadedSnapshot:
        """Read and verify a file's arrays; raises SnapshotFileError (file deleted)."""
        try:
            return self._load_verified(entry)
        except SnapshotFileError as exc:
            log.warning("prefix cache: deleting %s: %s", entry.path.name, exc)
            entry.path.unlink(missing_ok=True)
            raise

    def _load_verified(self, entry: StoredSnapshot) -> LoadedSnapshot:
        try:
            with safe_open(str(entry.path), framework="numpy") as f:
                meta = f.metadata() or {}
            self._check_metadata(meta)
            arrays = load_file(str(entry.path))
        except SnapshotFileError:
            raise
        except Exception as exc:
            raise SnapshotFileError(f"unreadable: {exc}") from exc
        blocks = _parse_blocks(meta)
        if _file_checksum(arrays, meta.get("blocks", "")) != meta["checksum"]:
            raise SnapshotFileError("checksum mismatch")
        tokens = tuple(int(t) for t in arrays.pop(_TOKENS))
        if tokens != entry.tokens:
            raise SnapshotFileError("token path changed since start-up")
        logits = arrays.pop(_LOGITS)
        if logits.ndim != 1:
            raise SnapshotFileError("bad logits row")
        state: dict[str, np.ndarray | RowBlocks] = {
            name[len(_STATE_PREFIX) :]: value
            for name, value in arrays.items()
            if name.startswith(_STATE_PREFIX)
        }
        for name, spec in blocks.items():
            partial = arrays.get(_STATE_PREFIX + name)
            if partial is None:
                raise SnapshotFileError(f"no tail array for {name}")
            frozen = tuple(self._read_block(h, spec) for h in spec["hashes"])
            state[name] = RowBlocks(frozen, partial)
        return LoadedSnapshot(tokens, logits, state)

    def _read_block(self, digest: str, spec: Mapping[str, Any]) -> np.ndarray:
        """A verified, read-only block: the array already in memory when this process
        knows it (its file must still exist), else read from its file and hashed."""
        path = self.block_path(digest)
        dtype, cols = np.dtype(spec["dtype"]), int(spec["cols"])
        known = self._known.array(digest)
        if known is not None and known.dtype == dtype and known.shape[1:] == (cols,):
            if not path.is_file():
                raise SnapshotFileError(f"block {digest[:12]} is missing")
            return known
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SnapshotFileError(f"block {digest[:12]} unreadable: {exc}") from exc
        try:  # the rows per block are the file's size: the hash covers the shape
            rows = np.frombuffer(data, dtype=dtype).reshape(-1, cols)
        except (ValueError, TypeError) as exc:
            path.unlink(missing_ok=True)
            raise SnapshotFileError(f"block {digest[:12]} has the wrong size") from exc
        if block_hash(rows) != digest:
            path.unlink(missing_ok=True)
            raise SnapshotFileError(f"block {digest[:12]} is corrupt")
        self._known.remember(digest, rows)
        return rows

    def delete(self, entry: StoredSnapshot) -> None:
        """Delete a snapshot file (its blocks are the caller's to release)."""
        entry.path.unlink(missing_ok=True)


def _parse_blocks(meta: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The ``blocks`` metadata, validated enough to be used as file names and shapes."""
    try:
        blocks = json.loads(meta.get("blocks", "{}"))
        for spec in blocks.values():
            np.dtype(spec["dtype"])
            int(spec["cols"])
            for h in spec["hashes"]:
                if len(h) != 64 or not all(c in "0123456789abcdef" for c in h):
                    raise ValueError("bad block hash")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SnapshotFileError(f"bad block list: {exc}") from exc
    if not isinstance(blocks, dict):
        raise SnapshotFileError("bad block list")
    return blocks
