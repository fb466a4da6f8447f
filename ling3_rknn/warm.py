"""``ling3-rknn warm``: replay recorded requests against a running server, so the prefix cache
holds their prompts before the first real session.

An agent's first request after an install is its longest wait: opencode's is 16.6K tokens,
all of it evaluated cold. Every later session of the same agent sends the same system prompt
and tools and is served from the prefix cache (docs/serving.md, prefix cache); with
``serve --cache-dir`` that cache persists across restarts. Replaying the agent's recorded
first request once (answer capped at one token) moves the cold evaluation to install time.

The requests are chat-completions bodies as a client sent them: one JSON object per file, or
one per line (JSONL). Each is sent with ``max_tokens`` 1 and no streaming; everything else
(messages, tools, reasoning switches, model) as recorded, since any change to what the
template renders would warm a different prefix. The standard library's HTTP client: the
command sends a handful of sequential requests and needs no event loop.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DROPPED = ("stream", "stream_options", "max_completion_tokens", "n")


class WarmError(ValueError):
    """A request file that is not a chat request, or a server that refused one."""


@dataclass(frozen=True)
class Warmed:
    source: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float


def load_requests(paths: Sequence[Path]) -> list[tuple[str, dict[str, Any]]]:
    """(label, body) for every request in ``paths``; a file holds one JSON object or JSONL."""
    requests = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WarmError(f"{path}: cannot read: {exc}") from None
        try:
            bodies = [json.loads(text)]  # one object (a pretty-printed file included)
        except ValueError:
            try:
                bodies = [json.loads(line) for line in text.splitlines() if line.strip()]
            except ValueError as exc:
                raise WarmError(f"{path}: not JSON or JSONL: {exc}") from None
        for i, body in enumerate(bodies, 1):
            label = f"{path}" if len(bodies) == 1 else f"{path}:{i}"
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise WarmError(f"{label}: not a chat-completions request (no messages list)")
            requests.append((label, body))
    if not requests:
        raise WarmError("no requests to replay")
    return requests


def replay_body(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The recorded body as it is replayed: one answer token, no stream."""
    out = {k: v for k, v in body.items() if k not in DROPPED}
    out["max_tokens"] = 1
    if model is not None:
        out["model"] = model
    return out


def warm(base_url: str, requests: Sequence[tuple[str, dict[str, Any]]], *,
         api_key: str | None = None, model: str | None = None, timeout: float = 3600.0
         ) -> list[Warmed]:
    """POST each request to ``base_url``'s /v1/chat/completions, one after another."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    done = []
    for label, body in requests:
        data = json.dumps(replay_body(body, model)).encode()
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:500]
            raise WarmError(f"{label}: the server answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise WarmError(f"{label}: no answer from {url}: {exc}") from None
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        done.append(Warmed(label, int(usage.get("prompt_tokens", 0)),
                           int(details.get("cached_tokens", 0)), time.perf_counter() - t0))
    return done


def run_warm(url: str, files: Sequence[Path], api_key: str | None, model: str | None) -> int:
    """The CLI: replay, print one line per request; exit 0, or 2 with one line on error."""
    try:
        results = warm(url, load_requests(files), api_key=api_key, model=model)
    except WarmError as exc:
        print(f"ling3-rknn warm: {exc}")
        return 2
    for r in results:
        print(f"{r.source}: {r.prompt_tokens} prompt tokens, {r.cached_tokens} already cached, "
              f"{r.seconds:.1f} s")
    return 0
