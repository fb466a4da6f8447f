"""``board/check.py`` run as the board runs it (a subprocess), with the host mock.

The bundle is a tiny oracle checkpoint converted with ``build_rknn=False``: placeholder
``.rknn`` files plus their ONNX twins, which ``MockRKNNLite`` executes. The board path
proper (``rknnlite`` imported, no ``--mock``) is driven with a stand-in ``rknnlite``
package on ``PYTHONPATH`` that re-exports the mock: it must refuse the placeholders.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, ORACLE_DIR, ORACLE_FIXTURES
from onnx import TensorProto, helper

from convert.converter import ConvertOptions, convert

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "board" / "check.py"
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


def check(*args: str | Path, cwd: Path, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    run_env = {k: v for k, v in os.environ.items() if k != "LING3_NPU_RUNTIME"}
    run_env.update(env or {})
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)], cwd=cwd,
                          env=run_env, capture_output=True, text=True, timeout=300,
                          check=False)


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


def test_mock_run_reports_every_stage(bundle, tmp_path) -> None:
    proc = check(bundle, "--mock", "--runs", "2", "--json", tmp_path / "out.json",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    assert "skip NPU driver version: --mock" in proc.stdout
    report = json.loads((tmp_path / "out.json").read_text())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert report["ok"] is True and report["failures"] == []
    assert report["runtime"] == "mock" and report["driver"] is None
    assert report["chunk"] == CHUNK
    assert set(report["stages"]) == set(manifest["stages"])
    assert any(".expert." in name for name in report["stages"])  # the plan's NPU experts
    for name, row in report["stages"].items():
        assert row["core"] == manifest["placement"]["stage_cores"][name]
        for t in ("T=1", f"T={CHUNK}"):
            assert 0 < row[t]["median_ms"] <= row[t]["p90_ms"], (name, t, row)
    dense = [n for n in manifest["stages"] if ".expert." not in n]
    layers = manifest["model_config"]["num_hidden_layers"]
    assert len(dense) == 2 * layers + 1
    floor = report["decode_floor"]
    assert floor["calls"] == len(dense)
    assert floor["ms_per_token"] == pytest.approx(
        sum(report["stages"][n]["T=1"]["median_ms"] for n in dense))
    assert f"decode NPU floor: {len(dense)} calls" in proc.stdout


def test_empty_graph_gives_the_per_call_cost(bundle, tmp_path) -> None:
    empty = add_graph(tmp_path / "empty", [1, 1, 8])
    proc = check(bundle, "--mock", "--runs", "2", "--empty-rknn", empty, "--json",
                 tmp_path / "out.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   empty graph:" in proc.stdout
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["sdk"] == "mock (onnxruntime twin)"
    assert 0 < report["empty_ms"]["median_ms"] <= report["empty_ms"]["p90_ms"]


def test_empty_graph_of_the_wrong_shape_fails(bundle, tmp_path) -> None:
    empty = add_graph(tmp_path / "empty", [1, 1, 4])
    proc = check(bundle, "--mock", "--runs", "1", "--empty-rknn", empty, cwd=tmp_path)
    assert proc.returncode == 1
    assert "FAIL empty graph" in proc.stdout and "[1, 1, 8]" in proc.stdout
    assert "decode NPU floor" in proc.stdout  # the stages are still measured


def test_missing_empty_graph_fails(bundle, tmp_path) -> None:
    proc = check(bundle, "--mock", "--runs", "1", "--empty-rknn", tmp_path / "none.rknn",
                 cwd=tmp_path)
    assert proc.returncode == 1
    assert "FAIL empty graph" in proc.stdout and "did not load" in proc.stdout


def test_flipped_byte_fails_full_verification(bundle, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    weights = copy / "weights.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    weights.write_bytes(bytes(raw))
    proc = check(copy, "--mock", "--runs", "1", "--full", "--json", tmp_path / "out.json",
                 cwd=tmp_path)
    assert proc.returncode == 1
    fail = [line for line in proc.stdout.splitlines() if line.startswith("FAIL bundle:")]
    assert len(fail) == 1 and "weights.safetensors" in fail[0] and "sha256" in fail[0]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["ok"] is False and "weights.safetensors" in report["failures"][0]
    assert "stages" not in report


def test_truncated_stage_fails_even_the_size_check(bundle, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    twin = copy / "stages" / "final.onnx"
    twin.write_bytes(twin.read_bytes()[:-1])
    proc = check(copy, "--mock", "--runs", "1", cwd=tmp_path)
    assert proc.returncode == 1
    assert "FAIL bundle:" in proc.stdout and "stages/final.onnx" in proc.stdout


def test_cpu_target_bundle_is_refused(tmp_path) -> None:
    cpu = _convert(tmp_path, "cpu", target="cpu", npu_budget=0)
    proc = check(cpu, "--mock", "--runs", "1", cwd=tmp_path)
    assert proc.returncode == 1
    assert "not rk3588" in proc.stdout


def test_not_a_bundle(tmp_path) -> None:
    proc = check(tmp_path / "nothing", "--mock", cwd=tmp_path)
    assert proc.returncode == 1
    assert "FAIL bundle:" in proc.stdout and "does not exist" in proc.stdout


def test_runs_must_be_positive(bundle, tmp_path) -> None:
    proc = check(bundle, "--mock", "--runs", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--runs" in proc.stderr


def test_board_path_refuses_placeholder_graphs(bundle, tmp_path) -> None:
    """Without --mock: ``rknnlite`` imports (a stand-in re-exporting the mock), the driver
    line is printed, and placeholder ``.rknn`` files are refused by name."""
    fake = tmp_path / "site" / "rknnlite"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "api.py").write_text("from ling3_rknn.npu import MockRKNNLite as RKNNLite\n")
    proc = check(bundle, "--runs", "1", "--json", tmp_path / "out.json", cwd=tmp_path,
                 env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ok   rknnlite imports" in proc.stdout
    assert "NPU driver:" in proc.stdout
    report = json.loads((tmp_path / "out.json").read_text())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert report["runtime"] == "rknnlite"
    assert len(report["failures"]) == len(manifest["stages"])
    assert all("placeholder" in f for f in report["failures"])
    assert "FAIL final: stages/final.rknn is a placeholder" in proc.stdout


def test_without_rknnlite_the_board_path_fails_clearly(bundle, tmp_path) -> None:
    try:
        import rknnlite  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("rknnlite is installed here")
    proc = check(bundle, "--runs", "1", cwd=tmp_path)
    assert proc.returncode == 1
    assert "FAIL rknnlite import" in proc.stdout and "--mock" in proc.stdout


def test_default_is_the_embedded_demo_bundle(tmp_path) -> None:
    """A new board's first smoke test: no argument checks the shipped demo bundle (real
    ``.rknn`` files from the toolkit, their twins run by the mock here)."""
    proc = check("--mock", "--runs", "2", "--full", "--json", tmp_path / "out.json",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert Path(report["bundle"]).parts[-3:] == ("ling3_rknn", "demo", "bundle")
    assert report["decode_floor"]["calls"] == 9  # 4 layers x (in, out) + final
