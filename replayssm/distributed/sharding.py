"""Which slice of every weight and cache a tensor-parallel rank holds.

    tensor (checkpoint name)                      split                     rank r keeps
    ---------------------------------------------------------------------------------------------
    mamba in_proj  rows [z | x | B | C | dt]      heads; B, C by group      z_r, x_r, B_g, C_g, dt_r
    mamba conv1d   channels [x | B | C]           same as in_proj           x_r, B_g, C_g
    mamba A_log, D, dt_bias, norm.weight          heads                     its heads' entries
    mamba out_proj (hidden, H*P)                  columns (row-parallel)    its heads' columns
    attention q / k / v                           heads / kv heads          its heads (kv replicated
                                                                            when kv heads < ranks)
    Qwen gated attention q_proj [q | gate]/head   heads                     its heads' 2 * head_dim rows
    GDN in_proj_qkvz, in_proj_ba (Qwen3-Next)     key heads (a row block    its key heads' blocks
                                                  per key head)
    GDN in_proj_qkv, conv1d channels [q | k | v]  key heads; v by the       q_r, k_r and the v of the
                                                  value heads reading them  value heads reading them
    GDN in_proj_z / b / a, A_log, dt_bias         value heads               its value heads' entries
    GDN out_proj (hidden, Hv*Dv)                  columns (row-parallel)    its value heads' columns
    attention o_proj, mlp down, expert down       columns (row-parallel)    its intermediate slice
    mlp up / gate, expert up (every expert)       rows (column-parallel)    its intermediate slice
    fused [gate | up] rows (Granite, Zamba2)      each half by rows         gate_r and up_r
    Zamba2 LoRA adapter: A (rank, in)             replicated                everything
                         B (out, rank)            rows, as the projection   the projection's rows
    embeddings, lm_head                           vocab rows (padded)       ceil(V / size) rows
    norms, routers, latent projections, Zamba2    replicated                everything
    `linear`, Qwen shared_expert_gate, MTP fc
    bias of a row-parallel projection             rank 0 only               zeros elsewhere
    FP8 weight_scale (N, 1) per channel           as its weight's rows      its rows' scales (all of
                                                                            them when row-parallel)
    FP8 weight_scale per tensor, input_scale      replicated                everything

Groups (g): with G >= size each rank keeps G / size whole groups; with G < size the ranks that
share a group each keep a copy of it (G must divide size). The gated RMSNorm normalizes over a
group's I / G channels; with G < size those channels span ranks, and the mixer all-reduces the
sum of squares (see MambaShard.norm_group). Every row-parallel output is a partial sum that the
block all-reduces once per sum it feeds (a LoRA adapter's output adds to its projection's shard,
which is exact: B_r (A x) are the rows of B (A x) that the shard computes).

A tensor is found by our parameter name: `layers.{i}.mixer.*` has the kind of layer i (a parallel
layer's mixer is its Mamba-2), the family modules beside it by `_PARTS`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from replayssm.distributed.parallel import TensorParallel
from replayssm.models.config import ATTENTION, GDN, MAMBA, MLP, MOE, PARALLEL, ModelConfig
from replayssm.models.config_qwen3_next import GDN_ARCHITECTURES


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the field that does not split over `size` ranks."""
    if size == 1:
        return

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model: {what}")

    kinds = cfg.block_kinds
    if GDN in kinds:
        # Each rank keeps whole key heads and the value heads that read them.
        for name, value in (("gdn_num_k_heads (linear_num_key_heads)", cfg.gdn_num_k_heads),
                            ("gdn_num_v_heads (linear_num_value_heads)", cfg.gdn_num_v_heads)):
            need(value % size == 0, f"{name}={value} must be a multiple of {size}")
    if kinds & {MAMBA, PARALLEL}:
        H, G = cfg.mamba_num_heads, cfg.mamba_n_groups
        need(H % size == 0, f"mamba_num_heads={H} must be a multiple of {size}")
        need(G % size == 0 or size % G == 0, f"n_groups={G} must divide or be a multiple of {size}")
    if kinds & {ATTENTION, PARALLEL}:
        nh, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        need(nh % size == 0, f"num_attention_heads={nh} must be a multiple of {size}")
        need(kv % size == 0 or size % kv == 0,
             f"num_key_value_heads={kv} must divide or be a multiple of {size}")
    # Parallel layers (Falcon-H1, Zamba2 hybrid) carry a dense MLP of intermediate_size too.
    if kinds & {MLP, PARALLEL}:
        need(cfg.intermediate_size % size == 0, f"intermediate_size={cfg.intermediate_size} "
             f"must be a multiple of {size}")
    if MOE in kinds:
        for name in ("moe_intermediate_size", "moe_shared_intermediate_size"):
            value = getattr(cfg, name)
            need(value % size == 0, f"{name}={value} must be a multiple of {size}")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's shard (head, group and intermediate counts divided); same on every rank."""
    if size == 1:
        return cfg
    check_shardable(cfg, size)
    return dataclasses.replace(
        cfg,
        mamba_num_heads=cfg.mamba_num_heads // size,
        mamba_n_groups=max(cfg.mamba_n_groups // size, 1),
        gdn_num_k_heads=cfg.gdn_num_k_heads // size,
        gdn_num_v_heads=cfg.gdn_num_v_heads // size,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(cfg.num_key_value_heads // size, 1) if cfg.num_key_value_heads else 0,
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
        moe_shared_intermediate_size=cfg.moe_shared_intermediate_size // size,
    )


def _owned(n: int, tp: TensorParallel) -> tuple[int, int]:
    """[start, stop) of n items split over ranks, or the one item shared by this rank when n < size."""
    if n >= tp.size:
        return tp.split(n)
    g = tp.rank // (tp.size // n)
    return g, g + 1


@dataclass(frozen=True)
class MambaShard:
    """One rank's Mamba heads and groups (see the module docstring)."""

    heads: tuple[int, int]
    groups: tuple[int, int]
    norm_group_size: int  # I / G channels per gated-norm group (global)
    norm_group: int | None  # global group index when the group spans ranks (sum of squares all-reduced)
    num_norm_groups: int

    @classmethod
    def of(cls, cfg: ModelConfig, tp: TensorParallel) -> MambaShard:
        H, G = cfg.mamba_num_heads, cfg.mamba_n_groups
        groups = _owned(G, tp)
        spans = G < tp.size
        return cls(tp.split(H), groups, cfg.mamba_intermediate_size // G, groups[0] if spans else None, G)


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(start, stop, rows): rank r holds ids [start, stop) in `rows` = ceil(V / size) rows (zero padded)."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


_LAYER = re.compile(r"^layers\.(\d+)\.mixer\.(.+)$")
_EXPERT = re.compile(r"^experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
# Family modules beside `mixer`: our name -> (kind whose rules apply, leaf). A LoRA adapter's second
# matrix (B) is sliced like the projection it adds to; its first (A) is replicated.
_PARTS = (
    (re.compile(r"^(?:layers|shared)\.\d+\.self_attn\.(.+)$"), ATTENTION),  # Falcon-H1, Zamba2, Qwen
    (re.compile(r"^layers\.\d+\.linear_attn\.(.+)$"), GDN),  # Qwen3-Next, Qwen3.5
    (re.compile(r"^layers\.\d+\.mlp\.((?:experts|shared_expert)\..+)$"), MOE),  # Qwen's MoE
    (re.compile(r"^(?:layers|shared)\.\d+\.(?:mlp|feed_forward)\.(.+)$"), MLP),
    (re.compile(r"^layers\.\d+\.block_sparse_moe\.(experts\..+)$"), MOE),  # Granite's stacked experts
    (re.compile(r"^layers\.\d+\.([qkv])_adapter\.1\.weight$"), ATTENTION),
    (re.compile(r"^layers\.\d+\.mlp_adapter\.1\.weight$"), MLP),
)


def _locate(cfg: ModelConfig, name: str) -> tuple[str, str] | None:
    """(kind, leaf) whose rules slice our parameter `name`, or None when it is replicated."""
    m = _LAYER.match(name)
    if m:
        kind = cfg.layer_types[int(m.group(1))]
        return (MAMBA if kind == PARALLEL else kind), m.group(2)
    for pattern, kind in _PARTS:
        m = pattern.match(name)
        if m:
            if name.endswith("_adapter.1.weight"):
                leaf = "gate_up_proj.weight" if kind == MLP else f"{m.group(1)}_proj.weight"
                return kind, leaf
            return kind, m.group(1)
    return None


def _halves(r: tuple[int, int], n: int) -> list[tuple[int, int]]:
    """Rows [gate | up] of 2n: this rank's slice r of each half."""
    return [r, (n + r[0], n + r[1])]


def _rules(cfg: ModelConfig, kind: str, leaf: str, tp: TensorParallel):
    """(dim, ranges) to read, "rank0" for a row-parallel bias, or None when replicated."""
    if kind == MAMBA:
        sh = MambaShard.of(cfg, tp)
        I, N, P = cfg.mamba_intermediate_size, cfg.ssm_state_size, cfg.mamba_head_dim
        GN = cfg.mamba_n_groups * N
        (h0, h1), (g0, g1) = sh.heads, sh.groups
        x = (h0 * P, h1 * P)  # also z's rows and the norm weight's entries
        b = (g0 * N, g1 * N)
        conv = [x, (I + b[0], I + b[1]), (I + GN + b[0], I + GN + b[1])]  # channels [x | B | C]
        if leaf in ("in_proj.weight", "in_proj.bias"):
            # rows [z | x B C | dt]: conv's ranges shifted past z
            return 0, [x] + [(I + s, I + e) for s, e in conv] + [(2 * I + 2 * GN + h0, 2 * I + 2 * GN + h1)]
        if leaf in ("conv1d.weight", "conv1d.bias"):
            return 0, conv
        if leaf in ("A_log", "D", "dt_bias"):
            return 0, [(h0, h1)]
        if leaf == "norm.weight":
            return 0, [x]
        if leaf == "out_proj.weight":
            return 1, [x]
        return "rank0" if leaf == "out_proj.bias" else None
    if kind == GDN:
        return _gdn_rule(cfg, leaf, tp)
    if kind == ATTENTION:
        d = cfg.head_dim
        q = tuple(d * i for i in tp.split(cfg.num_attention_heads))
        kv = tuple(d * i for i in _owned(cfg.num_key_value_heads, tp))
        # Qwen's gated attention: q_proj rows [q | gate] per head, 2 * head_dim rows each.
        q_rows = tuple(2 * i for i in q) if cfg.architecture in GDN_ARCHITECTURES else q
        table = {"q_proj": (0, [q_rows]), "k_proj": (0, [kv]), "v_proj": (0, [kv])}
        proj, _, what = leaf.partition(".")
        if proj in table:
            return table[proj]
        if proj == "o_proj":
            return (1, [q]) if what == "weight" else "rank0"
        return None
    if kind == MLP:
        return _mlp_rule(leaf, cfg.intermediate_size, tp)
    assert kind == MOE, kind
    m = _EXPERT.match(leaf)
    if m:
        r = tp.split(cfg.moe_intermediate_size)
        return (1, [r]) if m.group(1) == "down_proj" else (0, [r])
    if leaf in ("experts.up_proj", "experts.down_proj"):
        # Granite's stacked experts: up (E, 2I, hidden) rows [gate | up], down (E, hidden, I).
        r = tp.split(cfg.moe_intermediate_size)
        return (1, _halves(r, cfg.moe_intermediate_size)) if leaf == "experts.up_proj" else (2, [r])
    shared, dot, rest = leaf.partition(".")
    if dot and shared in ("shared_experts", "shared_expert"):  # Nemotron-H's, Qwen's
        return _mlp_rule(rest, cfg.moe_shared_intermediate_size, tp)
    return "rank0" if leaf == "fc2_latent_proj.bias" else None


def _gdn_rule(cfg: ModelConfig, leaf: str, tp: TensorParallel):
    """Gated DeltaNet by key heads: rank r keeps key heads [k0, k1) and value heads [k0 n, k1 n) (n = Hv / Hk
    value heads read each key head). The fused projections (Qwen3-Next) hold one row block per key head,
    in_proj_qkvz [q k v z] (2 Dk + 2 n Dv rows) and in_proj_ba [b a] (2 n rows), so a rank's rows are
    one contiguous range; the conv channels are [q | k | v] in both layouts."""
    Hk, Dk, Dv = cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    n = cfg.gdn_num_v_heads // Hk
    k0, k1 = tp.split(Hk)
    v0, v1 = k0 * n, k1 * n
    K = Hk * Dk
    qkv = [(k0 * Dk, k1 * Dk), (K + k0 * Dk, K + k1 * Dk), (2 * K + v0 * Dv, 2 * K + v1 * Dv)]
    block = 2 * Dk + 2 * n * Dv
    table = {
        "in_proj_qkvz.weight": (0, [(k0 * block, k1 * block)]),
        "in_proj_ba.weight": (0, [(k0 * 2 * n, k1 * 2 * n)]),
        "in_proj_qkv.weight": (0, qkv),
        "conv1d.weight": (0, qkv),
        "in_proj_z.weight": (0, [(v0 * Dv, v1 * Dv)]),
        "in_proj_b.weight": (0, [(v0, v1)]),
        "in_proj_a.weight": (0, [(v0, v1)]),
        "A_log": (0, [(v0, v1)]),
        "dt_bias": (0, [(v0, v1)]),
        "out_proj.weight": (1, [(v0 * Dv, v1 * Dv)]),
    }
    return table.get(leaf)  # norm.weight (Dv, shared by the heads): replicated


def _mlp_rule(leaf: str, intermediate: int, tp: TensorParallel):
    r = tp.split(intermediate)
    if leaf.startswith(("up_proj.", "gate_proj.")):
        return 0, [r]
    if leaf.startswith(("gate_up_proj.", "input_linear.")):
        return 0, _halves(r, intermediate)
    if leaf in ("down_proj.weight", "output_linear.weight"):
        return 1, [r]
    return "rank0" if leaf == "down_proj.bias" else None


def read_shard(cfg: ModelConfig, tp: TensorParallel, f, key: str, name: str) -> torch.Tensor:
    """This rank's part of checkpoint tensor `key` (our name `name`), read with safetensors get_slice.

    f is an open `safe_open(..., framework="pt")` handle; only the slices this rank keeps are read.
    FP8 scales are named `<weight>_scale` and `<module>.input_scale` (models/loader.py).
    """
    if name.endswith(".input_scale"):
        return f.get_tensor(key)
    if name.endswith("_scale"):
        return _read_scale(cfg, tp, f, key, name.removesuffix("_scale"))
    if name in ("embeddings.weight", "lm_head.weight"):
        start, stop, rows = vocab_range(cfg.vocab_size, tp)
        part = f.get_slice(key)[start:stop]
        pad = part.new_zeros(rows - part.shape[0], *part.shape[1:])
        return torch.cat([part, pad]) if pad.shape[0] else part
    where = _locate(cfg, name)
    rule = _rules(cfg, *where, tp) if where else None
    if rule is None:
        return f.get_tensor(key)
    sl = f.get_slice(key)
    if rule == "rank0":
        return f.get_tensor(key) if tp.rank == 0 else torch.zeros(sl.get_shape(), dtype=_dtype(sl))
    dim, ranges = rule
    parts = [sl[(slice(None),) * dim + (slice(s, e),)] for s, e in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_scale(cfg: ModelConfig, tp: TensorParallel, f, key: str, weight: str) -> torch.Tensor:
    """A weight_scale: the rows its weight keeps where it has one scale per row, else all of it."""
    sl = f.get_slice(key)
    shape = sl.get_shape()
    if weight == "lm_head.weight" and len(shape) == 2 and shape[0] > 1:
        start, stop, rows = vocab_range(cfg.vocab_size, tp)
        part = sl[start:stop]
        return torch.cat([part, part.new_ones(rows - part.shape[0], *part.shape[1:])])
    where = _locate(cfg, weight)
    rule = _rules(cfg, *where, tp) if where else None
    if rule is None or rule == "rank0" or len(shape) <= rule[0] or shape[rule[0]] == 1:
        return f.get_tensor(key)
    dim, ranges = rule
    parts = [sl[(slice(None),) * dim + (slice(s, e),)] for s, e in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _dtype(sl) -> torch.dtype:
    return _ST_DTYPES.get(sl.get_dtype(), torch.float32)
