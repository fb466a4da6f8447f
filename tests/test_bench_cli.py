"""``ling3-rknn bench`` on the embedded demo bundle with the RKNNLite mock: the report has
its figures, ``--plot`` writes a PNG, ``--compare`` prints ratios, and bad inputs are a
one-line error with exit status 2. Speeds are only checked to be positive, never timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ling3_rknn import cli
from ling3_rknn.bench import npu_matmul
from ling3_rknn.npu.executors import RUNTIME_ENV

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEYS = ("prefill_tok_s", "decode_tok_s", "ttft_s", "prefix_cache", "npu_calls_per_token",
        "rss_bytes", "executor", "machine", "bundle")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    report, png = out / "b.json", out / "b.png"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNTIME_ENV, "mock")
        assert cli.main(["bench", "--quick", "--json", str(report), "--plot", str(png)]) == 0
    return report, png, out


def test_quick_report_has_sane_figures(quick_run):
    report = json.loads(quick_run[0].read_text())
    assert all(key in report for key in KEYS)
    assert report["executor"] == "mock"
    assert set(report["prefill_tok_s"]) == {"128", "466"}
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_s"):
        assert all(v > 0 for v in report[key].values()), key
    cache = report["prefix_cache"]
    assert cache["turn2_cached_tokens"] > 0
    assert cache["turn2_evaluated_tokens"] < cache["turn2_prompt_tokens"]
    agent = report["agent_first_request"]  # quick: the agent request's shape at pi's size
    assert 2900 <= agent["prompt_tokens"] <= 3065 and agent["ttft_s"] > 0
    assert agent["prefill_tok_s"] > 0
    # the next session shares everything but the question: only that is evaluated
    assert agent["next_session_cached_tokens"] > 0.8 * agent["prompt_tokens"]
    assert (agent["next_session_evaluated_tokens"]
            == agent["next_session_prompt_tokens"] - agent["next_session_cached_tokens"])
    assert report["npu_calls_per_token"]["decode"] >= 1
    assert report["rss_bytes"] > 0 and report["npu_resident_bytes"] > 0
    assert report["empty_graph"]["median_us"] > 0
    matmuls = report["npu_matmul"]  # the prefill plan's shapes, on the host stand-in
    assert matmuls["runtime"] == "stand-in" and matmuls["runs"] == 5
    assert set(matmuls["shapes"]) == set(npu_matmul.plan_shapes())
    for name, figure in matmuls["shapes"].items():
        assert figure["shape"] == str(npu_matmul.plan_shapes()[name])
        assert figure["us_per_run"] > 0 and figure["gops"] > 0 and figure["npu_gops"] > 0
    for key in ("ms_per_token", "prefill_ms_per_token"):  # decode's and prefill's split
        for split in report[key].values():
            assert {"npu_stages", "experts", "cpu_glue"} <= set(split)
    assert report["machine"]["is_rk3588"] in (True, False)
    assert len(report["bundle"]["manifest_sha256"]) == 64
    assert report["bundle"]["model_id"] == "ling-3.0-tiny-demo"


def test_plot_writes_a_png(quick_run):
    assert quick_run[1].read_bytes()[:8] == PNG_MAGIC


def test_compare_prints_ratios(quick_run, capsys):
    old = json.loads(quick_run[0].read_text())
    old["prefill_tok_s"] = {k: v / 2 for k, v in old["prefill_tok_s"].items()}
    old_path = quick_run[2] / "old.json"
    old_path.write_text(json.dumps(old))
    capsys.readouterr()
    new = quick_run[2] / "new.json"
    assert cli.main(["bench", "--quick", "--json", str(new), "--compare", str(old_path)]) == 0
    out = capsys.readouterr().out
    assert "new/old" in out
    row = next(line for line in out.splitlines() if line.startswith("prefill_tok_s.466 "))
    assert float(row.split()[-1]) > 0


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]", '{"hello": 1}'],
                         ids=["missing", "not-json", "not-object", "not-a-report"])
def test_bad_compare_file_is_exit_2(tmp_path, content):
    old = tmp_path / "old.json"
    if content is not None:
        old.write_text(content)
    proc = subprocess.run(
        [sys.executable, "-m", "ling3_rknn.cli", "bench", "--quick", "--json",
         str(tmp_path / "new.json"), "--compare", str(old)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--compare" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "new.json").exists()  # failed before measuring


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    code = cli.main(["bench", "--quick", "--json", str(tmp_path / "b.json"),
                     "--plot", str(tmp_path / "b.png")])
    assert code == 2
    assert "ling3-rknn[plot]" in capsys.readouterr().err


def test_npu_calls_per_token_reads_each_phase_from_its_own_key(quick_run):
    """The report's prefill figure comes from the prefill counts, the decode one from the
    decode counts: a prefill chunk is one call for many tokens, so prefill is lower."""
    from ling3_rknn.bench.report import build_report

    report = json.loads(quick_run[0].read_text())
    runs = report["runs"]
    calls = report["npu_calls_per_token"]
    mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
    assert calls["prefill"] == pytest.approx(mean("npu_calls_per_prefill_token"))
    assert calls["decode"] == pytest.approx(mean("npu_calls_per_token"))
    assert calls["prefill"] < calls["decode"]
    synthetic = [{"target": 1, "prefill_tok_s": 1.0, "decode_tok_s": 1.0, "ttft_s": 1.0,
                  "ms_per_token": {}, "prefill_ms_per_token": {}, "npu_calls_per_token": 7.0,
                  "npu_calls_per_prefill_token": 0.25}]
    figures = {"runs": synthetic, "prefix_cache": {}, "empty_graph": {},
               "agent_first_request": {}}
    built = build_report(figures,
                         executor="mock", machine={}, bundle={}, quick=True, load_s=0.0,
                         rss=(1, 1), npu_resident_bytes=0)
    assert built["npu_calls_per_token"] == {"decode": 7.0, "prefill": 0.25}
