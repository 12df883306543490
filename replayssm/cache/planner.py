"""Memory planner: a byte budget -> number of KV blocks and Mamba slots."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachePlan:
    """How the cache budget is split.

    num_requests_fit: requests that can run at once (bounded by slots and max_num_seqs).
    num_max_len_requests_fit: requests of max_model_len tokens whose KV fits at the same time;
        when it is below num_requests_fit, long requests may be preempted.
    """

    num_kv_blocks: int
    num_slots: int
    slots_per_request: int
    num_requests_fit: int
    num_max_len_requests_fit: int
    bytes_per_slot: int
    bytes_per_kv_block: int

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot + self.num_kv_blocks * self.bytes_per_kv_block


def slots_per_request(replayssm: bool, num_speculative_tokens: int) -> int:
    """1 with ReplaySSM (one checkpoint + ring serves every draft); 1 + k for the baseline,
    whose verify step writes one state per draft position."""
    return 1 if replayssm else 1 + num_speculative_tokens


def plan_cache(
    memory_budget: int,
    *,
    bytes_per_slot: int,
    bytes_per_kv_block: int,
    kv_block_size: int,
    max_model_len: int,
    slots_per_request: int,
    max_num_seqs: int,
    num_kv_blocks: int | None = None,
    num_slots: int | None = None,
    checkpoint_interval: int | None = None,
) -> CachePlan:
    """Split ``memory_budget`` bytes between Mamba slots and KV blocks.

    Without overrides: reserve the KV blocks of one max_model_len request, give slots to as
    many requests as the rest allows (at most max_num_seqs), and give what remains to KV
    blocks, capped at what every running request at max_model_len would need. A
    pure-attention or pure-Mamba model (0 bytes per slot or per block) gets that cap for free.
    With prefix caching (``checkpoint_interval`` set) and no forced slot count, memory still
    unused after that becomes extra Mamba slots for checkpoints, at most one per interval of
    tokens the KV blocks hold (checkpoints also take slots that no running request uses).
    Raises ValueError when the budget cannot hold one max-length request.
    """
    forced_slots = num_slots is not None
    s = slots_per_request
    blocks_per_request = -(-max_model_len // kv_block_size)
    one_request = s * bytes_per_slot + blocks_per_request * bytes_per_kv_block
    if memory_budget < one_request and (num_kv_blocks is None or num_slots is None):
        raise ValueError(
            f"memory_budget={memory_budget} bytes cannot hold one request of max_model_len={max_model_len} "
            f"tokens: it needs {one_request} bytes ({s} slot(s) x {bytes_per_slot} + {blocks_per_request} KV "
            f"blocks x {bytes_per_kv_block}); raise memory_budget or lower max_model_len"
        )
    if num_slots is not None:
        if num_slots < s:
            raise ValueError(f"num_slots={num_slots} cannot hold one request ({s} slots per request)")
        requests = min(max_num_seqs, num_slots // s)
    else:
        kv_reserved = (
            num_kv_blocks if num_kv_blocks is not None else blocks_per_request
        ) * bytes_per_kv_block
        by_memory = (memory_budget - kv_reserved) // (s * bytes_per_slot) if bytes_per_slot else max_num_seqs
        requests = min(max_num_seqs, by_memory)
        if requests < 1:
            raise ValueError(
                f"memory_budget={memory_budget} bytes leaves no room for one request's {s} Mamba slot(s) "
                f"({s * bytes_per_slot} bytes) after {kv_reserved} bytes of KV blocks"
            )
        num_slots = requests * s
    if num_kv_blocks is not None:
        if num_kv_blocks < blocks_per_request:
            raise ValueError(
                f"num_kv_blocks={num_kv_blocks} cannot hold one request of max_model_len={max_model_len} "
                f"tokens ({blocks_per_request} blocks of {kv_block_size})"
            )
    else:
        cap = requests * blocks_per_request
        if bytes_per_kv_block:
            num_kv_blocks = min(cap, (memory_budget - num_slots * bytes_per_slot) // bytes_per_kv_block)
        else:
            num_kv_blocks = cap
        assert num_kv_blocks >= blocks_per_request
    if checkpoint_interval and not forced_slots and bytes_per_slot:
        spare = memory_budget - num_slots * bytes_per_slot - num_kv_blocks * bytes_per_kv_block
        useful = num_kv_blocks * kv_block_size // checkpoint_interval
        num_slots += max(0, min(spare // bytes_per_slot, useful))
    return CachePlan(
        num_kv_blocks=num_kv_blocks,
        num_slots=num_slots,
        slots_per_request=s,
        num_requests_fit=requests,
        num_max_len_requests_fit=num_kv_blocks // blocks_per_request,
        bytes_per_slot=bytes_per_slot,
        bytes_per_kv_block=bytes_per_kv_block,
    )
