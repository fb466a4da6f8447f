"""The client settings the docs show, run as written against the demo server.

The README's opencode and pi snippets are for ``make serve`` (the embedded demo, served as
``ling-3.0-tiny-demo``); the board guide's are for the board service (a bundle, served as
``ling-3.0-tiny``, behind an API key from the environment). Each is taken from the
Markdown, its model id must be one the server lists, and opencode's and pi's own client
libraries (``tests/server_clients/doc_snippets.mjs``) send real requests with it: a 404 for
a wrong id, a missing key or pi's thinking still on with ``--thinking off`` fail here.
Needs node and ``make agent-clients``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from server_harness import running_server

from ling3_rknn.demo import DEMO_MODEL_ID, load_demo_engine
from ling3_rknn.loading import DEFAULT_MODEL_ID, LoadOptions
from ling3_rknn.server import AppConfig

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT / "tests" / "server_clients"
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.npm,
    pytest.mark.skipif(
        NODE is None or not (CLIENTS / "node_modules" / "ai").exists(),
        reason="needs node and `make agent-clients` (npm ci in tests/server_clients)",
    ),
]


def snippets(markdown: Path) -> dict[str, Any]:
    """The opencode.json (has "provider") and pi models.json (has "providers") blocks."""
    found: dict[str, Any] = {}
    for block in re.findall(r"```json\n(.*?)```", markdown.read_text(), re.DOTALL):
        try:
            data = json.loads(block)
        except ValueError:
            continue
        if isinstance(data, dict) and "provider" in data:
            found["opencode"] = data
        elif isinstance(data, dict) and "providers" in data:
            found["pi"] = data
    assert found.keys() == {"opencode", "pi"}, f"{markdown.name}: {sorted(found)}"
    return found


class Recording:
    """The engine, with the prompt of every request kept (to see pi's thinking switch)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.prompts: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, request):
        self.prompts.append("".join(s.text for s in request.prompt))
        return self._engine.generate(request)


async def run_snippets(markdown: Path, model_id: str, api_key: str | None) -> tuple[
        list[dict], list[str], list[str]]:
    """(the clients' results, the ids the server lists, the prompts it got)."""
    docs = snippets(markdown)
    engine = load_demo_engine(LoadOptions(model_id=model_id))
    recording = Recording(engine)
    env = {**os.environ, "LING3_RKNN_API_KEY": api_key or ""}
    try:
        async with running_server(recording, AppConfig(api_key=api_key)) as srv:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            async with aiohttp.ClientSession(headers=headers) as http, http.get(
                    f"{srv.v1}/models") as reply:
                listed = [m["id"] for m in (await reply.json())["data"]]
            process = await asyncio.create_subprocess_exec(
                NODE, str(CLIENTS / "doc_snippets.mjs"), srv.v1, json.dumps(docs), cwd=CLIENTS,
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(process.communicate(), 300)
    finally:
        engine.close()
    assert process.returncode == 0, err.decode()
    results = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return results, listed, recording.prompts


def check(results: list[dict], listed: list[str], prompts: list[str], model_id: str) -> None:
    assert model_id in listed
    opencode = [r for r in results if r["client"] == "opencode"]
    pi = [r for r in results if r["client"] == "pi"]
    assert opencode and pi and {r["id"] for r in results} == {model_id}, results
    for r in opencode:
        assert "thrown" not in r, r
        assert r["npm"] == "@ai-sdk/openai-compatible" and r["finishReason"] in ("stop", "length")
    by_level = {r["thinkingLevel"]: r for r in pi}
    for r in pi:
        assert r["errorMessage"] is None and r["stopReason"] in ("stop", "length"), r
    # pi's --thinking off reaches the server as reasoning_effort "none": thinking off.
    assert by_level["off"]["thinking"] == ""
    assert prompts[-2].endswith("<think></think>"), prompts[-2][-40:]
    assert prompts[-1].endswith("<think>"), prompts[-1][-40:]


async def test_the_readme_snippets_run_against_make_serve():
    results, listed, prompts = await run_snippets(ROOT / "README.md", DEMO_MODEL_ID, None)
    check(results, listed, prompts, DEMO_MODEL_ID)


async def test_the_board_guide_snippets_run_against_the_board_service():
    """The board serves a bundle (``ling-3.0-tiny``) with an API key from the env file."""
    results, listed, prompts = await run_snippets(
        ROOT / "docs" / "board-guide.md", DEFAULT_MODEL_ID, "k3y-from-env")
    check(results, listed, prompts, DEFAULT_MODEL_ID)
