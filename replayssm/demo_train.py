"""Train the demo model: a small Nemotron-H (Mamba-2, attention, MLP) plus one MTP layer, on demo_task.

    python -m replayssm.demo_train --out OUT_DIR [--time-budget 240 | --steps N] [--device cuda]

The model is demo_net.DemoLM (plain PyTorch, checkpoint names). Rows pack whole problems after <s>,
so few-shot prompts are in distribution. Loss: next token on answer characters + `mtp_weight` x the
mean MTP loss of depths 1..mtp_depth (chained as the engine drafts, see demo_net). OUT_DIR gets
config.json, model.safetensors (bf16), the tokenizer files, generation_config.json (the newline
that ends an answer is an end-of-sequence token) and train_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from replayssm.demo import CHARACTERS, SPECIAL_TOKENS, write_demo_tokenizer
from replayssm.demo_net import DemoLM
from replayssm.demo_task import train_stream

VOCAB = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARACTERS)}
BOS, EOS, NEWLINE = VOCAB["<s>"], VOCAB["</s>"], VOCAB["\n"]
# Characters -> token ids in one table lookup (printable ASCII and newline only).
_LUT = torch.full((128,), VOCAB["<unk>"], dtype=torch.long)
for _c, _i in VOCAB.items():
    if len(_c) == 1:
        _LUT[ord(_c)] = _i

BASE_CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": len(VOCAB),
    "conv_kernel": 4,
    "expand": 2,
    "use_conv_bias": True,
    "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2",
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "num_nextn_predict_layers": 1,
    "mtp_layers_block_type": ["attention", "mlp"],
    # Δ has no floor in training or in the engine; transformers floors it at time_step_min (default 1e-3).
    "time_step_min": 0.0,
}
# "demo": the shipped model (about 3.5M parameters); "toy": the CPU tests' model.
SIZES = {
    "demo": dict(hidden_size=256, hybrid_override_pattern="M-M*-M-M*-", mamba_num_heads=8, mamba_head_dim=64,
                 ssm_state_size=32, n_groups=1, chunk_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512),
    "toy": dict(hidden_size=32, hybrid_override_pattern="M*-M", mamba_num_heads=4, mamba_head_dim=16,
                ssm_state_size=16, n_groups=1, chunk_size=16, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, intermediate_size=64),
}


def model_config(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    c = {**BASE_CONFIG, **SIZES[size]}
    c["num_hidden_layers"] = len(c["hybrid_override_pattern"])
    return c


def encode(text: str) -> torch.Tensor:
    return _LUT[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]


def make_batch(stream, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, length) token ids of packed rows <s> problem problem ..., and a mask of answer characters."""
    rows, masks = [], []
    for _ in range(batch):
        text, spans = "", []
        while len(text) + 1 < length:
            p = next(stream)
            spans.append((len(text) + 1 + len(p.prompt), len(text) + 1 + len(p.text)))
            text += p.text
        ids = torch.cat([torch.tensor([BOS]), encode(text)])[:length]
        mask = torch.zeros(length, dtype=torch.bool)
        for a, b in spans:
            mask[a:b] = True
        rows.append(ids)
        masks.append(mask)
    return torch.stack(rows), torch.stack(masks)


