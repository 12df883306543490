"""ModelConfig: the Hugging Face config.json of a supported checkpoint, normalized once.

Every model, cache and planner reads these plain fields, never the raw HF dict. Supported
architectures: `NemotronHForCausalLM` (Mamba-2 + attention + MLP + MoE layers, any
transformers version: `layers_block_type` or `hybrid_override_pattern`, legacy and current
layer names), `Mamba2ForCausalLM` (pure Mamba-2), and the two-part families read by
config_two_part.py: `GraniteMoeHybridForCausalLM` (Granite 4.0-H) and `BambaForCausalLM`;
`FalconH1ForCausalLM` (parallel attention + Mamba-2 layers, read by config_falcon_h1.py);
`Zamba2ForCausalLM` (Mamba-2 layers and hybrid layers with shared transformer blocks, config_zamba2.py);
the Gated DeltaNet hybrids Qwen3-Next and Qwen3.5 (config_qwen3_next.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replayssm.models.config_falcon_h1 import FALCON_H1, FalconH1Multipliers, falcon_h1_fields
from replayssm.models.config_fields import ATTENTION, GDN, LAYER_TYPES, MAMBA, MLP, MOE, PARALLEL
from replayssm.models.config_fields import dtype_of as _dtype
from replayssm.models.config_fields import eos_ids as _eos
from replayssm.models.config_fields import field as _field
from replayssm.models.config_fields import layer_list as _layer_list
from replayssm.models.config_quant import QuantConfig, quant_config_from_hf
from replayssm.models.config_qwen3_next import GDN_ARCHITECTURES, qwen3_next_fields
from replayssm.models.config_two_part import TWO_PART, two_part_fields
from replayssm.models.config_zamba2 import ZAMBA2, Zamba2Shared, zamba2_fields

TWO_PART_ARCHITECTURES = TWO_PART
ARCHITECTURES = ("NemotronHForCausalLM", "Mamba2ForCausalLM", *TWO_PART_ARCHITECTURES, FALCON_H1, ZAMBA2,
                 *GDN_ARCHITECTURES)
MLP_ACTIVATIONS = ("relu2", "silu", "gelu")
# MoE routers: Nemotron-H's sigmoid scores with grouped top-k and a correction bias; Granite's
# softmax over the top-k router logits; Qwen's softmax over all experts, then the top k (renormalized).
ROUTERS = ("sigmoid_grouped", "softmax_topk", "softmax_all")


@dataclass(frozen=True)
class ModelConfig:
    """Plain model description. Mamba letters follow the op API: H heads, P head dim, N state, G groups."""

    architecture: str
    layer_types: tuple[str, ...]
    hidden_size: int
    vocab_size: int
    norm_eps: float
    tie_word_embeddings: bool
    dtype: torch.dtype
    max_model_len: int
    # Mamba-2 mixer
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    mamba_n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    mamba_proj_bias: bool
    # Gated DeltaNet mixer (Qwen3-Next, Qwen3.5): key heads Hk, value heads Hv, head dims Dk, Dv; its
    # short conv over [q, k, v] uses conv_kernel.
    gdn_num_k_heads: int = 0
    gdn_num_v_heads: int = 0
    gdn_k_head_dim: int = 0
    gdn_v_head_dim: int = 0
    # Not applied: transformers clamps Δ at this floor in its prefill scan only (never in decode);
    # our ops, like the fused Mamba kernels, use plain softplus. Kept for the record.
    time_step_min: float = 0.0
    residual_in_fp32: bool = False
    # Attention (no positional encoding in Nemotron-H)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    # Rotary position embedding of the attention layers: rope_theta 0 = none; rotary_dim 0 = head_dim
    # (fewer: partial rotary on the first rotary_dim channels of each head)
    rope_theta: float = 0.0
    rotary_dim: int = 0
    # Dense MLP (relu2 for Nemotron-H)
    intermediate_size: int = 0
    mlp_bias: bool = False
    mlp_act: str = "relu2"
    # MoE routing (sigmoid scores + e_score_correction_bias, grouped top-k)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Tokens
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Multi-token prediction (loaded later; recorded now)
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    # Two-part layers (Granite 4.0-H, Bamba): layer i is mixer layer_types[i] (mamba or attention), then
    # the feed-forward ffn_types[i] (mlp or moe), each pre-normed with its own residual. Empty for
    # one-part layers (one mixer per layer).
    ffn_types: tuple[str, ...] = ()
    router: str = "sigmoid_grouped"
    # muP multipliers (Granite): embeddings are scaled by embedding_multiplier, every sub-block
    # output by residual_multiplier before its residual add, logits divided by logits_scaling;
    # attention_scale is the softmax scale (0: head_dim ** -0.5).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float = 0.0
    logits_scaling: float = 1.0
    # Falcon-H1's own multipliers and Mamba options; set exactly when layer_types are PARALLEL.
    falcon_h1: FalconH1Multipliers | None = None
    # Zamba2's shared transformer blocks; set exactly for Zamba2, whose hybrid layers are PARALLEL.
    zamba2: Zamba2Shared | None = None
    # FP8 weights of a pre-quantized checkpoint (config_quant.py); None: the weights are bf16 / fp32.
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if not self.layer_types or bad:
            raise ValueError(f"layer_types must be a non-empty list of {LAYER_TYPES}, got {bad or 'empty'}")
        if self.num_mamba_layers:
            if self.mamba_num_heads % self.mamba_n_groups:
                raise ValueError(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of "
                                 f"n_groups={self.mamba_n_groups}")
            if self.conv_kernel < 2:
                raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.num_gdn_layers and self.num_mamba_layers:
            raise ValueError("a model holds Mamba-2 or Gated DeltaNet layers, not both")
        if self.num_gdn_layers and (self.gdn_num_v_heads % max(self.gdn_num_k_heads, 1)
                                    or self.conv_kernel < 2):
            raise ValueError(f"gdn_num_v_heads={self.gdn_num_v_heads} must be a multiple of gdn_num_k_heads="
                             f"{self.gdn_num_k_heads} and conv_kernel={self.conv_kernel} at least 2")
        if self.num_attention_layers and self.num_attention_heads % max(self.num_key_value_heads, 1):
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_theta > 0 and self.num_attention_layers and (
                self.rotary_dim < 0 or self.rotary_dim > self.head_dim or self.rotary_dim % 2):
            raise ValueError(f"rotary_dim={self.rotary_dim} (head_dim * partial_rotary_factor) must be even "
                             f"and at most head_dim={self.head_dim}")
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_hidden_act {self.mlp_act!r} is not one of {MLP_ACTIVATIONS}")
        if self.architecture in GDN_ARCHITECTURES:
            if set(self.layer_types) - {GDN, ATTENTION} or len(self.ffn_types) != self.num_layers or \
                    set(self.ffn_types) - {MLP, MOE}:
                raise ValueError(f"{self.architecture} layers must be gdn or attention, each with mlp or "
                                 f"moe, got {self.layer_types}, {self.ffn_types}")
        elif GDN in self.layer_types:
            raise ValueError(f"gdn layers are for {GDN_ARCHITECTURES}")
        elif self.architecture in TWO_PART_ARCHITECTURES:
            if set(self.layer_types) - {MAMBA, ATTENTION}:
                raise ValueError(f"layer_types of {self.architecture} must be mamba or attention, "
                                 f"got {sorted(set(self.layer_types))}")
            if len(self.ffn_types) != len(self.layer_types) or set(self.ffn_types) - {MLP, MOE}:
                raise ValueError(f"ffn_types must give mlp or moe for each of the {self.num_layers} layers, "
                                 f"got {self.ffn_types}")
        elif self.ffn_types:
            raise ValueError(f"ffn_types is for two-part architectures {TWO_PART_ARCHITECTURES}")
        if self.zamba2 is not None:
            if set(self.layer_types) - {MAMBA, PARALLEL} or self.falcon_h1 is not None:
                raise ValueError(f"layer_types of {self.architecture} must be mamba or parallel (hybrid), "
                                 f"got {sorted(set(self.layer_types))}")
        elif (PARALLEL in self.layer_types) != (self.falcon_h1 is not None) or (
                self.falcon_h1 is not None and set(self.layer_types) != {PARALLEL}):
            raise ValueError(f"layer_types of {self.architecture} must be all parallel exactly when the "
                             f"Falcon-H1 multipliers are set, got {sorted(set(self.layer_types))}")
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r} is not one of {ROUTERS}")
        if self.has_moe and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                             f"{self.num_experts} experts")
        if MOE in self.layer_types and self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} is not a multiple of "
                             f"n_group={self.n_group}")

    @property
    def block_kinds(self) -> frozenset[str]:
        """Every sub-block kind the model holds (mixers and feed-forwards)."""
        return frozenset(self.layer_types) | frozenset(self.ffn_types)

    @property
    def has_moe(self) -> bool:
        return MOE in self.block_kinds

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count(MAMBA) + self.layer_types.count(PARALLEL)

    @property
    def num_gdn_layers(self) -> int:
        return self.layer_types.count(GDN)

    @property
    def num_recurrent_layers(self) -> int:
        """Layers that own a recurrent cache (Mamba-2 or Gated DeltaNet): the engine's slots."""
        return self.num_mamba_layers + self.num_gdn_layers

    @property
    def gdn_conv_dim(self) -> int:
        """Gated DeltaNet conv channels: q, k and v side by side."""
        return 2 * self.gdn_num_k_heads * self.gdn_k_head_dim + self.gdn_num_v_heads * self.gdn_v_head_dim

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(ATTENTION) + self.layer_types.count(PARALLEL)

    @property
    def mamba_intermediate_size(self) -> int:
        """H * P: width of x, z and the gated norm."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Conv channels: x, B and C side by side."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.ssm_state_size

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a checkpoint directory, a config.json path, or an already-parsed dict."""
        if isinstance(path_or_dict, dict):
            return _with_quant(_parse(path_or_dict, "<config dict>"), path_or_dict, None, "<config dict>")
        path = Path(path_or_dict)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{file}: config.json not found")
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: unreadable config.json ({e})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: config.json is not a JSON object")
        return _with_quant(_parse(raw, str(file)), raw, file.parent, str(file))


