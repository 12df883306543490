"""Tiny random-weight checkpoints in the Hugging Face format, written with `save_pretrained`.

Shared by the model, runner and engine tests. The weights are re-drawn so that every code path
carries signal (nonzero router bias, non-unit norms, dt biases that keep Δ well above the
`time_step_min` clamp that transformers applies in prefill only), and `transformers` itself is
the oracle that reads the same files.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import math
import re
import shutil
import tempfile
from pathlib import Path

import torch

# Every layer kind, two attention layers, two MoE layers, Mamba layers at both ends. Given as
# the pattern string, which every transformers version accepts (M mamba, * attention, - mlp, E moe).
NEMOTRON_H_PATTERN = "M*EM-*ME"
# Granite 4.0-H: Mamba and attention mixers (each layer then runs its MoE + shared MLP).
GRANITE_LAYERS = ["mamba", "attention", "mamba", "mamba", "attention", "mamba"]
# Bamba: the attention layers by index (Mamba-2 elsewhere), Mamba layers at both ends.
BAMBA_ATTENTION = [1, 4]
# Zamba2: hybrid layers (shared transformer block, then Mamba-2) at 1, 3, 5; Mamba-2 elsewhere.
ZAMBA2_LAYERS = ["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid", "mamba"]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter so that no path is degenerate (fan-in scaled, fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 7.0 + 1.0))
            elif leaf == "dt_bias":
                p.copy_(torch.rand(p.shape, generator=gen) * 2.5 - 2.0)
            elif leaf == "D":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "norm" in name or p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embedding" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def tiny_nemotron_h(path: str | Path, seed: int = 0, max_shard_size: str | None = None, mtp: bool = False,
                    **overrides):
    """Write a tiny NemotronHForCausalLM (Mamba, attention, MLP and MoE layers) to `path`.

    `overrides` replace NemotronHConfig fields; `max_shard_size` (e.g. "40KB") forces a sharded
    checkpoint with an index file. `mtp=True` also writes one MTP layer group (attention + MoE,
    random `mtp.*` tensors, which transformers ignores). Returns the transformers model (eval, fp32).
    """
    if mtp:
        overrides = {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["full_attention", "moe"],
                     **overrides}
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fields = dict(
        vocab_size=256, hidden_size=64, hybrid_override_pattern=NEMOTRON_H_PATTERN,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=2.5, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
    )
    fields.update(overrides)
    config = NemotronHConfig(**fields)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).eval()
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if mtp:
        _write_mtp_weights(Path(path), seed)
    return model


def _write_mtp_weights(path: Path, seed: int) -> None:
    """Add random `mtp.*` tensors (checkpoint names, one tensor per expert) to model.safetensors."""
    from safetensors.torch import load_file, save_file

    from replayssm.models.config import ModelConfig
    from replayssm.speculative.mtp_model import NemotronHMTP

    mtp = NemotronHMTP(ModelConfig.from_hf(path), dtype=torch.float32)
    _randomize(mtp, seed + 1)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for name, t in mtp.state_dict().items():
        stem, leaf = name.rsplit(".", 1)
        if stem.endswith("mixer.experts"):
            for e in range(t.shape[0]):
                tensors[f"mtp.{stem}.{e}.{leaf}.weight"] = t[e].clone()
        else:
            tensors[f"mtp.{name}"] = t.clone()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _mamba2_norm_class():
    """transformers' gated norm of Mamba-2, under either of the names its releases use."""
    from transformers.models.mamba2 import modeling_mamba2

    for name in ("Mamba2RMSNormGated", "MambaRMSNormGated"):
        if hasattr(modeling_mamba2, name):
            return getattr(modeling_mamba2, name)
    raise ImportError("transformers.models.mamba2 has no gated RMSNorm class (Mamba2RMSNormGated)")


def tiny_mamba2(path: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Write a tiny pure Mamba-2 Mamba2ForCausalLM (3 layers, 2 groups) to `path`; returns the model."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    fields = dict(
        vocab_size=256, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
        num_hidden_layers=3, chunk_size=8, expand=2, conv_kernel=4, eos_token_id=2, bos_token_id=0,
    )
    if "group_size" not in inspect.signature(_mamba2_norm_class().__init__).parameters:
        # Older transformers (e.g. 5.17 on the GPU machine) normalize Mamba-2's gated norm over
        # all channels instead of per group; with one group both definitions agree.
        fields["n_groups"] = 1
    fields.update(overrides)
    config = Mamba2Config(**fields)
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(config).eval()
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return model


