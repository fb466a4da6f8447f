"""``ling3-rknn``: command-line entry point.

``serve`` brings the HTTP API up first (``/health`` answers 503 while loading) and loads
the model in a background thread, so a service manager sees a live process at once and a
slow model load never looks like a hang. ``convert`` (host only) hands over to the
``convert`` package, imported lazily so the board runtime never loads it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ling3_rknn.bundle import EXPERT_FORMATS, STAGE_QUANTS, TARGETS
from ling3_rknn.loading import LoadOptions

if TYPE_CHECKING:
    from ling3_rknn.engine import EngineProtocol

API_KEY_ENV = "LING3_RKNN_API_KEY"
PLACEHOLDER_API_KEY = "change-me"  # what systemd/ling3-rknn.env ships with
SERVICE_ENV_FILE = "/etc/ling3-rknn/ling3-rknn.env"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}

log = logging.getLogger("ling3_rknn.cli")


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``512M``, ``2GiB`` (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1073741824, 512M, 2G)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_size_or_auto(text: str) -> int | None:
    """``parse_size``, or None for ``auto``: sized at start from the machine's memory
    (``ling3_rknn.memory_plan``); the systemd unit passes every flag, so it needs a word
    for "not set"."""
    return None if text.strip().lower() == "auto" else parse_size(text)


def _chunk_sizes(text: str) -> tuple[int, ...]:
    """``64`` or ``64,256``: distinct sizes, smallest first."""
    try:
        return tuple(sorted({_positive_int(part.strip()) for part in text.split(",")}))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"chunk sizes {text!r}: {exc}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {value}")
    return value


def _port(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ling3-rknn", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--bundle", type=Path, metavar="DIR", help="converted model bundle")
    source.add_argument("--hf", type=Path, metavar="DIR", help="HF checkpoint (numpy model)")
    source.add_argument(
        "--demo", action="store_true",
        help="the embedded demo model (also what serve runs with no model flag)",
    )
    serve.add_argument("--tokenizer", type=Path, metavar="FILE", help="tokenizer.json for --hf")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost)")
    serve.add_argument("--port", type=_port, default=8080)
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}). Prefer the "
             "variable: a key on the command line is visible to every local user in ps and "
             "/proc/PID/cmdline",
    )
    serve.add_argument(
        "--cache-bytes", type=parse_size_or_auto, metavar="N",
        help="the prefix cache's memory tier (0: no cache). Default (or auto): up to 2G, "
             "what this machine's memory leaves beside the model (shared with "
             "--prefill-scratch; the sizes chosen are logged at start)",
    )
    serve.add_argument("--cache-dir", type=Path, metavar="DIR", help="persist the prefix cache")
    serve.add_argument("--max-context", type=_positive_int, metavar="N", help="context limit")
    serve.add_argument(
        "--model-id", default=None,
        help="served model id (default ling-3.0-tiny; the demo: ling-3.0-tiny-demo)",
    )
    serve.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model id clients may send (repeatable)",
    )
    serve.add_argument(
        "--default-max-tokens", type=_non_negative_int, metavar="N",
        help="output tokens of a request that sends no max_tokens (default 4096; 0: up to "
             "the context limit); a single-stream board is held by a runaway answer",
    )
    serve.add_argument(
        "--max-queue",
        type=_positive_int,
        metavar="N",
        help="requests that may wait for the model before new ones get 503 (default 16)",
    )
    serve.add_argument("--max-body-bytes", type=parse_size, default=16 * 1024**2, metavar="N")
    serve.add_argument(
        "--max-connections", type=_positive_int, metavar="N",
        help="open connections allowed before new ones get 503 (default: the descriptor "
             "limit less 256)",
    )
    serve.add_argument(
        "--allowed-host", action="append", default=[], metavar="HOST",
        help="without an API key, a Host besides loopback names that requests may carry "
             "(repeatable; foreign hosts are refused against DNS rebinding)",
    )
    serve.add_argument(
        "--allowed-origin", action="append", default=[], metavar="ORIGIN",
        help="without an API key, a browser Origin besides loopback ones that may call the "
             "API, e.g. http://ui.lan:3000 (repeatable; '*' allows any)",
    )
    serve.add_argument(
        "--drain-seconds", type=float, default=0.0, metavar="S",
        help="after SIGTERM keep answering /health and new requests with 503 for S seconds "
             "(load balancers stop sending) before ending running requests (default 0)",
    )
    serve.add_argument(
        "--threads", type=_positive_int, metavar="N",
        help="CPU threads per compute pool (routed experts, CPU stages, attention), pinned "
             "to the big cores (default: one per big core, at most 4)",
    )
    serve.add_argument(
        "--latent-cache", choices=["float32", "float16"], default="float32",
        help="the MLA latent cache's dtype: float16 halves its memory (a 32K context: 226 "
             "instead of 453 MB) for a rounding of 2^-11 per cached value (default float32)",
    )
    serve.add_argument(
        "--npu-prefill", choices=["auto", "on", "off"], default="auto",
        help="a prompt's MLA attention as float16 matmuls on the NPU (librknnrt's matmul "
             "API; docs/model.md 5.5): auto = on a board, on = also off a board (the host "
             "stand-in: for tests, slower than the CPU kernel), off = on the CPU "
             "(default auto)",
    )
    serve.add_argument(
        "--prefill-scratch", type=parse_size_or_auto, metavar="N",
        help="memory a prompt's expanded MLA rows may take while it is evaluated (3.4x "
             "fewer attention FLOPs; 2G covers a 16.6K-token prompt of Ling-3.0-tiny; "
             "longer prompts continue in the absorbed form; 0: never). Default (or auto): up "
             "to 2G, what this machine's memory leaves beside the model (see --cache-bytes)",
    )
    serve.add_argument(
        "--npu-experts", choices=["auto", "on", "off"],
        help="prefill's routed experts on the NPU from the bundle's int8 copy: auto (where "
             "the memory allows it: 16 / 32 GB boards), on, off (default: "
             "$LING3_RKNN_NPU_EXPERTS, else auto)",
    )
    serve.add_argument(
        "--verify", choices=["stamped", "full", "size"], default="stamped",
        help="bundle check at start: sha256 of every file, remembered while the files are "
             "unchanged (stamped, default), always (full), or sizes only (size: opt-out)",
    )
    _add_convert(commands)
    _add_bench(commands)
    _add_doctor(commands)
    _add_warm(commands)
    _add_build_kernels(commands)
    return parser


def _add_convert(commands: Any) -> None:
    """``convert`` (host only: needs the ``convert`` package, onnx and, for rk3588,
    rknn-toolkit2 in .venv-rknn); imported lazily so the board runtime never loads it."""
    conv = commands.add_parser("convert", help="HF checkpoint -> bundle (host only)")
    conv.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    conv.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    conv.add_argument("--target", choices=TARGETS, default="rk3588")
    conv.add_argument("--quant", choices=[q for t in TARGETS for q in STAGE_QUANTS[t]],
                      help="stage weights: fp16 (default) | w8a8 for rk3588; int8 (default) "
                      "| int4 | fp32 for --target cpu")
    conv.add_argument("--experts", choices=EXPERT_FORMATS, default="int4")
    conv.add_argument("--calibration", type=Path, metavar="FILE",
                      help="prompts: JSONL (text or ids per line) or blank-line separated text")
    conv.add_argument("--npu-budget", type=parse_size, metavar="BYTES",
                      help="bytes for routed experts on the NPU (default: what the ~4 GB "
                           "window leaves after the dense stages for fp16 experts; 0 for "
                           "int4/int8, whose QMoE kernel runs k experts per token anyway)")
    conv.add_argument("--chunk", type=_chunk_sizes, default=(64,), metavar="N[,N...]",
                      help="prefill chunk size(s): each is one more input shape of every "
                           "stage graph; the engine prefills in pieces of the largest (at "
                           "least 64) and cuts each into the cheapest cover (default 64)")
    conv.add_argument("--tokenizer", type=Path, metavar="FILE",
                      help="tokenizer.json (default HF_DIR/tokenizer.json)")
    conv.add_argument("--chat-template", type=Path, metavar="FILE")
    conv.add_argument("--block-size", type=_positive_int, default=32, help="expert quant block")
    conv.add_argument("--w8a8-algorithm", choices=["normal", "mmse", "kl_divergence"],
                      help="rknn-toolkit2 quantized_algorithm for w8a8 stages (default: "
                      "the converter's, mmse: the demo's held-out calls 36 / 37 of 40 in the "
                      "simulator, normal 32 / 32; docs/toolchain.md 3)")
    conv.add_argument("--w8a8-hybrid-cos", type=float, metavar="COS",
                      help="keep in fp16 the ops whose calibration cosine falls below COS "
                           "(rknn-toolkit2 auto-hybrid; default: everything int8)")
    conv.add_argument("--npu-experts", action=argparse.BooleanOptionalAction, default=None,
                      help="write the routed experts' int8 copy for prefill on the NPU "
                           "(~1.6x the int4 experts' bytes, loaded only on boards with the "
                           "memory for it: 16/32 GB; default: on for rk3588)")
    conv.add_argument("--no-rknn-build", action="store_true",
                      help="write placeholder .rknn files (host mock tests only)")
    conv.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    conv.add_argument("--resume", action="store_true",
                      help="keep finished files of an interrupted run of the same conversion")


def _demo_default_bundle(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--bundle", type=Path, metavar="DIR",
                        help=f"{what} (default: the embedded demo bundle)")


def _add_bench(commands: Any) -> None:
    """``bench``: the product's own path measured end to end (``ling3_rknn.bench``)."""
    bench = commands.add_parser("bench", help="measure the engine end to end (JSON, plot)")
    _demo_default_bundle(bench, "converted bundle")
    bench.add_argument("--json", type=Path, required=True, metavar="OUT", help="report file")
    bench.add_argument("--plot", type=Path, metavar="OUT.png", help="PNG (needs the plot extra)")
    bench.add_argument("--compare", type=Path, metavar="OLD.json",
                       help="print new/old per figure against an earlier report")
    bench.add_argument("--threads", type=_positive_int, metavar="N",
                       help="CPU threads per compute pool (as serve --threads)")
    bench.add_argument("--quick", action="store_true",
                       help="128 and 466 prompt tokens only (a host run in well under a minute)")
    bench.add_argument("--npu-prefill", choices=["auto", "on", "off"], default="auto",
                       help="prefill attention on the NPU (as serve --npu-prefill)")


