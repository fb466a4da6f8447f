"""Opening a bundle: read and check the manifest, verify every file it lists.

Each failure is a typed :class:`~ling3_rknn.bundle.errors.BundleError` naming the file
or key; verification is size only, or full sha256 streamed in chunks, remembered in a
stamp while the files are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..paths import state_directory
from .errors import (
    BundleNotFoundError,
    FileCorruptError,
    IncompleteBundleError,
    ManifestError,
    MissingFileError,
    TemplateMismatchWarning,
)
from .format import MANIFEST
from .manifest import Manifest

log = logging.getLogger("ling3_rknn.bundle")

# full: sha256 of every file; stamped: the same, skipped for files a stamp of an earlier
# full check says are unchanged (size, mtime, inode); size: stat only; none: nothing.
VerifyMode = Literal["full", "stamped", "size", "none"]
_HASH_CHUNK = 1 << 22
STAMP = ".verified.json"  # next to the manifest; never listed in it
_PROGRESS_EVERY_S = 5.0


def sha256_file(path: str | os.PathLike[str],
                progress: Callable[[int], None] | None = None) -> str:
    """Streamed sha256, so multi-GB expert files never sit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: Manifest

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        verify: VerifyMode = "stamped",
        expected_template_sha256: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Bundle:
        """Load and check a bundle.

        ``verify``: ``"stamped"`` (default: sha256 of every file, remembered while the
        files are unchanged, see :meth:`verify`), ``"full"`` (sha256 always), ``"size"``
        (stat only: the explicit opt-out) or ``"none"``. ``expected_template_sha256`` is
        the hash of the template the renderer implements
        (``ling3_rknn.chat.TEMPLATE_SHA256``); a different bundle template is a loud
        :class:`TemplateMismatchWarning`, not an error.
        """
        root = Path(root)
        if not root.is_dir():
            raise BundleNotFoundError(f"bundle directory {str(root)!r} does not exist")
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise IncompleteBundleError(
                f"{str(root)!r} has no {MANIFEST}: not a bundle, or an interrupted conversion")
        try:
            data = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError("<root>", f"not valid JSON: {exc}") from exc
        bundle = cls(root, Manifest.from_json(data))
        if verify != "none":
            bundle.verify(verify, progress)
        if expected_template_sha256 is not None:
            bundle.check_template(expected_template_sha256)
        return bundle

    def path(self, relpath: str) -> Path:
        if relpath not in self.manifest.files:
            raise MissingFileError(relpath)
        return self.root / relpath

    def loaded_bytes(self, npu_graphs: bool, npu_matmul_experts: bool = False) -> int:
        """What loading the bundle brings into memory: every file but the stage graphs the
        runtime leaves on disk. An rk3588 bundle holds each stage twice, as ``.rknn`` for
        the NPU and as its ONNX twin for a host's mock; ``npu_graphs`` says which is read.
        The routed experts' int8 copy counts only when it is loaded (``npu_matmul_experts``:
        the memory plan's choice)."""
        unused: set[str] = set()
        copy = self.manifest.npu_matmul_experts
        if copy is not None and not npu_matmul_experts:
            unused.update(copy.layers.values())
        for spec in self.manifest.stages.values():
            if spec.rknn is not None:
                unused.add(spec.onnx if npu_graphs else spec.rknn)
        return sum(entry.size for rel, entry in self.manifest.files.items()
                   if rel not in unused and not any(rel.startswith(u + ".") for u in unused))

    def verify(self, mode: VerifyMode = "full",
               progress: Callable[[int], None] | None = None) -> None:
        """Check every manifest file; a typed error names the first bad one.

        Boards run from SD cards and eMMC, where a copy or a write can corrupt bytes
        silently, so the serving default is ``stamped``: a full sha256 check whose success
        is remembered per file (size, mtime, ctime, device, inode), so restarting an
        unchanged bundle costs one ``stat`` per file and any write, copy or replacement
        since is hashed again. What it cannot see is rot on the medium after a successful
        check with no write at all; ``full`` hashes every start. The stamp lives next to the
        manifest, or where the bundle directory is read-only (the systemd unit mounts it
        so) in ``$STATE_DIRECTORY``, ``$LING3_RKNN_STATE_DIR`` or ``~/.cache/ling3-rknn``.
        """
        keys: dict[str, list[int]] = {}
        for rel, entry in self.manifest.files.items():
            p = self.root / rel
            if not p.is_file():
                raise MissingFileError(rel)
            st = p.stat()
            if st.st_size != entry.size:
                raise FileCorruptError(rel, "size", entry.size, st.st_size)
            # ctime cannot be set back by a user (unlike mtime), dev + ino name the file
            keys[rel] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]
        if mode not in ("full", "stamped"):
            return
        trusted = self._read_stamp() if mode == "stamped" else {}
        todo = [rel for rel in keys if trusted.get(rel) != keys[rel]]
        if todo:
            self._hash_files(todo, progress)
        if mode == "stamped" and todo:
            self._write_stamp(keys)

    def _hash_files(self, rels: list[str], progress: Callable[[int], None] | None) -> None:
        total = sum(self.manifest.files[r].size for r in rels)
        done, started, last = 0, time.monotonic(), time.monotonic()

        def count(n: int) -> None:
            nonlocal done, last
            done += n
            if progress is not None:
                progress(n)
            if time.monotonic() - last >= _PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("verifying bundle %s: %.0f / %.0f MiB", self.root.name,
                         done / 2**20, total / 2**20)

        for rel in rels:
            entry = self.manifest.files[rel]
            digest = sha256_file(self.root / rel, count)
            if digest != entry.sha256:
                raise FileCorruptError(rel, "sha256", entry.sha256, digest)
        log.info("bundle %s: sha256 of %d files (%.0f MiB) verified in %.1f s", self.root.name,
                 len(rels), total / 2**20, time.monotonic() - started)

    def _manifest_digest(self) -> str:
        return hashlib.sha256((self.root / MANIFEST).read_bytes()).hexdigest()

    def _stamp_paths(self) -> list[Path]:
        """Where a stamp may live: beside the manifest, then a state directory named for
        this bundle's real path (one stamp per bundle, however many are installed)."""
        name = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:16]
        return [self.root / STAMP, state_directory() / f"verified-{name}.json"]

    def _read_stamp(self) -> dict[str, list[int]]:
        """Files an earlier full check verified, keyed by their stat; empty when no stamp
        is readable or it belongs to another manifest."""
        digest = self._manifest_digest()
        for path in self._stamp_paths():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("manifest_sha256") == digest:
                    return {str(k): list(v) for k, v in data["files"].items()}
            except (OSError, ValueError, AttributeError, KeyError, TypeError):
                continue
        return {}

    def _write_stamp(self, keys: dict[str, list[int]]) -> None:
        """Atomic; with no writable place the next start just hashes again."""
        body = json.dumps({"manifest_sha256": self._manifest_digest(), "files": keys})
        for path in self._stamp_paths():
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(body, encoding="utf-8")
                os.replace(tmp, path)
                return
            except OSError:
                tmp.unlink(missing_ok=True)
        log.info("bundle %s: no writable place for the verification stamp; the next start "
                 "hashes again", self.root.name)

    def check_template(self, expected_sha256: str) -> bool:
        actual = self.manifest.chat_template_sha256
        if actual == expected_sha256:
            return True
        msg = (f"bundle {self.root.name!r} carries chat template sha256 {actual} but the "
               f"renderer implements {expected_sha256}; prompts may not match what the model "
               "was trained on")
        log.warning(msg)
        warnings.warn(msg, TemplateMismatchWarning, stacklevel=2)
        return False