def _with_quant(cfg: ModelConfig, raw: dict, root: Path | None, source: str) -> ModelConfig:
    quant = quant_config_from_hf(raw, root, source)
    return cfg if quant is None else dataclasses.replace(cfg, quantization=quant)


def _parse(raw: dict, source: str) -> ModelConfig:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{source}: missing field 'architectures'")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: field 'architectures' names {arch!r}; supported: {ARCHITECTURES}")
    if arch in TWO_PART_ARCHITECTURES:
        return ModelConfig(**two_part_fields(raw, source, arch))
    if arch == FALCON_H1:
        return ModelConfig(**falcon_h1_fields(raw, source))
    if arch == ZAMBA2:
        return ModelConfig(**zamba2_fields(raw, source))
    if arch in GDN_ARCHITECTURES:
        return ModelConfig(**qwen3_next_fields(raw, source, arch))
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    if f("mamba_hidden_act", "hidden_act", default="silu", kind=str) != "silu":
        raise ValueError(f"{source}: field 'mamba_hidden_act' must be 'silu'")
    common = dict(
        architecture=arch,
        hidden_size=f("hidden_size"),
        vocab_size=f("vocab_size"),
        norm_eps=f("layer_norm_epsilon", "rms_norm_eps", default=1e-5, kind=float),
        tie_word_embeddings=f("tie_word_embeddings", default=False, kind=bool),
        dtype=_dtype(raw, source),
        chunk_size=f("chunk_size", "mamba_chunk_size", default=256),
        conv_kernel=f("conv_kernel", "mamba_d_conv", default=4),
        use_conv_bias=f("use_conv_bias", "mamba_conv_bias", default=True, kind=bool),
        time_step_min=f("time_step_min", "mamba_dt_min", default=0.0, kind=float),
        eos_token_ids=_eos(raw, source),
        bos_token_id=f("bos_token_id", default=None),
    )
    if arch == "Mamba2ForCausalLM":
        hidden, heads, head_dim = common["hidden_size"], f("num_heads"), f("head_dim", default=64)
        if heads * head_dim != f("expand", default=2) * hidden:
            raise ValueError(f"{source}: field 'num_heads' * 'head_dim' ({heads * head_dim}) must equal "
                             f"'expand' * 'hidden_size'")
        return ModelConfig(
            **common,
            layer_types=(MAMBA,) * f("num_hidden_layers"),
            max_model_len=f("max_position_embeddings", default=1 << 20),
            mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=f("state_size"),
            mamba_n_groups=f("n_groups", default=1), mamba_proj_bias=f("use_bias", default=False, kind=bool),
            residual_in_fp32=f("residual_in_fp32", default=True, kind=bool),
        )
    if raw.get("layers_block_type") is not None:
        layers = _layer_list(raw["layers_block_type"], source, "layers_block_type")
    elif raw.get("hybrid_override_pattern") is not None:
        layers = _layer_list(raw["hybrid_override_pattern"], source, "hybrid_override_pattern")
    else:
        raise ValueError(f"{source}: missing field 'layers_block_type' (or 'hybrid_override_pattern')")
    mtp = raw.get("mtp_layers_block_type") or raw.get("mtp_hybrid_override_pattern") or ()
    num_mtp = f("num_nextn_predict_layers", default=0)
    heads = f("num_attention_heads", default=0) if ATTENTION in layers else 0
    head_dim = f("head_dim", "attention_head_dim", default=None) if heads else 0
    if heads and head_dim is None:
        head_dim = common["hidden_size"] // heads
    moe = MOE in layers
    return ModelConfig(
        **common,
        layer_types=layers,
        max_model_len=f("max_position_embeddings", default=4096),
        mamba_num_heads=f("mamba_num_heads") if MAMBA in layers else 0,
        mamba_head_dim=f("mamba_head_dim") if MAMBA in layers else 0,
        ssm_state_size=f("ssm_state_size") if MAMBA in layers else 0,
        mamba_n_groups=f("n_groups", "mamba_n_groups", default=1),
        mamba_proj_bias=f("use_bias", "mamba_proj_bias", default=False, kind=bool),
        # transformers' Nemotron-H block ignores residual_in_fp32; so do we.
        residual_in_fp32=False,
        num_attention_heads=heads,
        num_key_value_heads=f("num_key_value_heads", default=heads) if heads else 0,
        head_dim=head_dim,
        attention_bias=f("attention_bias", default=False, kind=bool),
        intermediate_size=f("intermediate_size") if MLP in layers else 0,
        mlp_bias=f("mlp_bias", default=False, kind=bool),
        mlp_act=f("mlp_hidden_act", default="relu2", kind=str),
        num_experts=f("n_routed_experts", "num_local_experts") if moe else 0,
        num_experts_per_tok=f("num_experts_per_tok") if moe else 0,
        moe_intermediate_size=f("moe_intermediate_size") if moe else 0,
        moe_shared_intermediate_size=f("moe_shared_expert_intermediate_size", default=0) if moe else 0,
        moe_latent_size=f("moe_latent_size", default=None),
        n_group=f("n_group", default=1),
        topk_group=f("topk_group", default=1),
        norm_topk_prob=f("norm_topk_prob", default=True, kind=bool),
        routed_scaling_factor=f("routed_scaling_factor", default=1.0, kind=float),
        num_nextn_predict_layers=num_mtp,
        mtp_layer_types=_layer_list(mtp, source, "mtp_layers_block_type") if num_mtp and mtp else (),
    )

