"""The product path end to end over HTTP: a converted bundle (int4 QMoE experts, stage
graphs on the RKNNLite mock) loaded by ``serve --bundle``'s own loader, run by the real
engine, served by the real server and driven by the official openai SDK.

Also pins what the loader takes from the bundle: the sampling defaults of its generation
config (here greedy, so requests that set no temperature repeat exactly) and its identity,
under which the persisted prefix cache survives a restart.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
from conftest import FIXTURES
from engine_tiny_model import make_tiny_checkpoint
from server_harness import running_server

from convert.converter import ConvertOptions, convert
from ling3_rknn.cli import build_parser, make_loader

TOKENIZER = FIXTURES / "tokenizer" / "compact" / "tokenizer.json"
MODEL = "ling-3.0-tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Open the README and summarise it."},
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bundle-e2e")
    hf = make_tiny_checkpoint(tmp / "hf")
    shutil.copyfile(TOKENIZER, hf / "tokenizer.json")
    (hf / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    convert(hf, tmp / "bundle", ConvertOptions(chunk=16, block_size=16, build_rknn=False,
                                               progress=False))
    return tmp / "bundle"


def loader(bundle, cache_dir):
    args = build_parser().parse_args(
        ["serve", "--bundle", str(bundle), "--cache-dir", str(cache_dir), "--max-context", "512"]
    )
    return make_loader(args)


async def ask(client: openai.AsyncOpenAI, **extra):
    return await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=10, **extra
    )


@pytest.mark.filterwarnings("ignore::ling3_rknn.bundle.TemplateMismatchWarning")
async def test_bundle_served_over_http_with_cache_that_survives_restart(bundle, tmp_path):
    cache_dir = tmp_path / "cache"
    async with running_server(loader=loader(bundle, cache_dir)) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            for _ in range(600):  # the loader runs in a thread; /health turns 200 when ready
                if srv.holder.engine is not None:
                    break
                await asyncio.sleep(0.05)
            first = await ask(client)
            second = await ask(client)
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=10, stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
        finally:
            await client.close()
        await asyncio.to_thread(srv.holder.engine.close)

    # No temperature in the request: the bundle's generation config (greedy) applies.
    assert first.choices[0].message == second.choices[0].message
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert list(cache_dir.iterdir()), "the prefix cache was persisted on shutdown"

    async with running_server(loader=loader(bundle, cache_dir)) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            for _ in range(600):
                if srv.holder.engine is not None:
                    break
                await asyncio.sleep(0.05)
            again = await ask(client)
        finally:
            await client.close()
        await asyncio.to_thread(srv.holder.engine.close)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].message == first.choices[0].message
