"""``ling3-rknn doctor`` over converted bundles: every graph loaded and timed, the empty
graph's per-call cost, verification failures, the board path's refusals.

The bundle is a tiny oracle checkpoint converted with ``build_rknn=False``: placeholder
``.rknn`` files plus their ONNX twins, which ``MockRKNNLite`` executes. On this host (an
empty filesystem root: no device tree) the doctor runs the graphs on the mock; the board
path proper (a fake RK3588 tree) gets the mock as its ``RKNNLite`` class and must refuse
the placeholders. (These were ``board/check.py``'s tests before the doctor absorbed it.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, ORACLE_DIR, ORACLE_FIXTURES
from fake_board import fake_board
from onnx import TensorProto, helper

from convert.converter import ConvertOptions, convert
from ling3_rknn import cli
from ling3_rknn.doctor import command, host, run_doctor

TOKENIZER = FIXTURES / "tokenizer" / "compact" / "tokenizer.json"
SRC = ORACLE_DIR / ORACLE_FIXTURES[0]
CHUNK = 8


def _convert(tmp: Path, name: str, **kw) -> Path:
    calib = tmp / "calib.jsonl"
    rng = np.random.default_rng(0)
    calib.write_text("\n".join(json.dumps({"ids": rng.integers(2, 256, 40).tolist()})
                               for _ in range(2)))
    # npu_budget: enough bytes to promote a handful of experts to NPU graphs.
    opts = dict(chunk=CHUNK, tokenizer=TOKENIZER, build_rknn=False, progress=False,
                calibration=calib, block_size=16, experts="int4", npu_budget=20000)
    opts.update(kw)
    convert(SRC, tmp / name, ConvertOptions(**opts))
    return tmp / name


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return _convert(tmp_path_factory.mktemp("board"), "b")


def doctor(capsys, root: Path, *args: str | Path) -> tuple[int, str]:
    """The command as typed, on the filesystem ``root`` (empty: a host, not an RK3588)."""
    parsed = cli.build_parser().parse_args(["doctor", *map(str, args)])
    code = run_doctor(parsed, root=root)
    return code, capsys.readouterr().out


def checks(out: str) -> dict[str, dict]:
    report = json.loads(out)
    return {c["name"]: c for c in report["checks"]}


def add_graph(path: Path, shape: list[int]) -> Path:
    """The documented empty graph (one Add) as an ONNX twin + an ``.rknn`` beside it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "empty", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path.with_suffix(".onnx")))
    rknn = path.with_suffix(".rknn")
    rknn.write_bytes(b"placeholder: the mock runs the .onnx twin next to it\n")
    return rknn


