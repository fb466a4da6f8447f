"""Agent clients against the running server: opencode's and pi's own client libraries,
and the real Codex CLI (``codex exec``, Responses API) and Claude Code (``claude -p``,
Anthropic Messages API) binaries, pinned in ``tests/server_clients/package-lock.json``.

``tests/server_clients/agent_clients.mjs`` drives the server with the Vercel AI SDK's
``@ai-sdk/openai-compatible`` provider (opencode's path: zod-validated chunks, tool-call
tracker, reasoning, usage) and ``@mariozechner/pi-ai`` (pi's path: developer role, store,
max_completion_tokens, reasoning_effort, overflow detection). The scripted engine supplies
the model text in scenario order. Needs Node 20+ and ``npm ci`` in that folder
(``make agent-clients``); each test is skipped, with the reason, without its client.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from scripted_engine import ONE_CALL, Script, ScriptedEngine
from server_harness import running_server

CLIENTS = Path(__file__).resolve().parent / "server_clients"
NODE = shutil.which("node")

TWO_CALLS = [
    "Both files.</think>",
    "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>",
    "\n<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>b.py</arg_value>\n</tool_call>",
]

pytestmark = pytest.mark.npm  # every test drives a client from npm (make agent-clients)

needs_client_libraries = pytest.mark.skipif(
    NODE is None or not (CLIENTS / "node_modules" / "ai").exists(),
    reason="needs node and `make agent-clients` (npm ci in tests/server_clients)",
)


async def run_clients(engine: ScriptedEngine, group: str = "chat"
                      ) -> tuple[dict[str, dict], list[str]]:
    async with running_server(engine) as srv:
        process = await asyncio.create_subprocess_exec(
            NODE,
            str(CLIENTS / "agent_clients.mjs"),
            srv.v1,
            group,
            cwd=CLIENTS,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    results = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    prompts = ["".join(s.text for s in r.prompt) for r in engine.requests]
    return {r.pop("scenario"): r for r in results}, prompts


@needs_client_libraries
async def test_opencode_and_pi_client_libraries():
    engine = ScriptedEngine()
    engine.push(*ONE_CALL, cached_tokens=7)  # aisdk_stream_tool_call
    engine.push("</think>It prints ", "1.")  # aisdk_stream_tool_result_turn
    engine.push("I should", " greet.</think>Hel", "lo!")  # aisdk_generate_reasoning
    engine.push("x", fail="context")  # aisdk_context_overflow
    engine.push(*TWO_CALLS)  # pi_stream_parallel_calls
    engine.push("x", fail="context")  # pi_context_overflow
    results, prompts = await run_clients(engine)

    call = results["aisdk_stream_tool_call"]
    assert call["errors"] == []
    assert call["finishReason"] == "tool-calls"
    assert call["reasoning"] == "Need the file."
    assert call["text"] == ""
    assert [(c["name"], c["input"]) for c in call["calls"]] == [
        ("read", {"path": "a.py", "limit": 20})
    ]
    assert call["calls"][0]["id"].startswith("call_")
    assert call["cachedInputTokens"] == 7

    turn = results["aisdk_stream_tool_result_turn"]
    assert turn == {"finishReason": "stop", "text": "It prints 1."}
    # opencode's replay of reasoning + call re-renders to exactly what the model wrote.
    assert "<role>ASSISTANT</role>\n<think>" + "".join(ONE_CALL) + "<|role_end|>" in prompts[1]
    assert "<tool_response>\nprint(1)\n</tool_response>" in prompts[1]

    reasoning = results["aisdk_generate_reasoning"]
    assert reasoning == {"finishReason": "stop", "reasoning": "I should greet.", "text": "Hello!"}

    overflow = results["aisdk_context_overflow"]
    assert "maximum context length is 4096 tokens" in overflow["thrown"]

    pi = results["pi_stream_parallel_calls"]
    assert pi["stopReason"] == "toolUse", pi
    assert pi["thinking"] == "Both files."
    assert [(c["name"], c["arguments"]) for c in pi["calls"]] == [
        ("read", {"path": "a.py"}),
        ("read", {"path": "b.py"}),
    ]
    assert {"thinking_delta", "toolcall_end", "done"} <= set(pi["events"])
    assert "You are pi." in prompts[4]  # pi's developer message became the system prompt

    pi_overflow = results["pi_context_overflow"]
    assert pi_overflow["stopReason"] == "error"
    assert pi_overflow["overflow"] is True


@needs_client_libraries
async def test_responses_and_messages_client_libraries():
    """The AI SDK's default OpenAI provider (``@ai-sdk/openai``: the Responses API) and pi's
    ``anthropic-messages`` provider against the other two routes."""
    engine = ScriptedEngine()
    engine.push(*ONE_CALL)  # aisdk_responses_tool_call
    engine.push("I should", " greet.</think>Hel", "lo!")  # aisdk_responses_generate
    engine.push(*TWO_CALLS, cached_tokens=5)  # pi_anthropic_tool_call
    results, prompts = await run_clients(engine, "apis")

    call = results["aisdk_responses_tool_call"]
    assert call["errors"] == []
    assert call["finishReason"] == "tool-calls"
    assert call["reasoning"] == "Need the file."
    assert call["calls"] == [{"name": "read", "input": {"path": "a.py", "limit": 20}}]
    assert results["aisdk_responses_generate"] == {
        "finishReason": "stop", "text": "Hello!", "reasoning": "I should greet."}

    pi = results["pi_anthropic_tool_call"]
    assert pi["stopReason"] == "toolUse", pi
    assert pi["thinking"] == "Both files."
    assert [c["arguments"] for c in pi["calls"]] == [{"path": "a.py"}, {"path": "b.py"}]
    assert pi["cacheRead"] == 5
    assert "You are pi." in prompts[2]


# ---- the real CLIs: Codex CLI (Responses API) and Claude Code (Anthropic Messages API) --

CODEX = CLIENTS / "node_modules" / ".bin" / "codex"
CLAUDE = CLIENTS / "node_modules" / ".bin" / "claude"
CLI_TIMEOUT_S = 180  # start-up of a native CLI on a loaded machine; never a limit asserted


async def run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT_S)
    return process.returncode, out.decode(), err.decode()


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: no user config, no credentials, no proxies."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TMPDIR")}
    return {**keep, "HOME": str(home), "NO_COLOR": "1"}


@pytest.mark.skipif(not CODEX.exists(), reason="needs `make agent-clients` (@openai/codex)")
async def test_codex_exec_runs_a_tool_turn(tmp_path):
    """``codex exec`` with a custom provider on ``wire_api = "responses"``: the model calls
    Codex's own ``exec_command``, Codex runs it and sends back the whole history (the
    reasoning item as ``encrypted_content``), the model answers, Codex exits 0. Turn 2's
    prompt re-renders turn 1 byte for byte, so it is a prefix-cache hit."""
    call = ("I will run it.</think><tool_call>exec_command\n<arg_key>cmd</arg_key>\n"
            "<arg_value>echo ling3-ok</arg_value>\n</tool_call>")
    engine = ScriptedEngine(max_context=200_000)
    engine.push(call[:20], call[20:])
    engine.push("It printed.</think>The command printed ling3-ok.")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    async with running_server(engine) as srv:
        (home / ".codex" / "config.toml").write_text(
            'model = "ling-3.0-tiny"\nmodel_provider = "ling3"\n\n'
            "[model_providers.ling3]\n"
            'name = "ling3-rknn"\n'
            f'base_url = "{srv.v1}"\n'
            'wire_api = "responses"\n')
        rc, out, err = await run_cli(
            [str(CODEX), "exec", "--skip-git-repo-check", "Run echo ling3-ok"],
            {**base_env(home), "CODEX_HOME": str(home / ".codex")}, work)
    assert rc == 0, err[-3000:]
    assert "The command printed ling3-ok." in out
    assert len(engine.requests) >= 2
    turn2 = "".join(s.text for s in engine.requests[1].prompt)
    assert "<role>ASSISTANT</role>\n<think>" + call + "<|role_end|>" in turn2
    assert "<tool_response>" in turn2 and "exec_command" in turn2


@pytest.mark.skipif(not CLAUDE.exists(),
                    reason="needs `make agent-clients` (@anthropic-ai/claude-code)")
async def test_claude_code_print_mode_reads_a_file(tmp_path):
    """``claude -p`` with ``ANTHROPIC_BASE_URL`` at the server: the model calls Claude
    Code's ``Read`` tool, Claude Code sends back the (omitted-display) thinking block and
    the file, the model answers, Claude Code prints it and exits 0."""
    work = tmp_path / "work"
    work.mkdir()
    note = work / "note.txt"
    note.write_text("the secret word is kestrel\n")
    call = ("Read it.</think><tool_call>Read\n<arg_key>file_path</arg_key>\n"
            f"<arg_value>{note}</arg_value>\n</tool_call>")
    engine = ScriptedEngine(max_context=200_000)
    engine.default = Script(pieces=["The word is kestrel."])  # any side request
    engine.push(call)
    engine.push("Got it.</think>The secret word is kestrel.")
    home = tmp_path / "home"
    home.mkdir()
    async with running_server(engine) as srv:
        env = {**base_env(home), "ANTHROPIC_BASE_URL": srv.base, "ANTHROPIC_API_KEY": "none",
               "ANTHROPIC_MODEL": "ling-3.0-tiny",
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": "ling-3.0-tiny",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        rc, out, err = await run_cli([str(CLAUDE), "-p", "What is the secret word in note.txt?"],
                                     env, work)
    assert rc == 0, (out + err)[-3000:]
    assert "kestrel" in out
    prompts = ["".join(s.text for s in r.prompt) for r in engine.requests]
    (turn2,) = [p for p in prompts if "<tool_response>" in p]
    assert "the secret word is kestrel" in turn2
    assert "<think>" + call + "<|role_end|>" in turn2
