"""ModelRunner: owns the model and its caches; runs one engine step (execute) and its commit.

Per step the engine calls `execute(rows)`, samples from the returned logits, then
`commit(rows, num_accepted)` with the same rows, before the next execute:

    execute: prefill rows  -> chunked scan writes a clean S_0; their cursors reset to 0 first
             decode rows   -> ReplaySSM (or the baseline state update); conv inputs parked
    commit:  decode rows   -> cursors move by a = num_accepted (one replay_commit for all
                              layers), conv windows advance by the a accepted inputs

Baseline speculative verify (replayssm=False, row.spec_slots = 1 + k slots): the state after
token t is written to spec_slots[t]; nothing is copied afterwards. `commit` returns each row's
live slot, which is spec_slots[a - 1] for such rows (row.slot otherwise); the engine must adopt
it as the request's slot. The conv window is committed into that slot too. `row.slot` may be
one of the spec_slots (the source is read before any write), so a request can own exactly
1 + k slots.

Staggered checkpoints (replay_stagger, ReplaySSM on): a request's first decode step after its prefill
starts from j null history entries instead of none, j = 0, 1, ..., W - q_max in turn over the
requests. They are zeroed ring rows (Δ = x = B = 0): they neither decay S_0 nor add to an output or
a fold, so every result is that of the empty ring (to fp32 rounding: the sums associate differently).
Its ring then fills after W - j entries, so requests that start decoding together write their states
on different steps of the window instead of all on one (a batch decoding in lock-step otherwise
flushes every row on one step in W). The entries count as
history everywhere (a materialize or a fold replays them as no-ops). DESIGN.md's lifecycle resets a
prefilled slot's cursors to 0; this sets committed = j just before its first decode forward.

The host mirrors the cursors exactly (it knows q and a), so nothing here syncs with the device:
inputs go up through pinned memory without blocking, and the model's decode path (MoE routing
included) reads nothing back on CUDA.

Tensor parallelism (tp_size > 1, process group already up): this runner holds rank tp_rank's
shard of the weights and of every cache; every rank must receive the same calls in the same
order (distributed/runner.py mirrors rank 0's calls), so cursors stay identical everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replayssm.cache.mamba_cache import KVCache, MambaCache, as_dtype
from replayssm.distributed.parallel import TensorParallel
from replayssm.distributed.sharding import local_config
from replayssm.engine.batch_inputs import BatchInputs, RowView, build_inputs, to_device
from replayssm.engine.block_tables import BlockTables
from replayssm.engine.context import DeviceSeeds, ForwardContext
from replayssm.engine.decode_commit import commit_decode, commit_decode_device, mirror_commit
from replayssm.engine.row_checks import RowLimits, check_batch, check_slot, view_row
from replayssm.models.config import GDN, MAMBA, PARALLEL, ModelConfig
from replayssm.models.loader import load_model
from replayssm.ops.attention import resolve_kv_dtype


@dataclass
class ScheduledRow:
    token_ids: list[int]  # prefill chunk, [last] for decode, [last] + drafts for verify
    start_pos: int  # tokens already computed (KV + Mamba state cover [0, start_pos))
    block_table: list[int]  # KV block ids covering [0, start_pos + len(token_ids))
    slot: int  # Mamba slot holding the request's live state
    is_prefill: bool
    num_logits: int = 1  # trailing positions that need logits
    spec_slots: list[int] | None = None  # baseline verify: 1 + k destination slots
    # Prefix caching: (b, slot) = write the exact Mamba state + conv window after the row's first
    # b tokens into `slot` (decode rows: only if b <= num_accepted). See engine/publish.py.
    checkpoints: list[tuple[int, int]] | None = None


class ModelRunner:
    """Loads a checkpoint, allocates the caches, runs steps. See the module docstring for the protocol."""

    def __init__(self, model_path: str | Path, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype | None = None, replayssm: bool = True, replay_window: int = 16,
                 state_dtype: str | torch.dtype = "float32", num_speculative_tokens: int = 0,
                 num_kv_blocks: int = 64, kv_block_size: int = 16, num_slots: int = 8, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 2048, seed: int = 0, load_format: str = "auto",
                 cuda_graphs: bool | None = False, tp_rank: int = 0, tp_size: int = 1,
                 replay_stagger: bool = True, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        # The sizes come validated from EngineConfig (config.py), the one place that checks them.
        self.q_max = 1 + num_speculative_tokens
        assert not replayssm or self.q_max <= replay_window, (num_speculative_tokens, replay_window)
        self.device = torch.device(device)
        self.tp = TensorParallel(tp_rank, tp_size)
        self.tp.check_group()
        self.model, self.model_config = load_model(model_path, device=self.device,
                                                   dtype=None if dtype is None else as_dtype(dtype, "dtype"),
                                                   load_format=load_format, tp=self.tp,
                                                   quantization=quantization)
        cfg = self.model_config
        # Caches hold this rank's heads only: they are sized from the shard's config.
        self.shard_config = local = local_config(cfg, tp_size)
        self.dtype = self.model.dtype
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        self.state_dtype = as_dtype(state_dtype, "state_dtype")
        self.replayssm, self.window = replayssm, replay_window
        self.num_slots, self.max_num_seqs = num_slots, max_num_seqs
        self.num_kv_blocks, self.kv_block_size = num_kv_blocks, kv_block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mamba_cache = MambaCache(local, num_slots=num_slots, act_dtype=self.dtype,
                                      state_dtype=self.state_dtype, replayssm=replayssm, window=replay_window,
                                      q_max=self.q_max, max_num_seqs=max_num_seqs, device=self.device)
        # CUDA graphs (None: wherever supported) pad rows onto one extra block past the engine's
        # (see engine/cuda_graph.py).
        cuda_graphs = self._graphs_wanted(cuda_graphs)
        self.kv_cache = KVCache(local, num_blocks=num_kv_blocks + int(cuda_graphs), block_size=kv_block_size,
                                dtype=self.kv_dtype, device=self.device)
        # The recurrent mixers, cache layer l's owner at index l: Mamba-2 (parallel layers, Falcon-H1 and
        # Zamba2, hold theirs as `.mixer` too) or Gated DeltaNet. Each materializes its own states.
        self.mixers = [b.mixer for b, kind in zip(self.model.layers, cfg.layer_types)
                       if kind in (MAMBA, PARALLEL, GDN)]
        # Exact host mirror of ring_start / committed (index num_slots is the private scratch slot).
        self._ring_start = [0] * (num_slots + 1)
        self._committed = [0] * (num_slots + 1)
        self._block_tables = BlockTables(num_slots, num_kv_blocks)  # host tables of the last steps
        # Staggered checkpoints (module docstring): null entries 0 .. span - 1 in turn; slots prefilled
        # since their last decode step take theirs on the next one. Kept as a set, not read off the host
        # mirror (committed 0): with async scheduling a step launches before the last one's counts
        # reach the mirror, which then still shows 0 for a slot that has decoded.
        self._stagger_span = replay_window - self.q_max + 1 if replayssm and replay_stagger else 0
        self._stagger_next = 0
        self._fresh: set[int] = set()
        # Stochastic-rounding seeds in device memory, advanced on the device once per draw (a step,
        # a prefill fold, a publication), so CUDA graphs replay them too (engine/context.py).
        self.rand_seed = DeviceSeeds(seed, len(self.mamba_cache.state), self.device)
        self._pending: BatchInputs | None = None
        self._hidden: torch.Tensor | None = None
        self._row_offsets: dict[int, int] = {}
        self.graphs = None
        if cuda_graphs:
            from replayssm.engine.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, dummy_block=num_kv_blocks)

    def _graphs_wanted(self, wanted: bool | None) -> bool:
        """Whether to replay CUDA graphs: False stays off, None takes them where `graphs_supported`
        allows, True raises a ValueError saying why they cannot run."""
        if wanted is False:
            return False
        from replayssm.engine.cuda_graph import graphs_supported

        why = graphs_supported(self)
        if why is not None and wanted:
            raise ValueError(f"cuda_graphs=True: {why}")
        return why is None

    # ---- sizes (static: usable by the planner before allocation) ---------------------------------

    @staticmethod
    def slot_bytes(model_config: ModelConfig, *, dtype: str | torch.dtype, state_dtype: str | torch.dtype,
                   replayssm: bool, replay_window: int, num_speculative_tokens: int,
                   tensor_parallel_size: int = 1, **_: object) -> int:
        """Bytes of one Mamba slot (all layers; ring only with ReplaySSM) on one tensor-parallel rank."""
        return MambaCache.bytes_per_slot(local_config(model_config, tensor_parallel_size),
                                         act_dtype=as_dtype(dtype, "dtype"),
                                         state_dtype=as_dtype(state_dtype, "state_dtype"),
                                         replayssm=replayssm, window=replay_window,
                                         q_max=1 + num_speculative_tokens)

    @staticmethod
    def kv_block_bytes(model_config: ModelConfig, *, dtype: str | torch.dtype, kv_block_size: int,
                       tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto", **_: object) -> int:
        """Bytes of one KV block (K and V of every attention layer) on one tensor-parallel rank."""
        kv_dtype = resolve_kv_dtype(kv_cache_dtype, as_dtype(dtype, "dtype"))
        return KVCache.bytes_per_block(local_config(model_config, tensor_parallel_size),
                                       block_size=kv_block_size, dtype=kv_dtype)

    @staticmethod
    def fixed_bytes(model_config: ModelConfig, *, dtype: str | torch.dtype, state_dtype: str | torch.dtype,
                    replayssm: bool, replay_window: int, num_speculative_tokens: int, max_num_seqs: int,
                    tensor_parallel_size: int = 1, **_: object) -> int:
        """Cache bytes not proportional to slots or blocks: the private scratch slot + decode conv scratch."""
        act = as_dtype(dtype, "dtype")
        k = num_speculative_tokens
        slot = ModelRunner.slot_bytes(model_config, dtype=act, state_dtype=state_dtype, replayssm=replayssm,
                                      replay_window=replay_window, num_speculative_tokens=k,
                                      tensor_parallel_size=tensor_parallel_size)
        scratch = MambaCache.scratch_bytes(local_config(model_config, tensor_parallel_size), act_dtype=act,
                                           q_max=1 + k, max_num_seqs=max_num_seqs)
        return slot + scratch

    def bytes_per_slot(self) -> int:
        return MambaCache.bytes_per_slot(self.shard_config, act_dtype=self.dtype,
                                         state_dtype=self.state_dtype, replayssm=self.replayssm,
                                         window=self.window, q_max=self.q_max)

    def bytes_per_kv_block(self) -> int:
        return KVCache.bytes_per_block(self.shard_config, block_size=self.kv_block_size, dtype=self.kv_dtype)

    # ---- one step ---------------------------------------------------------------------------------

    feeds_tokens = True  # execute(rows, feed=...) below (the engine's async scheduling checks it)

    @torch.no_grad()
    def execute(self, rows: list[ScheduledRow], feed: tuple[torch.Tensor, list[int]] | None = None
                ) -> torch.Tensor:
        """Forward one engine step; returns fp32 logits (sum of num_logits, vocab), rows in order.

        feed: (tokens, index) for a step of one-token decode rows whose input tokens are on the
        device, e.g. the previous step's samples: row i's input is tokens[index[i]] (its
        token_ids entry is a placeholder). Taken on the device, so nothing waits for them.
        """
        if self._pending is not None:
            raise ValueError("commit() the previous step's rows before the next execute()")
        limits = self._limits  # one RowLimits per step, not per row
        views = [view_row(i, r, limits, check_blocks=False) for i, r in enumerate(rows)]
        # Block ids of all rows are range-checked at once; on a failure the per-row checks name the row.
        tables = self._block_tables.tensor([v.slot for v in views], [v.block_table for v in views])
        if tables is None:
            views = [view_row(i, r, limits) for i, r in enumerate(rows)]
        check_batch(views, limits)
        batch = build_inputs(views, block_size=self.kv_block_size, device=self.device,
                             baseline=not self.replayssm, tables=tables)
        if feed is not None:
            tokens, index = feed
            if batch.prefill or len(index) != len(rows) or any(
                    r.forced or len(r.token_ids) != 1 or r.index != i for i, r in enumerate(batch.decode)):
                raise ValueError("feed needs one-token decode rows only, one index per row")
            batch.input_ids.copy_(tokens.index_select(0, to_device(index, torch.int64, tokens.device)))
        if self.replayssm and batch.prefill:
            self._prepare_prefill_slots(batch.prefill)
        if self._fresh and batch.decode:
            self._stagger([r.slot for r in batch.decode if r.slot in self._fresh])
        self._reset_cursors([d for v in views for _, d in v.checkpoints or ()])
        ctx = ForwardContext(attn=batch.attn, mamba=batch.mamba, kv_cache=self.kv_cache,
                             mamba_cache=self.mamba_cache, replayssm=self.replayssm, window=self.window,
                             rand_seed=self.rand_seed, positions=batch.positions)
        # A replayed graph advances the seeds itself (captured at the end of its step).
        replayed = self.graphs.run(batch) if self.graphs is not None else None
        if replayed is not None:
            logits, hidden = replayed
        else:
            hidden = self.model(batch.input_ids, ctx)
            self.rand_seed.advance()
            logits = self.model.compute_logits(hidden[batch.logit_index])
        # Kept until the next execute: model drafters (MTP) read the target's hidden states.
        self._hidden, self._row_offsets = hidden, batch.row_offsets
        forced = [r for r in batch.decode if r.forced]
        if forced:
            self._commit_decode(batch, forced, [1] * len(forced))
        self._pending = batch if any(not r.forced for r in batch.decode) else None
        return logits

    @torch.no_grad()
    def commit(self, rows: list[ScheduledRow], num_accepted: list[int]) -> list[int]:
        """Commit the last execute's decode rows with a = num_accepted[i] in [1, q_i] (others ignored).

        Returns the live slot of every row after the commit (row.slot, or spec_slots[a-1] for a
        baseline verify row: the engine must adopt it).
        """
        if len(num_accepted) != len(rows):
            raise ValueError(f"num_accepted has {len(num_accepted)} entries for {len(rows)} rows")
        live = [r.slot for r in rows]
        pending = self._pending_decode(rows, "commit")
        if pending is None:
            return live
        batch, decode = pending
        accepted = _accepted(decode, num_accepted, live)
        self._pending = None
        self._commit_decode(batch, decode, accepted)
        return live

    def commit_async(self, rows: list[ScheduledRow], accepted: torch.Tensor) -> Any:
        """`commit` with the counts on the device (int32, one per row; rows that verify nothing
        accept 1), reading nothing back. Returns what `finish_commit` takes once the counts are
        known on the host. Rows with checkpoints (prefix caching) need `commit`: their
        publications read the counts first."""
        pending = self._pending_decode(rows, "commit_async")
        if pending is None:
            return None
        batch, decode = pending
        if any(r.checkpoints for r in decode):
            raise ValueError("commit_async() cannot publish checkpoints: use commit()")
        if accepted.shape != (len(rows),) or accepted.dtype != torch.int32 or \
                accepted.device.type != self.device.type:
            raise ValueError(f"accepted must be an int32 tensor of shape ({len(rows)},) on {self.device}")
        self._pending = None
        if decode:
            commit_decode_device(self, batch, decode, accepted)
        return batch.mamba.decode_q, decode

    def finish_commit(self, handle: Any, rows: list[ScheduledRow], num_accepted: list[int],
                      keep: list[bool]) -> list[int]:
        """After `commit_async`: the counts as a host list (validated as `commit` does). Updates the
        host cursor mirror of the rows with keep[i] (the others' requests finished since: their
        slots may already serve another request) and returns every row's live slot, as `commit`."""
        live = [r.slot for r in rows]
        if handle is None:
            return live
        q, decode = handle
        accepted = _accepted(decode, num_accepted, live)
        kept = [(r.slot, a) for r, a in zip(decode, accepted) if keep[r.index]]
        self.mirror_commit([s for s, _ in kept], [a for _, a in kept], q)
        return live

    def _pending_decode(self, rows: list[ScheduledRow],
                        what: str) -> tuple[BatchInputs, list[RowView]] | None:
        """The last execute's batch and its engine decode rows (None: nothing to commit)."""
        batch = self._pending
        if batch is None:
            return None
        decode = [r for r in batch.decode if not r.forced]
        if any(r.index >= len(rows) or rows[r.index].slot != r.slot for r in decode):
            raise ValueError(f"{what}() rows differ from the rows of the last execute()")
        return batch, decode

    def row_hidden(self, index: int, num_tokens: int) -> torch.Tensor:
        """Hidden states (num_tokens, hidden), before the final norm, of the first num_tokens
        tokens of row `index` of the last execute()."""
        start = self._row_offsets[index]
        return self._hidden[start:start + num_tokens]

    def _commit_decode(self, batch: BatchInputs, rows: list[RowView], accepted: list[int]) -> None:
        """Cursor commit (once) and conv-window commit (per layer) for `rows`, a slice of batch.decode."""
        commit_decode(self, batch, rows, accepted)

    def _prepare_prefill_slots(self, prefill: list[RowView]) -> None:
        """Prefill rows start from a bare S_0: fold committed ring entries first, then zero the cursors."""
        cache = self.mamba_cache
        for r in prefill:
            h = self._committed[r.slot]
            if r.start_pos > 0 and h > 0:
                # A chunk after a one-token chunk mid-prompt (a token budget with one token left
                # runs it as a decode row, which appends to the ring): fold the ring through the
                # private scratch slot so the scan starts from the exact state.
                src = torch.tensor([r.slot], dtype=torch.int32, device=self.device)
                tmp = torch.tensor([cache.scratch_slot], dtype=torch.int32, device=self.device)
                n = torch.tensor([h], dtype=torch.int32, device=self.device)
                for li, (mixer, state) in enumerate(zip(self.mixers, cache.state)):
                    mixer.materialize(cache, li, src, n, tmp, rand_seed=self.rand_seed[li])
                    state[r.slot] = state[cache.scratch_slot]
                # Rows fold through the same scratch slot: a fresh draw each, or their bits would repeat.
                self.rand_seed.advance()
        self._reset_cursors([r.slot for r in prefill])
        if self._stagger_span > 1:
            self._fresh.update(r.slot for r in prefill)

    def _stagger(self, slots: list[int]) -> None:
        """First decode step of freshly prefilled slots (cursors 0): give each j null history
        entries (j = 0 .. span - 1 in turn; its ring rows zeroed, so Δ = x = B = 0: module docstring)."""
        if not slots:
            return
        self._fresh.difference_update(slots)
        pads = [(self._stagger_next + i) % self._stagger_span for i in range(len(slots))]
        self._stagger_next += len(slots)
        padded = [(s, j) for s, j in zip(slots, pads) if j]
        if not padded:
            return
        self.mamba_cache.set_null_history(to_device([s for s, _ in padded], torch.int64, self.device),
                                          to_device([j for _, j in padded], torch.int32, self.device))
        for s, j in padded:
            self._committed[s] = j

    def _reset_cursors(self, slots: list[int]) -> None:
        """ring_start = committed = 0 on the device and in the host mirror."""
        if slots:
            self.mamba_cache.reset_cursors(to_device(slots, torch.int64, self.device))
        for s in slots:
            self._ring_start[s] = self._committed[s] = 0

    def mirror_commit(self, slots: list[int], accepted: list[int], q: int) -> None:
        """Move the host mirror of `slots`' cursors as `replay_commit` moved them on the device
        (q tokens computed, accepted[i] kept); nothing to do with ReplaySSM off."""
        if self.replayssm:
            mirror_commit(self._ring_start, self._committed, slots, accepted, q, self.window,
                          self.mamba_cache.ring_rows)

    def cursors(self, slot: int) -> tuple[int, int]:
        """(ring_start, committed) of `slot`, from the exact host mirror (no device read)."""
        self._check_slot(slot, "slot")
        return self._ring_start[slot], self._committed[slot]

    # ---- slot moves ---------------------------------------------------------------------------------

    def copy_slot(self, src: int, dst: int) -> None:
        """slot dst <- slot src: state, conv, ring and cursors together."""
        self.copy_slots([src], [dst])

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Batched copy_slot; dst entries distinct and not in src."""
        if len(src) != len(dst) or len(set(dst)) != len(dst) or set(src) & set(dst):
            raise ValueError(f"copy_slots needs equal-length src/dst, distinct dst not in src: {src}, {dst}")
        for s in (*src, *dst):
            self._check_slot(s, "slot")
        if not src:
            return
        # Prefix-hit copies come from checkpoints (no committed ring entries): ring rows are skipped,
        # 2 of 5 per-layer tensors instead of all.
        ring = any(self._committed[s] for s in src)
        self.mamba_cache.copy_slots(src, dst, ring=ring)
        for s, d in zip(src, dst):
            self._ring_start[d], self._committed[d] = self._ring_start[s], self._committed[s]
            # dst now holds src's cursors: it takes its null entries where src would have (dst is not in src).
            if s in self._fresh:
                self._fresh.add(d)
            else:
                self._fresh.discard(d)

    # ---- validation ---------------------------------------------------------------------------------

    @property
    def _limits(self) -> RowLimits:
        return RowLimits(self.num_slots, self.num_kv_blocks, self.kv_block_size, self.q_max,
                         self.max_num_seqs, self.max_num_batched_tokens, self.replayssm,
                         self.model_config.max_model_len if self.model_config.rope_theta > 0 else None)

    def _check_slot(self, slot: object, name: str) -> None:
        check_slot(slot, name, self.num_slots)


def _accepted(decode: list[RowView], num_accepted: list[int], live: list[int]) -> list[int]:
    """The decode rows' counts, each checked to lie in [1, the row's tokens]; live[i] becomes the spec
    slot a baseline verify row keeps (spec_slots[a - 1])."""
    accepted = []
    for r in decode:
        a = num_accepted[r.index]
        if not isinstance(a, int) or not 1 <= a <= len(r.token_ids):
            raise ValueError(f"num_accepted[{r.index}] must be in [1, {len(r.token_ids)}], got {a!r}")
        accepted.append(a)
        if r.spec_slots is not None:
            live[r.index] = r.spec_slots[a - 1]
    return accepted
