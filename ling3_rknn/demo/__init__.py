"""The embedded default model: what ``ling3-rknn serve`` runs with no model flag (``make serve``).

A 7.1M-parameter model of exactly the Ling-3.0 architecture (KDA + MLA, MoE with expert
groups and a shared expert, a dense first layer, untied lm_head), trained by the project to
behave like a very small agent: it calls ``get_weather``/``get_time``-style tools for a
city, quotes the result, and answers small talk without a call. Training, corpus and
figures: ``convert/demo_model/`` and ``docs/demo-model.md``.

What ships here is that checkpoint converted by ``ling3-rknn convert`` into an rk3588
bundle (fp16 stage graphs, int4 QMoE experts), loaded exactly like a user's ``--bundle``:
on a board its graphs run on the NPU, which makes it the first smoke test of a new board;
on a host the RKNNLite mock runs their ONNX twins.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ling3_rknn.engine import Engine
    from ling3_rknn.loading import LoadOptions

DEMO_MODEL_ID = "ling-3.0-tiny-demo"


def bundle_dir() -> Path:
    return Path(str(resources.files(__name__).joinpath("bundle")))


def load_demo_engine(options: LoadOptions | None = None, *,
                     latent_dtype: str = "float32") -> Engine:
    """An ``Engine`` serving the demo bundle, loaded as ``serve --bundle`` loads one
    (``options``: serve's flags, ``loading.LoadOptions``)."""
    from ling3_rknn.loading import LoadOptions, engine_from_bundle

    return engine_from_bundle(bundle_dir(), options or LoadOptions(),
                              default_model_id=DEMO_MODEL_ID, latent_dtype=latent_dtype)
