"""demo_train: its checkpoint loads in the engine, and the engine reproduces the training model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from demo_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    one_thread,
    prompt_ids,
    toy_checkpoint,
    toy_checkpoint_random_mtp,
    toy_checkpoint_small_dt,
)

from replayssm.demo_net import Attention, DemoLM
from replayssm.demo_task import held_out_set
from replayssm.demo_train import NEWLINE, make_batch, model_config, train
from replayssm.engine.llm import LLM
from replayssm.models.config import ModelConfig
from replayssm.sampling_params import SamplingParams


def test_checkpoint_files():
    """The output folder holds a bf16 Nemotron-H checkpoint with one MTP layer, the tokenizer and the log."""
    from safetensors.torch import load_file

    path = toy_checkpoint()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "train_log.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    cfg = ModelConfig.from_hf(path)
    assert cfg.num_nextn_predict_layers == 1 and cfg.mtp_layer_types == ("attention", "mlp")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert "mtp.layers.0.eh_proj.weight" in tensors and "mtp.layers.1.final_layernorm.weight" in tensors
    with open(os.path.join(path, "train_log.json")) as f:
        log = json.load(f)
    assert log["steps"] == 20 and log["step_time_ms"] > 0 and log["device"] == "cpu"
    with open(os.path.join(path, "generation_config.json")) as f:
        assert NEWLINE in json.load(f)["eos_token_id"]


def test_engine_greedy_equals_training_model():
    """The engine's greedy tokens (fp32, CPU) equal the training model's on held-out prompts."""
    path = toy_checkpoint()
    model = DemoLM.from_checkpoint(path)
    prompts = prompt_ids(held_out_set(3))
    expected = [model.greedy(p, 16) for p in prompts]
    with LLM(path, device="cpu") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("make", [toy_checkpoint, toy_checkpoint_small_dt])
def test_engine_logprobs_equal_training_model(make):
    """The engine's prompt and output log-probabilities (fp32, CPU) equal the training model's, also
    where Δ is below transformers' time_step_min (neither applies a floor)."""
    path = make()
    model = DemoLM.from_checkpoint(path)
    prompt = prompt_ids(held_out_set(1))[0]
    with LLM(path, device="cpu") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model.logits(model.hidden(torch.tensor([seq])))[0], -1)
    expected = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    got = torch.tensor(out.prompt_logprobs[1:] + out.logprobs)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_transformers_reproduces_training_trunk():
    """transformers' NemotronHForCausalLM reads the checkpoint and gives the training model's logits
    (Mamba-heavy weights: D = 0, out_proj x30, Δ below time_step_min)."""
    from transformers import NemotronHForCausalLM

    path = toy_checkpoint_small_dt()
    hf = NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = DemoLM.from_checkpoint(path)
    for prompt in prompt_ids(held_out_set(2)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            torch.testing.assert_close(model.logits(model.hidden(ids)), hf(ids).logits.float(), atol=1e-4,
                                       rtol=1e-4)


def test_engine_mtp_drafts_equal_training_head(monkeypatch):
    """Every MTP draft logit row of the engine (k=3, full-scale random MTP weights) equals the training
    MTP head's at its depth, fed the same tokens (the sequence so far, then the earlier drafts)."""
    import replayssm.speculative.mtp as mtp_module

    path, k = toy_checkpoint_random_mtp(), 3
    groups: dict[tuple[str, int], list[tuple[int, torch.Tensor, int]]] = {}
    draw = mtp_module.draw_drafts

    def record(logits, reqs, positions):
        drawn, p = draw(logits, reqs, positions)
        for r, t, row, d in zip(reqs, positions, logits, drawn):
            groups.setdefault((r.request_id, r.num_computed_tokens), []).append((t, row.clone(), d))
        return drawn, p

    monkeypatch.setattr(mtp_module, "draw_drafts", record)
    prompts = prompt_ids(held_out_set(3))
    with LLM(path, device="cpu", speculative_method="mtp", num_speculative_tokens=k) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    seqs = {o.request_id: p + o.token_ids for p, o in zip(prompts, outs)}
    model = DemoLM.from_checkpoint(path)
    checked = [0] * k
    for (rid, _), drafts in groups.items():
        start = drafts[0][0]  # the first draft's position: the request holds tokens 0 .. start - 1
        seq = seqs[rid][:start] + [d for _, _, d in drafts]
        with torch.no_grad():
            ref = [x[0] for x in model.mtp_logits(torch.tensor([seq]), len(drafts))]  # row p predicts x_{p+2}
        for j, (t, row, _) in enumerate(drafts):
            assert t == start + j
            torch.testing.assert_close(row, ref[j][t - 2], atol=1e-4, rtol=1e-4)
            checked[j] += 1
    assert min(checked) >= 5, checked


@pytest.mark.parametrize("depth", [2, 3])
def test_mtp_attention_matches_per_query_reference(depth):
    """Depth-d MTP attention at query p reads depth d-o's key/value at p-o (o < d-1) and depth 1's at
    p-d+1 and before: checked against a per-query loop."""
    torch.manual_seed(depth)
    c = {**model_config("toy"), "num_attention_heads": 4, "num_key_value_heads": 2}
    attn = Attention(c).double()
    xs = [torch.randn(2, 7, c["hidden_size"], dtype=torch.float64) for _ in range(depth)]
    kv: list = []
    for x in xs[:-1]:
        attn(x, kv)
    out = attn(xs[-1], kv)
    q = attn.q_proj(xs[-1]).view(2, 7, 4, 16)
    ks = [attn.k_proj(x).view(2, 7, 2, 16).repeat_interleave(2, 2) for x in xs]
    vs = [attn.v_proj(x).view(2, 7, 2, 16).repeat_interleave(2, 2) for x in xs]
    ref = torch.empty_like(q)
    for p in range(7):
        level = [depth - 1 - (p - j) if p - j < depth - 1 else 0 for j in range(p + 1)]  # 0-based depth
        keys = [ks[e][:, j] for j, e in enumerate(level)]
        vals = [vs[e][:, j] for j, e in enumerate(level)]
        w = torch.softmax(torch.einsum("bhd,jbhd->bhj", q[:, p], torch.stack(keys)) / 4.0, -1)
        ref[:, p] = torch.einsum("bhj,jbhd->bhd", w, torch.stack(vals))
    torch.testing.assert_close(out, attn.o_proj(ref.reshape(2, 7, 64)))


def test_batch_rows_pack_problems_and_mask_answers():
    """A batch row is <s> then whole problems; the loss mask covers exactly the answer characters."""
    from replayssm.demo_task import train_stream
    from replayssm.demo_train import CHARACTERS, SPECIAL_TOKENS

    ids, mask = make_batch(train_stream(0), 2, 300)
    vocab = SPECIAL_TOKENS + CHARACTERS
    for row, m in zip(ids, mask):
        text = "".join(vocab[i] for i in row[1:].tolist())
        assert row[0] == 1 and text.startswith("Q: ")
        masked = "".join(vocab[i] for i, keep in zip(row.tolist(), m.tolist()) if keep)
        answers = [line.split(" A:", 1)[1] + "\n" for line in text.split("\n")[:-1]]
        assert masked.startswith("".join(answers)) and " A:" not in masked


def test_train_needs_steps_or_time_budget(tmp_path):
    """train() with neither or both of steps and time_budget is a ValueError naming them."""
    for kw in ({}, {"steps": 2, "time_budget": 1.0}):
        with pytest.raises(ValueError, match="steps and time_budget"):
            train(str(tmp_path), size="toy", **kw)
