"""The routed experts' int8 copy through a bundle: ``convert`` writes it, the manifest lists
it, ``Model.from_bundle(npu_experts=True)`` writes it into NPU memory (the host stand-in of
librknnrt's matmul API) and prefill pieces run on it while decode stays on the CPU copy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ORACLE_FIXTURES
from safetensors.numpy import load_file, save_file
from test_convert_bundle import (
    CPU_QUANT_MAX_KL,
    CPU_QUANT_MIN_TOP1,
    QUANT_POSITIONS,
    make_bundle,
)

from ling3_rknn.bundle import Bundle
from ling3_rknn.model import Model
from ling3_rknn.npu import ExpertError
from ling3_rknn.npu.matmul_experts import NpuLayerExperts, padded_sizes
from ling3_rknn.npu.matmul_plan import MatmulError

FIXTURE = ORACLE_FIXTURES[0]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """fp16 stages and fp16 (float) CPU experts, so the NPU's int8 copy is the only
    quantization between the two paths; the copy is written by default for rk3588."""
    tmp = tmp_path_factory.mktemp("npu-experts")
    return make_bundle(tmp, FIXTURE, "b", quant="fp16", experts="fp16", npu_budget=0)


def _model(path: Path, **kw) -> Model:
    try:
        return Model.from_bundle(path, executor="mock", **kw)
    except MatmulError as exc:  # no C compiler: conftest could not build the stand-in
        pytest.skip(f"the matmul stand-in is not built: {exc}")


def test_convert_writes_the_int8_copy_beside_the_cpu_one(bundle) -> None:
    m = Bundle.open(bundle, verify="full").manifest
    spec = m.npu_matmul_experts
    cfg = m.model_config
    moe = sorted(m.experts.layers)
    assert spec is not None and spec.format == "int8" and sorted(spec.layers) == moe
    dp, ip = padded_sizes(cfg["hidden_size"], cfg["moe_intermediate_size"])
    tensors = load_file(bundle / spec.layers[moe[0]])
    assert tensors["gate_up"].dtype == np.int8
    assert tensors["gate_up"].shape == (cfg["num_experts"], dp, 2 * ip)
    assert tensors["down"].shape == (cfg["num_experts"], ip, dp)
    assert m.npu_matmul_expert_bytes() == sum(m.files[r].size for r in spec.layers.values())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_prefill_runs_on_the_npu_copy_and_decode_on_the_cpu(bundle) -> None:
    cpu = _model(bundle)
    npu = _model(bundle, npu_experts=True)
    assert cpu.npu_matmul_experts is None and npu.npu_matmul_experts is not None
    calls: list[tuple[int, float]] = []

    def spy(layer: int, ex: NpuLayerExperts):
        run, float_experts = ex.run, npu.experts._cpu[layer]

        def checked(x, i, w):
            got, want = run(x, i, w), float_experts.run(x, i, w)
            calls.append((len(x), float(np.linalg.norm(got - want) / np.linalg.norm(want))))
            return got
        return checked

    for layer, ex in npu.experts.prefill.items():
        assert isinstance(ex, NpuLayerExperts)
        ex.run = spy(layer, ex)
    ids = np.random.default_rng(11).integers(2, 256, QUANT_POSITIONS)
    state_n, state_c = npu.new_state(), cpu.new_state()
    got, want = npu.forward(ids, state_n), cpu.forward(ids, state_c)
    assert calls and len(calls) % len(npu.experts.prefill) == 0
    assert min(n for n, _ in calls) >= 32
    # every layer on the model's own hidden states: within twice the int8 arithmetic's
    # typical error (~1.4 %: four roundings of max / 254, test_npu_matmul_experts)
    assert max(err for _, err in calls) < 0.03
    # one decoded token, and a piece below the NPU's minimum, stay on the CPU copy
    calls.clear()
    step_n, step_c = npu.forward([5], state_n), cpu.forward([5], state_c)
    assert npu.forward(list(range(3, 10)), state_n).shape[0] == 7
    assert not calls
    # End to end this random 32-wide model is chaotic (test_convert_bundle.py: 1 % noise
    # on the expert outputs drops top-1 to 0.82-0.89; int8 QMoE experts measured top-1
    # 0.73 on the oracle prompt): the bounds are test_convert_bundle's for int8 stages.
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    p, q = _softmax(want.astype(np.float64)), _softmax(got.astype(np.float64))
    kl = float((p * (np.log(p) - np.log(q))).sum(-1).mean())
    print(f"\n[npu experts] {FIXTURE}: {QUANT_POSITIONS} positions, int8 NPU experts vs "
          f"the float CPU experts: top-1 agreement {agree:.3f}, mean KL {kl:.4f}")
    assert agree >= CPU_QUANT_MIN_TOP1["int8"] and kl <= CPU_QUANT_MAX_KL["int8"]
    assert step_n.shape == step_c.shape


def test_a_bundle_without_the_copy_loads_and_refuses_npu_experts(tmp_path) -> None:
    path = make_bundle(tmp_path, FIXTURE, "b", quant="fp16", experts="int4", npu_budget=0,
                       npu_experts=False)
    manifest = json.loads((path / "manifest.json").read_text())
    assert "npu_matmul_experts" not in manifest
    assert not list((path / "experts").glob("*.npu.safetensors"))
    model = _model(path)
    assert model.npu_matmul_experts is None and not model.experts.prefill
    with pytest.raises(ExpertError, match="no int8 copy"):
        Model.from_bundle(path, executor="mock", npu_experts=True)
    # a bundle of the previous format version (no copy) still loads
    manifest["format_version"] = 2
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert _model(path).bundle.manifest.format_version == 2


def test_a_damaged_copy_is_a_typed_error(bundle, tmp_path) -> None:
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    spec = Bundle.open(copy, verify="none").manifest.npu_matmul_experts
    rel = next(iter(spec.layers.values()))
    tensors = load_file(copy / rel)
    save_file({**tensors, "down": tensors["down"][:, :-1].copy()}, copy / rel)
    with pytest.raises(ExpertError, match=f"{rel}: int8 NPU experts: down is"):
        _model(copy, verify="none", npu_experts=True)
    (copy / rel).write_bytes(b"not a safetensors file")
    with pytest.raises(ExpertError, match="not a readable safetensors"):
        _model(copy, verify="none", npu_experts=True)


@pytest.mark.filterwarnings("ignore::ling3_rknn.bundle.TemplateMismatchWarning")
def test_loading_takes_the_copy_where_the_memory_plan_allows(bundle, monkeypatch) -> None:
    from ling3_rknn import loading
    from ling3_rknn.loading import LoadOptions, npu_experts_choice, npu_experts_setting

    opened = Bundle.open(bundle, verify="size")
    copy = opened.manifest.npu_matmul_expert_bytes()
    roomy = {"MemTotal": 16 << 30, "MemAvailable": 15 << 30}
    tight = {"MemTotal": opened.loaded_bytes(npu_graphs=False) + copy + (1 << 30),
             "MemAvailable": 1 << 40}
    monkeypatch.delenv(loading.NPU_EXPERTS_ENV, raising=False)
    from ling3_rknn.npu import matmul

    off_board = npu_experts_choice(opened, LoadOptions(), meminfo=roomy)
    assert not off_board.taken and "not a board" in off_board.reason  # the stand-in: asked
    with monkeypatch.context() as board:  # a board: librknnrt found
        board.setattr(matmul, "resolve_library", lambda choice=None: ("librknnrt", None))
        taken = npu_experts_choice(opened, LoadOptions(), meminfo=roomy)
        assert taken.taken and taken.copy_bytes == copy
        tight_choice = npu_experts_choice(opened, LoadOptions(), meminfo=tight)
        assert not tight_choice.taken and "not a board" not in tight_choice.reason
    assert npu_experts_choice(opened, LoadOptions(npu_experts="on"), meminfo=tight).taken
    monkeypatch.setenv(loading.NPU_EXPERTS_ENV, "off")
    assert npu_experts_setting(LoadOptions()) is False
    assert npu_experts_setting(LoadOptions(npu_experts="auto")) is None  # the flag wins
    assert not npu_experts_choice(opened, LoadOptions(), meminfo=roomy).taken
    monkeypatch.setenv(loading.NPU_EXPERTS_ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, on, off"):
        npu_experts_setting(LoadOptions())
    monkeypatch.delenv(loading.NPU_EXPERTS_ENV)
    # serving: the choice loads the copy, and the memory plan counts it and says so
    monkeypatch.setattr(loading, "machine_memory", lambda: dict(roomy))
    try:
        engine = loading.engine_from_bundle(bundle, LoadOptions(npu_experts="on"),
                                            verify="size")
    except MatmulError as exc:
        pytest.skip(f"the matmul stand-in is not built: {exc}")
    plan = engine.memory_plan
    assert engine.model.npu_matmul_experts is not None
    assert plan.npu_experts is not None and plan.npu_experts.taken
    assert plan.model_bytes == opened.loaded_bytes(npu_graphs=False, npu_matmul_experts=True)
    assert "int8 copy" in plan.describe() and "loaded (forced on)" in plan.describe()
    engine.model.npu_matmul_experts.close()
