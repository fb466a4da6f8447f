"""The decode kernels' C ABI as Python reads it from ``native_abi.h``, its one declaration.

The header is the single source: the C files include it, so the compiler rejects a
definition that differs from its prototype, and this module derives the ctypes argument
and result types, the ABI version and the layout constants from the same text. Why a
header read here rather than cffi's ABI mode (which parses a ``cdef`` the same way): no
extra package on the board, and ctypes calls take the arrays' addresses as plain integers,
with the GIL released during a call (the glue's split threads rely on that), as before.
The reader accepts only the small subset the header is written in and refuses anything
else loudly, so a new type cannot be bound wrongly by accident.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

HEADER = Path(__file__).with_name("native_abi.h")

_SCALARS: dict[str, Any] = {
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_QUALIFIERS = {"const", "restrict"}
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)\s+(-?\d+)\s*$", re.MULTILINE)
_PROTOTYPE = re.compile(r"^(?P<result>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<params>[^()]*)\)$")


class AbiError(ValueError):
    """``native_abi.h`` holds something this reader does not bind."""


@dataclass(frozen=True)
class Function:
    """One prototype: the C types as written, and the ctypes they bind to."""

    name: str
    result: str
    params: tuple[tuple[str, str], ...]  # (C type, parameter name)

    @property
    def restype(self) -> Any:
        return _ctype(self.result, result=True)

    @property
    def argtypes(self) -> list[Any]:
        return [_ctype(kind) for kind, _ in self.params]


@dataclass(frozen=True)
class Abi:
    """Everything ``native_abi.h`` declares."""

    version: int
    constants: dict[str, int]
    functions: dict[str, Function]

    def bind(self, library: Any) -> None:
        """Set every declared function's ctypes signature on ``library`` (a ``ctypes.CDLL``).
        Raises AttributeError when the library lacks one."""
        for fn in self.functions.values():
            symbol = getattr(library, fn.name)
            symbol.argtypes = fn.argtypes
            symbol.restype = fn.restype


def _ctype(kind: str, result: bool = False) -> Any:
    if "*" in kind:
        return ctypes.c_char_p if result and kind.replace(" ", "") == "char*" else ctypes.c_void_p
    if kind == "void" and result:
        return None
    try:
        return _SCALARS[kind]
    except KeyError:
        raise AbiError(f"native_abi.h: no binding for the C type {kind!r}") from None


def _normalise(words: str) -> str:
    """A C type without qualifiers, pointers written as one ``*`` each: ``const void *const *``
    -> ``void **``."""
    spaced = words.replace("*", " * ")
    kept = [w for w in spaced.split() if w not in _QUALIFIERS]
    base = " ".join(w for w in kept if w != "*")
    stars = kept.count("*")
    return base + (" " + "*" * stars if stars else "")


def _param(text: str) -> tuple[str, str]:
    match = re.fullmatch(r"(?P<kind>[\w\s*]+?)\s*\b(?P<name>\w+)", text.strip())
    if match is None:
        raise AbiError(f"native_abi.h: cannot read the parameter {text.strip()!r}")
    kind = _normalise(match["kind"])
    _ctype(kind)  # refuse an unbound type here, with its name
    return kind, match["name"]


def parse(text: str) -> Abi:
    """The declarations of a header written in ``native_abi.h``'s subset."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    constants = {name: int(value) for name, value in _DEFINE.findall(text)}
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    functions: dict[str, Function] = {}
    for statement in code.split(";"):
        statement = " ".join(statement.split())
        if not statement:
            continue
        match = _PROTOTYPE.match(statement)
        if match is None:
            raise AbiError(f"native_abi.h: not a prototype: {statement!r}")
        params_text = match["params"].strip()
        params = () if params_text in ("", "void") else tuple(
            _param(p) for p in params_text.split(","))
        result = _normalise(match["result"])
        _ctype(result, result=True)
        functions[match["name"]] = Function(match["name"], result, params)
    if "LING3_NATIVE_ABI" not in constants:
        raise AbiError("native_abi.h: no LING3_NATIVE_ABI version")
    return Abi(constants["LING3_NATIVE_ABI"], constants, functions)


@cache
def abi() -> Abi:
    """The package's own ``native_abi.h``, read once."""
    return parse(HEADER.read_text())
