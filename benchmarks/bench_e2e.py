"""End-to-end engine benchmark: ``replayssm bench`` (or ``python3 benchmarks/bench_e2e.py``).

Model: a Nemotron-H-8B-shaped config (hidden 4096, the 52-layer M/-/* pattern; or, with
``--model-shape granite-4.0-h-small``, the published Granite 4.0-H Small: 40 layers of Mamba-2 or
attention each followed by 72-expert MoE + shared MLP, 32B parameters; ``qwen3.5-27b``, the published
Qwen3.5-27B text model: 64 layers, 3 Gated DeltaNet to 1 gated attention, dense MLP; or
``qwen3-next-80b-a3b``, 512-expert MoE, 160 GB of bf16 weights: more than one GPU holds) with seeded
random bf16 weights made on the device (``load_format="dummy"``: only a config.json is written), fp32 Mamba
state, W=16. Every mode runs its settings in OFF, ON, ON, OFF order in
one process, so ON/OFF ratios come from one run with drift cancelled:

    (a) decode   OFF = ReplaySSM off, ON = ReplaySSM on; short prompts, long outputs
    (b) spec     k=3 synthetic drafts (acceptance length 3.1151); OFF = ReplaySSM off
                 (baseline verify, 1 + k state slots per request), ON = ReplaySSM on
    (c) prefix   multi-turn over one long shared context; OFF/ON = prefix caching off/on
    (s) seeds    the seeds' prefix-caching run: (c)'s conversation at 51,200 shared tokens, 20 turns
                 of 2,048 in / 1,024 out (x `--scale`), with k=3 synthetic drafts (acceptance
                 3.1151) and fp16 state; OFF/ON = prefix caching off/on. Not in the default modes.

`--state-dtype float32,float16` runs (a), (b) and (c) once per state dtype (each its own
OFF/ON/ON/OFF set), so the ON/OFF ratios per dtype and the ON(fp16) / ON(fp32) ratio come from one
process. `--quantization none,fp8` (weights in the model dtype, or FP8 quantized at load) and
`--kv-cache-dtype auto,fp8` work the same way: every combination runs its own set, and the report
compares each one's ON and OFF with those of bf16 weights and KV (`variant_ratios`).
`--tensor-parallel-size N` runs every engine over N GPUs. Every row records its state dtype,
quantization, KV cache dtype and TP size.

`--model-shape nemotron-3-nano-30b-a3b` is the published NVIDIA-Nemotron-3-Nano-30B-A3B config
(52 layers: 23 Mamba-2, 23 MoE of 128 routed experts (6 per token) + a shared expert, 6 attention;
31.6B parameters). Its bf16 weights take 63 GB, which leaves an 80 GB GPU too little for batch 256
with fp32 state: run it with `--quantization fp8` (32 GB of weights) on an H100, or in bf16 on an H200.

(c) defaults to 12,800 shared tokens and 4 turns of 1,024 in / 128 out (x `--scale`), so the
whole benchmark fits in about ten minutes on an H200; `--shared-context 51200 --turns 20
--turn-input 2048` runs the full-size conversation. The prefix share of a turn's prompt (which
sets the TTFT saving) stays above 90% either way. Per request the engine loop records the
submit time and the step (and time) of its first and last token; see summarize() for the
metrics. `--quick` is a CPU smoke run of the same code paths on a tiny model: one rep of
OFF/ON/ON/OFF per mode without warm-ups, whose numbers say nothing about speed.

Before the timed runs of a (mode, setting, batch) an untimed warm-up engine of the same config
runs a short version of the workload (not recorded: "warmups" in the result), so Triton JIT and
other first-use costs do not land in rep 0. Every engine is released before the next is built:
the planner sizes caches from free CUDA memory, so a live previous engine would shrink the next.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
    "hidden_size": 4096, "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "expand": 2, "chunk_size": 128, "use_conv_bias": True, "mamba_hidden_act": "silu",
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    # No positional encoding: the long multi-turn context only needs the limit raised.
    "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}
# A few layers of every kind (MoE included) for the CPU smoke run.
TINY = {
    **NEMOTRON_H_8B, "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 6,
    "hybrid_override_pattern": "M-M*ME", "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
    "n_groups": 2, "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "max_position_embeddings": 4096, "dtype": "float32",
}
# ibm-granite/granite-4.0-h-small's config.json (the fields that shape the model).
GRANITE_4_H_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 100352,
    "hidden_size": 4096, "num_hidden_layers": 40,
    "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
    "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attention_bias": False, "hidden_act": "silu",
    "num_local_experts": 72, "num_experts_per_tok": 10, "intermediate_size": 768,
    "shared_intermediate_size": 1536, "embedding_multiplier": 12, "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125, "logits_scaling": 16, "position_embedding_type": "nope",
    "normalization_function": "rmsnorm", "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "bos_token_id": 100257, "eos_token_id": 100257, "dtype": "bfloat16",
}
# ibm-granite/granite-4.0-h-tiny: the same structure at 7B (1B active), which fits one 80 GB GPU
# with batch-256 fp32 state; the multipliers are Small's (they do not change the work per step).
GRANITE_4_H_TINY = {
    **GRANITE_4_H_SMALL, "hidden_size": 1536,
    "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
    "mamba_n_heads": 48, "num_attention_heads": 12, "num_key_value_heads": 4,
    "num_local_experts": 64, "num_experts_per_tok": 6, "intermediate_size": 512,
    "shared_intermediate_size": 1024,
}
# The same structure at toy size for the CPU smoke run.
TINY_GRANITE = {
    **GRANITE_4_H_SMALL, "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"], "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
    "shared_intermediate_size": 48, "attention_multiplier": 0.0625, "max_position_embeddings": 4096,
    "dtype": "float32",
}
# Qwen/Qwen3.5-27B's text_config (dense, 64 layers: 3 Gated DeltaNet + 1 gated attention, repeated),
# served as the text-only Qwen3_5ForCausalLM (the vision tower does not change a text decode step).
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
    "hidden_size": 5120, "num_hidden_layers": 64, "full_attention_interval": 4,
    "intermediate_size": 17408,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 248044,
    "dtype": "bfloat16",
}
# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: 48 layers, every FFN a 512-expert top-10 MoE with
# a shared expert. 80B parameters (160 GB in bf16): more than one 80 GB (or 141 GB) GPU holds.
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4, "intermediate_size": 5120,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [], "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True, "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6,
    "rope_theta": 5000000, "partial_rotary_factor": 0.25, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
}
# The same structures at toy size for the CPU smoke run (value heads 2x the key heads, as published).
_TINY_QWEN = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "max_position_embeddings": 4096,
              "dtype": "float32"}
TINY_QWEN3_5 = {**QWEN3_5_27B, **_TINY_QWEN, "intermediate_size": 96}
TINY_QWEN3_NEXT = {**QWEN3_NEXT_80B_A3B, **_TINY_QWEN, "intermediate_size": 96, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json (the fields that shape the model).
NEMOTRON_3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
    "hidden_size": 2688, "num_hidden_layers": 52,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "expand": 2, "chunk_size": 128, "use_conv_bias": True, "mamba_hidden_act": "silu",
    "mamba_proj_bias": False, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "attention_bias": False,
    "intermediate_size": 1856, "mlp_hidden_act": "relu2", "mlp_bias": False,
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}
# --model-shape: (full shape, its CPU smoke twin); the first is the default.
MODEL_SHAPES = {"nemotron-h-8b": (NEMOTRON_H_8B, TINY),
                "nemotron-3-nano-30b-a3b": (NEMOTRON_3_NANO, TINY),
                "granite-4.0-h-small": (GRANITE_4_H_SMALL, TINY_GRANITE),
                "granite-4.0-h-tiny": (GRANITE_4_H_TINY, TINY_GRANITE),
                "qwen3.5-27b": (QWEN3_5_27B, TINY_QWEN3_5),
                "qwen3-next-80b-a3b": (QWEN3_NEXT_80B_A3B, TINY_QWEN3_NEXT)}
ORDER = ("off", "on", "on", "off")
ACCEPTANCE_LENGTH = 3.1151
STATE_DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "fp8")  # --quantization: weights in the model dtype, or FP8 E4M3 at load
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: the model dtype, or FP8 E4M3
SEED_STATE_DTYPE = "float16"  # mode (s): the seeds' FP16 SSM state
# ON/OFF targets per mode, and "a:float16" = mode (a) ON with fp16 state over ON with fp32 state.
TARGETS = {"a": 1.45, "b": 2.2, "c": 0.88, "a:float16": 1.12}


@dataclass(frozen=True)
class Workload:
    """Sizes of every mode (token counts are per request)."""

    config: dict
    device: str
    dtype: str
    decode_batch: int = 256
    decode_prompt: int = 32
    decode_output: int = 1000
    spec_batches: tuple[int, ...] = (256, 512)
    spec_prompt: int = 32
    spec_output: int = 256
    spec_k: int = 3
    # 4,096: a whole verify step of 512 rows (512 x (1 + k) = 2,048) plus as many prompt tokens.
    # A smaller budget spreads the prefill of (b) 512 over many mixed steps in which decode rows get
    # fewer drafts, so most steps are ragged and run eagerly instead of replaying a graph. Simulating
    # the scheduler alone (prompt 32, output 256, k = 3, ~3.1 accepted) gives steps with prefill /
    # ragged / uniform rows of 52 / 44 / 47 at 2,048, 6 / 24 / 80 at 4,096, 3 / 22 / 79 at 8,192.
    spec_max_num_batched_tokens: int = 4096
    conversations: int = 1
    shared_context: int = 12800
    turns: int = 4
    turn_input: int = 1024
    turn_output: int = 128
    max_num_batched_tokens: int = 8192
    # (s): the seeds' prefix-caching conversation (k = spec_k synthetic drafts, fp16 state).
    seed_shared_context: int = 51200
    seed_turns: int = 20
    seed_turn_input: int = 2048
    seed_turn_output: int = 1024
    # (a), (b), (c) run once per state dtype (s always runs SEED_STATE_DTYPE).
    state_dtypes: tuple[str, ...] = ("float32",)
    # ... and once per weight quantization and KV cache dtype ((s) runs the first of each).
    quantizations: tuple[str, ...] = ("none",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    tensor_parallel_size: int = 1
    # (c) ON turns all spare cache memory into checkpoint slots; a lower share keeps room for the
    # 8,192-token prefill chunks of one long conversation (a single conversation needs little cache).
    prefix_gpu_memory_utilization: float = 0.8
    # (b) at 0.9 leaves too little memory for the prefill's scratch on the H200 (the planner gives
    # every byte left after KV to Mamba slots).
    spec_gpu_memory_utilization: float = 0.8
    kv_block_size: int = 16
    window: int = 16
    cuda_graphs: bool | None = None  # the engine's default (graphs wherever supported) unless set
    async_scheduling: bool | None = None  # the engine's default (on with CUDA) unless set
    replay_stagger: bool | None = None  # the engine's default (staggered checkpoints on) unless set
    # One untimed warm-up run per (mode, setting, batch) before the timed ones (see warmup_sizes).
    warmup: bool = True
    # A CPU smoke run of the code paths (--quick): no targets, no rep-to-rep checks in the report.
    smoke: bool = False

    def scaled(self, s: float) -> Workload:
        """Output lengths and context sizes times s (batches unchanged)."""
        n = lambda v: max(2, round(v * s))  # noqa: E731
        return dataclasses.replace(self, decode_output=n(self.decode_output), spec_output=n(self.spec_output),
                                   shared_context=n(self.shared_context), turn_input=n(self.turn_input),
                                   turn_output=n(self.turn_output),
                                   seed_shared_context=n(self.seed_shared_context),
                                   seed_turn_input=n(self.seed_turn_input),
                                   seed_turn_output=n(self.seed_turn_output))


def warmup_sizes(w: Workload) -> Workload:
    """The warm-up's workload: same batches, prompts and contexts (the kernels' shapes), outputs cut to
    two replay windows plus two tokens (every ring flush path runs), at most two turns of (c) and
    (s) (the second hits the prefix cache). (b) keeps its whole outputs: its requests finish over
    many steps (acceptance varies), so its batch shrinks through the small graph buckets, whose first use
    compiles kernel variants (several seconds on the H200, which would land in the first timed
    ON run)."""
    cut = 2 * w.window + 2
    return dataclasses.replace(w, decode_output=min(w.decode_output, cut), turns=min(w.turns, 2),
                               turn_output=min(w.turn_output, cut), seed_turns=min(w.seed_turns, 2),
                               seed_turn_output=min(w.seed_turn_output, cut))


def _shape(name: str) -> tuple[dict, dict]:
    if name not in MODEL_SHAPES:
        raise ValueError(f"--model-shape must be one of {sorted(MODEL_SHAPES)}, got {name!r}")
    return MODEL_SHAPES[name]


def first_layers(config: dict, n: int) -> dict:
    """config cut to its first n layers: the layer pattern (hybrid_override_pattern or layer_types)
    sliced, so a shallower model keeps the published layer mix (what --layers runs)."""
    depth = config["num_hidden_layers"]
    if not 1 <= n <= depth:
        raise ValueError(f"--layers must be in 1..{depth} (the shape's num_hidden_layers), got {n}")
    out = {**config, "num_hidden_layers": n}
    if "hybrid_override_pattern" in config:
        out["hybrid_override_pattern"] = config["hybrid_override_pattern"][:n]
    if "layer_types" in config:
        out["layer_types"] = list(config["layer_types"][:n])
    return out


def h200_workload(scale: float = 1.0, model_shape: str = "nemotron-h-8b") -> Workload:
    return Workload(_shape(model_shape)[0], "cuda", "bfloat16").scaled(scale)


def quick_workload(model_shape: str = "nemotron-h-8b") -> Workload:
    """The CPU smoke run: every mode's code path on a tiny model, one spec batch, no warm-ups (nothing
    to compile on the CPU), outputs just past one replay window so ring flushes run."""
    return Workload(_shape(model_shape)[1], "cpu", "float32", decode_batch=4, decode_prompt=5,
                    decode_output=6, spec_batches=(4,), spec_prompt=5, spec_output=6,
                    spec_max_num_batched_tokens=64,
                    conversations=2, shared_context=24, turns=2, turn_input=6, turn_output=3,
                    seed_shared_context=24, seed_turns=2, seed_turn_input=6, seed_turn_output=6,
                    max_num_batched_tokens=64, kv_block_size=4, window=4, warmup=False, smoke=True)


# ---- driving the engine -------------------------------------------------------------------------


@dataclass
class Trace:
    """Per-request timeline of one run (host clock after each step; step() syncs on the tokens)."""

    submit: dict[str, float] = dataclasses.field(default_factory=dict)
    first: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    last: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    turn: dict[str, int] = dataclasses.field(default_factory=dict)
    steps: int = 0
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def drive(engine, prompts: dict[str, list[int]], max_tokens: int, trace: Trace, turn: int = 0) -> None:
    """Submit `prompts` at once (greedy, ignore_eos, exactly max_tokens each) and step until done."""
    from replayssm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    now = time.perf_counter()
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
        trace.submit[rid], trace.turn[rid] = now, turn
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        trace.steps += 1
        for out in outs:
            if out.num_output_tokens and out.request_id not in trace.first:
                trace.first[out.request_id] = (trace.steps, now)
            trace.last[out.request_id] = (trace.steps, now)
            trace.tokens[out.request_id] = out.num_output_tokens
            if out.finished:
                trace.outputs[out.request_id] = list(out.token_ids)


def _decode_workload(engine, w: Workload, batch: int, prompt: int, output: int, rng: random.Random) -> Trace:
    trace = Trace()
    vocab = w.config["vocab_size"]
    drive(engine, {f"r{i}": [rng.randrange(3, vocab) for _ in range(prompt)] for i in range(batch)}, output,
          trace)
    return trace


def conversation(w: Workload, mode: str) -> tuple[int, int, int, int]:
    """(shared context, turns, turn input, turn output) of mode (c) or (s)."""
    if mode == "s":
        return w.seed_shared_context, w.seed_turns, w.seed_turn_input, w.seed_turn_output
    return w.shared_context, w.turns, w.turn_input, w.turn_output


def _multiturn_workload(engine, w: Workload, rng: random.Random, mode: str = "c") -> Trace:
    """Each conversation: shared context + turn input -> output; the next turn appends both."""
    trace = Trace()
    vocab = w.config["vocab_size"]
    shared_context, turns, turn_input, turn_output = conversation(w, mode)
    shared = [rng.randrange(3, vocab) for _ in range(shared_context)]
    history = {f"c{c}": list(shared) for c in range(w.conversations)}
    for t in range(turns):
        prompts = {}
        for c, h in history.items():
            h.extend(rng.randrange(3, vocab) for _ in range(turn_input))
            prompts[f"{c}t{t}"] = list(h)
        drive(engine, prompts, turn_output, trace, turn=t)
        for c in history:
            history[c].extend(trace.outputs[f"{c}t{t}"])
    return trace


# ---- metrics ------------------------------------------------------------------------------------


def _median(v: list[float]) -> float:
    v = sorted(v)
    return 0.0 if not v else (v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2)


def summarize(trace: Trace, metrics: dict[str, Any], wall_s: float, *, ttft_from_turn: int = 0,
              k: int = 0) -> dict[str, Any]:
    """Output tok/s; per-request decode tok/s ((n-1) / (last - first token time)); TTFT (submit ->
    first token; requests of turn >= ttft_from_turn); peak concurrent decoding requests (most
    [first, last] token-step intervals covering one step); engine counters."""
    rids = list(trace.first)
    out_tokens = sum(trace.tokens.values())
    per_req = [(trace.tokens[r] - 1) / (trace.last[r][1] - trace.first[r][1]) for r in rids
               if trace.tokens[r] > 1 and trace.last[r][1] > trace.first[r][1]]
    ttft = [trace.first[r][1] - trace.submit[r] for r in rids if trace.turn[r] >= ttft_from_turn]
    events = sorted([(trace.first[r][0], 1) for r in rids] + [(trace.last[r][0] + 1, -1) for r in rids])
    live = peak = 0
    for _, d in events:  # ends (+1) sort before starts at the same step: half-open intervals
        live += d
        peak = max(peak, live)
    drafts, accepted = metrics.get("spec_draft_tokens", 0), metrics.get("spec_accepted_tokens", 0)
    verify_rows = metrics.get("spec_verify_steps") or (drafts / k if k else 0)
    return {
        "wall_s": wall_s, "steps": trace.steps, "num_requests": len(rids), "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "decode_tok_s_per_request": _median(per_req),
        "ttft_s": sum(ttft) / len(ttft) if ttft else 0.0, "ttft_p50_s": _median(ttft),
        "ttft_max_s": max(ttft, default=0.0),
        "peak_decoding_requests": peak, "peak_running_requests": metrics.get("peak_running_requests", 0),
        "preemptions": metrics.get("num_preemptions", 0),
        "prefix_hit_tokens": metrics.get("prefix_cache_hit_tokens", 0),
        "prefix_query_tokens": metrics.get("prefix_cache_query_tokens", 0),
        "spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
        # Tokens a request gains per verify step: 1 + accepted drafts per verify row.
        "acceptance_length": 1.0 + accepted / verify_rows if verify_rows else 1.0,
    }


# ---- modes --------------------------------------------------------------------------------------


def mode_runs(w: Workload) -> list[tuple[str, str, dict[str, Any], Any]]:
    """(mode, label, engine kwargs, workload fn(engine, rng, sizes)) for every run, OFF/ON/ON/OFF within
    each group, (a), (b), (c) once per state dtype; the kwargs come from w, the fn runs the sizes it
    is given (w, or warmup_sizes(w))."""
    runs = []
    for state_dtype in w.state_dtypes:
        for quantization in w.quantizations:
            for kv_cache_dtype in w.kv_cache_dtypes:
                runs += _dtype_runs(w, state_dtype, quantization, kv_cache_dtype)
    seed_runs = []
    shared_context, turns, turn_input, turn_output = conversation(w, "s")
    total = shared_context + turns * (turn_input + turn_output) + w.spec_k + 1
    for s in ORDER:
        base = _base_kwargs(w, SEED_STATE_DTYPE, w.quantizations[0], w.kv_cache_dtypes[0])
        kw = dict(base, replayssm=True, enable_prefix_caching=s == "on",
                  max_num_seqs=max(w.conversations, 1), max_model_len=total, num_speculative_tokens=w.spec_k,
                  speculative_method="synthetic", synthetic_acceptance_length=ACCEPTANCE_LENGTH,
                  gpu_memory_utilization=w.prefix_gpu_memory_utilization)
        seed_runs.append(("s", s, kw, lambda e, rng, ww: _multiturn_workload(e, ww, rng, "s")))
    return runs + seed_runs


def _base_kwargs(w: Workload, state_dtype: str, quantization: str = "none",
                 kv_cache_dtype: str = "auto") -> dict[str, Any]:
    return dict(device=w.device, dtype=w.dtype, replay_window=w.window, state_dtype=state_dtype,
                quantization=None if quantization == "none" else quantization, kv_cache_dtype=kv_cache_dtype,
                kv_block_size=w.kv_block_size, max_num_batched_tokens=w.max_num_batched_tokens,
                load_format="dummy", cuda_graphs=w.cuda_graphs, async_scheduling=w.async_scheduling,
                tensor_parallel_size=w.tensor_parallel_size,
                **({} if w.replay_stagger is None else {"replay_stagger": w.replay_stagger}))


def _dtype_runs(w: Workload, state_dtype: str, quantization: str = "none",
                kv_cache_dtype: str = "auto") -> list[tuple[str, str, dict[str, Any], Any]]:
    """Modes (a), (b), (c) with `state_dtype` state, `quantization` weights and `kv_cache_dtype` KV."""
    base = _base_kwargs(w, state_dtype, quantization, kv_cache_dtype)
    runs = []
    for s in ORDER:
        kw = dict(base, replayssm=s == "on", max_num_seqs=w.decode_batch,
                  max_model_len=w.decode_prompt + w.decode_output + 1)
        runs.append(("a", s, kw, lambda e, rng, ww, b=w.decode_batch: _decode_workload(
            e, ww, b, ww.decode_prompt, ww.decode_output, rng)))
    for b in w.spec_batches:
        spec_len = w.spec_prompt + w.spec_output + w.spec_k + 1
        for s in ORDER:
            # KV blocks for all b requests at full length, the rest of the budget to Mamba slots:
            # left to the planner, (b) 512 OFF would admit 269 requests (4 slots each) with KV for
            # ~54 of them and thrash on preemptions; this way OFF admits ~263 and runs them whole.
            kw = dict(base, replayssm=s == "on", max_num_seqs=b, num_speculative_tokens=w.spec_k,
                      max_num_batched_tokens=w.spec_max_num_batched_tokens,
                      num_kv_blocks=b * -(-spec_len // w.kv_block_size),
                      speculative_method="synthetic", synthetic_acceptance_length=ACCEPTANCE_LENGTH,
                      max_model_len=spec_len, gpu_memory_utilization=w.spec_gpu_memory_utilization)
            runs.append(("b", s, kw, lambda e, rng, ww, b=b: _decode_workload(
                e, ww, b, ww.spec_prompt, ww.spec_output, rng)))
    total = w.shared_context + w.turns * (w.turn_input + w.turn_output) + 1
    for s in ORDER:
        kw = dict(base, replayssm=True, enable_prefix_caching=s == "on", max_num_seqs=max(w.conversations, 1),
                  max_model_len=total, gpu_memory_utilization=w.prefix_gpu_memory_utilization)
        runs.append(("c", s, kw, lambda e, rng, ww: _multiturn_workload(e, ww, rng)))
    return runs


def _run_engine(engine_cls, config, workload, rng: random.Random, sizes: Workload) -> dict[str, Any]:
    """Build one engine, run `workload` on it (timed, collector frozen), return plain values only.

    Nothing here outlives the call: the CUDA graph runner holds the model runner, so a graph stats
    object kept by the caller would keep the whole engine (weights and caches) alive while the next
    engine is planned from free memory, and the next plan would shrink.
    """
    import torch

    t0 = time.perf_counter()
    engine = engine_cls(config)
    build_s = time.perf_counter() - t0
    # Long-lived objects (torch, the model) leave the collector's view: a full collection over
    # them takes ~75 ms every ~125 steps on the host, a pause the GPU would sit through. The smoke
    # run times nothing and skips the collection before the freeze (~0.1 s each on the CPU); the
    # one after the run still releases the engine.
    if not sizes.smoke:
        gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    try:
        trace = workload(engine, rng, sizes)
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - t0
    graphs = getattr(engine.runner, "graphs", None)
    out = {"build_s": build_s, "wall": wall, "trace": trace, "metrics": engine.get_metrics(),
           "cuda_graphs": graphs is not None,
           "graph_replays": graphs.num_replays if graphs is not None else 0,
           "async_scheduling": engine.async_scheduling, "interleave": engine.interleave,
           "graph_error": graphs.error if graphs is not None else None}
    engine.close()  # with tensor parallelism, the workers drop their shards now
    del engine, graphs
    gc.collect()
    if torch.cuda.is_available():  # free this run's caches before the next engine allocates
        torch.cuda.empty_cache()
    return out


def run_benchmark(w: Workload, modes: str = "abc", log=print, on_row=None) -> dict[str, Any]:
    """Run every selected mode; return {"rows": [...], "warmups": [...], "modes": ..., "workload": ...}.

    on_row(partial result) runs after every timed run, so a command cut short keeps what it measured.
    """
    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine

    rows, warmups = [], []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(w.config))
        runs = [r for r in mode_runs(w) if r[0] in modes]
        reps: dict[tuple, int] = {}
        for order, (mode, setting, kw, workload) in enumerate(runs):
            batch, state_dtype = kw["max_num_seqs"], kw["state_dtype"]
            quantization, kv_cache_dtype = kw["quantization"] or "none", kw["kv_cache_dtype"]
            label = f"({mode}) {setting:3s} batch {batch:4d}" + \
                ("" if state_dtype == "float32" else f" {state_dtype}") + \
                ("" if quantization == "none" else f" {quantization} weights") + \
                ("" if kv_cache_dtype == "auto" else f" {kv_cache_dtype} KV")
            config = EngineConfig.from_kwargs(model_dir, **kw)
            key = (mode, setting, batch, state_dtype, quantization, kv_cache_dtype)
            if w.warmup and key not in reps:
                # Untimed: compiles every kernel this config's shapes reach and fills the JIT caches.
                warm = _run_engine(LLMEngine, config, workload, random.Random(f"warm-{mode}-{batch}"),
                                   warmup_sizes(w))
                warmups.append({"mode": mode, "setting": setting, "batch": batch, "state_dtype": state_dtype,
                                "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
                                "build_s": warm["build_s"],
                                "wall_s": warm["wall"], "steps": warm["trace"].steps,
                                "num_requests_fit": warm["metrics"].get("num_requests_fit"),
                                "graph_replays": warm["graph_replays"]})
                log(f"bench: {label} warm-up (not recorded): "
                    f"{warm['trace'].steps} steps, {warm['wall']:.1f} s")
                del warm
            rep = reps[key] = reps.get(key, -1) + 1
            # ON and OFF of one rep get the same prompts, and so do the state dtypes.
            rng = random.Random(f"{mode}-{batch}-{rep}")
            run = _run_engine(LLMEngine, config, workload, rng, w)
            m = run["metrics"]
            row = {"mode": mode, "setting": setting, "batch": batch, "rep": rep, "order": order,
                   "state_dtype": state_dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
                   "tensor_parallel_size": w.tensor_parallel_size,
                   "build_s": run["build_s"], "num_requests_fit": m.get("num_requests_fit"),
                   "num_slots": m.get("num_slots"), **mode_sizes(mode, w),
                   # Graphs on (asked for, or the engine's default where supported), replays done, and
                   # why they were turned off (eager fallback).
                   "cuda_graphs": run["cuda_graphs"], "graph_replays": run["graph_replays"],
                   "graph_error": run["graph_error"],
                   # Steps launched ahead of the previous step's read-back (LLMEngine.step).
                   "async_scheduling": run["async_scheduling"], "ahead_steps": m.get("num_ahead_steps", 0),
                   "interleave": run.get("interleave", False), "replay_stagger": config.replay_stagger,
                   **summarize(run["trace"], m, run["wall"],
                               ttft_from_turn=1 if mode in "cs" and conversation(w, mode)[1] > 1 else 0,
                               k=kw.get("num_speculative_tokens", 0))}
            rows.append(row)
            if on_row is not None:
                on_row(_result(w, modes, rows, warmups))
            log(f"bench: {label} rep {rep}: {row['output_tok_s']:.1f} tok/s, "
                f"TTFT {row['ttft_s'] * 1e3:.1f} ms, peak decoding {row['peak_decoding_requests']}, "
                f"{run['wall']:.1f} s")
    return _result(w, modes, rows, warmups)


def mode_sizes(mode: str, w: Workload) -> dict[str, int]:
    """The token counts a mode's row ran with (modes may run in separate commands at other scales)."""
    if mode == "a":
        return {"prompt_len": w.decode_prompt, "output_len": w.decode_output}
    if mode == "b":
        return {"prompt_len": w.spec_prompt, "output_len": w.spec_output, "k": w.spec_k}
    shared_context, turns, turn_input, turn_output = conversation(w, mode)
    return {"shared_context": shared_context, "turns": turns, "turn_input": turn_input,
            "output_len": turn_output, **({"k": w.spec_k} if mode == "s" else {})}


def _result(w: Workload, modes: str, rows: list[dict], warmups: list[dict]) -> dict[str, Any]:
    return {"rows": list(rows), "warmups": list(warmups), "modes": modes, "workload": dataclasses.asdict(w)}


if __name__ == "__main__":
    from replayssm.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
