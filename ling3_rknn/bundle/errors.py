"""Every way a bundle can be wrong, as a typed error that names the file or key."""

from __future__ import annotations

from .format import FORMAT_VERSION, READABLE_FORMAT_VERSIONS


class BundleError(Exception):
    """Base of every bundle problem."""


class BundleNotFoundError(BundleError):
    pass


class IncompleteBundleError(BundleError):
    """No manifest: not a bundle, or a conversion that never finished."""


class ManifestError(BundleError):
    """manifest.json is not valid JSON or violates the schema; ``key`` names the spot."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"manifest.json: {key}: {message}")
        self.key = key


class FormatVersionError(BundleError):
    def __init__(self, found: object) -> None:
        hint = ("written by a newer ling3-rknn; upgrade the runtime"
                if isinstance(found, int) and found > FORMAT_VERSION
                else "re-convert the checkpoint with this version")
        super().__init__(f"bundle format version {found!r} is not supported "
                         f"(this runtime reads versions "
                         f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}): {hint}")
        self.found = found


class MissingFileError(BundleError):
    def __init__(self, relpath: str) -> None:
        super().__init__(f"bundle file {relpath!r} listed in the manifest is missing")
        self.relpath = relpath


class FileCorruptError(BundleError):
    """A file's size or sha256 differs from the manifest."""

    def __init__(self, relpath: str, what: str, expected: object, actual: object) -> None:
        super().__init__(f"bundle file {relpath!r}: {what} is {actual}, manifest says {expected}")
        self.relpath = relpath


class BundleExistsError(BundleError):
    pass


class TemplateMismatchWarning(UserWarning):
    """The bundle's chat template is not the one the renderer implements."""
