"""Safetensors loading: single/sharded, per-expert or stacked experts, tied embeddings; named errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoints import cached_checkpoint, tiny_mamba2, tiny_nemotron_h
from safetensors.torch import load_file, save_file

from replayssm.models.loader import load_model


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_sharded_equals_single(tmp_path):
    """A sharded checkpoint (index json) loads the same tensors as the single file."""
    tiny_nemotron_h(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single, _ = load_model(cached_checkpoint("nemotron_h")[0])
    sharded, _ = load_model(tmp_path / "sharded")
    a, b = _params(single), _params(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stacked_expert_names_and_model_prefix(tmp_path):
    """Stacked `experts.up_proj` tensors under a `model.` prefix load like per-expert `backbone.` ones."""
    src = cached_checkpoint("nemotron_h")[0]
    tensors = load_file(f"{src}/model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        key = key.replace("backbone.", "model.")
        if ".experts." in key:
            stem, rest = key.split(".experts.")
            e, proj = rest.split(".")[:2]
            out.setdefault(f"{stem}.experts.{proj}", {})[int(e)] = t
        else:
            out[key] = t
    out = {k: torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}
    (tmp_path / "ck").mkdir()
    shutil.copy(f"{src}/config.json", tmp_path / "ck" / "config.json")
    save_file(out, str(tmp_path / "ck" / "model.safetensors"))
    a, _ = load_model(src)
    b, _ = load_model(tmp_path / "ck")
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_tied_embeddings(tmp_path):
    """A tied Mamba-2 checkpoint (no lm_head tensor) reuses the embedding for the logits."""
    hf = tiny_mamba2(tmp_path, tie_word_embeddings=True)
    model, cfg = load_model(tmp_path)
    assert cfg.tie_word_embeddings and model.lm_head is None
    torch.testing.assert_close(model.embeddings.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_requested_dtype():
    """dtype=bfloat16 converts the weights but keeps A_log, D, dt_bias and the router in fp32."""
    model, _ = load_model(cached_checkpoint("nemotron_h")[0], dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.0.mixer.in_proj.weight"] == torch.bfloat16
    assert dtypes["layers.0.mixer.A_log"] == torch.float32
    assert dtypes["layers.2.mixer.gate.weight"] == torch.float32


def _rewrite(tmp_path, edit) -> str:
    src = cached_checkpoint("nemotron_h")[0]
    dst = tmp_path / "ck"
    dst.mkdir()
    shutil.copy(f"{src}/config.json", dst / "config.json")
    tensors = load_file(f"{src}/model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_tensor_named(tmp_path):
    """A checkpoint lacking a tensor raises ValueError naming it."""
    path = _rewrite(tmp_path, lambda t: t.pop("backbone.layers.3.mixer.dt_bias"))
    with pytest.raises(ValueError, match=r"layers\.3\.mixer\.dt_bias"):
        load_model(path)


def test_missing_expert_named(tmp_path):
    """A checkpoint lacking one expert raises ValueError naming that expert's tensor."""
    path = _rewrite(tmp_path, lambda t: t.pop("backbone.layers.7.mixer.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"layers\.7\.mixer\.experts\.5\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape_named(tmp_path):
    """A tensor of the wrong shape raises ValueError naming the file and tensor."""
    def edit(t):
        t["backbone.layers.1.mixer.k_proj.weight"] = torch.zeros(16, 64)
    path = _rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=r"model\.safetensors.*layers\.1\.mixer\.k_proj\.weight"):
        load_model(path)


def test_unreadable_file_named(tmp_path):
    """A corrupt safetensors file raises ValueError naming the file."""
    path = _rewrite(tmp_path, lambda t: None)
    with open(f"{path}/model.safetensors", "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path)


def test_missing_weights_and_shard(tmp_path):
    """No weights at all, or an index naming a missing shard, raises ValueError naming the path."""
    src = cached_checkpoint("nemotron_h")[0]
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "shard-1.safetensors"}}')
    with pytest.raises(ValueError, match="shard-1.safetensors"):
        load_model(tmp_path)
