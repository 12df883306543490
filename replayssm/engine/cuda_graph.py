"""CUDA graphs for pure decode / verify steps (``cuda_graphs``: on by default where supported,
`graphs_supported`; tested against eager steps on the H200, tests/engine/test_cuda_graph.py).

One graph per (bucket size B, tokens per row q, baseline per-token destinations or not),
captured lazily the first time a step needs it, all over ONE set of static input buffers
sized for the largest bucket and one shared memory pool. A step of b <= B rows copies its
inputs into rows [0, b) and turns rows [b, B) into padding:

    row i < b (real)      token ids, positions, slot_mapping, block table, context_len, slot
                          (, dst slots)
    row i >= b (padding)  slot -1 (Mamba ops touch nothing), dst -1, context_len q, positions 0
                          (in every rotary table), every block-table entry and slot_mapping ->
                          the reserved dummy KV block (num_kv_blocks: one block past the
                          engine's, so no real K/V is written)

The graph computes logits for all B*q positions; the step keeps the rows `logit_index` names
(and the real rows' hidden states, which the MTP drafter reads).
Only what the forward reads on the device may change between replays, so a step replays only
when its host-side metadata is static: no prefill rows, one q for every row, paged attention
on the Triton decode kernel (its loops read context_lens on the device), no tensor parallelism.
Anything else runs eagerly. Nothing here reads device memory.

16-bit Mamba states round stochastically with the runner's seeds (`runner.rand_seed`, device
memory: engine/context.py DeviceSeeds). The kernels read them by pointer and each graph ends with
their advance, so every replay draws fresh bits, and a replayed step writes bit for bit what the
eager step with the same seed values writes. The capture's warm-up forwards restore the seeds they
advanced, so capturing a graph leaves the sequence of draws unchanged.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from replayssm.engine.batch_inputs import BatchInputs
from replayssm.engine.context import AttentionMetadata, ForwardContext, MambaMetadata

Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]  # graph, its logits and hidden outputs
# Mamba metadata a graph step may carry; any other field (e.g. prefill publication) must be None.
_DECODE_FIELDS = {"num_prefill_tokens", "prefill_cu_seqlens", "prefill_slots", "has_initial_state",
                  "num_decode_rows", "decode_q", "decode_slots", "decode_token_index", "decode_dst_slots"}


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then steps of 32 up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8, 16) if s < max_num_seqs]
    sizes += list(range(32, max_num_seqs, 32))
    return sizes + [max_num_seqs]


def graphs_supported(runner) -> str | None:
    """Why `runner` cannot replay graphs (None when it can)."""
    if runner.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if getattr(getattr(runner, "tp", None), "size", 1) > 1:
        return "CUDA graphs are not wired for tensor parallelism"
    if runner.model_config.num_gdn_layers and not gdn_decode_kernels(runner.device):
        return "CUDA graphs for Gated DeltaNet layers need their Triton decode kernels (ops/triton/gdn)"
    if runner.model_config.has_moe and runner.dtype != torch.bfloat16:
        return "CUDA graphs with MoE layers need bfloat16 (the sync-free grouped GEMM)"
    try:
        import triton  # noqa: F401  (the graph path needs the Triton decode kernels)
    except ImportError:
        return "CUDA graphs need triton"
    return None


def gdn_decode_kernels(device: torch.device) -> bool:
    """Whether a Gated DeltaNet decode / verify step on `device` runs kernels that a graph can capture
    (`gdn_replay_forward` and `gdn_state_update` dispatch to Triton): their PyTorch references
    select rows with nonzero(), a host sync with a data-dependent shape."""
    from replayssm.ops import gdn
    from replayssm.ops.common import pick_impl

    probe = torch.empty(0, device=device)
    return all(pick_impl("gdn", name, probe, getattr(gdn, f"{name}_ref")) is not getattr(gdn, f"{name}_ref")
               for name in ("gdn_replay_forward", "gdn_state_update"))


class CudaGraphRunner:
    """Captures and replays the runner's model forward for decode steps (see the module docstring)."""

    def __init__(self, runner, dummy_block: int) -> None:
        self.runner = runner
        self.dummy_block = dummy_block
        self.sizes = bucket_sizes(runner.max_num_seqs)
        B, Q, dev = self.sizes[-1], runner.q_max, runner.device
        bs = runner.kv_block_size
        self.width = runner.num_kv_blocks  # a row never holds more blocks than exist
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(B * Q, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B * Q, dtype=torch.int64, device=dev)
        self.pad_mapping = (dummy_block * bs + torch.arange(B * Q, device=dev) % bs).long()
        self.slot_mapping = self.pad_mapping.clone()
        self.block_tables = torch.full((B, self.width), dummy_block, **i32)
        self.context_lens = torch.ones(B, **i32)
        self.slots = torch.full((B,), -1, **i32)
        self.dst = {q: torch.full((B, q), -1, **i32) for q in range(2, Q + 1)}
        self.cu = {q: torch.arange(0, B * q + 1, q, **i32) for q in range(1, Q + 1)}
        self.empty_i32 = torch.zeros(1, **i32)
        self.empty_bool = torch.zeros(0, dtype=torch.bool, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, bool], Captured] = {}
        self.num_replays = 0
        # A capture that raises turns graphs off for good: every later step runs eagerly.
        self.error: str | None = None

    def _context(self, B: int, q: int, has_dst: bool) -> ForwardContext:
        r = self.runner
        attn = AttentionMetadata(slot_mapping=self.slot_mapping[:B * q], cu_seqlens_q=self.cu[q][:B + 1],
                                 block_tables=self.block_tables[:B], context_lens=self.context_lens[:B],
                                 max_query_len=q, max_context_len=self.width * r.kv_block_size)
        mamba = MambaMetadata(num_prefill_tokens=0, prefill_cu_seqlens=self.empty_i32,
                              prefill_slots=self.empty_i32[:0], has_initial_state=self.empty_bool,
                              num_decode_rows=B, decode_q=q, decode_slots=self.slots[:B],
                              decode_token_index=None, decode_dst_slots=self.dst[q][:B] if has_dst else None)
        return ForwardContext(attn=attn, mamba=mamba, kv_cache=r.kv_cache, mamba_cache=r.mamba_cache,
                              replayssm=r.replayssm, window=r.window, rand_seed=r.rand_seed,
                              positions=self.positions[:B * q])

    def _forward(self, B: int, q: int, has_dst: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.runner.model
        hidden = model(self.input_ids[:B * q], self._context(B, q, has_dst))
        self.runner.rand_seed.advance()  # inside the graph: each replay moves to the next draw
        # Logits stay 16-bit in the graph and the kept rows are cast after their gather: 10 bytes per
        # logit moved instead of 14 (cast, then gather fp32), and a bucket's padding rows never cast.
        return model.compute_logits(hidden, fp32=False), hidden

    def _capture(self, B: int, q: int, has_dst: bool) -> Captured:
        # Every row is padding while capturing, so the warm-up runs write no real state or K/V.
        self._pad_rows(0, B, q)
        seeds = self.runner.rand_seed.table
        saved = seeds.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels and create library handles outside the capture
                self._forward(B, q, has_dst)
        torch.cuda.current_stream().wait_stream(stream)
        seeds.copy_(saved)  # the warm-up's draws are undone: the step's seeds stay the eager ones
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, hidden = self._forward(B, q, has_dst)
        return graph, logits, hidden

    def _pad_rows(self, b: int, B: int, q: int) -> None:
        """Rows [b, B) become padding (device fills only)."""
        self.slots[b:B].fill_(-1)
        self.context_lens[b:B].fill_(q)
        self.block_tables[b:B, : -(-q // self.runner.kv_block_size)].fill_(self.dummy_block)
        self.slot_mapping[b * q:B * q].copy_(self.pad_mapping[b * q:B * q])
        self.positions[b * q:B * q].zero_()
        if q in self.dst:
            self.dst[q][b:B].fill_(-1)

    def run(self, batch: BatchInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits, hidden) of this step via a graph replay, or None when the step must run eagerly.

        logits are the rows `logit_index` names (a fresh fp32 tensor); hidden (b*q, hidden) is a view
        of the graph's output, valid until the next replay.
        """
        md = batch.mamba
        b, q = md.num_decode_rows, md.decode_q
        if self.error is not None:
            return None
        if batch.prefill or not b or md.decode_token_index is not None or b > self.sizes[-1]:
            return None
        extra = [f.name for f in dataclasses.fields(md) if f.name not in _DECODE_FIELDS]
        if any(getattr(md, name) is not None for name in extra):
            return None
        if batch.attn.block_tables.shape[1] > self.width or q > self.runner.q_max:
            return None
        has_dst = md.decode_dst_slots is not None
        B = next(s for s in self.sizes if s >= b)
        key = (B, q, has_dst)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(B, q, has_dst)
            except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError too
                self.error = f"capture of bucket {key} failed: {type(e).__name__}: {e}"[:800]
                warnings.warn(f"CUDA graphs off for this engine, steps run eagerly: {self.error}",
                              stacklevel=2)
                self.graphs.clear()
                torch.cuda.synchronize()
                return None
        graph, logits, hidden = self.graphs[key]
        attn = batch.attn
        self.input_ids[:b * q].copy_(batch.input_ids)
        self.positions[:b * q].copy_(batch.positions)
        self.slot_mapping[:b * q].copy_(attn.slot_mapping)
        self.block_tables[:b, :attn.block_tables.shape[1]].copy_(attn.block_tables)
        self.context_lens[:b].copy_(attn.context_lens)
        self.slots[:b].copy_(md.decode_slots)
        if has_dst:
            self.dst[q][:b].copy_(md.decode_dst_slots)
        self._pad_rows(b, B, q)
        graph.replay()
        self.num_replays += 1
        return logits[batch.logit_index].float(), hidden[:b * q]
