"""CUDA graph replay of decode/verify steps equals the eager forward (GPU); CPU-side checks."""

import json

import pytest
import torch
from conftest import requires_cuda

from replayssm.engine.context import DeviceSeeds
from replayssm.engine.cuda_graph import bucket_sizes, graphs_supported
from replayssm.engine.model_runner import ModelRunner, ScheduledRow

BASE = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 192, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
}


def make_runner(path, pattern, dtype, graphs, replayssm=True, k=0, device="cuda", **kw):
    config = {**BASE, "hybrid_override_pattern": pattern, "dtype": dtype}
    (path / "config.json").write_text(json.dumps(config))
    return ModelRunner(path, device=device, dtype=dtype, replayssm=replayssm,
                       load_format="dummy", num_slots=12, max_num_seqs=6, num_kv_blocks=40, kv_block_size=4,
                       num_speculative_tokens=k, cuda_graphs=bool(graphs), **kw)


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


# ---- 16-bit state: the rounding seeds live on the device --------------------------------------------


def decode_steps(runner, num_rows, steps):
    """Prefill num_rows requests, then `steps` one-token decode steps of all of them (greedy tokens fed
    back). Returns the tokens of each step and every Mamba state pool after each step."""
    slots = [9, 2, 7, 0, 11, 5][:num_rows]
    prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + 2 * i)] for i in range(num_rows)]
    tables = [[i * 6 + j for j in range(6)] for i in range(num_rows)]
    rows = [ScheduledRow(p, 0, t, s, True) for p, t, s in zip(prompts, tables, slots)]
    last = runner.execute(rows).argmax(-1).tolist()
    runner.commit(rows, [1] * num_rows)
    pos = [len(p) for p in prompts]
    tokens, states = [], []
    for _ in range(steps):
        rows = [ScheduledRow([last[i]], pos[i], tables[i], slots[i], False) for i in range(num_rows)]
        last = runner.execute(rows).argmax(-1).tolist()
        runner.commit(rows, [1] * num_rows)
        pos = [p + 1 for p in pos]
        tokens.append(last)
        states.append([s.clone() for s in runner.mamba_cache.state])
    return tokens, states


def test_device_seeds_advance_once_per_step(tmp_path):
    """Each engine step moves every layer's rounding seed on by one draw (num_layers), and no further:
    a step of 16-bit state never reuses its predecessor's bits and never skips ahead on the host."""
    runner = make_runner(tmp_path, "M*M-M", "float32", False, device="cpu", state_dtype="float16",
                         replay_window=4)
    seeds = runner.rand_seed
    L = len(runner.mamba_cache.state)
    start = seeds.values()
    assert start == [start[0] + i for i in range(L)]
    slots, prompt, table = [3, 8], [[5, 6, 7], [9, 10]], [[0, 1, 2], [3, 4, 5]]
    rows = [ScheduledRow(p, 0, t, s, True) for p, t, s in zip(prompt, table, slots)]
    runner.execute(rows)
    runner.commit(rows, [1, 1])
    assert seeds.values() == [v + L for v in start]
    for step in range(6):  # crosses flushes of the ring (window 4)
        rows = [ScheduledRow([11 + step], len(p) + step, t, s, False)
                for p, t, s in zip(prompt, table, slots)]
        runner.execute(rows)
        runner.commit(rows, [1, 1])
        assert seeds.values() == [v + (step + 2) * L for v in start]


def test_graphs_supported_with_16bit_state(tmp_path):
    """`graphs_supported` no longer refuses float16 and bfloat16 state (only a CUDA device is missing)."""
    for state_dtype in ("float16", "bfloat16"):
        runner = make_runner(tmp_path, "M*M-M", "float32", False, device="cpu", state_dtype=state_dtype)
        assert graphs_supported(runner) == "CUDA graphs need a CUDA device"


@requires_cuda
@pytest.mark.parametrize("state_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("replayssm", [True, False])
def test_graph_step_equals_eager_16bit_state(tmp_path, state_dtype, replayssm):
    """16-bit state: graph replays give the eager steps' tokens and write the same states bit for bit,
    over 12 decode steps that flush the ring (window 4) three times; batches of 4 rows fill their
    bucket, so graph and eager run the same shapes."""
    (tmp_path / "g").mkdir()
    (tmp_path / "e").mkdir()
    kw = dict(state_dtype=state_dtype, replay_window=4)
    graph = make_runner(tmp_path / "g", "M*M-M", "float32", True, replayssm, **kw)
    eager = make_runner(tmp_path / "e", "M*M-M", "float32", False, replayssm, **kw)
    got, want = decode_steps(graph, 4, 12), decode_steps(eager, 4, 12)
    assert graph.graphs.num_replays == 12
    assert got[0] == want[0]
    for step, (g, w) in enumerate(zip(got[1], want[1])):
        for layer, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (step, layer)
    assert graph.rand_seed.values() == eager.rand_seed.values()


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["ssu", "replay"])
def test_graph_replays_draw_fresh_bits(state_dtype, op):
    """Two replays of one captured state update (same inputs, same state) round with different seeds,
    so their 16-bit writes differ (a seed frozen at capture would repeat them); each equals the eager
    call with the seed value that replay read."""
    from replayssm.ops.replay import replay_forward
    from replayssm.ops.ssu import selective_state_update

    torch.manual_seed(0)
    dev = torch.device("cuda")
    S, H, P, N, G, b, W = 10, 8, 64, 128, 2, 6, 4
    state0 = torch.randn(S, H, P, N, device=dev).to(state_dtype)
    x, dt = torch.randn(b, 1, H, P, device=dev), torch.randn(b, 1, H, device=dev)
    B, C = torch.randn(b, 1, G, N, device=dev), torch.randn(b, 1, G, N, device=dev)
    A, D, dt_bias = -torch.rand(H, device=dev), torch.randn(H, device=dev), torch.randn(H, device=dev)
    idx = torch.randperm(S)[:b].to(torch.int32).to(dev)
    R = W + 1
    rings0 = (torch.randn(S, H, R, P, device=dev), torch.randn(S, G, R, N, device=dev),
              torch.rand(S, H, R, device=dev) * 0.5)
    start0 = torch.randint(0, R, (S,), dtype=torch.int32, device=dev)
    committed = torch.full((S,), W, dtype=torch.int32, device=dev)  # every row flushes (h + q > W)
    state, rings, start = state0.clone(), [r.clone() for r in rings0], start0.clone()
    seeds = DeviceSeeds(7, 1, dev)
    first = seeds.values()

    def step():
        if op == "ssu":
            selective_state_update(state, x, dt, A, B, C, D, dt_bias, idx, rand_seed=seeds[0])
        else:
            replay_forward(x, dt, A, B, C, D, dt_bias, state, *rings, start, committed, idx, W,
                           rand_seed=seeds[0])
        seeds.advance()

    def restore():
        state.copy_(state0)
        for r, r0 in zip(rings, rings0):
            r.copy_(r0)
        start.copy_(start0)

    stream = torch.cuda.Stream()  # warm-up (compiles) outside the capture, then undone
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    seeds.table[:, 0] = first[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    outs = []
    for _ in range(2):
        restore()
        graph.replay()
        outs.append(state.clone())
    assert seeds.values() == [first[0] + 2]
    assert not torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    seeds.table[:, 0] = first[0]
    for k in range(2):
        restore()
        step()
        assert torch.equal(state.view(torch.int16), outs[k].view(torch.int16)), k
