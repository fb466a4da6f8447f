"""Prefix-cache snapshots on disk: one safetensors file per snapshot.

Each file holds the token path, the last logits row and the model state arrays, plus in
its metadata the format version, the identity (fingerprint) of the model the state
belongs to and a SHA-256 over every array. Files are written to a temporary name, synced
and renamed, so a crash leaves either the old set or the new file, never half a file.
At start-up only headers and token paths are read (the index); arrays are read and their
checksum verified when a request first needs them. Anything that fails a check (not
safetensors, truncated, foreign fingerprint, wrong checksum, wrong shapes) is deleted.

safetensors is used instead of a home-made container because it is already a runtime
dependency, refuses malformed headers and out-of-bounds offsets itself, and reads the
token path without touching the (large) state arrays.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

FORMAT = "ling3-rknn-prefix-snapshot/1"
SUFFIX = ".l3snap"
_TMP_SUFFIX = ".tmp"
_TOKENS = "tokens"
_LOGITS = "logits"
_STATE_PREFIX = "state."


class SnapshotFileError(Exception):
    """A snapshot file that must not be trusted (reason in the message)."""


def model_fingerprint(config: Any, weights_identity: str) -> str:
    """Identity of the model a snapshot belongs to: its config plus the caller's
    identity of the weights (e.g. the bundle manifest hash) plus our file format."""
    if hasattr(config, "__dataclass_fields__"):
        import dataclasses

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
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _note_checksum(note: str, tokens: tuple[int, ...]) -> str:
    """Notes are read at start-up, before the arrays' checksum is ever checked."""
    h = hashlib.sha256(note.encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class StoredSnapshot:
    """Index entry of one file: enough to place it in the trie without reading arrays."""

    path: Path
    tokens: tuple[int, ...]
    nbytes: int  # size of the file
    note: str = ""  # caller's annotation (the engine keeps its turn transcript here)


@dataclass(frozen=True)
class LoadedSnapshot:
    tokens: tuple[int, ...]
    logits: np.ndarray
    state: dict[str, np.ndarray]


class SnapshotStore:
    """A directory of snapshot files belonging to one model fingerprint."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, tokens: tuple[int, ...]) -> Path:
        digest = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()
        return self.directory / f"{digest[:40]}{SUFFIX}"

    # -- writing -------------------------------------------------------------------

    def write(
        self,
        tokens: tuple[int, ...],
        logits: np.ndarray,
        state: Mapping[str, np.ndarray],
        note: str = "",
    ) -> StoredSnapshot:
        """Write one snapshot atomically; returns its index entry."""
        arrays: dict[str, np.ndarray] = {
            _TOKENS: np.asarray(tokens, dtype=np.int64),
            _LOGITS: np.ascontiguousarray(logits, dtype=np.float32),
        }
        for name, value in state.items():
            arrays[_STATE_PREFIX + name] = np.asarray(value, order="C")
        metadata = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "checksum": arrays_checksum(arrays),
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
        self._sync_directory()
        return StoredSnapshot(final, tuple(tokens), final.stat().st_size, note)

    def _sync_directory(self) -> None:
        try:
            fd = os.open(self.directory, os.O_RDONLY)
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
        return found

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
        return StoredSnapshot(path, key, path.stat().st_size, note)

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
        if arrays_checksum(arrays) != meta["checksum"]:
            raise SnapshotFileError("checksum mismatch")
        tokens = tuple(int(t) for t in arrays.pop(_TOKENS))
        if tokens != entry.tokens:
            raise SnapshotFileError("token path changed since start-up")
        logits = arrays.pop(_LOGITS)
        if logits.ndim != 1:
            raise SnapshotFileError("bad logits row")
        state = {
            name[len(_STATE_PREFIX) :]: value
            for name, value in arrays.items()
            if name.startswith(_STATE_PREFIX)
        }
        return LoadedSnapshot(tokens, logits, state)

    def delete(self, entry: StoredSnapshot) -> None:
        entry.path.unlink(missing_ok=True)