def _add_warm(commands: Any) -> None:
    """``warm``: replay recorded requests so the prefix cache holds them (``ling3_rknn.warm``)."""
    warm = commands.add_parser(
        "warm", help="replay recorded chat requests against a running server (cache warm-up)")
    warm.add_argument("files", nargs="+", type=Path, metavar="FILE",
                      help="chat-completions request bodies: one JSON object, or JSONL")
    warm.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    warm.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                      help=f"the server's key (default: ${API_KEY_ENV})")
    warm.add_argument("--model", help="send this model id instead of the recorded one")


def _add_build_kernels(commands: Any) -> None:
    """``build-kernels``: compile the decode kernels for this machine (the install step;
    ``ling3_rknn.model.native_build``)."""
    build = commands.add_parser(
        "build-kernels", help="compile the decode kernels for this machine (install step)")
    build.add_argument("--dir", type=Path, metavar="DIR",
                       help="where to put them (default: $LING3_RKNN_KERNEL_DIR, else "
                            "<venv>/lib/ling3-rknn); the service must find them there")
    build.add_argument("--march", metavar="TARGET",
                       help="a narrower target than this CPU's own, to test another vector "
                            "width (x86-64-v4, x86-64-v3, x86-64; armv8-a on aarch64; default: "
                            "$LING3_RKNN_KERNEL_MARCH, else native)")


