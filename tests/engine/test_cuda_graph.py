"""CUDA graph replay of decode/verify steps equals the eager forward (GPU); CPU-side checks."""

import json

import pytest
import torch
from conftest import requires_cuda

from replayssm.engine.cuda_graph import bucket_sizes
from replayssm.engine.model_runner import ModelRunner, ScheduledRow

BASE = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 192, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
}


def make_runner(path, pattern, dtype, graphs, replayssm=True, k=0):
    config = {**BASE, "hybrid_override_pattern": pattern, "dtype": dtype}
    (path / "config.json").write_text(json.dumps(config))
    return ModelRunner(path, device="cuda", dtype=dtype, replayssm=replayssm,
                       load_format="dummy", num_slots=12, max_num_seqs=6, num_kv_blocks=40, kv_block_size=4,
                       num_speculative_tokens=k, cuda_graphs=bool(graphs))


def test_bucket_sizes_cover_every_batch():
    """Buckets rise, end at max_num_seqs, and every batch size 1..max has one >= it."""
    for m in (1, 5, 32, 100, 512):
        sizes = bucket_sizes(m)
        assert sizes == sorted(set(sizes)) and sizes[-1] == m
        assert all(any(s >= b for s in sizes) for b in range(1, m + 1))


def test_cuda_graphs_need_cuda(tmp_path):
    """cuda_graphs=True on a CPU runner raises ValueError naming the reason."""
    with pytest.raises(ValueError, match="cuda_graphs"):
        (tmp_path / "config.json").write_text(json.dumps({**BASE, "hybrid_override_pattern": "M*", "dtype":
                                                          "float32"}))
        ModelRunner(tmp_path, device="cpu", load_format="dummy", cuda_graphs=True)


def test_cuda_graphs_auto_off_where_unsupported(tmp_path):
    """The default (None) takes graphs only where `graphs_supported` allows: a CPU runner and an engine
    on the CPU stay eager without an error; other values are refused."""
    from replayssm import LLM
    from replayssm.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "hybrid_override_pattern": "M*", "dtype":
                                                      "float32"}))
    assert ModelRunner(tmp_path, device="cpu", load_format="dummy", cuda_graphs=None).graphs is None
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", max_model_len=32)
    assert llm.engine.config.cuda_graphs is None and llm.engine.runner.graphs is None
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        EngineConfig.from_kwargs(str(tmp_path), cuda_graphs="yes")


@requires_cuda
def test_cuda_graphs_auto_on_cuda(tmp_path):
    """On CUDA the default replays graphs where supported (bfloat16 with MoE layers) and runs eagerly
    where not (fp32 with MoE layers: no error), while True there names the reason."""
    config = {**BASE, "hybrid_override_pattern": "M*E", "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    kw = dict(device="cuda", load_format="dummy", num_slots=4, max_num_seqs=4, num_kv_blocks=16,
              kv_block_size=4)
    assert ModelRunner(tmp_path, dtype="bfloat16", cuda_graphs=None, **kw).graphs is not None
    assert ModelRunner(tmp_path, dtype="float32", cuda_graphs=None, **kw).graphs is None
    with pytest.raises(ValueError, match="MoE layers need bfloat16"):
        ModelRunner(tmp_path, dtype="float32", cuda_graphs=True, **kw)


def run_schedule(runner, q):
    """Prefill 5 requests on permuted slots, then decode steps with a shrinking, reordered batch."""
    slots = [9, 2, 7, 0, 11]
    prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + 2 * i)] for i in range(5)]
    tables = [[i * 8 + j for j in range(8)] for i in range(5)]
    rows = [ScheduledRow(p, 0, t, s, True) for p, t, s in zip(prompts, tables, slots)]
    runner.execute(rows)
    runner.commit(rows, [1] * 5)
    pos = [len(p) for p in prompts]
    out = []
    for step in range(6):
        live = [i for i in (4, 0, 3, 1, 2) if i < 5 - step // 2]  # 5, 5, 4, 4, 3, 3 rows
        rows = [ScheduledRow([(step * 13 + i) % 250 + 3] * q, pos[i], tables[i], slots[i], False,
                             num_logits=q) for i in live]
        out.append(runner.execute(rows).float().cpu())
        acc = [1 + (step + i) % q for i in live]
        runner.commit(rows, acc)
        for i, a in zip(live, acc):
            pos[i] += a
    return out


@requires_cuda
@pytest.mark.parametrize("replayssm", [True, False])
def test_graph_decode_equals_eager_fp32(tmp_path, replayssm):
    """fp32 model, plain decode: graph replays give the eager logits (close) and the same greedy tokens."""
    (tmp_path / "g").mkdir()
    (tmp_path / "e").mkdir()
    graph = make_runner(tmp_path / "g", "M*M-M", "float32", True, replayssm)
    eager = make_runner(tmp_path / "e", "M*M-M", "float32", False, replayssm)
    got, want = run_schedule(graph, 1), run_schedule(eager, 1)
    assert graph.graphs.num_replays == 6
    for g, w in zip(got, want):
        assert torch.equal(g.argmax(-1), w.argmax(-1))
        assert (g - w).abs().max() < 1e-3 * w.abs().max()


@requires_cuda
def test_graph_verify_rows_bf16_moe(tmp_path):
    """bf16 model with MoE, ReplaySSM verify rows (q = 1 + k = 3): graph logits stay within bf16 noise."""
    (tmp_path / "g").mkdir()
    (tmp_path / "e").mkdir()
    graph = make_runner(tmp_path / "g", "M*EM-", "bfloat16", True, True, k=2)
    eager = make_runner(tmp_path / "e", "M*EM-", "bfloat16", False, True, k=2)
    got, want = run_schedule(graph, 3), run_schedule(eager, 3)
    assert graph.graphs.num_replays == 6
    for g, w in zip(got, want):
        assert (g - w).norm() / w.norm() < 2e-2


def test_failed_capture_falls_back_to_eager_for_good(monkeypatch):
    """A capture that raises RuntimeError makes run() return None (eager) now and on every later step,
    with one warning."""
    from types import SimpleNamespace

    from replayssm.engine.batch_inputs import RowView, build_inputs
    from replayssm.engine.cuda_graph import CudaGraphRunner

    calls = []

    def boom(B, q, has_dst):
        calls.append((B, q, has_dst))
        raise RuntimeError("operation not permitted when stream is capturing")

    g = CudaGraphRunner.__new__(CudaGraphRunner)
    g.sizes, g.width, g.graphs, g.num_replays, g.error = [1, 2, 4], 8, {}, 0, None
    g.runner = SimpleNamespace(q_max=1, kv_block_size=4)
    g._capture = boom
    rows = [RowView(i, [5 + i], 3, [2 * i, 2 * i + 1], 7 - i, 1, None, True, False) for i in range(3)]
    batch = build_inputs(rows, block_size=4, device=torch.device("cpu"), baseline=False)
    # No device here; the fallback synchronizes after a failure.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with pytest.warns(UserWarning, match="CUDA graphs off for this engine, steps run eagerly: capture"):
        assert g.run(batch) is None
    assert g.run(batch) is None  # no second warning: later steps skip the graphs silently
    assert calls == [(4, 1, False)] and "capture" in g.error and g.graphs == {}
