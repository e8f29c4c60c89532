"""What to synthesize: architectures, presets shaped like real MoE checkpoints, and the resolved spec.

A preset fixes every shape of a real model (attention heads, head size, context length); explicit
arguments override it, so `--preset qwen3-30b-a3b --layers 8 --experts 32` keeps Qwen3-30B-A3B's
attention and expert size with fewer layers and experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from moestream.errors import MoestreamError

ARCHS: tuple[str, ...] = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "gpt_oss",
)
DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


@dataclass(frozen=True)
class SynthSpec:
    """A fully resolved synthetic model: architecture, sizes and how to fill the weights.

    `heads`, `kv_heads` and `head_dim` come from the preset, or are derived from `hidden` when None.
    `extra` holds further config keyword arguments (context length, RoPE) that a preset pins.
    """

    arch: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    dtype: str = "bf16"
    preset: str | None = None
    seed: int = 0
    mxfp4: bool = False
    realistic_routing: bool = True
    vocab_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def torch_dtype_name(self) -> str:
        """The dtype as transformers writes it in config.json ("bfloat16", ...)."""
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Preset:
    """The shape of a real model; `extra` goes into the transformers config as is."""

    arch: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    about: str = ""


PRESETS: dict[str, Preset] = {
    "qwen3-30b-a3b": Preset(
        "qwen3_moe",
        layers=48,
        experts=128,
        top_k=8,
        hidden=2048,
        moe_intermediate=768,
        heads=32,
        kv_heads=4,
        head_dim=128,
        extra={
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        about="Qwen3-30B-A3B: 48 layers x 128 experts, top-8, 32 heads / 4 kv heads of 128",
    ),
    "olmoe-1b-7b": Preset(
        "olmoe",
        layers=16,
        experts=64,
        top_k=8,
        hidden=2048,
        moe_intermediate=1024,
        heads=16,
        kv_heads=16,
        head_dim=128,
        extra={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
        about="OLMoE-1B-7B: 16 layers x 64 experts, top-8, 16 heads of 128",
    ),
    "gpt-oss-20b": Preset(
        "gpt_oss",
        layers=24,
        experts=32,
        top_k=4,
        hidden=2880,
        moe_intermediate=2880,
        heads=64,
        kv_heads=8,
        head_dim=64,
        # GptOssConfig's default RoPE is already gpt-oss's YaRN (theta 150000, factor 32)
        extra={"max_position_embeddings": 131072, "sliding_window": 128},
        about="gpt-oss-20b: 24 layers x 32 experts, top-4, 64 heads / 8 kv heads of 64",
    ),
    # about 1 GiB of bf16 routed experts (5 x 64 x 3 x 1024 x 512 x 2 B = 960 MiB, 192 MiB a layer, so
    # --layers 11 gives 2 GiB); one token's working set, 5 layers x top-8 x 3 MiB = 120 MiB, fits the
    # 128 MiB cache of `moestream demo`
    "demo": Preset(
        "qwen3_moe",
        layers=5,
        experts=64,
        top_k=8,
        hidden=1024,
        moe_intermediate=512,
        heads=16,
        kv_heads=4,
        head_dim=64,
        extra={"max_position_embeddings": 4096, "norm_topk_prob": True},
        about="small Qwen3-MoE with 960 MiB of bf16 experts, for `moestream demo`",
    ),
}


def resolve_spec(preset: str | None = None, **given: Any) -> SynthSpec:
    """Merge a preset with explicit arguments (None means "not given") into a validated SynthSpec.

    Raises:
        MoestreamError: unknown preset or architecture, a missing size, or inconsistent sizes.
    """
    values = {k: v for k, v in given.items() if v is not None}
    if preset is not None:
        if preset not in PRESETS:
            raise MoestreamError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
        base = PRESETS[preset]
        if "arch" in values and values["arch"] != base.arch:
            raise MoestreamError(f"preset {preset!r} is a {base.arch} model, not {values['arch']}")
        merged = {k: v for k, v in vars(base).items() if k != "about"}
        if values.get("hidden", base.hidden) != base.hidden:
            # the preset's attention shape belongs to its hidden size: derive a new one
            merged.update(heads=None, kv_heads=None, head_dim=None)
        merged.update(values)
        values = merged
    missing = [
        k for k in ("arch", "layers", "experts", "top_k", "hidden", "moe_intermediate") if k not in values
    ]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise MoestreamError(f"give a --preset or all of the sizes; missing: {flags}")
    values["dtype"] = normalize_dtype(values.get("dtype", "bf16"))
    return SynthSpec(preset=preset, **values)


def normalize_dtype(name: str) -> str:
    """Map "bf16"/"bfloat16"/... to one of bf16, fp16, fp32."""
    key = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPES:
        raise MoestreamError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return key


def with_attention_shape(spec: SynthSpec) -> SynthSpec:
    """Fill in heads, kv_heads and head_dim derived from `hidden` where the spec leaves them open."""
    head_dim = spec.head_dim or next(
        (d for d in (128, 64, 32, 16, 8) if spec.hidden % d == 0 and spec.hidden // d >= 4), None
    )
    if head_dim is None:
        raise MoestreamError(f"hidden size {spec.hidden} must be a multiple of 8 and at least 32")
    heads = spec.heads or max(1, spec.hidden // head_dim)
    kv_heads = spec.kv_heads or max(
        d for d in range(1, heads + 1) if heads % d == 0 and d <= max(2, heads // 4)
    )
    if heads % kv_heads:
        raise MoestreamError(f"{heads} attention heads are not a multiple of {kv_heads} kv heads")
    return replace(spec, heads=heads, kv_heads=kv_heads, head_dim=head_dim)


def _validate(spec: SynthSpec) -> None:
    if spec.arch not in ARCHS:
        raise MoestreamError(f"unknown architecture {spec.arch!r} (choose from {', '.join(ARCHS)})")
    if spec.dtype not in DTYPES:
        raise MoestreamError(f"unknown dtype {spec.dtype!r} (choose from {', '.join(DTYPES)})")
    for name in ("layers", "experts", "top_k", "hidden", "moe_intermediate"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MoestreamError(f"--{name.replace('_', '-')} must be a positive integer, not {value!r}")
    if spec.top_k > spec.experts:
        raise MoestreamError(f"--top-k {spec.top_k} is more than the {spec.experts} experts per layer")
    if spec.mxfp4 and spec.arch != "gpt_oss":
        raise MoestreamError(f"--mxfp4 is the gpt_oss expert format; {spec.arch} checkpoints do not use it")
    if spec.mxfp4 and (spec.hidden % 32 or spec.moe_intermediate % 32):
        raise MoestreamError(
            f"--mxfp4 packs blocks of 32 values: hidden ({spec.hidden}) and moe-intermediate "
            f"({spec.moe_intermediate}) must both be multiples of 32"
        )
    if spec.vocab_size is not None and spec.vocab_size < 1:
        raise MoestreamError(f"vocab size must be positive, not {spec.vocab_size}")
    if spec.seed < 0:
        raise MoestreamError(f"--seed must be zero or positive, not {spec.seed}")
