"""config.json of Falcon-H1 (`FalconH1ForCausalLM`) -> ModelConfig fields (models/falcon_h1.py has the math).

Every Falcon-H1 layer is one "parallel" layer: attention and Mamba-2 side by side on the same
normed input, then a SwiGLU MLP. The muP multipliers that are Falcon-H1's own live in
`FalconH1Multipliers` (ModelConfig.falcon_h1); embedding_multiplier is ModelConfig's. A field
that would change the math and that we do not implement is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replayssm.models.config_fields import PARALLEL
from replayssm.models.config_fields import dtype_of as _dtype
from replayssm.models.config_fields import eos_ids as _eos
from replayssm.models.config_fields import field as _field
from replayssm.models.config_two_part import _check_time_step_limit

FALCON_H1 = "FalconH1ForCausalLM"


@dataclass(frozen=True)
class FalconH1Multipliers:
    """Falcon-H1's muP scalars and Mamba options, as transformers applies them (models/falcon_h1.py)."""

    attention_in: float = 1.0  # attention input (after the shared input norm)
    attention_out: float = 1.0  # attention output, before the residual sum
    key: float = 1.0  # keys (before RoPE; linear, so it folds into the softmax scale)
    ssm_in: float = 1.0  # Mamba input, before in_proj
    ssm_out: float = 1.0  # Mamba output, before the residual sum
    ssm_zxbcdt: tuple[float, ...] = (1.0,) * 5  # in_proj output segments z, x, B, C, dt (mup_vector)
    mlp_gate: float = 1.0  # gate projection, before the activation
    mlp_down: float = 1.0  # down projection output
    lm_head: float = 1.0  # logits
    mamba_rms_norm: bool = False  # gated RMSNorm after the scan (False: y * silu(z), no weight)
    mamba_norm_before_gate: bool = True  # norm(y) * silu(z) (False: norm(y * silu(z)))
    projectors_bias: bool = False  # Mamba out_proj bias


def _floats(raw: dict, source: str, name: str, n: int) -> tuple[float, ...]:
    value = raw.get(name)
    if value is None:
        return (1.0,) * n
    ok = isinstance(value, list) and len(value) == n and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ValueError(f"{source}: field {name!r} must be a list of {n} numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _rope_theta(raw: dict, source: str) -> float:
    """rope_theta (top level or transformers 5's rope_parameters); only unscaled RoPE is served."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        if not isinstance(value, dict):
            raise ValueError(f"{source}: field {name!r} must be an object, got {value!r}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{source}: field {name!r} has rope_type {kind!r}; only unscaled RoPE "
                             f"('default') is supported")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def falcon_h1_fields(raw: dict, source: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for a FalconH1ForCausalLM config.json."""
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    if f("hidden_act", default="silu", kind=str) != "silu":
        raise ValueError(f"{source}: field 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
    if raw.get("mamba_use_mlp") is False:
        raise ValueError(f"{source}: field 'mamba_use_mlp' must be true (every layer runs its MLP)")
    _check_time_step_limit(raw.get("time_step_limit"), source)
    layers = f("num_hidden_layers")
    hidden = f("hidden_size")
    heads = f("num_attention_heads")
    head_dim = f("head_dim", default=None) or hidden // heads
    m_heads = f("mamba_n_heads")
    inner = f("mamba_d_ssm", default=None) or f("mamba_expand", default=2) * hidden
    m_head_dim = raw.get("mamba_d_head", "auto")
    if m_head_dim == "auto":
        m_head_dim = inner // m_heads
    elif not isinstance(m_head_dim, int) or isinstance(m_head_dim, bool):
        raise ValueError(f"{source}: field 'mamba_d_head' must be an integer or 'auto', got {m_head_dim!r}")
    if m_heads * m_head_dim != inner:
        raise ValueError(f"{source}: fields 'mamba_n_heads' * 'mamba_d_head' ({m_heads * m_head_dim}) must "
                         f"equal the Mamba width 'mamba_d_ssm' (or 'mamba_expand' * 'hidden_size': {inner})")
    gate, down = _floats(raw, source, "mlp_multipliers", 2)
    mult = FalconH1Multipliers(
        attention_in=f("attention_in_multiplier", default=1.0, kind=float),
        attention_out=f("attention_out_multiplier", default=1.0, kind=float),
        key=f("key_multiplier", default=1.0, kind=float),
        ssm_in=f("ssm_in_multiplier", default=1.0, kind=float),
        ssm_out=f("ssm_out_multiplier", default=1.0, kind=float),
        ssm_zxbcdt=_floats(raw, source, "ssm_multipliers", 5),
        mlp_gate=gate, mlp_down=down,
        lm_head=f("lm_head_multiplier", default=1.0, kind=float),
        mamba_rms_norm=f("mamba_rms_norm", default=False, kind=bool),
        mamba_norm_before_gate=f("mamba_norm_before_gate", default=True, kind=bool),
        projectors_bias=f("projectors_bias", default=False, kind=bool),
    )
    return dict(
        architecture=FALCON_H1,
        layer_types=(PARALLEL,) * layers,
        hidden_size=hidden,
        vocab_size=f("vocab_size"),
        norm_eps=f("rms_norm_eps", default=1e-5, kind=float),
        tie_word_embeddings=f("tie_word_embeddings", default=False, kind=bool),
        dtype=_dtype(raw, source),
        max_model_len=f("max_position_embeddings", default=8192),
        mamba_num_heads=m_heads,
        mamba_head_dim=m_head_dim,
        ssm_state_size=f("mamba_d_state"),
        mamba_n_groups=f("mamba_n_groups", default=1),
        conv_kernel=f("mamba_d_conv", default=4),
        chunk_size=f("mamba_chunk_size", default=256),
        use_conv_bias=f("mamba_conv_bias", default=True, kind=bool),
        mamba_proj_bias=f("mamba_proj_bias", default=False, kind=bool),
        num_attention_heads=heads,
        num_key_value_heads=f("num_key_value_heads", default=heads),
        head_dim=head_dim,
        attention_bias=f("attention_bias", default=False, kind=bool),
        rope_theta=_rope_theta(raw, source),
        intermediate_size=f("intermediate_size"),
        mlp_bias=f("mlp_bias", default=False, kind=bool),
        mlp_act="silu",
        eos_token_ids=_eos(raw, source),
        bos_token_id=f("bos_token_id", default=None),
        embedding_multiplier=f("embedding_multiplier", default=1.0, kind=float),
        falcon_h1=mult,
    )
