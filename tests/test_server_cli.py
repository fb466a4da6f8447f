"""``ling3-rknn serve`` argument handling (the running process is tested in
test_server_e2e.py)."""

from __future__ import annotations

import argparse
import os

import pytest

from ling3_rknn import cli
from ling3_rknn.engine import DEFAULT_MAX_TOKENS, EngineOptions
from ling3_rknn.loading import DEFAULT_MAX_CONTEXT, DEFAULT_MODEL_ID, LoadOptions, engine_options


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), ("512M", 512 * 1024**2), ("2G", 2 * 1024**3), ("1.5GiB", 3 * 512 * 1024**2)],
)
def test_parse_size(text, size):
    assert cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "2X", "G", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size(text)


def test_memory_sizes_take_auto():
    """The unit passes every flag; auto (any case) leaves the size to the memory plan."""
    args = cli.build_parser().parse_args(
        ["serve", "--cache-bytes", "AUTO", "--prefill-scratch", "auto"])
    assert args.cache_bytes is None and args.prefill_scratch is None
    args = cli.build_parser().parse_args(["serve", "--cache-bytes", "0"])
    assert args.cache_bytes == 0
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--prefill-scratch", "automatic"])


def test_serve_defaults_bind_localhost(monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    args = cli.build_parser().parse_args(["serve", "--demo"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8080, None)


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    args = cli.build_parser().parse_args(["serve", "--demo"])
    assert args.api_key == "from-env"
    args = cli.build_parser().parse_args(["serve", "--demo", "--api-key", "flag"])
    assert args.api_key == "flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--demo", "--bundle", "b"],
        ["serve", "--hf", "h", "--bundle", "b"],
        ["serve", "--demo", "--port", "70000"],
        ["serve", "--demo", "--max-context", "0"],
        ["serve", "--demo", "--cache-bytes", "lots"],
        ["serve", "--demo", "--threads", "0"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_tokenizer_only_with_hf(capsys):
    assert cli.main(["serve", "--demo", "--tokenizer", "t.json", "--port", "0"]) == 2
    assert "--tokenizer only applies to --hf" in capsys.readouterr().err


def test_missing_or_incomplete_bundle_exits_1(tmp_path, capsys):
    assert cli.main(["serve", "--bundle", str(tmp_path / "nope"), "--port", "0"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["serve", "--bundle", str(tmp_path), "--port", "0"]) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_refuses_exposed_without_key_or_with_the_placeholder(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    argv = ["serve", "--hf", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0 without an API key" in err
    assert "/etc/ling3-rknn/ling3-rknn.env" in err
    monkeypatch.setenv(cli.API_KEY_ENV, "change-me")  # what systemd/ling3-rknn.env ships
    assert cli.main(argv) == 2
    assert "placeholder API key 'change-me'" in capsys.readouterr().err


def test_api_key_rule():
    assert cli.api_key_problem("127.0.0.1", None) is None
    assert cli.api_key_problem("localhost", "change-me") is None
    assert cli.api_key_problem("::1", "") is None
    assert cli.api_key_problem("0.0.0.0", "s3cret-key") is None
    assert cli.api_key_problem("192.168.1.20", "") is not None
    assert cli.api_key_problem("::", "change-me") is not None


def test_engine_options_only_pass_what_was_given():
    args = cli.build_parser().parse_args(["serve", "--demo", "--cache-bytes", "1M"])
    assert cli._engine_options(args) == LoadOptions(cache_bytes=1024**2)
    argv = ["serve", "--demo", "--max-queue", "4", "--max-context", "512", "--model-id", "x"]
    options = cli._engine_options(cli.build_parser().parse_args(argv))
    assert options == LoadOptions(max_queue=4, max_context=512, model_id="x")
    for flag, cap in (("4096", 4096), ("0", None)):  # 0: no cap but the context
        args = cli.build_parser().parse_args(["serve", "--default-max-tokens", flag])
        assert cli._engine_options(args) == LoadOptions(default_max_tokens=int(flag))
        assert engine_options(cli._engine_options(args), 8192).default_max_tokens == cap
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--default-max-tokens", "-1"])
    for flag, size in (("1G", 1024**3), ("0", 0)):
        args = cli.build_parser().parse_args(["serve", "--prefill-scratch", flag])
        assert cli._engine_options(args) == LoadOptions(prefill_scratch_bytes=size)


def test_engine_options_keep_the_engines_defaults_where_nothing_was_given():
    """What neither the flags nor the model say is the engine's own default (issue 27:
    the options are typed, not a dict of what happened to be set)."""
    given = engine_options(LoadOptions(), 8192)
    assert given == EngineOptions(model_id=DEFAULT_MODEL_ID, max_context=8192)
    assert given.default_max_tokens == DEFAULT_MAX_TOKENS
    capped = engine_options(LoadOptions(max_context=512, cache_bytes=7), 65536,
                            generation_config={"eos_token_id": [3, 4], "temperature": 0.5},
                            weights_identity="w", default_model_id="demo")
    assert (capped.model_id, capped.max_context, capped.cache_bytes) == ("demo", 512, 7)
    assert capped.eos_token_ids == (3, 4) and capped.weights_identity == "w"
    assert capped.generation_defaults.temperature == 0.5
    assert engine_options(LoadOptions(), 65536).max_context == DEFAULT_MAX_CONTEXT


def test_prefill_scratch_reaches_the_model_not_the_engine():
    from ling3_rknn.demo import load_demo_engine

    engine = load_demo_engine(LoadOptions(prefill_scratch_bytes=12345))
    try:
        assert engine.model.prefill_scratch_bytes == 12345
    finally:
        engine.close()


def test_no_model_flag_serves_the_embedded_demo(monkeypatch):
    loaded = {}

    def fake_demo_engine(options=None, *, latent_dtype="float32"):
        loaded.update(options=options, latent_dtype=latent_dtype)
        return "engine"

    monkeypatch.setattr("ling3_rknn.demo.load_demo_engine", fake_demo_engine)
    for argv in (["serve"], ["serve", "--demo"]):
        loaded.clear()
        args = cli.build_parser().parse_args([*argv, "--max-context", "4096"])
        assert cli.make_loader(args)() == "engine"
        assert loaded == {"options": LoadOptions(max_context=4096), "latent_dtype": "float32"}
    args = cli.build_parser().parse_args(["serve", "--latent-cache", "float16"])
    cli.make_loader(args)()
    assert loaded["latent_dtype"] == "float16"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--latent-cache", "int8"])


def test_max_context_beyond_the_model_is_refused():
    """Advertising more context than the model's positions would pass prompts the model
    then fails on after the headers (issue 12, item 8)."""
    from types import SimpleNamespace

    from ling3_rknn.loading import make_engine

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192),
                            prefill_chunk=64)
    with pytest.raises(ValueError, match="max_position_embeddings 8192"):
        make_engine(model, None, LoadOptions(max_context=65536))


def test_more_threads_than_cores_exits_2_before_loading(capsys):
    too_many = len(os.sched_getaffinity(0)) + 1
    assert cli.main(["serve", "--demo", "--threads", str(too_many), "--port", "0"]) == 2
    assert f"--threads {too_many} is more than the" in capsys.readouterr().err
