"""Static checks of ``deploy/haproxy.cfg`` that need no haproxy binary (the behaviour in
front of real boards is ``test_deploy_haproxy.py``, skipped where haproxy is missing)."""

from __future__ import annotations

from pathlib import Path

CFG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy.cfg"


def _directives(name: str) -> list[list[str]]:
    lines = (line.split("#", 1)[0].split() for line in CFG.read_text().splitlines())
    return [words[1:] for words in lines if words and words[0] == name]


def test_retries_only_what_no_board_processed():
    """A request is resent to another board only after a failed connection or a 503 (every
    503 the server sends is a refusal before generating). A 500 or a timeout may come from
    a board that already ran the request (and its tools' side effects upstream): never."""
    (retry_on,) = _directives("retry-on")
    assert set(retry_on) == {"conn-failure", "503"}, retry_on
    assert _directives("retries") == [["3"]]
