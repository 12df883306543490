"""config.json of Zyphra Zamba2 (`Zamba2ForCausalLM`) -> ModelConfig fields (models/zamba2.py has the math).

A Zamba2 layer is a Mamba-2 layer ("mamba" / "linear_attention") or a hybrid layer ("hybrid"): one
of `num_mem_blocks` shared transformer blocks (round-robin over the hybrid layers) runs on
concat(hidden, embeddings), then the layer's Mamba-2. A hybrid layer is of kind PARALLEL: one Mamba
cache and one KV cache of its own (the shared block's weights are shared, its caches are not).
The shared-block options live in `Zamba2Shared` (ModelConfig.zamba2). A field that would change
the math and that we do not implement is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replayssm.models.config_falcon_h1 import _rope_theta
from replayssm.models.config_fields import MAMBA, PARALLEL
from replayssm.models.config_fields import dtype_of as _dtype
from replayssm.models.config_fields import eos_ids as _eos
from replayssm.models.config_fields import field as _field

ZAMBA2 = "Zamba2ForCausalLM"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "hybrid": PARALLEL}
_ACTIVATIONS = ("gelu", "silu")


@dataclass(frozen=True)
class Zamba2Shared:
    """The shared transformer blocks of Zamba2, as transformers builds them (models/zamba2.py)."""

    num_mem_blocks: int = 1  # shared blocks; hybrid layer j runs block j % num_mem_blocks
    adapter_rank: int = 128  # rank of the per-layer LoRA adapters
    attention_adapter: bool = False  # q/k/v adapters (use_shared_attention_adapter); the MLP's are always on


def zamba2_fields(raw: dict, source: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Zamba2ForCausalLM config.json."""
    f = lambda *names, **kw: _field(raw, source, *names, **kw)  # noqa: E731
    act = f("hidden_act", default="gelu", kind=str)
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source}: field 'hidden_act' must be one of {_ACTIVATIONS}, got {act!r}")
    blocks = raw.get("layers_block_type")
    if not isinstance(blocks, list) or not blocks or any(b not in _KINDS for b in blocks):
        raise ValueError(f"{source}: field 'layers_block_type' must be a non-empty list of "
                         f"{sorted(_KINDS)}, got {blocks!r}")
    layers = tuple(_KINDS[b] for b in blocks)
    if len(layers) != f("num_hidden_layers", default=len(layers)):
        raise ValueError(f"{source}: field 'layers_block_type' has {len(layers)} entries, "
                         f"'num_hidden_layers' says {raw['num_hidden_layers']}")
    hidden = f("hidden_size")
    heads = f("num_attention_heads")
    if (2 * hidden) % heads:
        raise ValueError(f"{source}: field 'num_attention_heads' ({heads}) must divide the attention width "
                         f"2 * hidden_size ({2 * hidden})")
    m_heads = f("n_mamba_heads")
    inner = int(f("mamba_expand", default=2.0, kind=float) * hidden)
    if inner % m_heads:
        raise ValueError(f"{source}: field 'n_mamba_heads' ({m_heads}) must divide the Mamba width "
                         f"mamba_expand * hidden_size ({inner})")
    shared = Zamba2Shared(
        num_mem_blocks=f("num_mem_blocks", default=1),
        adapter_rank=f("adapter_rank", default=128),
        attention_adapter=f("use_shared_attention_adapter", default=False, kind=bool),
    )
    if raw.get("use_shared_mlp_adapter") is False:
        raise ValueError(f"{source}: field 'use_shared_mlp_adapter' must be true (transformers always runs "
                         f"the MLP adapters)")
    kv_heads = f("num_key_value_heads", default=heads)
    if shared.attention_adapter and kv_heads != heads:
        raise ValueError(f"{source}: field 'num_key_value_heads' ({kv_heads}) must equal "
                         f"'num_attention_heads' ({heads}) with use_shared_attention_adapter (the k/v "
                         f"adapters are full width)")
    if shared.num_mem_blocks < 1:
        raise ValueError(f"{source}: field 'num_mem_blocks' must be >= 1, got {shared.num_mem_blocks}")
    bias = f("add_bias_linear", default=False, kind=bool)
    max_len = 16384 if f("use_long_context", default=False, kind=bool) else f("max_position_embeddings",
                                                                             default=4096)
    return dict(
        architecture=ZAMBA2,
        layer_types=layers,
        hidden_size=hidden,
        vocab_size=f("vocab_size"),
        norm_eps=f("rms_norm_eps", default=1e-5, kind=float),
        tie_word_embeddings=f("tie_word_embeddings", default=True, kind=bool),
        dtype=_dtype(raw, source),
        max_model_len=max_len,
        mamba_num_heads=m_heads,
        mamba_head_dim=inner // m_heads,
        ssm_state_size=f("mamba_d_state", default=64),
        mamba_n_groups=f("mamba_ngroups", default=1),
        conv_kernel=f("mamba_d_conv", default=4),
        chunk_size=f("chunk_size", default=256),
        use_conv_bias=True,  # transformers' Zamba2 conv always has a bias, whatever use_conv_bias says
        mamba_proj_bias=bias,
        time_step_min=f("time_step_min", default=0.001, kind=float),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=2 * hidden // heads,
        rope_theta=_rope_theta(raw, source) if f("use_mem_rope", default=False, kind=bool) else 0.0,
        intermediate_size=f("intermediate_size", default=4 * hidden),
        mlp_bias=bias,
        mlp_act=act,
        eos_token_ids=_eos(raw, source),
        bos_token_id=f("bos_token_id", default=None),
        zamba2=shared,
    )
