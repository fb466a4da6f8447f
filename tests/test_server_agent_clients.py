"""opencode's and pi's own client libraries against the running server.

``tests/server_clients/agent_clients.mjs`` drives the server with the Vercel AI SDK's
``@ai-sdk/openai-compatible`` provider (opencode's path: zod-validated chunks, tool-call
tracker, reasoning, usage) and ``@mariozechner/pi-ai`` (pi's path: developer role, store,
max_completion_tokens, reasoning_effort, overflow detection). The scripted engine supplies
the model text in scenario order. Needs Node 20+ and ``npm ci`` in that folder
(``make agent-clients``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from scripted_engine import ONE_CALL, ScriptedEngine
from server_harness import running_server

CLIENTS = Path(__file__).resolve().parent / "server_clients"
NODE = shutil.which("node")

TWO_CALLS = [
    "Both files.</think>",
    "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>",
    "\n<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>b.py</arg_value>\n</tool_call>",
]

pytestmark = [
    pytest.mark.npm,
    pytest.mark.skipif(
        NODE is None or not (CLIENTS / "node_modules" / "ai").exists(),
        reason="needs node and `make agent-clients` (npm ci in tests/server_clients)",
    ),
]


async def run_clients(engine: ScriptedEngine) -> tuple[dict[str, dict], list[str]]:
    async with running_server(engine) as srv:
        process = await asyncio.create_subprocess_exec(
            NODE,
            str(CLIENTS / "agent_clients.mjs"),
            srv.v1,
            cwd=CLIENTS,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    results = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    prompts = ["".join(s.text for s in r.prompt) for r in engine.requests]
    return {r.pop("scenario"): r for r in results}, prompts


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
