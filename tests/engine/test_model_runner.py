"""ModelRunner steps == transformers' full-sequence forward: decode, chunked prefill, batching, verify."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import cached_checkpoint
from conftest import requires_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayssm.engine.model_runner import ModelRunner, ScheduledRow

BLOCK = 4
# fp32 CPU uses the PyTorch references; CUDA runs the Triton kernels (other summation orders);
# a bf16 model is compared with the fp32 transformers model, so it gets a loose bound.
TOL = {"cpu": dict(rtol=1e-4, atol=1e-4), "cuda": dict(rtol=2e-3, atol=2e-3),
       "bf16": dict(rtol=0.05, atol=0.3)}
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def make_runner(kind: str, **kw) -> ModelRunner:
    """A runner whose Mamba slots start as NaN: a fresh request must never read what it did not write."""
    args = dict(num_kv_blocks=48, kv_block_size=BLOCK, num_slots=10, max_num_seqs=4, replay_window=4)
    args.update(kw)
    runner = ModelRunner(cached_checkpoint(kind)[0], **args)
    for t in runner.mamba_cache.per_slot_tensors() + runner.mamba_cache.conv_scratch:
        if t.is_floating_point():
            t.fill_(float("nan"))
    return runner


def hf_logits(kind: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return cached_checkpoint(kind)[1](torch.tensor([ids])).logits[0]


class Seq:
    """One request driven by hand: its true tokens, computed count, KV blocks and owned slots."""

    def __init__(self, kind: str, length: int, slots: list[int], blocks: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        self.ref = hf_logits(kind, self.ids)
        self.slots, self.slot, self.blocks, self.t = slots, slots[0], blocks, 0
        self.got: dict[int, torch.Tensor] = {}  # position -> logits row we produced

    def prefill(self, n: int, is_prefill: bool = True) -> ScheduledRow:
        toks = self.ids[self.t:self.t + n]
        return ScheduledRow(toks, self.t, self.blocks, self.slot, is_prefill, num_logits=n)

    def verify(self, k: int, wrong: int | None = None, baseline: bool = False) -> ScheduledRow:
        """[token t] + k drafts; the draft at index `wrong` (1-based) is replaced by a wrong token."""
        toks = list(self.ids[self.t:self.t + 1 + k])
        if wrong is not None:
            toks[wrong] = (toks[wrong] + 1) % 256
        spec = self.slots[:1 + k] if baseline and k else None
        return ScheduledRow(toks, self.t, self.blocks, self.slot, False, num_logits=1 + k, spec_slots=spec)

    def take(self, row: ScheduledRow, logits: torch.Tensor, accepted: int, live: int) -> None:
        """Record the logits of the accepted positions and advance past them."""
        for j in range(accepted):
            self.got[row.start_pos + j] = logits[j]
        self.t += accepted
        self.slot = live
        if row.spec_slots is not None:
            # Keep owning the same 1 + k slots; the live one comes first for the next verify.
            self.slots = [live] + [s for s in self.slots if s != live]

    def check(self, tol: str = "cpu") -> None:
        pos = sorted(self.got)
        got = torch.stack([self.got[p] for p in pos]).cpu()
        torch.testing.assert_close(got, self.ref[pos], **TOL[tol])


def step(runner: ModelRunner, seqs: list[Seq], rows: list[ScheduledRow], accepted: list[int]) -> None:
    logits = runner.execute(rows)
    live = runner.commit(rows, accepted)
    off = 0
    for s, row, a, slot in zip(seqs, rows, accepted, live):
        n = row.num_logits
        s.take(row, logits[off:off + n], a if not row.is_prefill else len(row.token_ids), slot)
        off += n
    assert off == logits.shape[0]
    # The host mirror of the cursors is exact.
    cache = runner.mamba_cache
    device = list(zip(cache.ring_start.tolist(), cache.committed.tolist()))[:runner.num_slots]
    assert [runner.cursors(s) for s in range(runner.num_slots)] == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
@pytest.mark.parametrize("replayssm", [True, False])
def test_decode_matches_full_forward(kind, replayssm, device):
    """Prefill then token-by-token decode (W=4: flushes) gives the full-sequence logits."""
    runner = make_runner(kind, replayssm=replayssm, device=device)
    s = Seq(kind, 20, [7], [9, 2, 11, 5, 0], seed=3)
    step(runner, [s], [s.prefill(6)], [1])
    while s.t < 20:
        step(runner, [s], [s.verify(0)], [1])
    s.check(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replayssm", [True, False])
def test_bf16_model_decode_close(replayssm, device):
    """A bf16 model (fp32 state) decodes close to the fp32 transformers logits, ReplaySSM on and off."""
    kind = "nemotron_h"
    runner = make_runner(kind, replayssm=replayssm, device=device, dtype="bfloat16")
    s = Seq(kind, 18, [3], [4, 1, 0, 2, 6], seed=13)
    step(runner, [s], [s.prefill(7)], [1])
    while s.t < 18:
        step(runner, [s], [s.verify(0)], [1])
    s.check("bf16")


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_chunked_prefill_matches_one_shot(kind):
    """Prefill in chunks (5, 5, 3, then a one-token chunk on prior state) equals one-shot, then decodes on."""
    runner = make_runner(kind)
    s = Seq(kind, 17, [3], [1, 8, 4, 6, 2], seed=4)
    for n in (5, 5, 3):
        step(runner, [s], [s.prefill(n)], [1])
    step(runner, [s], [s.prefill(1)], [1])  # is_prefill=True, one token, start_pos > 0: a decode row
    while s.t < 17:
        step(runner, [s], [s.verify(0)], [1])
    s.check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replayssm", [True, False])
def test_batched_varlen_mixed_rows(replayssm, device):
    """Prefill, decode and verify rows of three requests in shared steps equal each request alone."""
    kind = "nemotron_h"
    runner = make_runner(kind, replayssm=replayssm, num_speculative_tokens=2, device=device)
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(5)).tolist()
    a = Seq(kind, 22, [4, 1, 8], perm[0:6], seed=6)
    b = Seq(kind, 16, [0, 9, 5], perm[6:12], seed=7)
    c = Seq(kind, 18, [2, 6, 3], perm[12:18], seed=8)
    base = not replayssm
    step(runner, [a, b], [a.prefill(9), b.prefill(5)], [1, 1])
    # Rows arrive decode-first; c's prefill is split over two steps.
    step(runner, [b, c, a], [b.verify(0), c.prefill(4), a.verify(2, baseline=base)], [1, 1, 3])
    step(runner, [a, c, b], [a.verify(2, wrong=2, baseline=base), c.prefill(3), b.verify(0)], [2, 1, 1])
    # c's last prompt token comes as a one-token prefill chunk on prior state (a decode row).
    step(runner, [c, a, b], [c.prefill(1), a.verify(2, wrong=1, baseline=base), b.verify(0)], [1, 1, 1])
    for _ in range(2):
        step(runner, [c, a, b], [c.verify(0), a.verify(2, wrong=1, baseline=base), b.verify(0)], [1, 1, 1])
    for _ in range(2):
        step(runner, [a, b, c], [a.verify(1, baseline=base), b.verify(2, baseline=base),
                                 c.verify(2, wrong=2, baseline=base)], [2, 3, 2])
    for s in (a, b, c):
        s.check(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replayssm", [True, False])
def test_verify_with_rejections(replayssm, device):
    """Verify steps with every acceptance count leave the state at the last accepted token."""
    kind = "mamba2"
    runner = make_runner(kind, replayssm=replayssm, num_speculative_tokens=3, device=device)
    s = Seq(kind, 40, [5, 2, 7, 0], [3, 7, 1, 9, 4, 8, 2, 0, 6, 5], seed=9)
    step(runner, [s], [s.prefill(5)], [1])
    for wrong in (None, 1, 2, 3, None, 2, 1, 1, 3, None):
        a = 4 if wrong is None else wrong
        step(runner, [s], [s.verify(3, wrong=wrong, baseline=not replayssm)], [a])
    s.check(device)


def test_prefill_on_committed_ring_materializes():
    """A prefill chunk after decode steps (ring entries committed) still continues the exact state."""
    kind = "nemotron_h"
    runner = make_runner(kind)
    s = Seq(kind, 20, [6], [0, 1, 2, 3, 4], seed=10)
    step(runner, [s], [s.prefill(6)], [1])
    for _ in range(3):
        step(runner, [s], [s.verify(0)], [1])
    assert runner.cursors(6)[1] == 3 == int(runner.mamba_cache.committed[6])
    step(runner, [s], [s.prefill(6)], [1])
    assert runner.cursors(6) == (0, 0)
    while s.t < 20:
        step(runner, [s], [s.verify(0)], [1])
    s.check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stagger", [True, False])
def test_staggered_checkpoints_spread_the_flushes(stagger, device):
    """Four requests prefilled together then decoded in lock-step (W = 4): with staggered checkpoints
    their first decode steps start from 0, 1, 2, 3 null history entries, so one row flushes per step
    instead of all four on one; the logits are transformers' either way, from slots whose rings held
    NaN (the null entries are zeroed rows, not whatever the slot held)."""
    kind = "nemotron_h"
    runner = make_runner(kind, device=device, replay_stagger=stagger)
    seqs = [Seq(kind, 18, [i], [5 * i + j for j in range(5)], seed=20 + i) for i in range(4)]
    step(runner, seqs, [s.prefill(5) for s in seqs], [1] * 4)
    flushing = []
    while seqs[0].t < 18:
        flushing.append(sum(runner.cursors(s.slot)[1] + 1 > 4 for s in seqs))
        rows = [s.verify(0) for s in seqs]
        step(runner, seqs, rows, [1] * 4)
        if len(flushing) == 1:
            assert sorted(runner.cursors(s.slot)[1] for s in seqs) == ([1, 2, 3, 4] if stagger else [1] * 4)
    # Host-mirrored cursors before each step (checked against the device's in `step`).
    assert flushing[4:] == ([1] * 9 if stagger else [4, 0, 0, 0, 4, 0, 0, 0, 4])
    for s in seqs:
        s.check(device)


def test_copy_slot_moves_everything():
    """copy_slot mid-decode (ring non-empty) moves state, conv, ring and cursors; decoding goes on exactly."""
    kind = "nemotron_h"
    runner = make_runner(kind)
    s = Seq(kind, 16, [1], [5, 6, 7, 8], seed=11)
    step(runner, [s], [s.prefill(7)], [1])
    for _ in range(2):
        step(runner, [s], [s.verify(0)], [1])
    runner.copy_slot(1, 8)
    for t in runner.mamba_cache.per_slot_tensors():  # bit-exact, never-written NaN rows included
        torch.testing.assert_close(t[8], t[1], rtol=0, atol=0, equal_nan=True)
    assert runner.mamba_cache.committed[8] == 2
    s.slot = 8
    while s.t < 16:
        step(runner, [s], [s.verify(0)], [1])
    s.check()


@pytest.mark.parametrize("replayssm", [True, False])
def test_bf16_state_stays_close(replayssm):
    """A bf16 state pool (stochastic rounding on write) keeps decode logits close to fp32."""
    kind = "mamba2"
    runner = make_runner(kind, replayssm=replayssm, state_dtype="bfloat16")
    s = Seq(kind, 24, [2], [0, 1, 2, 3, 4, 5], seed=12)
    step(runner, [s], [s.prefill(6)], [1])
    while s.t < 24:
        step(runner, [s], [s.verify(0)], [1])
    pos = sorted(s.got)
    torch.testing.assert_close(torch.stack([s.got[p] for p in pos]), s.ref[pos], rtol=0.05, atol=0.05)


def test_sizes_match_allocation():
    """bytes_per_slot / bytes_per_kv_block (static and bound) equal the allocated tensors' bytes."""
    kind = "nemotron_h"
    runner = make_runner(kind, num_speculative_tokens=1, state_dtype="float16")
    cache = runner.mamba_cache
    slot_bytes = sum(t[0].numel() * t.element_size() for t in cache.per_slot_tensors())
    assert runner.bytes_per_slot() == slot_bytes
    assert runner.bytes_per_slot() == ModelRunner.slot_bytes(
        runner.model_config, dtype="float32", state_dtype="float16", replayssm=True, replay_window=4,
        num_speculative_tokens=1, kv_block_size=BLOCK)
    kv = runner.kv_cache
    assert runner.bytes_per_kv_block() == sum(t[0].numel() * t.element_size() for t in kv.k + kv.v)
    assert ModelRunner.kv_block_bytes(runner.model_config, dtype="float32", kv_block_size=BLOCK) == \
        runner.bytes_per_kv_block()
    total = sum(t.numel() * t.element_size() for t in cache.per_slot_tensors() + cache.conv_scratch)
    fixed = ModelRunner.fixed_bytes(runner.model_config, dtype="float32", state_dtype="float16",
                                    replayssm=True, replay_window=4, num_speculative_tokens=1, max_num_seqs=4)
    assert total == runner.num_slots * runner.bytes_per_slot() + fixed
    off = make_runner(kind, replayssm=False, num_speculative_tokens=1, state_dtype="float16")
    assert off.bytes_per_slot() < runner.bytes_per_slot()


