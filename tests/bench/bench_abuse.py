"""One careless client against `ling3-rknn serve` (the demo, in its own process, under
`ulimit -n 4096` like the unit's LimitNOFILE): for each attack, another client's worst
/health latency while it runs, the server's RSS before and after, and its warning lines.

Attacks: a 15 MB prompt; two 6 MB prompts at once; an enum checked against `^(a+)+$`
(a forced call, and a lenient tool under parallel_tool_calls false); 2,000 tools; 4,200
connections that send half a request's headers and stop; count_tokens on 15 MB, eight
4 MB counts beside a chat, three 15 MB counts whose clients hang up, 100k image blocks;
two 6 MB prompts on Messages and on Responses; ten clients leaving part way through
their body.

    .venv/bin/python tests/bench/bench_abuse.py [ATTACK ...]
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

MODEL = "ling-3.0-tiny-demo"
Attack = Callable[[str, int], Awaitable[Any]]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Server:
    """`serve` in its own process; counts its warning/error lines and tracebacks."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LING3_RKNN_API_KEY"}
        env["PYTHONUNBUFFERED"] = "1"
        self.process = subprocess.Popen(
            ["bash", "-c", f"ulimit -n 4096 && exec {sys.executable} -m ling3_rknn.cli serve "
                           "--port 0"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.warnings = self.tracebacks = 0
        self.port = 0

    async def start(self) -> str:
        assert self.process.stderr is not None
        while not self.port:
            line = await asyncio.to_thread(self.process.stderr.readline)
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
            elif not line and self.process.poll() is not None:
                raise SystemExit("the server exited")
        threading.Thread(target=self._drain, daemon=True).start()
        base = f"http://127.0.0.1:{self.port}"
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(base + "/health") as r:
                    if r.status == 200:
                        return base
                await asyncio.sleep(0.1)

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.warnings += "WARNING" in line or "ERROR" in line
            self.tracebacks += "Traceback" in line

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)


async def watch(base: str, stop: asyncio.Event, out: dict[str, float]) -> None:
    """/health every 50 ms; latency from when the client meant to ask."""
    out.update(worst=0.0, polls=0, failures=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        due = time.monotonic()
        while not stop.is_set():
            try:
                async with session.get(base + "/health") as r:
                    await r.read()
            except (aiohttp.ClientError, TimeoutError):
                out["failures"] += 1
            done = time.monotonic()
            out["worst"] = max(out["worst"], done - due)
            out["polls"] += 1
            due = done + 0.05
            await asyncio.sleep(0.05)


async def run(name: str, attack: Attack) -> None:
    server = Server()
    base = await server.start()
    before = rss_mb(server.process.pid)
    stop, health = asyncio.Event(), {}
    watcher = asyncio.create_task(watch(base, stop, health))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    result = await attack(base, server.port)
    took = time.monotonic() - started
    await asyncio.sleep(0.5)
    stop.set()
    await watcher
    after = rss_mb(server.process.pid)
    server.stop()
    print(f"{name}: {result}; attack {took:.1f} s; other client's /health worst "
          f"{health['worst']:.2f} s over {health['polls']} polls ({health['failures']} failed); "
          f"RSS {before:.0f} -> {after:.0f} MB; warning lines {server.warnings}, "
          f"tracebacks {server.tracebacks}", flush=True)


async def post(base: str, body: dict[str, Any], path: str = "/v1/chat/completions"
               ) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with (aiohttp.ClientSession(timeout=timeout) as session,
                session.post(base + path, data=json.dumps(body),
                             headers={"Content-Type": "application/json"}) as r):
        answer = await r.json()
        if r.status == 200 and "input_tokens" in answer:
            return r.status, answer["input_tokens"]
        error = answer.get("error") or {}
        return r.status, (error.get("code") or error.get("param")
                          or str(error.get("message", ""))[:60])


def messages(content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **extra}


def regex_tool(value: str, pattern: str, **extra: Any) -> dict[str, Any]:
    parameters = {"type": "object", "required": ["x"], "properties": {
        "x": {"type": "string", "enum": [value], "pattern": pattern}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return chat("hi", tools=[tool], **extra)


async def one_big(base: str, port: int) -> Any:
    return await post(base, chat("abcd " * 3_000_000))


async def two_6mb(base: str, port: int) -> Any:
    body = chat("abcd " * 1_200_000)
    return await asyncio.gather(post(base, body), post(base, body))


async def regex27(base: str, port: int) -> Any:
    return await post(base, regex_tool("a" * 27 + "!", "^(a+)+$", tool_choice="required"))


async def regex_auto(base: str, port: int) -> Any:
    return await post(base, regex_tool("a" * 27 + "!", "^(a+)+$", parallel_tool_calls=False))


async def tools2000(base: str, port: int) -> Any:
    parameters = {"type": "object", "properties": {"a": {"type": "string"},
                                                   "b": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": parameters}}
             for i in range(2000)]
    return await post(base, chat("hi", tools=tools, tool_choice="required"))


async def count_15mb(base: str, port: int) -> Any:
    return await post(base, messages("abcd " * 3_000_000), "/v1/messages/count_tokens")


async def count_8x4mb(base: str, port: int) -> Any:
    """Eight 4 MB counts at once, and another client's 4-token chat meanwhile."""
    body = messages("abcd " * 800_000)
    counts = [asyncio.ensure_future(post(base, body, "/v1/messages/count_tokens"))
              for _ in range(8)]
    started = time.monotonic()
    chat_answer = await post(base, chat("hi"))
    chat_s = time.monotonic() - started
    return (f"counts {await asyncio.gather(*counts)}; a chat meanwhile {chat_answer} in "
            f"{chat_s:.2f} s")


async def count_hangups(base: str, port: int) -> str:
    """Three clients send a 15 MB count and hang up 0.3 s later."""
    raw = json.dumps(messages("abcd " * 3_000_000)).encode()
    head = (f"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode()
    writers = []
    for _ in range(3):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + raw)
        writers.append(writer)
    await asyncio.sleep(0.3)
    for writer in writers:
        writer.close()
    return "3 clients left 0.3 s after sending"


async def count_images(base: str, port: int) -> Any:
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": ""}}] * 100_000
    return await post(base, {"model": MODEL, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": blocks}]}]}, "/v1/messages/count_tokens")


async def messages_6mb(base: str, port: int) -> Any:
    body = messages("abcd " * 1_200_000, max_tokens=2)
    return await asyncio.gather(post(base, body, "/v1/messages"),
                                post(base, body, "/v1/messages"))


async def responses_6mb(base: str, port: int) -> Any:
    body = {"model": MODEL, "input": "abcd " * 1_200_000, "max_output_tokens": 2}
    return await asyncio.gather(post(base, body, "/v1/responses"),
                                post(base, body, "/v1/responses"))


async def body_hangups(base: str, port: int) -> str:
    """Ten clients announce 100 KB, send 10 bytes and close (logged as 500s before)."""
    for _ in range(10):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                     b'{"model": ')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
    return "10 clients left part way through their body"


async def slowloris(base: str, port: int) -> str:
    streams = []
    for _ in range(4200):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        streams.append((reader, writer))
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as r:
        during = r.status
    answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 30) for r, _ in streams),
                                   return_exceptions=True)
    refused = sum(isinstance(a, bytes) and a.startswith(b"HTTP/1.1 503") for a in answers)
    closed = sum(a == b"" for a in answers)
    errors: dict[str, int] = {}
    for a in answers:
        if isinstance(a, BaseException):
            errors[type(a).__name__] = errors.get(type(a).__name__, 0) + 1
    for _, writer in streams:
        writer.close()
    async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as r:
        after = r.status
    return (f"{len(streams)} sockets: {refused} got a 503 at once, {closed} closed at the "
            f"header deadline (all within {time.monotonic() - started:.1f} s), errors {errors}; "
            f"a new client during the attack got {during}, after it {after}")


ATTACKS: dict[str, Attack] = {
    "one_big": one_big, "two_6mb": two_6mb, "regex27": regex27, "regex_auto": regex_auto,
    "tools2000": tools2000, "slowloris": slowloris,
    "count_15mb": count_15mb, "count_8x4mb": count_8x4mb, "count_hangups": count_hangups,
    "count_images": count_images, "messages_6mb": messages_6mb,
    "responses_6mb": responses_6mb, "body_hangups": body_hangups,
}


async def main() -> None:
    for name in sys.argv[1:] or list(ATTACKS):
        await run(name, ATTACKS[name])


if __name__ == "__main__":
    asyncio.run(main())
