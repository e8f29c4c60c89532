"""Tiny random-weight MoE checkpoints of every supported architecture, written by transformers itself.

These are the oracle: the stock transformers model loaded from the same directory is what streamed
output must equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as T
from safetensors.torch import load_file, save_file

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    eos_token_id=0,
    bos_token_id=1,
    pad_token_id=0,
)
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
LINEAR_ATTN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"],
)


def tiny_config(arch: str, experts: int = 8, top_k: int = 2, **overrides):
    config = _tiny_config(arch, experts, top_k)
    for name, value in overrides.items():  # e.g. a layout a real checkpoint of the family has
        setattr(config, name, value)
    return config


def _tiny_config(arch: str, experts: int, top_k: int):
    moe = dict(num_experts_per_tok=top_k)
    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **COMMON,
            **moe,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=experts,
            norm_topk_prob=True,
        )
    if arch == "qwen2_moe":
        return T.Qwen2MoeConfig(
            **COMMON,
            **moe,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=experts,
        )
    if arch == "mixtral":
        return T.MixtralConfig(**COMMON, **moe, intermediate_size=32, num_local_experts=experts)
    if arch == "olmoe":
        return T.OlmoeConfig(**COMMON, **moe, intermediate_size=32, num_experts=experts)
    if arch == "deepseek_v2":
        return T.DeepseekV2Config(
            **COMMON,
            **moe,
            **MLA,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            head_dim=8,
            n_group=1,
            topk_group=1,
        )
    if arch == "deepseek_v3":
        return T.DeepseekV3Config(
            **COMMON,
            **moe,
            **MLA,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        )
    if arch == "glm4_moe":
        return T.Glm4MoeConfig(
            **COMMON,
            **moe,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
    if arch in ("gpt_oss", "gpt_oss_mxfp4"):
        return T.GptOssConfig(
            **COMMON,
            **moe,
            head_dim=16,
            intermediate_size=64,
            num_local_experts=experts,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        )
    if arch == "qwen3_next":
        return T.Qwen3NextConfig(
            **COMMON,
            **moe,
            **LINEAR_ATTN,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=experts,
        )
    if arch == "qwen3_5_moe":
        return T.Qwen3_5MoeTextConfig(
            **COMMON,
            **moe,
            **LINEAR_ATTN,
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=experts,
        )
    raise ValueError(arch)


ARCHS = [
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
    "gpt_oss_mxfp4",
]


def write_tiny(arch: str, out: Path, seed: int = 0, experts: int = 8, top_k: int = 2, **overrides) -> Path:
    """Save a tiny random model of `arch` with transformers' save_pretrained (its real on-disk layout).

    Weights are scaled up from transformers' tiny init so routing and logits are not degenerate.
    qwen3_5_moe is rewritten into the fused `model.language_model.*` layout of real Qwen3.5 files;
    gpt_oss_mxfp4 into MXFP4 blocks and scales.
    """
    torch.manual_seed(seed)
    config = tiny_config(arch, experts, top_k, **overrides)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2 if "embed" in name or "lm_head" in name else 0.15)
    model.save_pretrained(out)
    write_tokenizer(out)
    if arch == "qwen3_5_moe":
        _fuse_qwen3_5(out, config)
    if arch == "gpt_oss_mxfp4":
        _to_mxfp4(out)
    return out


def _fuse_qwen3_5(out: Path, config) -> None:
    path = out / "model.safetensors"
    sd = load_file(path)
    fused, E = {}, config.num_experts
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([sd.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)])
        up = torch.stack([sd.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)])
        down = torch.stack([sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
        fused[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = down
    for key, value in sd.items():
        fused[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = value
    save_file({k: v.contiguous() for k, v in fused.items()}, path, metadata={"format": "pt"})


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference quantizer: w [E, R, K] -> blocks [E, R, K/32, 16] u8, scales [E, R, K/32] u8."""
    E, R, K = w.shape
    groups = w.reshape(E, R, K // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-12)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exp)[..., None]
    codes = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)  # nearest E2M1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def _to_mxfp4(out: Path) -> None:
    path = out / "model.safetensors"
    sd = load_file(path)
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(key).transpose(1, 2).contiguous()  # stored [E, K, R] -> [E, R, K] like the real files
        sd[key + "_blocks"], sd[key + "_scales"] = quantize_mxfp4(w)
    save_file(sd, path, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Streaming weights from disk lets a small machine run a large model.",
    "안녕하세요. 오늘은 날씨가 좋습니다.",
    "Hello, world! 0123456789",
]


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer (vocab < 320) with a ChatML template, saved beside a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=1,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|bos|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf.save_pretrained(out)