def test_bad_rows_raise():
    """Malformed rows and protocol misuse raise ValueError naming the problem."""
    runner = make_runner("nemotron_h", num_speculative_tokens=1)
    ok = ScheduledRow([1, 2, 3], 0, [0], 0, True)
    cases = [
        (ScheduledRow([], 0, [0], 0, True), "token_ids"),
        (ScheduledRow([1], 0, [0], 10, True), "slot"),
        (ScheduledRow([1] * 5, 0, [0], 0, True), "block_table"),
        (ScheduledRow([1] * 5, 0, [0, -1], 0, True), "outside"),
        (ScheduledRow([1] * 5, 0, [runner.num_kv_blocks, 0], 0, True), "outside"),
        (ScheduledRow([1], 0, [0], 0, False), "prior state"),
        (ScheduledRow([1, 2, 3], 4, [0, 1], 0, False), "decode tokens"),
        (ScheduledRow([1, 2], 4, [0, 1], 0, False, spec_slots=[0, 1]), "spec_slots"),
        (ScheduledRow([1], 0, [0], 0, True, num_logits=2), "num_logits"),
    ]
    for row, match in cases:
        with pytest.raises(ValueError, match=match):
            runner.execute([row])
    with pytest.raises(ValueError, match="share a slot"):
        runner.execute([ok, ScheduledRow([4], 0, [1], 0, True)])
    runner.execute([ok])
    runner.commit([ok], [1])
    dec = ScheduledRow([4, 5], 3, [0, 1], 0, False, num_logits=2)
    runner.execute([dec])
    with pytest.raises(ValueError, match="commit"):
        runner.execute([dec])
    with pytest.raises(ValueError, match="num_accepted"):
        runner.commit([dec], [3])