def tiny_granite_hybrid(path: str | Path, seed: int = 0, **overrides):
    """Write a tiny GraniteMoeHybridForCausalLM to `path`; returns the transformers model (eval, fp32).

    Scaled down from ibm-granite/granite-4.0-h-small with every structural field kept: Mamba and
    attention layers, 2 Mamba groups, GQA, routed experts (softmax top-2) plus the shared MLP, tied
    embeddings, NoPE, and muP multipliers that are not 1 (attention_multiplier is not
    head_dim ** -0.5). `num_local_experts=0` gives the dense (granite-4.0-h-micro) layout.
    """
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    fields = dict(
        vocab_size=256, hidden_size=64, layer_types=GRANITE_LAYERS, num_hidden_layers=len(GRANITE_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
        logits_scaling=4.0, position_embedding_type="nope", tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )
    fields.update(overrides)
    config = GraniteMoeHybridConfig(**fields)
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path))
    return model


def tiny_bamba(path: str | Path, seed: int = 0, **overrides):
    """Write a tiny BambaForCausalLM to `path`; returns the transformers model (eval, fp32).

    Scaled down from ibm-ai-platform/Bamba-9B with every structural field kept (attention layers
    by `attn_layer_indices`, GQA, partial RoPE on half of each head, untied embeddings, SwiGLU
    MLP), and 2 Mamba groups so that the per-group gated norm differs from a whole-width one.
    """
    from transformers import BambaConfig, BambaForCausalLM

    fields = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=6, attn_layer_indices=BAMBA_ATTENTION,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
        max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )
    fields.update(overrides)
    config = BambaConfig(**fields)
    torch.manual_seed(seed)
    model = BambaForCausalLM(config).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path))
    return model


def tiny_falcon_h1(path: str | Path, seed: int = 0, **overrides):
    """Write a tiny FalconH1ForCausalLM to `path`; returns the transformers model (eval, fp32).

    Scaled down from tiiuae/Falcon-H1-0.5B with every structural field kept: parallel attention +
    Mamba-2 layers, GQA with RoPE, a Mamba width (mamba_d_ssm) other than mamba_expand * hidden_size,
    untied embeddings; plus 2 Mamba groups, and every muP multiplier != 1 (each of the 5 in_proj
    segment multipliers different). The small mixer output multipliers make greedy text repeat
    tokens now and then, which gives the n-gram drafter hits.
    """
    from transformers import FalconH1Config
    from transformers import FalconH1ForCausalLM as HFFalconH1

    fields = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        mamba_rms_norm=False, mamba_norm_before_gate=False, rope_theta=10000.0,
        embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.6, attention_in_multiplier=1.3,
        attention_out_multiplier=0.3, ssm_in_multiplier=1.25, ssm_out_multiplier=0.2,
        ssm_multipliers=[0.7, 1.2, 0.9, 1.4, 0.5], mlp_multipliers=[0.8, 1.3],
        tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=512,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )
    fields.update(overrides)
    config = FalconH1Config(**fields)
    torch.manual_seed(seed)
    model = HFFalconH1(config).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path))
    return model


def tiny_zamba2(path: str | Path, seed: int = 0, **overrides):
    """Write a tiny Zamba2ForCausalLM to `path`; returns the transformers model (eval, fp32).

    Scaled down from Zyphra/Zamba2-1.2B with every structural field kept: Mamba-2 layers at both
    ends, hybrid layers at three positions over 2 shared blocks (the third reuses the first block),
    LoRA adapters on attention and MLP (which transformers runs only without GQA), RoPE, tied
    embeddings; plus 2 Mamba groups.
    """
    from transformers import Zamba2Config
    from transformers import Zamba2ForCausalLM as HFZamba2

    fields = dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=len(ZAMBA2_LAYERS), mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=8,
        num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8,
        use_mem_rope=True, rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True,
        layers_block_type=list(ZAMBA2_LAYERS),
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )
    fields.update(overrides)
    config = Zamba2Config(**fields)
    torch.manual_seed(seed)
    model = HFZamba2(config).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path))
    return model


