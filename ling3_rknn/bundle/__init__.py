"""The converted-model bundle: its format, reading it, and (host only) writing it.

* :mod:`.format` - the vocabulary spelled once: version, option enums, ``StageName``,
  CPU-weights keys, placeholder magic.
* :mod:`.manifest` - the typed ``Manifest`` and its schema check.
* :mod:`.reader` - ``Bundle.open``: manifest + verification of every file.
* :mod:`.writer` - ``BundleWriter``, all-or-nothing; used only by the converter.
* :mod:`.errors` - one typed error per way a bundle can be wrong.

docs/bundle-format.md describes the format.
"""

from .errors import (
    BundleError,
    BundleExistsError,
    BundleNotFoundError,
    FileCorruptError,
    FormatVersionError,
    IncompleteBundleError,
    ManifestError,
    MissingFileError,
    TemplateMismatchWarning,
)
from .format import (
    CORE_MASK_NAMES,
    CPU_QUANT_TYPES,
    EMBEDDING_KEY,
    EXPERT_FORMATS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    NPU_MATMUL_EXPERT_FORMATS,
    NPU_QUANT_TYPES,
    PLACEHOLDER_MAGIC,
    QMOE_FORMATS,
    QUANT_TYPES,
    READABLE_FORMAT_VERSIONS,
    STAGE_QUANTS,
    TARGETS,
    WEIGHTS_FILE,
    StageName,
    conv_key,
    expert_bias_key,
    mla_key_basis_key,
    mla_value_basis_key,
)
from .manifest import (
    ExpertsSpec,
    FileEntry,
    Manifest,
    NpuMatmulExpertsSpec,
    PlacementPlan,
    StageSpec,
)
from .reader import STAMP, Bundle, VerifyMode, sha256_file
from .writer import BundleWriter

__all__ = [
    "CORE_MASK_NAMES",
    "CPU_QUANT_TYPES",
    "EMBEDDING_KEY",
    "EXPERT_FORMATS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NPU_MATMUL_EXPERT_FORMATS",
    "NPU_QUANT_TYPES",
    "PLACEHOLDER_MAGIC",
    "QMOE_FORMATS",
    "QUANT_TYPES",
    "READABLE_FORMAT_VERSIONS",
    "STAGE_QUANTS",
    "STAMP",
    "TARGETS",
    "WEIGHTS_FILE",
    "Bundle",
    "BundleError",
    "BundleExistsError",
    "BundleNotFoundError",
    "BundleWriter",
    "ExpertsSpec",
    "FileCorruptError",
    "FileEntry",
    "FormatVersionError",
    "IncompleteBundleError",
    "Manifest",
    "ManifestError",
    "MissingFileError",
    "NpuMatmulExpertsSpec",
    "PlacementPlan",
    "StageName",
    "StageSpec",
    "TemplateMismatchWarning",
    "VerifyMode",
    "conv_key",
    "expert_bias_key",
    "mla_key_basis_key",
    "mla_value_basis_key",
    "sha256_file",
]
