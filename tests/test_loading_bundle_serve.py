"""``serve --bundle`` on a converted bundle: the CLI loader builds the engine from
``Model.from_bundle`` and the bundle's tokenizer, and a chat request generates exactly
what the float numpy model generates (fp16 stage twins + float experts on the mock).

The checkpoint is the tiny 1024-vocabulary model of the engine tests, converted with the
built-in calibration prompts tokenized by the bundle's tokenizer (the default path).
"""

from __future__ import annotations

import shutil

import pytest
from conftest import FIXTURES
from engine_tiny_model import make_tiny_checkpoint

from convert.converter import ConvertOptions, convert
from ling3_rknn.chat import render
from ling3_rknn.cli import build_parser, make_loader
from ling3_rknn.engine import (
    Engine,
    EngineOptions,
    Finished,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from ling3_rknn.model import Model
from ling3_rknn.model.bundle_stages import GraphStages
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = FIXTURES / "tokenizer" / "compact" / "tokenizer.json"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    hf = make_tiny_checkpoint(tmp / "hf")
    shutil.copyfile(TOKENIZER, hf / "tokenizer.json")
    convert(hf, tmp / "bundle", ConvertOptions(chunk=16, experts="fp16", block_size=16,
                                               build_rknn=False, progress=False))
    return hf, tmp / "bundle"


async def generate(engine: Engine, max_tokens: int) -> list[int]:
    messages = [{"role": "user", "content": "Say hello."}]
    events = [e async for e in engine.generate(
        GenerationRequest(render(messages, [], enable_thinking=False), GREEDY,
                          max_tokens=max_tokens))]
    assert isinstance(events[-1], Finished)
    return [i for e in events if isinstance(e, TextDelta) for i in e.token_ids]


@pytest.mark.filterwarnings("ignore::ling3_rknn.bundle.TemplateMismatchWarning")
async def test_serve_bundle_loader_generates_like_the_float_model(paths, monkeypatch) -> None:
    hf, bundle = paths
    loaded: list[Model] = []
    real = Model.from_bundle.__func__

    def spy(cls, path, **kw):
        loaded.append(real(cls, path, **kw))
        return loaded[-1]

    monkeypatch.setattr(Model, "from_bundle", classmethod(spy))
    args = build_parser().parse_args(["serve", "--bundle", str(bundle)])
    engine = make_loader(args)()
    assert isinstance(engine, Engine)
    assert len(loaded) == 1 and isinstance(loaded[0].stages, GraphStages)
    with engine:
        got = await generate(engine, 12)
    ref_engine = Engine(Model.from_hf(hf), Tokenizer.from_file(TOKENIZER),
                        EngineOptions(model_id="x", max_context=2048))
    with ref_engine:
        expected = await generate(ref_engine, 12)
    assert got == expected and len(got) > 0
