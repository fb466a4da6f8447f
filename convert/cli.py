"""``ling3-rknn convert``: argparse namespace -> :func:`convert.converter.convert`.

Every expected failure (bad checkpoint, config, tokenizer, calibration file, toolkit
error, existing output) is one line on stderr and exit status 1; nothing half-written
is left at OUT_DIR (the bundle writer renames a complete directory into place).
"""

from __future__ import annotations

import argparse
import sys

from convert.calibration import CalibrationError
from convert.converter import ConvertError, ConvertOptions, convert
from convert.options import DEFAULT_W8A8_ALGORITHM
from convert.rknn_toolkit import RknnToolkitError
from ling3_rknn.bundle import BundleError
from ling3_rknn.config import ConfigError
from ling3_rknn.model import CheckpointError
from ling3_rknn.tokenizer import TokenizerError


def run_convert(args: argparse.Namespace) -> int:
    opts = ConvertOptions(
        target=args.target, quant=args.quant, experts=args.experts,
        calibration=args.calibration, npu_budget=args.npu_budget, chunk=args.chunk[0],
        more_chunks=args.chunk[1:],
        tokenizer=args.tokenizer, chat_template=args.chat_template,
        block_size=args.block_size, build_rknn=not args.no_rknn_build,
        w8a8_algorithm=args.w8a8_algorithm or DEFAULT_W8A8_ALGORITHM,
        w8a8_hybrid_cos=args.w8a8_hybrid_cos,
        overwrite=args.overwrite, resume=args.resume, progress=sys.stderr.isatty(),
        npu_experts=args.npu_experts,
    )
    try:
        report = convert(args.hf_dir, args.out_dir, opts)
    except (ConvertError, ConfigError, CheckpointError, CalibrationError, TokenizerError,
            BundleError, RknnToolkitError) as exc:
        print(f"ling3-rknn convert: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    stage_mib = sum(report.stage_bytes.values()) / 2**20
    where = "NPU-resident" if args.target == "rk3588" else "of CPU stage weights"
    print(f"bundle written to {report.bundle} in {report.seconds:.1f} s; "
          f"{len(report.stage_bytes)} stage graphs, {stage_mib:.1f} MiB {where}")
    if report.placement is not None:
        p = report.placement
        print(f"placement: {sum(len(v) for v in p.plan.npu_experts.values())} experts on the "
              f"NPU, ~{p.expected_calls_per_token:.1f} NPU calls per token")
    return 0
