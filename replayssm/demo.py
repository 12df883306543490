"""The built-in demo checkpoint.

``--model demo`` runs the whole engine on a fresh machine without downloading anything and
without transformers. It is the trained checkpoint shipped in ``replayssm/demo_model/`` (a small
Nemotron-H with an MTP layer that answers the arithmetic problems of demo_task.py; written by
demo_train.py, see docs/demo.md) when that folder holds one. Otherwise it is a Nemotron-H-shaped
model with seeded random weights, generated here: the config, the safetensors weights (named as
Hugging Face writes them) and the same character-level tokenizer. Its text is random.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEMO_VERSION = 1
PACKAGED_DEMO = Path(__file__).resolve().parent / "demo_model"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Printable ASCII and newline, one token each, so any sampled token decodes to visible text.
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]

DEMO_CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": len(SPECIAL_TOKENS) + len(CHARACTERS),
    "hidden_size": 128,
    "hybrid_override_pattern": "M-M*ME",
    "num_hidden_layers": 6,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "ssm_state_size": 32,
    "n_groups": 2,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 64,
    "use_conv_bias": True,
    "mamba_hidden_act": "silu",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "mlp_hidden_act": "relu2",
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}


def _layer_weights(i: int, kind: str, c: dict, rand) -> dict[str, torch.Tensor]:
    h, pre = c["hidden_size"], f"backbone.layers.{i}."
    w = {pre + "norm.weight": 1.0 + 0.1 * rand(h)}
    mix = pre + "mixer."
    if kind == "M":
        nh, inner = c["mamba_num_heads"], c["mamba_num_heads"] * c["mamba_head_dim"]
        conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]
        w.update(
            {
                mix + "in_proj.weight": rand(2 * inner + 2 * c["n_groups"] * c["ssm_state_size"] + nh, h)
                / math.sqrt(h),
                mix + "conv1d.weight": rand(conv_dim, 1, c["conv_kernel"]) / math.sqrt(c["conv_kernel"]),
                mix + "conv1d.bias": 0.1 * rand(conv_dim),
                # A in [-8, -1] and dt_bias around softplus^-1(0.05): a few tokens of memory per head.
                mix + "A_log": torch.log(1.0 + 7.0 * rand(nh).sigmoid()),
                mix + "dt_bias": -3.0 + 0.5 * rand(nh),
                mix + "D": 1.0 + 0.1 * rand(nh),
                mix + "norm.weight": 1.0 + 0.1 * rand(inner),
                mix + "out_proj.weight": rand(h, inner) / math.sqrt(inner),
            }
        )
    elif kind == "*":
        q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
        w.update(
            {
                mix + "q_proj.weight": rand(q, h) / math.sqrt(h),
                mix + "k_proj.weight": rand(kv, h) / math.sqrt(h),
                mix + "v_proj.weight": rand(kv, h) / math.sqrt(h),
                mix + "o_proj.weight": rand(h, q) / math.sqrt(q),
            }
        )
    elif kind == "-":
        m = c["intermediate_size"]
        w.update(
            {
                mix + "up_proj.weight": rand(m, h) / math.sqrt(h),
                mix + "down_proj.weight": rand(h, m) / math.sqrt(m),
            }
        )
    else:
        e, m, s = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_shared_expert_intermediate_size"]
        for j in range(e):
            w[mix + f"experts.{j}.up_proj.weight"] = rand(m, h) / math.sqrt(h)
            w[mix + f"experts.{j}.down_proj.weight"] = rand(h, m) / math.sqrt(m)
        w.update(
            {
                mix + "gate.weight": rand(e, h) / math.sqrt(h),
                mix + "gate.e_score_correction_bias": 0.1 * rand(e),
                mix + "shared_experts.up_proj.weight": rand(s, h) / math.sqrt(h),
                mix + "shared_experts.down_proj.weight": rand(h, s) / math.sqrt(s),
            }
        )
    return w


def demo_weights(config: dict, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights for ``config`` under Hugging Face Nemotron-H names, on ``device``
    (a CUDA generator draws large models much faster; its stream differs from the CPU one)."""
    gen = torch.Generator(device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    h, v = config["hidden_size"], config["vocab_size"]
    weights = {"backbone.embeddings.weight": rand(v, h)}
    for i, kind in enumerate(config["hybrid_override_pattern"]):
        weights.update(_layer_weights(i, kind, config, rand))
    weights["backbone.norm_f.weight"] = 1.0 + 0.1 * rand(h)
    weights["lm_head.weight"] = rand(v, h) / math.sqrt(h)
    return {k: t.contiguous() for k, t in weights.items()}


def write_demo_tokenizer(path: str) -> None:
    """A character-level tokenizer (printable ASCII + newline) with <s> prepended to prompts."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": template}, f
        )


def write_demo_checkpoint(path: str, seed: int = 0) -> None:
    """Write config.json, model.safetensors and the tokenizer files into ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(DEMO_CONFIG, f, indent=2)
    save_file(
        demo_weights(DEMO_CONFIG, seed), os.path.join(path, "model.safetensors"), metadata={"format": "pt"}
    )
    write_demo_tokenizer(path)


def packaged_demo() -> str | None:
    """The trained demo checkpoint shipped in the package, or None when the package holds none."""
    return str(PACKAGED_DEMO) if (PACKAGED_DEMO / "model.safetensors").is_file() else None


def demo_checkpoint(seed: int = 0, cache_dir: str | None = None, trained: bool = True) -> str:
    """Path of the demo checkpoint: the packaged trained one (``packaged_demo``), else (or with
    trained=False) the random one of ``seed``, written once into ``cache_dir`` (default
    ``$REPLAYSSM_CACHE`` or ``~/.cache/replayssm``, else a temp dir when that is not writable)."""
    packaged = packaged_demo() if trained else None
    if packaged is not None:
        return packaged
    root = (
        cache_dir
        or os.environ.get("REPLAYSSM_CACHE")
        or os.path.join(os.path.expanduser("~"), ".cache", "replayssm")
    )
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        root = tempfile.gettempdir()
    target = os.path.join(root, f"demo-v{DEMO_VERSION}-seed{seed}")
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    # Write a sibling temp dir, then rename: no run ever sees half a checkpoint.
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=root)
    try:
        write_demo_checkpoint(tmp, seed)
        os.replace(tmp, target)
    except OSError:
        if not os.path.isfile(os.path.join(target, "tokenizer_config.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
