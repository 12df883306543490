"""FP8 checkpoints (compressed-tensors, ModelOpt) and --quantization fp8, on tiny test-written checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import FP8_FORMATS, cached_checkpoint, random_prompts, write_fp8_checkpoint
from torch import nn

from replayssm import LLM, SamplingParams
from replayssm.config import EngineConfig
from replayssm.distributed.parallel import TensorParallel
from replayssm.models.config import ModelConfig
from replayssm.models.layers.fp8_linear import Fp8Linear
from replayssm.models.loader import load_model
from replayssm.ops.fp8 import FP8_DTYPE, dequantize_fp8

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


def _write(tmp_path, fmt, **kw):
    src, _ = cached_checkpoint("nemotron_h")
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "twin", fmt, **kw)
    return str(tmp_path / "fp8"), str(tmp_path / "twin")


def _run(path, **kw):
    llm = LLM(path, device="cpu", max_model_len=64, **kw)
    outs = llm.generate(random_prompts([9, 4, 17], seed=3), GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def _chosen_logprobs(tokens, logprobs):
    """The sampled tokens' logprobs, (requests, steps)."""
    return torch.tensor(logprobs, dtype=torch.float64)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_checkpoint_matches_dequantized_twin(tmp_path, fmt):
    """A checkpoint in each FP8 format gives the greedy tokens and logprobs of its dequantized fp32 twin."""
    fp8, twin = _write(tmp_path, fmt, quantize_lm_head=fmt == "ct-tensor-static")
    tokens, logprobs = _run(fp8)
    twin_tokens, twin_logprobs = _run(twin)
    assert tokens == twin_tokens
    torch.testing.assert_close(_chosen_logprobs(tokens, logprobs), _chosen_logprobs(tokens, twin_logprobs),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "modelopt"])
def test_fp8_layers_are_the_quantized_ones(tmp_path, fmt):
    """The model holds FP8 exactly where the checkpoint does: projections and experts, not the ignored LM
    head, norms, conv, router or embeddings."""
    fp8, _ = _write(tmp_path, fmt)
    model, config = load_model(fp8)
    assert config.quantization.source == ("modelopt" if fmt == "modelopt" else "compressed-tensors")
    assert config.quantization.ignore == ("lm_head",)
    fp8_params = {n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    assert type(model.lm_head) is nn.Linear
    assert all(".mixer." in n and n.endswith(("_proj.weight", "experts.up_proj", "experts.down_proj"))
               for n in fp8_params)
    kinds = {n.split(".")[3] for n in fp8_params}
    assert kinds >= {"in_proj", "out_proj", "q_proj", "o_proj", "experts", "shared_experts", "up_proj"}
    assert model.layers[0].mixer.conv1d.weight.dtype == torch.float32
    assert model.layers[2].mixer.gate.weight.dtype == torch.float32


def test_runtime_quantization_equals_prequantized_checkpoint(tmp_path):
    """--quantization fp8 on a bf16/fp32 checkpoint gives the tokens and logprobs of the per-channel
    compressed-tensors checkpoint of the same weights."""
    src, _ = cached_checkpoint("nemotron_h")
    fp8, _ = _write(tmp_path, "ct-channel-dynamic")
    tokens, logprobs = _run(src, quantization="fp8")
    pre_tokens, pre_logprobs = _run(fp8)
    assert tokens == pre_tokens
    torch.testing.assert_close(_chosen_logprobs(tokens, logprobs), _chosen_logprobs(tokens, pre_logprobs),
                               rtol=0, atol=0)
    model, config = load_model(src, quantization="fp8")
    assert config.quantization.source == "runtime" and type(model.lm_head) is nn.Linear
    assert isinstance(model.layers[0].mixer.in_proj, Fp8Linear)


def test_runtime_quantization_with_dummy_weights(tmp_path):
    """Dummy weights with --quantization fp8 are finite E4M3 values with positive per-channel scales."""
    src, _ = cached_checkpoint("nemotron_h")
    model, _ = load_model(src, quantization="fp8", load_format="dummy")
    layer = model.layers[0].mixer.in_proj
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.out_features, 1)
    assert (layer.weight_scale > 0).all() and torch.isfinite(layer.weight.float()).all()
    assert layer.weight.float().abs().amax() == 448.0


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "modelopt"])
def test_tensor_parallel_shards_dequantize_to_the_twin_shards(tmp_path, fmt):
    """Under tensor parallelism each rank's FP8 weights and scales dequantize to that rank's shard of the
    twin (per-channel scales split with their rows, per-tensor scales replicated)."""
    fp8, twin = _write(tmp_path, fmt)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        model, _ = load_model(fp8, tp=tp)
        ref = dict(load_model(twin, tp=tp)[0].named_parameters())
        params = dict(model.named_parameters())
        for name, p in params.items():
            if name.endswith(("_scale", "input_scale")):
                continue
            if p.dtype == FP8_DTYPE:
                p = dequantize_fp8(p, params[name + "_scale"], torch.float32)
            assert torch.equal(p, ref[name]), (rank, name)


def _edit_config(tmp_path, fmt, edit):
    fp8, _ = _write(tmp_path, fmt)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    edit(config)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    return fp8


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["quantization_config"].update(quant_method="gptq"), "quant_method"),
    (lambda c: c["quantization_config"].update(format="pack-quantized"), "format"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="block"),
     "weights.strategy"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4),
     "weights.num_bits"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        strategy="group"), "input_activations.strategy"),
])
def test_bad_compressed_tensors_config_names_the_field(tmp_path, edit, field):
    """An FP8 scheme we do not implement is a ValueError naming the config field."""
    fp8 = _edit_config(tmp_path, "ct-channel-dynamic", edit)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(fp8)


def test_nvfp4_modelopt_config_names_quant_algo(tmp_path):
    """A ModelOpt NVFP4 checkpoint is a ValueError naming quant_algo and its value."""
    fp8, _ = _write(tmp_path, "modelopt")
    file = tmp_path / "fp8" / "hf_quant_config.json"
    file.write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}))
    with pytest.raises(ValueError, match="quant_algo.*NVFP4"):
        ModelConfig.from_hf(fp8)


def test_bad_quantization_flag():
    """--quantization takes fp8 only."""
    with pytest.raises(ValueError, match="quantization must be fp8"):
        EngineConfig(model="x", quantization="int8")


def test_fp8_tensor_in_a_bf16_checkpoint_layer_is_an_error(tmp_path):
    """An E4M3 weight where the config declares no FP8 scheme is a ValueError naming the tensor."""
    fp8, twin = _write(tmp_path, "ct-channel-dynamic")
    shutil.copy(tmp_path / "twin" / "config.json", tmp_path / "fp8" / "config.json")
    with pytest.raises(ValueError, match="in_proj.weight.*FP8"):
        load_model(fp8)