@functools.cache
def cached_checkpoint(kind: str, seed: int = 0, **overrides) -> tuple[str, torch.nn.Module]:
    """Write a tiny checkpoint once per test process; returns (directory, transformers model).

    kind: "nemotron_h", "mamba2", "granite_hybrid", "bamba", "falcon_h1" or "zamba2". The directory is
    removed at exit; do not modify it.
    """
    makers = {"nemotron_h": tiny_nemotron_h, "mamba2": tiny_mamba2, "granite_hybrid": tiny_granite_hybrid,
              "bamba": tiny_bamba, "falcon_h1": tiny_falcon_h1, "zamba2": tiny_zamba2}
    if kind not in makers:
        raise ValueError(f"kind must be one of {sorted(makers)}, got {kind!r}")
    root = tempfile.mkdtemp(prefix=f"replayssm-{kind}-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model = makers[kind](root, seed=seed, **overrides)
    return root, model


def random_prompts(lengths, seed: int, vocab: int = 256) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths (ids >= 3: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers generate(), one prompt at a time (no padding), eos disabled: the oracle."""
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        seq = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
        outs.append(seq[0, len(p) :].tolist())
    return outs


# FP8 checkpoints: which tensors the published FP8 checkpoints quantize (projections and experts;
# norms, conv, router, embeddings stay), and the config each format declares.
_FP8_WEIGHT = re.compile(r"\.(in_proj|out_proj|[qkvo]_proj|up_proj|down_proj)\.weight$")
FP8_FORMATS = ("ct-channel-dynamic", "ct-tensor-static", "ct-channel-weight-only", "modelopt")


def _ct_config(strategy: str, activations: dict | None, ignore: list[str]) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations,
             "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignore,
            "kv_cache_scheme": None}


def write_fp8_checkpoint(src: str | Path, dst: str | Path, twin: str | Path, fmt: str,
                         quantize_lm_head: bool = False) -> None:
    """Quantize the checkpoint at `src` to FP8 E4M3 in format `fmt` (FP8_FORMATS) at `dst`, and write its
    dequantized twin (E4M3 value * scale, fp32, the source's config) at `twin`.

    ct-*: compressed-tensors (llm-compressor) with per-channel (N, 1) or per-tensor (1,) weight scales;
    modelopt: per-tensor () weight scales and static () input scales, declared in hf_quant_config.json.
    quantize_lm_head also quantizes lm_head (else it is in the ignore / exclude list).
    """
    import json

    from safetensors.torch import load_file, save_file

    src, dst, twin = Path(src), Path(dst), Path(twin)
    assert fmt in FP8_FORMATS, fmt
    per_channel = "channel" in fmt
    gen = torch.Generator().manual_seed(7)
    quantized, dequantized = {}, {}
    for file in sorted(src.glob("*.safetensors")):
        for key, w in load_file(str(file)).items():
            wanted = _FP8_WEIGHT.search(key) or (quantize_lm_head and key == "lm_head.weight")
            if not wanted or w.dim() != 2:
                quantized[key] = dequantized[key] = w
                continue
            w = w.float()
            amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
            scale = amax / 448.0
            q = (w / scale).to(torch.float8_e4m3fn)
            dequantized[key] = q.float() * scale
            stem = key.removesuffix("weight")
            quantized[key] = q
            if fmt == "modelopt":
                quantized[stem + "weight_scale"] = scale.reshape(())
                quantized[stem + "input_scale"] = (0.01 + torch.rand((), generator=gen)).float()
            else:
                quantized[stem + "weight_scale"] = scale if per_channel else scale.reshape(1)
                if fmt == "ct-tensor-static":
                    quantized[stem + "input_scale"] = (0.01 + torch.rand(1, generator=gen)).float()
    config = json.loads((src / "config.json").read_text())
    ignore = [] if quantize_lm_head else ["lm_head"]
    for out in (dst, twin):
        out.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.suffix != ".safetensors" and extra.name not in ("config.json",
                                                                     "model.safetensors.index.json"):
                shutil.copy(extra, out / extra.name)
    save_file(dequantized, str(twin / "model.safetensors"))
    (twin / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(dst / "model.safetensors"))
    if fmt == "modelopt":
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ignore}}))
    else:
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                       "strategy": "token"}
        if fmt == "ct-tensor-static":
            activations = {**activations, "dynamic": False, "strategy": "tensor"}
        elif fmt == "ct-channel-weight-only":
            activations = None
        strategy = "channel" if per_channel else "tensor"
        config["quantization_config"] = _ct_config(strategy, activations, ignore)
    (dst / "config.json").write_text(json.dumps(config))