def build_kernels(directory: Path | None, march: str | None = None) -> int:
    from ling3_rknn.model import native_build

    target = directory or native_build.kernel_directory()
    try:
        manifest = native_build.build(target, march=march)
    except native_build.BuildError as exc:
        print(f"ling3-rknn: decode kernels not built: {exc}\n"
              "  without them the decode glue runs on numpy (correct, slower); "
              "a C compiler: sudo apt install gcc", file=sys.stderr)
        return 1
    print(f"built {target / native_build.LIBRARY}: {manifest.isa}; "
          f"{manifest.compiler} {' '.join(manifest.flags)}")
    return 0


def _add_doctor(commands: Any) -> None:
    """``doctor``: is this board ready to serve, and the command that fixes what is not."""
    doc = commands.add_parser("doctor", help="check the board and bundle; print the fixes")
    _demo_default_bundle(doc, "bundle to check")
    doc.add_argument("--json", action="store_true", help="print a machine-readable report")
    doc.add_argument("--quick", action="store_true",
                     help="skip loading the graphs and timing them (the unit's ExecStartPre)")
    doc.add_argument("--runs", type=_positive_int, metavar="N",
                     help="timed calls per graph shape (default 10)")
    doc.add_argument("--full", action="store_true",
                     help="hash every bundle file now instead of trusting its check stamp")
    doc.add_argument("--empty-rknn", type=Path, metavar="FILE",
                     help="an .rknn of one Add over [1, 1, 8]: the fixed cost of an NPU call")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _engine_options(args: argparse.Namespace) -> LoadOptions:
    """The serve flags that were given; the rest stay None (the model's or the engine's)."""
    return LoadOptions(
        model_id=args.model_id,
        max_context=args.max_context,
        cache_bytes=args.cache_bytes,
        cache_dir=args.cache_dir,
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,  # 0: no cap but the context
        prefill_scratch_bytes=args.prefill_scratch,
        npu_prefill=args.npu_prefill,
        npu_experts=args.npu_experts,
    )


