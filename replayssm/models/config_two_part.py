"""config.json of the two-part hybrid families -> ModelConfig fields (models/two_part.py has the math).

Granite 4.0-H (`GraniteMoeHybridForCausalLM`): `layer_types` names each layer's mixer (mamba or
attention, in any spelling transformers accepts); every layer then runs the shared gated MLP,
plus the routed experts when `num_local_experts` > 0.
Bamba (`BambaForCausalLM`): `attn_layer_indices` names the attention layers, every other layer
is Mamba-2; every layer then runs a SwiGLU MLP. Attention rotates the first half of each head
(partial RoPE: transformers' Bamba fixes partial_rotary_factor at 0.5 unless `rope_parameters`
states one); no multipliers. `z_loss_coefficient` is a training loss term and is ignored.
A field that would change the math and that we do not implement is a ValueError naming it,
never ignored.
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
BAMBA = "BambaForCausalLM"
TWO_PART = (GRANITE, BAMBA)


def two_part_fields(raw: dict, source: str, arch: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for a two-part architecture's config.json."""
    assert arch in TWO_PART, arch
    return _granite(raw, source) if arch == GRANITE else _bamba(raw, source)


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


def _bamba(raw: dict, source: str) -> dict[str, Any]:
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    num_layers = f("num_hidden_layers")
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                and 0 <= i < num_layers for i in indices) \
            or len(set(indices)) != len(indices):
        raise ValueError(f"{source}: field 'attn_layer_indices' must list distinct layer indices in "
                         f"[0, num_hidden_layers={num_layers}), got {raw['attn_layer_indices']!r}")
    layers = [ATTENTION if i in indices else MAMBA for i in range(num_layers)]
    for name in ("layer_types", "layers_block_type"):  # derived fields some writers also save
        if raw.get(name) is not None and _layer_list(raw[name], source, name) != tuple(layers):
            raise ValueError(f"{source}: field {name!r} ({raw[name]!r}) disagrees with 'attn_layer_indices' "
                             f"({indices!r})")
    # transformers' Bamba defaults where they differ from Granite's.
    raw = {"rms_norm_eps": 1e-5, "num_key_value_heads": 8, **raw, "layer_types": layers}
    common = _common(raw, source, BAMBA)
    return dict(
        **common,
        ffn_types=(MLP,) * num_layers,
        intermediate_size=f("intermediate_size"),
        mlp_bias=f("mlp_bias", default=False, kind=bool),
        **(_bamba_rope(raw, source, common["head_dim"]) if ATTENTION in layers else {}),
    )


def _bamba_rope(raw: dict, source: str, head_dim: int) -> dict[str, Any]:
    """rope_theta and rotary_dim as transformers' Bamba reads them; scaled RoPE is refused."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
    if params is None:
        scaling = raw.get("rope_scaling")
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            raise ValueError(f"{source}: field 'rope_scaling' is {scaling!r}; only unscaled RoPE "
                             f"(null or rope_type 'default') is supported")
        factor = raw.get("partial_rotary_factor", 0.5)
        if factor != 0.5:  # transformers' Bamba overrides a top-level factor with 0.5
            raise ValueError(f"{source}: field 'partial_rotary_factor' is {factor!r}; Bamba rotates half "
                             f"of each head (0.5); state another factor in 'rope_parameters'")
        params = {"rope_theta": _field(raw, source, "rope_theta", default=10000.0, kind=float)}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: field 'rope_parameters' has rope_type {params['rope_type']!r}; only "
                         f"'default' (unscaled RoPE) is supported")
    theta = _field(params, f"{source} rope_parameters", "rope_theta", kind=float)
    factor = _field(params, f"{source} rope_parameters", "partial_rotary_factor", default=0.5, kind=float)
    return dict(rope_theta=theta, rotary_dim=int(head_dim * factor))
