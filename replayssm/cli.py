"""Command line: ``replayssm generate | serve | bench [serve] | eval``.

Engine flags and their defaults come from the config dataclasses' fields (config_flags.py), so
the CLI and the Python API cannot drift apart; a bad value raises the dataclass's ValueError,
which ``main`` prints as one line. Each subcommand is one ``add_<name>_args(parser)`` +
``run_<name>(args)`` pair registered in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from replayssm.config_flags import add_engine_args, engine_kwargs

# ---- generate --------------------------------------------------------------------------------


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    s = parser.add_argument_group("sampling")
    s.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default: 1.0)")
    s.add_argument(
        "--top-k", type=int, default=-1, help="keep the k most likely tokens, -1 = off (default: -1)"
    )
    s.add_argument(
        "--seed", type=int, default=None, help="sampling seed, for reproducible samples (default: none)"
    )
    s.add_argument("--stop", action="append", default=None, help="stop string; repeat for several")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_generate(args: argparse.Namespace) -> int:
    from replayssm.engine.llm import LLM
    from replayssm.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, seed=args.seed or 0, **engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        # Synthetic speculative runs force acceptances: the tokens are not the model's.
                        **({"synthetic_spec": True} if out.synthetic_spec else {}),
                    }
                )
            )
        else:
            print(f"--- prompt: {prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
            print(out.text)
    m = llm.get_metrics()
    print(
        f"generated {m['generation_tokens']} tokens in {elapsed:.2f} s "
        f"({m['generation_tokens'] / max(elapsed, 1e-9):.1f} tok/s), preemptions: {m['num_preemptions']}",
        file=sys.stderr,
    )
    if m.get("spec_verify_steps"):
        note = "" if m["spec_output_is_model_output"] else " (synthetic: NOT the model's output)"
        print(
            f"speculative ({m['spec_method']}, k={m['spec_num_speculative_tokens']}): mean acceptance length "
            f"{m['spec_mean_acceptance_length']:.3f} over {m['spec_verify_steps']} verify steps{note}",
            file=sys.stderr,
        )
    return 0


# ---- serve (the server package owns its flags and loop; imported only when used) --------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from replayssm.server.launch import add_serve_args as add

    add(parser)


def run_serve(args: argparse.Namespace) -> int:
    from replayssm.server.launch import serve_main

    return serve_main(args)


# ---- bench (workload and report live in benchmarks/, next to the package in a source checkout) ----


def _load_benchmark(name: str) -> Any:
    """Import benchmarks/<name>.py of the source checkout this package runs from."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"replayssm bench needs a source checkout: {path} not found")
    spec = importlib.util.spec_from_file_location(f"replayssm_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run of the code paths: a tiny model and workload, about 20 s; "
                        "its numbers are not a speed measurement")
    parser.add_argument("--model-shape", default="nemotron-h-8b",
                        help="published model shape, dummy weights: nemotron-h-8b (default), "
                        "nemotron-3-nano-30b-a3b (32B MoE; its 63 GB of bf16 weights leave an 80 GB GPU too "
                        "little for batch 256: use --quantization fp8 there, or an H200), "
                        "granite-4.0-h-small (32B MoE), granite-4.0-h-tiny (7B MoE), "
                        "qwen3.5-27b (Gated DeltaNet, dense) or qwen3-next-80b-a3b (Gated DeltaNet, "
                        "512-expert MoE, 80B: 160 GB in bf16, more than one 80 GB GPU holds); with --quick, "
                        "a toy model of the same structure")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply output lengths and context sizes (default: 1.0; batches unchanged)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the first N layers of the shape's published layer pattern: a shallower "
                        "model with the same layer mix, e.g. the bf16 nemotron-3-nano-30b-a3b at 26 of its "
                        "52 layers fits an 80 GB GPU at batch 256 (default: all layers)")
    parser.add_argument("--modes", default="abc",
                        help="which modes to run: a decode, b speculative, c prefix caching, s the seeds' "
                        "prefix-caching workload (51,200 shared tokens, 20 turns of 2,048 in / 1,024 out x "
                        "--scale, k=3 synthetic drafts, float16 state) (default: abc)")
    parser.add_argument("--state-dtype", default="float32",
                        help="Mamba state dtype(s) of modes a, b, c, comma separated among float32, float16, "
                        "bfloat16; each runs its own OFF/ON/ON/OFF set and a 16-bit one is also compared "
                        "with float32 (default: float32; mode s always runs float16)")
    parser.add_argument("--quantization", default="none",
                        help="weights of modes a, b, c, comma separated among none (the model dtype) and fp8 "
                        "(E4M3 quantized at load, as --quantization fp8 of serve); each runs its own "
                        "OFF/ON/ON/OFF set and FP8 is compared with none, ON and OFF (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache dtype(s) of modes a, b, c, comma separated among auto (the model "
                        "dtype) and fp8 (E4M3); combined with every --quantization and --state-dtype "
                        "(default: auto)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="run every engine over N GPUs (N CPU processes with --quick) (default: 1)")
    parser.add_argument("--out", default=None,
                        help="results directory (default: benchmarks/results; with --quick a new temporary "
                        "directory, so the smoke run never replaces measured results)")
    for flag, what in (("shared-context", "shared context tokens"), ("turns", "turns per conversation"),
                       ("turn-input", "new input tokens per turn"),
                       ("turn-output", "output tokens per turn")):
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help=f"mode (c)'s {what}, after --scale (default: the workload's, 12,800 shared "
                            "tokens and 4 turns of 1,024 in / 128 out)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other modes' rows of an existing result (split one benchmark over "
                        "several commands)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="replay decode/verify steps as CUDA graphs (default: the engine's, on wherever "
                        "supported; --no-cuda-graphs: eager steps)")
    parser.add_argument("--replay-stagger", action=argparse.BooleanOptionalAction, default=None,
                        help="staggered ReplaySSM checkpoints (default: the engine's, on; "
                        "--no-replay-stagger: every request's first state write W tokens in, so a batch "
                        "admitted together flushes on one step)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="run every engine with async scheduling off (default: the engine's, on with "
                        "CUDA)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the modes: profile mode (a)'s decode step, OFF and ON (time per "
                        "layer part, SSM bytes against bandwidth) into e2e-profile.{json,md}")
    parser.add_argument("--profile-steps", type=int, default=16,
                        help="decode steps per profiled window (default: 16, one ring flush per row)")
    parser.add_argument("--profile-prompt", type=int, default=None,
                        help="prompt tokens per request in the --profile run (default: mode (a)'s, 32); "
                        "e.g. 532 profiles the steps of mode (a)'s middle, where attention reads ~550 keys")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="instead of the modes: profile one prefix-hit prefill step of mode (c) ON "
                        "against OFF's prefill of the same prompt into e2e-prefill-profile.{json,md}")
    what = "online benchmark of a running server (OpenAI API): throughput, TTFT / ITL / E2E percentiles"
    modes = parser.add_subparsers(dest="bench_mode", metavar="{serve}", help=f"serve: {what}")
    add_bench_serve_args(modes.add_parser("serve", help=what, description=what))


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server (default: http://127.0.0.1:8000)")
    parser.add_argument("--model", default=None, help="model name to ask for (default: the server's first)")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions (default: /v1/completions)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second; inf sends all at once (default: inf)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--dataset", default="random", choices=("random", "random-text"),
                        help="random token ids, or random words (default: random)")
    parser.add_argument("--input-len", default="128",
                        help="prompt length N, or LO:HI drawn uniformly; tokens, or words with random-text "
                        "(default: 128)")
    parser.add_argument("--output-len", default="128",
                        help="max_tokens N or LO:HI drawn uniformly, generated in full (ignore_eos) "
                        "(default: 128)")
    parser.add_argument("--token-ids", default="4:99",
                        help="range LO:HI of random prompt token ids (default: 4:99, inside every vocabulary "
                        "of at least 100 tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals (default: 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    parser.add_argument("--out", default=None,
                        help="write serve.{json,md,png} into this directory (default: print only)")


def run_bench_serve(args: argparse.Namespace) -> int:
    bench = _load_benchmark("bench_serve")
    w = bench.ServeWorkload(
        base_url=args.base_url.rstrip("/"), model=args.model, endpoint=args.endpoint, dataset=args.dataset,
        num_prompts=args.num_prompts, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        input_len=bench.parse_range(args.input_len, "--input-len"),
        output_len=bench.parse_range(args.output_len, "--output-len"),
        token_ids=bench.parse_range(args.token_ids, "--token-ids", low=0), temperature=args.temperature,
        seed=args.seed, api_key=args.api_key, timeout_s=args.timeout)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    doc = bench.main(w, args.out, ["replayssm", *args.argv], log=log)
    print(bench.render(doc), end="")
    return 0 if doc["completed"] else 1


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_mode", None) == "serve":
        return run_bench_serve(args)
    import torch

    bench, report = _load_benchmark("bench_e2e"), _load_benchmark("report_e2e")
    if not args.scale > 0:
        raise ValueError(f"--scale must be > 0, got {args.scale}")
    if not args.modes or set(args.modes) - set("abcs"):
        raise ValueError(f"--modes must be letters among a, b, c, s, got {args.modes!r}")
    state_dtypes = tuple(dict.fromkeys(d.strip() for d in args.state_dtype.split(",")))
    if not state_dtypes or set(state_dtypes) - set(bench.STATE_DTYPES):
        raise ValueError(f"--state-dtype must be a comma-separated list among "
                         f"{', '.join(bench.STATE_DTYPES)}, got {args.state_dtype!r}")
    variants = {}
    for flag, value, choices in (("--quantization", args.quantization, bench.QUANTIZATIONS),
                                 ("--kv-cache-dtype", args.kv_cache_dtype, bench.KV_CACHE_DTYPES)):
        variants[flag] = tuple(dict.fromkeys(v.strip() for v in value.split(",")))
        if not variants[flag] or set(variants[flag]) - set(choices):
            raise ValueError(f"{flag} must be a comma-separated list among {', '.join(choices)}, "
                             f"got {value!r}")
    quantizations, kv_cache_dtypes = variants["--quantization"], variants["--kv-cache-dtype"]
    if args.profile_prefill and (quantizations, kv_cache_dtypes) != (("none",), ("auto",)):
        raise ValueError("--quantization and --kv-cache-dtype apply to the modes and --profile; "
                         "--profile-prefill takes the model dtype")
    if args.profile and (len(quantizations), len(kv_cache_dtypes)) != (1, 1):
        raise ValueError("--profile takes one --quantization and one --kv-cache-dtype "
                         "(run it once per setting)")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.quick:
        workload = bench.quick_workload(args.model_shape).scaled(args.scale)
    elif torch.cuda.is_available():
        workload = bench.h200_workload(args.scale, args.model_shape)
    else:
        raise ValueError("the full benchmark needs a CUDA GPU; use --quick for the CPU smoke run")
    if args.layers is not None:
        workload = dataclasses.replace(workload, config=bench.first_layers(workload.config, args.layers))
    sizes = {f: getattr(args, f) for f in ("shared_context", "turns", "turn_input", "turn_output")}
    for f, v in sizes.items():
        if v is not None and v < 1:
            raise ValueError(f"--{f.replace('_', '-')} must be >= 1, got {v}")
    workload = dataclasses.replace(workload, **{f: v for f, v in sizes.items() if v is not None},
                                   state_dtypes=state_dtypes, quantizations=quantizations,
                                   kv_cache_dtypes=kv_cache_dtypes,
                                   tensor_parallel_size=args.tensor_parallel_size)
    if args.cuda_graphs is not None:
        workload = dataclasses.replace(workload, cuda_graphs=args.cuda_graphs)
    if args.no_async_scheduling:
        workload = dataclasses.replace(workload, async_scheduling=False)
    if args.replay_stagger is not None:
        workload = dataclasses.replace(workload, replay_stagger=args.replay_stagger)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.quick:
        log("bench: --quick is a CPU smoke run of the code paths on a tiny model; its numbers are not a "
            "speed measurement (run `replayssm bench` on a CUDA GPU for that)")
    out = args.out
    if out is None and args.quick:
        # The smoke run's numbers are CPU ones: never over the checkout's measured results.
        import tempfile

        out = tempfile.mkdtemp(prefix="replayssm-bench-quick-")
        log(f"bench: --quick without --out writes to {out}")
    elif out is None:
        out = str(report.ROOT / "benchmarks" / "results")
    command = ["replayssm", *args.argv]
    if args.profile_prefill:
        prof, rep = _load_benchmark("profile_prefill"), _load_benchmark("report_prefill")
        meta = report.run_meta(command)
        doc = rep.write(prof.run_prefill_profile(workload, log=log, save=lambda d: rep.write(d, out, meta)),
                        out, meta)
        print(rep.render(doc))
        log(f"bench: {doc['plot_note'] or f'wrote {out}/e2e-prefill-profile.{{json,md,png}}'}")
        return 0
    if args.profile:
        if args.profile_steps < 1:
            raise ValueError(f"--profile-steps must be >= 1, got {args.profile_steps}")
        if args.profile_prompt is not None:
            if args.profile_prompt < 1:
                raise ValueError(f"--profile-prompt must be >= 1, got {args.profile_prompt}")
            workload = dataclasses.replace(workload, decode_prompt=args.profile_prompt)
        prof = _load_benchmark("profile_e2e")
        doc = prof.run_profile(workload, steps=args.profile_steps, warm=min(4, args.profile_steps), log=log)
        stem = report.result_stem(args.model_shape, "a", ("float32",), quantizations, kv_cache_dtypes,
                                  args.layers).replace("e2e", "e2e-profile", 1)
        doc = report.write_profile(doc, out, report.run_meta(command), stem)
        print(report.render_profile(doc))
        log(f"bench: {doc['plot_note'] or f'wrote {out}/{stem}.{{json,md,png}}'}")
        return 0

    stem = report.result_stem(args.model_shape, args.modes, state_dtypes, quantizations, kv_cache_dtypes,
                              args.layers)

    def save(partial: dict, with_plot: bool = False) -> dict:
        return report.write_results(partial, out, command, bench.TARGETS, merge=args.merge, stem=stem,
                                    with_plot=with_plot)

    doc = save(bench.run_benchmark(workload, args.modes, log=log, on_row=save), with_plot=True)
    print(report.render_markdown(doc))
    for warning in doc["spread_warnings"]:
        log(f"bench: WARNING {warning}")
    log(f"bench: {doc['plot_note'] or f'wrote {out}/{stem}.{{json,md,png}}'}")
    return 0


# ---- eval (accuracy of the demo task's held-out set; demo_eval.py) ---------------------------------


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, model_required=False)
    parser.set_defaults(model="demo")
    e = parser.add_argument_group("eval")
    e.add_argument("--limit", type=int, default=None,
                   help="evaluate the first N held-out questions (default: all 500)")
    e.add_argument("--few-shot", type=int, default=0,
                   help="put K solved training problems before every question, a prefix shared by all "
                   "questions that prefix caching can reuse (default: 0)")
    e.add_argument("--max-tokens", type=int, default=96, help="tokens per answer at most (default: 96)")
    e.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run_eval(args: argparse.Namespace) -> int:
    from replayssm.demo_eval import evaluate, render

    kw = engine_kwargs(args)
    result = evaluate(args.model or "demo", limit=args.limit, few_shot=args.few_shot,
                      max_tokens=args.max_tokens, **kw)
    print(json.dumps(result) if args.json else render(result))
    return 0


Handler = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
SUBCOMMANDS: dict[str, Handler] = {
    "generate": ("generate text for one or more prompts", add_generate_args, run_generate),
    "serve": ("serve a checkpoint over an OpenAI-compatible HTTP API", add_serve_args, run_serve),
    "bench": ("end-to-end speed: ReplaySSM, speculative and prefix-caching ON/OFF runs", add_bench_args,
              run_bench),
    "eval": ("accuracy on the demo task's held-out questions (exact answer), with any engine settings",
             add_eval_args, run_eval),
}


def build_parser() -> argparse.ArgumentParser:
    from replayssm import __version__

    parser = argparse.ArgumentParser(
        prog="replayssm", description="Serve hybrid SSM language models with ReplaySSM."
    )
    parser.add_argument("--version", action="version", version=f"replayssm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return SUBCOMMANDS[args.command][2](args)
    except ValueError as e:
        print(f"replayssm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"replayssm {args.command}: interrupted", file=sys.stderr)
        return 130
