"""config.json of the Gated DeltaNet hybrids -> ModelConfig fields (models/qwen3_next.py has the math).

Qwen3-Next (`Qwen3NextForCausalLM`), Qwen3.5 (`Qwen3_5ForCausalLM`, dense) and Qwen3.5-MoE
(`Qwen3_5MoeForCausalLM`) share one layer: a pre-normed mixer (Gated DeltaNet, or gated full
attention with q/k RMSNorm and partial RoPE), then a pre-normed dense SwiGLU MLP or a softmax top-k
MoE with a sigmoid-gated shared expert. `layer_types` (or `full_attention_interval`) places the
attention layers. The published Qwen3.5 checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`) carry these fields in `text_config`; their vision tower is not
served. `mtp_num_hidden_layers` multi-token-prediction layers (`mtp.*`) serve `speculative_method="mtp"`
(speculative/mtp_model.py). A field that would
change the math and that we do not implement is a ValueError naming it.
"""

from __future__ import annotations

from typing import Any

from replayssm.models.config_fields import ATTENTION, GDN, MLP, MOE
from replayssm.models.config_fields import dtype_of as _dtype
from replayssm.models.config_fields import eos_ids as _eos
from replayssm.models.config_fields import field as _field

QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5 = "Qwen3_5ForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
QWEN3_5_VL = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE_VL = "Qwen3_5MoeForConditionalGeneration"
GDN_ARCHITECTURES = (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, QWEN3_5_VL, QWEN3_5_MOE_VL)
_MOE_ARCHITECTURES = (QWEN3_NEXT, QWEN3_5_MOE, QWEN3_5_MOE_VL)
_LAYER_NAMES = {"linear_attention": GDN, "full_attention": ATTENTION}


def _rope(raw: dict, source: str, f) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor). Plain RoPE only; Qwen3.5's multimodal RoPE sections turn
    text positions like plain RoPE (the three position components are equal for text)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"{source}: field 'rope_parameters.rope_type' {kind!r} is not supported (default only)"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def qwen3_next_fields(raw: dict, source: str, arch: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Gated DeltaNet hybrid's config.json."""
    assert arch in GDN_ARCHITECTURES, arch
    top = raw
    if arch in (QWEN3_5_VL, QWEN3_5_MOE_VL):
        raw = raw.get("text_config")
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: missing field 'text_config'")
        source = f"{source} (text_config)"
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    if f("hidden_act", default="silu", kind=str) != "silu":
        raise ValueError(f"{source}: field 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
    if f("attention_bias", default=False, kind=bool):
        raise ValueError(f"{source}: field 'attention_bias' true is not supported")
    num_layers = f("num_hidden_layers")
    names = raw.get("layer_types")
    if names is None:
        interval = f("full_attention_interval", default=4)
        names = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(names, list) or len(names) != num_layers or set(names) - set(_LAYER_NAMES):
        raise ValueError(
            f"{source}: field 'layer_types' must list {num_layers} entries of "
            f"{sorted(_LAYER_NAMES)}, got {names!r}"
        )
    layers = tuple(_LAYER_NAMES[n] for n in names)
    moe = arch in _MOE_ARCHITECTURES and f("num_experts", default=0) > 0
    if moe:
        step = f("decoder_sparse_step", default=1)
        only = raw.get("mlp_only_layers") or []
        ffn = tuple(MOE if i not in only and (i + 1) % step == 0 else MLP for i in range(num_layers))
    else:
        ffn = (MLP,) * num_layers
    theta, factor = _rope(raw, source, f)
    heads = f("num_attention_heads")
    head_dim = f("head_dim", default=None) or f("hidden_size") // heads
    hk, hv = f("linear_num_key_heads"), f("linear_num_value_heads")
    if hv % hk:
        raise ValueError(
            f"{source}: field 'linear_num_value_heads' ({hv}) must be a multiple of "
            f"'linear_num_key_heads' ({hk})"
        )
    eos = _eos(raw, source) or _eos(top, source)
    num_mtp = f("mtp_num_hidden_layers", default=0)
    return dict(
        architecture=arch,
        layer_types=layers,
        ffn_types=ffn,
        hidden_size=f("hidden_size"),
        vocab_size=f("vocab_size"),
        norm_eps=f("rms_norm_eps", default=1e-6, kind=float),
        tie_word_embeddings=_field(top, source, "tie_word_embeddings", default=False, kind=bool),
        dtype=_dtype(raw if raw.get("dtype") or raw.get("torch_dtype") else top, source),
        max_model_len=f("max_position_embeddings", default=32768),
        mamba_num_heads=0,
        mamba_head_dim=0,
        ssm_state_size=0,
        mamba_n_groups=1,
        conv_kernel=f("linear_conv_kernel_dim", default=4),
        chunk_size=64,
        use_conv_bias=False,
        mamba_proj_bias=False,
        gdn_num_k_heads=hk,
        gdn_num_v_heads=hv,
        gdn_k_head_dim=f("linear_key_head_dim"),
        gdn_v_head_dim=f("linear_value_head_dim"),
        num_attention_heads=heads,
        num_key_value_heads=f("num_key_value_heads", default=heads),
        head_dim=head_dim,
        rope_theta=theta,
        rotary_dim=int(head_dim * factor),
        intermediate_size=f("intermediate_size") if MLP in ffn else 0,
        mlp_act="silu",
        router="softmax_all",
        num_experts=f("num_experts") if moe else 0,
        num_experts_per_tok=f("num_experts_per_tok") if moe else 0,
        moe_intermediate_size=f("moe_intermediate_size") if moe else 0,
        moe_shared_intermediate_size=f("shared_expert_intermediate_size", default=0) if moe else 0,
        # Qwen3.5-MoE's router always renormalizes its top-k weights.
        norm_topk_prob=f("norm_topk_prob", default=True, kind=bool) if arch == QWEN3_NEXT else True,
        eos_token_ids=eos,
        bos_token_id=f("bos_token_id", default=None),
        # The MTP layers (`mtp.*`): gated attention, then the model's FFN kind (speculative/mtp_model.py).
        num_nextn_predict_layers=num_mtp,
        mtp_layer_types=(ATTENTION,) * num_mtp,
    )