def make_loader(args: argparse.Namespace) -> Callable[[], EngineProtocol]:
    """The function the server runs in a thread to build the engine."""
    from ling3_rknn import loading

    options = _engine_options(args)
    if args.hf is not None:
        hf_dir: Path = args.hf
        tokenizer_path: Path = args.tokenizer or hf_dir / "tokenizer.json"
        return lambda: loading.engine_from_hf(hf_dir, tokenizer_path, options,
                                              latent_dtype=args.latent_cache)
    if args.bundle is not None:
        bundle_dir: Path = args.bundle
        return lambda: loading.engine_from_bundle(bundle_dir, options, verify=args.verify,
                                                  latent_dtype=args.latent_cache)

    def load_demo() -> EngineProtocol:
        from ling3_rknn.demo import load_demo_engine

        print("ling3-rknn: serving the embedded demo model (a 7.1M-parameter Ling-3.0 trained "
              "as a tiny weather/time agent); --bundle DIR serves a converted Ling-3.0-tiny.",
              file=sys.stderr, flush=True)
        return load_demo_engine(options, latent_dtype=args.latent_cache)

    return load_demo


def api_key_problem(host: str, api_key: str | None) -> str | None:
    """Why serving ``host`` with ``api_key`` is refused: an exposed API with no key, or
    with the environment file's placeholder, is open to the whole network."""
    if _is_loopback(host) or (api_key and api_key != PLACEHOLDER_API_KEY):
        return None
    what = "without an API key" if not api_key else f"with the placeholder API key {api_key!r}"
    return (f"refusing to listen on {host} {what}: set {API_KEY_ENV} in {SERVICE_ENV_FILE} "
            "(generate one: python3 -c 'import secrets; print(secrets.token_urlsafe(32))') "
            "or pass --api-key, or bind 127.0.0.1")


def serve(args: argparse.Namespace) -> int:
    from ling3_rknn.server import AppConfig, EngineHolder, create_app, run_server
    from ling3_rknn.server.app import request_stop

    if args.tokenizer is not None and args.hf is None:
        print("ling3-rknn: --tokenizer only applies to --hf", file=sys.stderr)
        return 2
    if args.api_key is not None and not args.api_key.strip():
        print("ling3-rknn: --api-key is empty: every client would pass with an empty key; "
              f"set a real key (preferably in ${API_KEY_ENV}) or leave it out", file=sys.stderr)
        return 2
    key_problem = api_key_problem(args.host, args.api_key)
    if key_problem is not None:
        print(f"ling3-rknn: {key_problem}", file=sys.stderr)
        return 2
    if args.drain_seconds < 0:
        print("ling3-rknn: --drain-seconds must not be negative", file=sys.stderr)
        return 2
    from ling3_rknn.cpu_threads import ThreadPolicyError, apply_thread_policy

    try:
        # Before any pool starts (the server's threads, the loader's sessions): they all
        # inherit the pinning, and the model loaders find this policy in force.
        apply_thread_policy(args.threads)
    except ThreadPolicyError as exc:
        print(f"ling3-rknn: {exc}", file=sys.stderr)
        return 2
    config = AppConfig(
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        model_aliases=tuple(args.model_alias),
        drain_s=args.drain_seconds,
        max_connections=args.max_connections,
        allowed_hosts=tuple(args.allowed_host),
        allowed_origins=tuple(args.allowed_origin),
    )
    failed: list[BaseException] = []
    holder = EngineHolder()
    app = None

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        if app is not None:
            request_stop(app)

    app = create_app(holder, config, loader=make_loader(args), on_load_error=on_load_error)
    try:
        asyncio.run(run_server(app, args.host, args.port))
    except OSError as exc:
        print(f"ling3-rknn: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    if failed:
        print(f"ling3-rknn: model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "doctor":
        from ling3_rknn.doctor import run_doctor

        return run_doctor(args)
    if args.command == "bench":
        from ling3_rknn.bench.command import run_bench

        return run_bench(args)
    if args.command == "warm":
        from ling3_rknn.warm import run_warm

        return run_warm(args.url, args.files, args.api_key, args.model)
    if args.command == "build-kernels":
        return build_kernels(args.dir, args.march)
    if args.command == "convert":
        from convert.cli import run_convert

        return run_convert(args)
    return serve(args)


if __name__ == "__main__":  # `python -m ling3_rknn.cli` (the end-to-end tests run it so)
    sys.exit(main())