@settings(deadline=None, max_examples=4, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), replayssm=st.booleans())
def test_random_schedules(seed, replayssm):
    """Random chunking, skipped steps, verify lengths and acceptances: every logit equals transformers'."""
    kind = "nemotron_h"
    rng = random.Random(seed)
    runner = make_runner(kind, replayssm=replayssm, num_speculative_tokens=2)
    slots, blocks = rng.sample(range(10), 9), rng.sample(range(48), 15)
    seqs = [Seq(kind, rng.randint(8, 18), slots[3 * i:3 * i + 3], blocks[5 * i:5 * i + 5], seed=seed + i)
            for i in range(3)]
    prompts = [rng.randint(1, len(s.ids) - 1) for s in seqs]
    while any(s.t < len(s.ids) for s in seqs):
        todo = [i for i, s in enumerate(seqs) if s.t < len(s.ids) and rng.random() < 0.8]
        rng.shuffle(todo)
        rows, accepted = [], []
        for i in todo:
            s = seqs[i]
            if s.t < prompts[i]:
                rows.append(s.prefill(rng.randint(1, prompts[i] - s.t)))
                accepted.append(1)
            else:
                k = rng.randint(0, min(2, len(s.ids) - s.t - 1))
                wrong = rng.choice([None] + list(range(1, k + 1)))
                rows.append(s.verify(k, wrong=wrong, baseline=not replayssm))
                accepted.append(k + 1 if wrong is None else wrong)
        if rows:
            step(runner, [seqs[i] for i in todo], rows, accepted)
    for s in seqs:
        s.check()
