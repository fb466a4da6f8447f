"""Typed access into manifest JSON that reports the full key path of every error."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal, overload

from .errors import ManifestError


class JsonReader:
    """Typed access into a JSON object that reports the full key path on errors."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise ManifestError(path or "<root>", f"expected an object, got {type(data).__name__}")
        self.data, self.path = data, path

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise ManifestError(self._key(key), "missing")
        value = self.data[key]
        if value is None and optional:
            return None
        # bool is an int subclass; never accept it where a number is meant
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise ManifestError(self._key(key), f"expected {_names(types)}, got bool")
        if not isinstance(value, types):
            raise ManifestError(self._key(key), f"expected {_names(types)}, "
                                                f"got {type(value).__name__}")
        return value

    @overload
    def obj(self, key: str, optional: Literal[False] = False) -> JsonReader: ...

    @overload
    def obj(self, key: str, optional: bool) -> JsonReader | None: ...

    def obj(self, key: str, optional: bool = False) -> JsonReader | None:
        value = self.get(key, dict, optional)
        return None if value is None else JsonReader(value, self._key(key))

    def relpath(self, key: str) -> str:
        return check_relpath(self.get(key, str), self._key(key))

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.get(key, str)
        if value not in allowed:
            raise ManifestError(self._key(key), f"{value!r} is not one of {allowed}")
        return value

    def sha256(self, key: str) -> str:
        value = self.get(key, str)
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ManifestError(self._key(key), "not a lowercase hex sha256")
        return value

    def int_(self, key: str, minimum: int = 0) -> int:
        value = self.get(key, int)
        if value < minimum:
            raise ManifestError(self._key(key), f"must be >= {minimum}, got {value}")
        return value

    def only(self, *keys: str) -> None:
        extra = sorted(set(self.data) - set(keys))
        if extra:
            raise ManifestError(self.path or "<root>", f"unknown keys {extra}")


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple[type, ...]) -> str:
    return "/".join(t.__name__ for t in _as_tuple(types))


def check_relpath(value: str, key: str) -> str:
    p = PurePosixPath(value)
    if not value or p.is_absolute() or ".." in p.parts or "\\" in value or value != str(p):
        raise ManifestError(key, f"{value!r} is not a plain relative path inside the bundle")
    return value


ShapeSets = tuple[tuple[tuple[int, ...], ...], ...]


def shape_sets_of(value: object, key: str, n_inputs: int) -> ShapeSets:
    if not isinstance(value, list) or not value or not all(
        isinstance(group, list) and len(group) == n_inputs and all(
            isinstance(shape, list) and shape and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
            for shape in group)
        for group in value
    ):
        raise ManifestError(key, f"expected a non-empty list of {n_inputs}-input shape sets "
                                 "of positive integers")
    return tuple(tuple(tuple(shape) for shape in group) for group in value)
