"""config.json of the two-part hybrid families -> ModelConfig fields (models/two_part.py has the math).

Granite 4.0-H (`GraniteMoeHybridForCausalLM`): `layer_types` names each layer's mixer (mamba or
attention, in any spelling transformers accepts); every layer then runs the shared gated MLP,
plus the routed experts when `num_local_experts` > 0. A field that would change the math and
that we do not implement is a ValueError naming it, never ignored.
"""

from __future__ import annotations

import math
from typing import Any

from replayssm.models.config_fields import ATTENTION, MAMBA, MLP, MOE
from replayssm.models.config_fields import dtype_of as _dtype
from replayssm.models.config_fields import eos_ids as _eos
from replayssm.models.config_fields import field as _field
from replayssm.models.config_fields import layer_list as _layer_list

GRANITE = "GraniteMoeHybridForCausalLM"


def two_part_fields(raw: dict, source: str, arch: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for a two-part architecture's config.json."""
    assert arch == GRANITE, arch
    return _granite(raw, source)


def _common(raw: dict, source: str, arch: str) -> dict[str, Any]:
    """Fields the two-part families spell alike (the Bamba-style Mamba names)."""
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    if f("hidden_act", default="silu", kind=str) != "silu":
        raise ValueError(f"{source}: field 'hidden_act' must be 'silu' (the Mamba conv and the gated MLP), "
                         f"got {raw['hidden_act']!r}")
    _check_time_step_limit(raw.get("time_step_limit"), source)
    names = raw.get("layer_types", raw.get("layers_block_type"))
    if names is None:
        raise ValueError(f"{source}: missing field 'layer_types'")
    layers = _layer_list(names, source, "layer_types")
    if set(layers) - {MAMBA, ATTENTION}:
        raise ValueError(f"{source}: field 'layer_types' must name mamba or attention layers, got {names!r}")
    if f("num_hidden_layers", default=len(layers)) != len(layers):
        raise ValueError(f"{source}: field 'num_hidden_layers' ({raw['num_hidden_layers']}) differs from the "
                         f"{len(layers)} entries of 'layer_types'")
    hidden = f("hidden_size")
    heads = f("num_attention_heads") if ATTENTION in layers else 0
    head_dim = (f("head_dim", default=None) or hidden // heads) if heads else 0
    mamba = MAMBA in layers
    m_heads = f("mamba_n_heads") if mamba else 0
    m_head_dim = raw.get("mamba_d_head", "auto")
    if mamba:
        inner = f("mamba_expand", default=2) * hidden
        if m_head_dim == "auto":
            m_head_dim = inner // m_heads
        elif not isinstance(m_head_dim, int) or isinstance(m_head_dim, bool):
            raise ValueError(f"{source}: field 'mamba_d_head' must be an integer or 'auto', "
                             f"got {m_head_dim!r}")
        if m_heads * m_head_dim != inner:
            raise ValueError(f"{source}: fields 'mamba_n_heads' * 'mamba_d_head' ({m_heads * m_head_dim}) "
                             f"must equal 'mamba_expand' * 'hidden_size' ({inner})")
    return dict(
        architecture=arch,
        layer_types=layers,
        hidden_size=hidden,
        vocab_size=f("vocab_size"),
        norm_eps=f("rms_norm_eps", default=1e-6, kind=float),
        tie_word_embeddings=f("tie_word_embeddings", default=False, kind=bool),
        dtype=_dtype(raw, source),
        max_model_len=f("max_position_embeddings", default=4096),
        mamba_num_heads=m_heads,
        mamba_head_dim=m_head_dim if mamba else 0,
        ssm_state_size=f("mamba_d_state") if mamba else 0,
        mamba_n_groups=f("mamba_n_groups", default=1),
        conv_kernel=f("mamba_d_conv", default=4),
        chunk_size=f("mamba_chunk_size", default=256),
        use_conv_bias=f("mamba_conv_bias", default=True, kind=bool),
        mamba_proj_bias=f("mamba_proj_bias", default=False, kind=bool),
        num_attention_heads=heads,
        num_key_value_heads=f("num_key_value_heads", default=heads) if heads else 0,
        head_dim=head_dim,
        attention_bias=f("attention_bias", default=False, kind=bool),
        mlp_act="silu",
        eos_token_ids=_eos(raw, source),
        bos_token_id=f("bos_token_id", default=None),
    )


def _check_time_step_limit(value: Any, source: str) -> None:
    """transformers clamps softplus(dt) to time_step_limit; only the no-op (0, inf) is served."""
    if value is None:
        return

    def num(v: Any) -> float | None:
        if isinstance(v, dict) and set(v) == {"__float__"}:  # how transformers writes inf to JSON
            v = v["__float__"]
        try:
            return float(v) if not isinstance(v, bool) else None
        except (TypeError, ValueError):
            return None

    bounds = [num(v) for v in value] if isinstance(value, list) else []
    if bounds != [0.0, math.inf]:
        raise ValueError(f"{source}: field 'time_step_limit' must be [0.0, inf] (no clamp), got {value!r}")


def _granite(raw: dict, source: str) -> dict[str, Any]:
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    position = raw.get("position_embedding_type")
    if position not in (None, "nope"):
        raise ValueError(f"{source}: field 'position_embedding_type' is {position!r}; only 'nope' "
                         f"(no positional encoding, as in Granite 4.0-H) is supported")
    norm = raw.get("normalization_function", "rmsnorm")
    if norm != "rmsnorm":
        raise ValueError(f"{source}: field 'normalization_function' must be 'rmsnorm', got {norm!r}")
    common = _common(raw, source, GRANITE)
    experts = f("num_local_experts")
    shared = f("shared_intermediate_size")
    moe = dict(
        num_experts=experts, num_experts_per_tok=f("num_experts_per_tok"),
        moe_intermediate_size=f("intermediate_size"), moe_shared_intermediate_size=shared,
    ) if experts else {}
    return dict(
        **common,
        **moe,
        ffn_types=(MOE if experts else MLP,) * len(common["layer_types"]),
        intermediate_size=shared,
        router="softmax_topk",
        embedding_multiplier=f("embedding_multiplier", default=1.0, kind=float),
        residual_multiplier=f("residual_multiplier", default=1.0, kind=float),
        attention_scale=f("attention_multiplier", default=1.0, kind=float),
        logits_scaling=f("logits_scaling", default=1.0, kind=float),
    )
