"""The architecture table: which transformers experts class to replace, and how its experts compute.

Adding an architecture whose experts follow the transformers 5.x contract
`experts(hidden [T,H], top_k_index [T,K], top_k_weights [T,K]) -> [T,H]` is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.hfconfig import text_config


@dataclass(frozen=True)
class Arch:
    model_type: str
    experts_class: str  # the transformers class name that `register_patch_mapping` replaces
    family: str  # "swiglu" or "gpt_oss" (see moestream.store.experts)


ARCHES: dict[str, Arch] = {
    a.model_type: a
    for a in (
        Arch("qwen3_moe", "Qwen3MoeExperts", "swiglu"),
        Arch("qwen2_moe", "Qwen2MoeExperts", "swiglu"),
        Arch("mixtral", "MixtralExperts", "swiglu"),
        Arch("olmoe", "OlmoeExperts", "swiglu"),
        Arch("deepseek_v2", "DeepseekV2Experts", "swiglu"),
        Arch("deepseek_v3", "DeepseekV3Experts", "swiglu"),
        Arch("glm4_moe", "Glm4MoeExperts", "swiglu"),
        Arch("qwen3_next", "Qwen3NextExperts", "swiglu"),
        Arch("qwen3_5_moe", "Qwen3_5MoeExperts", "swiglu"),
        Arch("qwen3_5_moe_text", "Qwen3_5MoeExperts", "swiglu"),
        Arch("gpt_oss", "GptOssExperts", "gpt_oss"),
    )
}


def arch_for(config: Any) -> Arch:
    """The table entry for a config.

    Raises:
        UnsupportedModelError: dense or unknown model_type.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in ARCHES:
        return ARCHES[model_type]
    supported = ", ".join(sorted(ARCHES))
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported Mixture-of-Experts architecture "
        f"(supported: {supported}); dense models need no expert streaming"
    )


def num_experts(config: Any) -> int:
    cfg = text_config(config)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, name, None)
        if value:
            return int(value)
    raise UnsupportedModelError(f"config of model_type {config.model_type!r} names no routed expert count")


def top_k(config: Any) -> int:
    """Experts routed per token.

    Raises:
        CheckpointError: the config's `num_experts_per_tok` is not between 1 and the routed expert count.
    """
    k = int(text_config(config).num_experts_per_tok)
    if not 1 <= k <= num_experts(config):
        raise CheckpointError(
            f"config.json sets num_experts_per_tok to {k}, outside "
            f"1..{num_experts(config)} (the routed expert count)"
        )
    return k