def test_host_run_reports_every_stage(bundle, tmp_path, capsys) -> None:
    code, out = doctor(capsys, tmp_path, "--bundle", bundle, "--runs", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["ready"] is True, out
    assert report["machine"]["rk3588"] is False
    found = checks(out)
    assert "NPU driver" not in found  # not an RK3588: no driver to read
    assert all(c["status"] != "fail" for c in found.values())
    manifest = json.loads((bundle / "manifest.json").read_text())
    stages = found["graphs"]["data"]["stages"]
    assert found["graphs"]["detail"].endswith("loaded on the onnxruntime mock (host CPU)")
    assert set(stages) == set(manifest["stages"])
    assert any(".expert." in name for name in stages)  # the plan's NPU experts
    for name, row in stages.items():
        assert row["core"] == manifest["placement"]["stage_cores"][name]
        for t in ("T=1", f"T={CHUNK}"):
            assert 0 < row["median_ms"][t] <= row["p90_ms"][t], (name, t, row)
    dense = [n for n in manifest["stages"] if ".expert." not in n]
    layers = manifest["model_config"]["num_hidden_layers"]
    assert len(dense) == 2 * layers + 1
    floor = found["latency"]["data"]
    assert floor["calls"] == len(dense)
    assert floor["ms_per_token"] == pytest.approx(
        sum(stages[n]["median_ms"]["T=1"] for n in dense), abs=1e-3)
    assert f"over {len(dense)} dense graphs at T=1 (median of 2;" in found["latency"]["detail"]


def test_empty_graph_gives_the_per_call_cost(bundle, tmp_path, capsys) -> None:
    empty = add_graph(tmp_path / "empty", [1, 1, 8])
    code, out = doctor(capsys, tmp_path, "--bundle", bundle, "--runs", "2",
                       "--empty-rknn", empty)
    assert code == 0, out
    assert "ok   empty graph:" in out and "(runtime mock (onnxruntime twin))" in out
    _, out = doctor(capsys, tmp_path, "--bundle", bundle, "--runs", "2", "--empty-rknn",
                    empty, "--json")
    data = checks(out)["empty graph"]["data"]
    assert data["sdk"] == "mock (onnxruntime twin)"
    assert 0 < data["median_ms"] <= data["p90_ms"]


def test_empty_graph_of_the_wrong_shape_fails(bundle, tmp_path, capsys) -> None:
    empty = add_graph(tmp_path / "empty", [1, 1, 4])
    code, out = doctor(capsys, tmp_path, "--bundle", bundle, "--runs", "1",
                       "--empty-rknn", empty)
    assert code == 1
    assert "FAIL empty graph" in out and "[1, 1, 8]" in out
    assert "latency: decode floor" in out  # the stages are still measured


def test_missing_empty_graph_fails(bundle, tmp_path, capsys) -> None:
    code, out = doctor(capsys, tmp_path, "--bundle", bundle, "--runs", "1",
                       "--empty-rknn", tmp_path / "none.rknn")
    assert code == 1
    assert "FAIL empty graph" in out and "did not load" in out


def test_flipped_byte_fails_full_verification(bundle, tmp_path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    weights = copy / "weights.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    weights.write_bytes(bytes(raw))
    code, out = doctor(capsys, tmp_path / "root", "--bundle", copy, "--runs", "1", "--full")
    assert code == 1
    fail = [line for line in out.splitlines() if line.startswith("FAIL bundle:")]
    assert len(fail) == 1 and "weights.safetensors" in fail[0] and "sha256" in fail[0]
    _, out = doctor(capsys, tmp_path / "root", "--bundle", copy, "--full", "--json")
    assert json.loads(out)["ready"] is False
    found = checks(out)
    assert "weights.safetensors" in found["bundle"]["detail"]
    assert found["graphs"]["status"] == "skip"  # nothing loaded from a bad bundle


def test_truncated_stage_fails_even_the_size_check(bundle, tmp_path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    twin = copy / "stages" / "final.onnx"
    twin.write_bytes(twin.read_bytes()[:-1])
    code, out = doctor(capsys, tmp_path / "root", "--bundle", copy, "--quick")
    assert code == 1
    assert "FAIL bundle:" in out and "stages/final.onnx" in out


def test_cpu_target_bundle_is_refused(tmp_path, capsys) -> None:
    cpu = _convert(tmp_path, "cpu", target="cpu", npu_budget=0)
    code, out = doctor(capsys, tmp_path / "root", "--bundle", cpu, "--runs", "1")
    assert code == 1
    assert "FAIL bundle:" in out and "a --target cpu bundle has no NPU graphs" in out


def test_not_a_bundle(tmp_path, capsys) -> None:
    code, out = doctor(capsys, tmp_path, "--bundle", tmp_path / "nothing")
    assert code == 1
    assert "FAIL bundle:" in out and "does not exist" in out


def test_runs_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["doctor", "--runs", "0"])
    assert exit_.value.code == 2 and "--runs" in capsys.readouterr().err


def test_board_path_refuses_placeholder_graphs(bundle, tmp_path, capsys, monkeypatch) -> None:
    """On an RK3588 (a fake tree) with ``rknnlite`` importing (the mock stands in), the
    driver is read and placeholder ``.rknn`` files are refused by name."""
    from ling3_rknn.npu import MockRKNNLite

    monkeypatch.setattr(command, "_rknnlite_class", lambda on_board: MockRKNNLite)
    root = fake_board(tmp_path / "root")
    code, out = doctor(capsys, root, "--bundle", bundle, "--runs", "1")
    assert code == 1, out
    assert "ok   NPU driver:" in out
    assert "FAIL graph final: stages/final.rknn is a placeholder" in out
    _, out = doctor(capsys, root, "--bundle", bundle, "--runs", "1", "--json")
    manifest = json.loads((bundle / "manifest.json").read_text())
    refused = [c for c in json.loads(out)["checks"]
               if c["name"].startswith("graph ") and c["status"] == "fail"]
    assert len(refused) == len(manifest["stages"])
    assert all("placeholder" in c["detail"] for c in refused)
    assert checks(out)["graphs"]["detail"] == f"0 of {len(manifest['stages'])} loaded on the NPU"


def test_without_rknnlite_the_board_path_fails_clearly(bundle, tmp_path, capsys) -> None:
    if host.package_version("rknn-toolkit-lite2") is not None:
        pytest.skip("rknn-toolkit-lite2 is installed here")
    code, out = doctor(capsys, fake_board(tmp_path / "root"), "--bundle", bundle)
    assert code == 1
    assert "FAIL rknn-toolkit-lite2: not installed" in out
    assert "pip install 'ling3-rknn[board]'" in out
    assert "skip graphs: rknnlite does not import" in out


def test_default_is_the_embedded_demo_bundle(tmp_path, capsys) -> None:
    """A new board's first smoke test: no --bundle checks the shipped demo bundle (real
    ``.rknn`` files from the toolkit, their twins run by the mock here), every file hashed."""
    code, out = doctor(capsys, tmp_path, "--runs", "2", "--full", "--json")
    assert code == 0, out
    found = checks(out)
    assert Path(found["bundle"]["data"]["path"]).parts[-3:] == ("ling3_rknn", "demo", "bundle")
    assert found["bundle"]["data"]["verified"] == "full"
    assert found["latency"]["data"]["calls"] == 9  # 4 layers x (in, out) + final
