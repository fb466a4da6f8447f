"""``ModelConfig``: the Ling-3.0 (``bailing_hybrid``) hyper-parameters read from HF ``config.json``.

Two spellings exist in the wild: the released checkpoint's keys (``num_local_experts``,
``num_experts_per_tok``, ``n_group``, ``head_dim`` = KDA head dim, ...) and what transformers
5.24 writes on ``save_pretrained`` (``num_experts``, ``num_experts_per_token``,
``num_expert_group``, ``linear_head_dim``, ``head_dim`` = *rope* head dim, ...). Both are
accepted. Anything this runtime cannot compute faithfully (YaRN RoPE, SwiGLU clamps, KDA LoRA,
non-sigmoid routers) is rejected with a ``ConfigError`` naming the key, rather than silently
producing different numbers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

LayerKind = Literal["kda", "mla"]

_MISSING = object()


class ConfigError(ValueError):
    """A config.json value is missing, mistyped or unsupported; ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config.json: {key!r}: {message}")
        self.key = key


def _lookup(d: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, Any]:
    for name in names:
        if name in d:
            return name, d[name]
    return names[0], _MISSING


def _int(d: Mapping[str, Any], *names: str, default: Any = _MISSING, minimum: int = 1) -> int:
    key, value = _lookup(d, names)
    if value is _MISSING:
        if default is _MISSING:
            raise ConfigError(key, "is required")
        return default
    # bool is an int subclass in Python; `true` for a dimension is a bug in the file.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
    return value


def _opt_int(d: Mapping[str, Any], *names: str, minimum: int = 1) -> int | None:
    key, value = _lookup(d, names)
    if value is _MISSING or value is None:
        return None
    return _int({key: value}, key, minimum=minimum)


def _float(d: Mapping[str, Any], *names: str, default: Any = _MISSING) -> float:
    key, value = _lookup(d, names)
    if value is _MISSING:
        if default is _MISSING:
            raise ConfigError(key, "is required")
        return float(default)
    # Integers are accepted on purpose: the released file writes `kda_lower_bound: -5`.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(key, f"must be finite, got {value!r}")
    return float(value)


