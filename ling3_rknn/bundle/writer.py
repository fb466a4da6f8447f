"""Writing a bundle all-or-nothing; used only by the host converter.

:class:`BundleWriter` fills a hidden temporary directory next to the target and renames
it into place only after ``manifest.json`` - written last - is complete, so an
interrupted conversion never leaves a directory that looks valid.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import BundleError, BundleExistsError, MissingFileError
from .format import FORMAT, FORMAT_VERSION, MANIFEST
from .json_reader import check_relpath
from .manifest import Manifest
from .reader import sha256_file

_JOURNAL = ".journal.jsonl"  # resumable conversions only; never part of a bundle


class BundleWriter:
    """Builds a bundle in a hidden directory next to ``target``; :meth:`commit` hashes
    every file, writes the manifest last and renames the directory into place.

    Without ``resume`` the work directory is ``.<name>.partial-<id>`` and leaving the
    ``with`` block without committing removes it. With ``resume`` it is ``.<name>.partial``
    and survives a failure: files completed through :meth:`write_bytes`, :meth:`copy_file`
    or :meth:`record` are journaled (size, mtime, sha256), :meth:`done` tells the converter
    what it can skip on the next run, and anything unjournaled (half-written when the
    process died) is deleted on re-entry.
    """

    def __init__(self, target: str | os.PathLike[str], overwrite: bool = False,
                 resume: bool = False) -> None:
        self.target = Path(target)
        self.overwrite = overwrite
        self.resume = resume
        suffix = "partial" if resume else f"partial-{uuid.uuid4().hex[:8]}"
        self.workdir = self.target.parent / f".{self.target.name}.{suffix}"
        self._journal: dict[str, dict[str, Any]] = {}
        self._committed = False

    @property
    def _journal_path(self) -> Path:
        return self.workdir / _JOURNAL

    def __enter__(self) -> BundleWriter:
        if self.target.exists() and not self.overwrite:
            raise BundleExistsError(f"{str(self.target)!r} exists; pass overwrite to replace it")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.resume and self.workdir.is_dir():
            self._load_journal()
        else:
            self.workdir.mkdir()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed and not self.resume:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _load_journal(self) -> None:
        entries: dict[str, dict[str, Any]] = {}
        if self._journal_path.is_file():
            for line in self._journal_path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    entries[entry["path"]] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn last line from a crash
        for rel, entry in list(entries.items()):
            p = self.workdir / rel
            st = p.stat() if p.is_file() else None
            if st is None or st.st_size != entry["size"] or st.st_mtime_ns != entry["mtime_ns"]:
                del entries[rel]
        for p in self._files():
            rel = p.relative_to(self.workdir).as_posix()
            if rel not in entries:
                p.unlink()
        self._journal = entries
        with open(self._journal_path, "w", encoding="utf-8") as f:
            for entry in entries.values():
                f.write(json.dumps(entry) + "\n")

    def _files(self) -> list[Path]:
        return [p for p in sorted(self.workdir.rglob("*"))
                if p.is_file() and p.name != _JOURNAL]

    def done(self, relpath: str) -> bool:
        """Whether ``relpath`` was completed (and journaled) by this or an earlier run."""
        return relpath in self._journal

    def record(self, relpath: str, progress: Callable[[int], None] | None = None) -> None:
        """Mark a file written through :meth:`path` as complete."""
        p = self.workdir / check_relpath(relpath, relpath)
        if not p.is_file():
            raise MissingFileError(relpath)
        st = p.stat()
        entry = {"path": relpath, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                 "sha256": sha256_file(p, progress)}
        self._journal[relpath] = entry
        with open(self._journal_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def path(self, relpath: str) -> Path:
        """Where to write ``relpath`` (parent directories are created)."""
        p = self.workdir / check_relpath(relpath, relpath)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_bytes(self, relpath: str, data: bytes) -> Path:
        p = self.path(relpath)
        p.write_bytes(data)
        self.record(relpath)
        return p

    def copy_file(self, relpath: str, src: str | os.PathLike[str]) -> Path:
        p = self.path(relpath)
        shutil.copyfile(src, p)
        self.record(relpath)
        return p

    def commit(self, manifest: Manifest | Mapping[str, Any],
               progress: Callable[[int], None] | None = None) -> Path:
        """``manifest``: the typed :class:`Manifest` (its ``files`` are computed here and
        replace whatever it holds), or the same as JSON without ``format``,
        ``format_version`` and ``files``. Validated with the loader's parser before
        anything is renamed, so a committed bundle always opens."""
        if isinstance(manifest, Manifest):
            manifest = {k: v for k, v in manifest.to_json().items()
                        if k not in ("format", "format_version", "files")}
        files = {}
        for p in self._files():
            rel = p.relative_to(self.workdir).as_posix()
            if rel == MANIFEST:
                raise BundleError(f"{MANIFEST} is written by commit()")
            # safetensors writes 0600; a bundle is read by another user (the service).
            p.chmod(0o644)
            st = p.stat()
            known = self._journal.get(rel)
            if known is not None and (known["size"], known["mtime_ns"]) == (st.st_size,
                                                                         st.st_mtime_ns):
                files[rel] = {"size": st.st_size, "sha256": known["sha256"]}
            else:
                files[rel] = {"size": st.st_size, "sha256": sha256_file(p, progress)}
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": files}
        parsed = Manifest.from_json(json.loads(json.dumps(body)))  # schema check, no side effects
        manifest_path = self.workdir / MANIFEST
        tmp = manifest_path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(parsed.to_json(), f, indent=1, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, manifest_path)
        manifest_path.chmod(0o644)
        for d in (self.workdir, *(q for q in self.workdir.rglob("*") if q.is_dir())):
            d.chmod(0o755)
        self._journal_path.unlink(missing_ok=True)
        old = None
        if self.target.exists():
            if not self.overwrite:
                raise BundleExistsError(f"{str(self.target)!r} appeared during conversion")
            old = self.target.parent / f".{self.target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.target, old)
        os.replace(self.workdir, self.target)
        self._committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.target