def losses(model: DemoLM, ids: torch.Tensor, mask: torch.Tensor,
           depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, mean MTP loss over depths) on the answer characters of rows ids (B, L)."""
    h = model.hidden(ids[:, :-1])
    ce = lambda logits, target, m: (F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")  # noqa: E731
                                    * m.flatten()).sum() / m.sum().clamp(min=1)
    next_loss = ce(model.logits(h), ids[:, 1:], mask[:, 1:].float())
    outs = model.mtp(model.backbone.embeddings(ids[:, 1:-1]), h[:, :-1], depth)
    mtp_loss = 0.0
    for d, o in enumerate(outs):
        m = mask[:, 2:].float()
        m[:, :d] = 0  # depth d + 1 has no input at its first d rows
        mtp_loss = mtp_loss + ce(model.logits(o), ids[:, 2:], m)
    return next_loss, mtp_loss / depth


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save_checkpoint(model: DemoLM, out: str, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**model.config, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    tensors = {k: t.detach().to("cpu", dtype).contiguous() for k, t in model.state_dict().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_demo_tokenizer(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": [EOS, NEWLINE], "pad_token_id": 0}, f, indent=2)


def train(out: str, *, size: str = "demo", steps: int | None = None, time_budget: float | None = None,
          batch: int = 64, seq_len: int = 512, lr: float = 2e-3, seed: int = 0, device: str = "auto",
          mtp_depth: int = 3, mtp_weight: float = 0.5, log_every: int = 50, eval_limit: int = 200,
          log=print) -> dict:
    """Train, save into `out`, evaluate with the engine (eval_limit held-out questions, 0 = skip);
    returns the train log. Exactly one of steps / time_budget (seconds of training)."""
    if (steps is None) == (time_budget is None):
        raise ValueError("give exactly one of steps and time_budget")
    if steps is not None and steps < 1 or time_budget is not None and time_budget <= 0:
        raise ValueError(f"steps must be >= 1 and time_budget > 0, got {steps} and {time_budget}")
    if not 1 <= mtp_depth <= 8:
        raise ValueError(f"mtp_depth must be in [1, 8], got {mtp_depth}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(seed)
    config = model_config(size)
    model = DemoLM(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    model = model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    stream = train_stream(seed)
    total = steps or 10**9
    warmup = 100 if size == "demo" else 5
    length = f"{steps} steps" if steps else f"time budget {time_budget:.0f} s"
    log(f"demo_train: {params / 1e6:.2f}M parameters, {size} size, device {device}, "
        f"batch {batch} x {seq_len} tokens, {length}")
    history, start, step = [], time.perf_counter(), 0
    timed_from = None
    while step < total:
        ids, mask = make_batch(stream, batch, seq_len + 2)
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, lr, warmup)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            next_loss, mtp_loss = losses(model, ids, mask, mtp_depth)
        opt.zero_grad(set_to_none=True)
        (next_loss + mtp_weight * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            if cuda:
                torch.cuda.synchronize()
            timed_from = time.perf_counter()
        if time_budget is not None and step == 40:
            # Fix the schedule's length from the measured step time (steps 10-40).
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - timed_from) / 30
            total = max(step + 1, int((time_budget - (time.perf_counter() - start)) / per_step) + step)
            log(f"demo_train: {per_step * 1e3:.1f} ms/step -> {total} steps in the time budget")
        if step % log_every == 0 or step == total:
            history.append([step, round(next_loss.item(), 4), round(mtp_loss.item(), 4)])
            elapsed = time.perf_counter() - start
            log(f"step {step}/{total}  loss {history[-1][1]:.4f}  mtp {history[-1][2]:.4f}  "
                f"{elapsed / step * 1e3:.0f} ms/step  {elapsed:.0f} s")
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steady = (time.perf_counter() - timed_from) / (step - 10) if timed_from and step > 10 else wall / step
    model.eval()
    save_checkpoint(model, out)
    doc = {"size": size, "params": params, "steps": step, "batch": batch, "seq_len": seq_len, "lr": lr,
           "seed": seed, "mtp_depth": mtp_depth, "mtp_weight": mtp_weight, "device": device,
           "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
           "wall_time_s": round(wall, 1), "step_time_ms": round(steady * 1e3, 2),
           "final_loss": history[-1][1] if history else None,
           "final_mtp_loss": history[-1][2] if history else None,
           "history": history, "command": ["python", "-m", "replayssm.demo_train", *sys.argv[1:]]}
    log(f"demo_train: {step} steps in {wall:.0f} s ({steady * 1e3:.1f} ms/step); wrote {out}")
    _write_log(out, doc)
    if eval_limit:
        del model, opt
        if cuda:
            torch.cuda.empty_cache()  # the engine plans its cache from the free CUDA memory
        from replayssm.demo_eval import evaluate

        doc["eval"] = evaluate(out, limit=eval_limit, device=device, speculative_method="mtp",
                               num_speculative_tokens=3)
        log(f"demo_train: held-out accuracy {doc['eval']['accuracy']:.3f} on {eval_limit} questions, MTP k=3 "
            f"mean acceptance length {doc['eval']['mean_acceptance_length']:.3f}")
        _write_log(out, doc)
    return doc


def _write_log(out: str, doc: dict) -> None:
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump(doc, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replayssm.demo_train", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--size", default="demo", choices=sorted(SIZES), help="model size (default: demo)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (reproducible; or --time-budget)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training: the step count comes from the step time measured at steps "
                   "10-40 "
                   "(train_log.json records it; --steps N reproduces the run)")
    p.add_argument("--batch", type=int, default=64, help="rows per step (default: 64)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row (default: 512)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    p.add_argument("--seed", type=int, default=0, help="weights and data (default: 0)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda (default: auto)")
    p.add_argument("--mtp-depth", type=int, default=3, help="MTP depths trained, chained (default: 3)")
    p.add_argument("--mtp-weight", type=float, default=0.5, help="weight of the MTP loss (default: 0.5)")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress lines (default: 50)")
    p.add_argument("--eval-limit", type=int, default=200,
                   help="held-out questions evaluated with the engine after training, 0 = none "
                   "(default: 200)")
    a = p.parse_args(argv)
    if a.steps is None and a.time_budget is None:
        p.error("give --steps N or --time-budget SECONDS")
    try:
        train(a.out, size=a.size, steps=a.steps, time_budget=a.time_budget, batch=a.batch, seq_len=a.seq_len,
              lr=a.lr, seed=a.seed, device=a.device, mtp_depth=a.mtp_depth, mtp_weight=a.mtp_weight,
              log_every=a.log_every, eval_limit=a.eval_limit)
    except ValueError as e:
        print(f"demo_train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