def _bool(d: Mapping[str, Any], *names: str, default: bool) -> bool:
    key, value = _lookup(d, names)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _token_ids(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigError(key, f"must be a token id or a list of token ids, got {value!r}")
    return tuple(items)


def _expect(d: Mapping[str, Any], key: str, allowed: tuple[Any, ...], why: str) -> None:
    if key in d and d[key] not in allowed:
        raise ConfigError(key, f"{d[key]!r} is not supported ({why})")


@dataclass(frozen=True)
class ModelConfig:
    """Validated hyper-parameters; every field is in the released checkpoint's vocabulary."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_group_size: int
    num_attention_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    kda_safe_gate: bool
    kda_lower_bound: float
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    max_position_embeddings: int
    intermediate_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    layer_kinds: tuple[LayerKind, ...]

    # ----------------------------------------------------------------- derived
    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (generation should stop on any of ``eos_token_ids``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def kda_proj_dim(self) -> int:
        return self.num_attention_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token per MLA layer: normalised c_kv then rotated k_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        # transformers sizes the shared expert as moe_intermediate_size * n_shared_experts.
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mla")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form in this class's own vocabulary (``from_dict`` reads it back)."""
        d = asdict(self)
        d["eos_token_id"] = list(self.eos_token_ids)
        d["head_dim"] = d.pop("kda_head_dim")
        d["layer_types"] = [
            "full_attention" if k == "mla" else "linear_attention" for k in self.layer_kinds
        ]
        del d["eos_token_ids"], d["layer_kinds"]
        return d

    # ----------------------------------------------------------------- parsing
    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ModelConfig:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError("config.json", f"file not found: {os.fspath(path)}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError("config.json", f"is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        if not isinstance(d, Mapping):
            raise ConfigError("config.json", "top level must be a JSON object")
        _expect(d, "model_type", ("bailing_hybrid", "bailing_moe_v3"), "not a Ling-3.0 model")
        _expect(d, "hidden_act", ("silu",), "only SiLU is implemented")
        _expect(d, "score_function", ("sigmoid",), "only the sigmoid router is implemented")
        _expect(d, "topk_method", ("noaux_tc",), "only group-limited noaux_tc routing")
        _expect(d, "rope_interleave", (True,), "Ling-3.0 rotates interleaved pairs")
        _expect(d, "use_kda_lora", (False, None), "KDA LoRA gates are not implemented")
        _expect(d, "no_kda_lora", (True, None), "KDA LoRA gates are not implemented")
        _expect(d, "attention_bias", (False, None), "biased projections are not implemented")
        _expect(
            d, "gated_attention_proj_granularity_type", ("head_wise", None), "head-wise MLA gate"
        )
        for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            value = d.get(key)
            if value is not None and any(v not in (None, 0) for v in value):
                raise ConfigError(key, "SwiGLU clamps are not implemented (Ling-3.0-flash only)")

        hidden = _int(d, "hidden_size")
        layers = _int(d, "num_hidden_layers")
        group = _int(d, "layer_group_size")
        if layers % group:
            raise ConfigError(
                "layer_group_size",
                f"{group} does not divide num_hidden_layers={layers} into hybrid groups",
            )
        heads = _int(d, "num_attention_heads")
        for key in ("num_key_value_heads", "linear_num_heads"):
            if d.get(key) not in (None, heads):
                raise ConfigError(key, f"must equal num_attention_heads={heads}, got {d[key]!r}")
        if d.get("num_kv_heads_for_linear_attn") not in (None, 0, heads):
            raise ConfigError("num_kv_heads_for_linear_attn", "grouped KDA heads not supported")
        # transformers rewrites head_dim to the rope head dim on save and keeps the KDA one
        # in linear_head_dim; the released file has only head_dim (= KDA head dim).
        kda_head_dim = _int(d, "linear_head_dim", "head_dim")
        nope = _int(d, "qk_nope_head_dim")
        rope = _int(d, "qk_rope_head_dim")
        if rope % 2:
            raise ConfigError("qk_rope_head_dim", f"must be even to rotate pairs, got {rope}")
        if d.get("qk_head_dim") not in (None, nope + rope):
            raise ConfigError("qk_head_dim", "must equal qk_nope_head_dim + qk_rope_head_dim")

        rope_theta = _parse_rope(d)
        kinds = _parse_layer_kinds(d, layers, group)
        first_dense = _int(d, "first_k_dense_replace", minimum=0)
        if first_dense > layers:
            raise ConfigError("first_k_dense_replace", f"exceeds num_hidden_layers={layers}")
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is not None:
            expect = ["dense" if i < first_dense else "sparse" for i in range(layers)]
            if not isinstance(mlp_types, list) or mlp_types[:layers] != expect:
                raise ConfigError("mlp_layer_types", "disagrees with first_k_dense_replace")

        experts = _int(d, "num_local_experts", "num_experts")
        top_k = _int(d, "num_experts_per_tok", "num_experts_per_token")
        n_group = _int(d, "n_group", "num_expert_group", default=1)
        topk_group = _int(d, "topk_group", default=n_group)
        if experts % n_group:
            raise ConfigError("n_group", f"{n_group} does not divide num_experts={experts}")
        if experts // n_group < 2:
            raise ConfigError("n_group", "each group needs >= 2 experts (top-2 group score)")
        if topk_group > n_group:
            raise ConfigError("topk_group", f"{topk_group} exceeds n_group={n_group}")
        if top_k > topk_group * (experts // n_group):
            raise ConfigError("num_experts_per_tok", f"{top_k} exceeds the experts kept")
        lower_bound = _float(d, "kda_lower_bound", default=-5.0)
        if lower_bound >= 0:
            raise ConfigError("kda_lower_bound", f"must be negative, got {lower_bound}")
        eps = _float(d, "rms_norm_eps", default=1e-6)
        if eps <= 0:
            raise ConfigError("rms_norm_eps", f"must be positive, got {eps}")
        vocab = _int(d, "vocab_size")
        eos = _token_ids(d, "eos_token_id")
        for key, ids in (("eos_token_id", eos), ("pad_token_id", _token_ids(d, "pad_token_id"))):
            if any(i >= vocab for i in ids):
                raise ConfigError(key, f"{list(ids)} is outside vocab_size={vocab}")

        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            layer_group_size=group,
            num_attention_heads=heads,
            kda_head_dim=kda_head_dim,
            short_conv_kernel_size=_int(d, "short_conv_kernel_size", "linear_conv_kernel_dim"),
            kda_safe_gate=_bool(d, "kda_safe_gate", default=True),
            kda_lower_bound=lower_bound,
            q_lora_rank=_opt_int(d, "q_lora_rank"),
            kv_lora_rank=_int(d, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=_int(d, "v_head_dim"),
            rope_theta=rope_theta,
            max_position_embeddings=_int(d, "max_position_embeddings", "model_max_length"),
            intermediate_size=_int(d, "intermediate_size"),
            first_k_dense_replace=first_dense,
            num_experts=experts,
            num_experts_per_tok=top_k,
            num_shared_experts=_int(d, "n_shared_experts", "num_shared_experts", minimum=0),
            moe_intermediate_size=_int(d, "moe_intermediate_size"),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=_float(d, "routed_scaling_factor", default=1.0),
            norm_topk_prob=_bool(d, "norm_topk_prob", "moe_renormalize", default=True),
            rms_norm_eps=eps,
            tie_word_embeddings=_bool(d, "tie_word_embeddings", default=False),
            eos_token_ids=eos,
            pad_token_id=_opt_int(d, "pad_token_id", minimum=0),
            bos_token_id=_opt_int(d, "bos_token_id", minimum=0),
            layer_kinds=kinds,
        )


def _parse_rope(d: Mapping[str, Any]) -> float:
    """rope_theta from transformers-5 ``rope_parameters`` or the top-level key (default RoPE)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ConfigError(key, f"must be an object or null, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ConfigError(key, f"rope type {kind!r} is not supported (only default RoPE)")
        if "rope_theta" in params:
            theta = _float(params, "rope_theta")
            break
    else:
        theta = _float(d, "rope_theta")
    if theta <= 0:
        raise ConfigError("rope_theta", f"must be positive, got {theta}")
    return theta


def _parse_layer_kinds(d: Mapping[str, Any], layers: int, group: int) -> tuple[LayerKind, ...]:
    """Layer i is MLA iff (i + 1) % layer_group_size == 0; an explicit layer_types must agree."""
    kinds: tuple[LayerKind, ...] = tuple(
        "mla" if (i + 1) % group == 0 else "kda" for i in range(layers)
    )
    explicit = d.get("layer_types")
    if explicit is not None:
        names = {"full_attention": "mla", "linear_attention": "kda"}
        # transformers keeps the full list when a model is truncated; only the first
        # num_hidden_layers entries are used (docs/model.md 1).
        if (
            not isinstance(explicit, list)
            or len(explicit) < layers
            or any(names.get(t) != k for t, k in zip(explicit[:layers], kinds, strict=True))
        ):
            raise ConfigError("layer_types", f"disagrees with layer_group_size={group}")
    return kinds
