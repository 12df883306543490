"""The command line and the built-in demo checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import torch

from replayssm import LLM, SamplingParams, cli
from replayssm.cli import build_parser, main
from replayssm.config_flags import parse_size
from replayssm.demo import demo_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, cache):
    env = {**os.environ, "REPLAYSSM_CACHE": str(cache), "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "replayssm", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_generate_demo_in_subprocess(tmp_path):
    """`python -m replayssm generate --model demo` prints one completion per prompt and exits 0."""
    res = _cli(
        "generate",
        "--model",
        "demo",
        "--prompt",
        "Hello",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--device",
        "cpu",
        "--json",
        cache=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [d["prompt"] for d in lines] == ["Hello", "Once upon a time"]
    assert all(len(d["token_ids"]) == 12 and d["finish_reason"] == "length" for d in lines)
    assert "generated 24 tokens" in res.stderr and "generate" in res.stderr  # summary + progress bar


def test_cli_bad_flags_are_clear_errors(tmp_path, capsys):
    """Invalid values exit with status 2 and a message naming the argument."""
    assert main(["generate", "--model", "demo", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", "demo", "--prompt", "x", "--memory-budget", "lots"])
    assert "not a byte size" in capsys.readouterr().err


def test_cli_device_tokenizer_and_interrupt_are_clear(tmp_path, capsys, monkeypatch):
    """A CUDA device this process cannot use, a tokenizer path without tokenizer.json and Ctrl-C each
    end in one line on stderr (status 2, 2, 130), no traceback."""
    bad_device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    assert main(["generate", "--model", "demo", "--prompt", "x", "--device", bad_device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"device '{bad_device}'" in err and "Traceback" not in err
    assert main(["generate", "--model", "demo", "--prompt", "x", "--device", "cpu",
                 "--tokenizer", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.SUBCOMMANDS, "generate", (*cli.SUBCOMMANDS["generate"][:2], interrupted))
    assert main(["generate", "--model", "demo", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "replayssm generate: interrupted\n"


def test_cli_defaults_come_from_the_dataclasses():
    """Engine flag defaults equal the config dataclass defaults (generate and serve); sizes accept units."""
    args = build_parser().parse_args(["generate", "--model", "demo", "--prompt", "x"])
    assert (args.replay_window, args.kv_block_size, args.max_num_seqs, args.replayssm) == (16, 16, 64, True)
    assert args.memory_budget is None and args.state_dtype == "float32"
    serve = build_parser().parse_args(["serve", "--model", "demo", "--no-replayssm"])
    assert serve.command == "serve" and serve.replayssm is False and serve.port == 8000
    assert parse_size("512MiB") == 512 << 20 and parse_size("2GB") == 2 * 10**9 and parse_size("1024") == 1024


def test_demo_checkpoint_matches_transformers(tmp_path):
    """The demo checkpoint is a valid Hugging Face Nemotron-H: greedy tokens equal transformers generate()."""
    from transformers import AutoModelForCausalLM

    path = demo_checkpoint(cache_dir=str(tmp_path))
    assert demo_checkpoint(cache_dir=str(tmp_path)) == path  # written once
    llm = LLM(path, device="cpu", max_model_len=256)
    prompt = "The demo model"
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    assert out.token_ids == ref
    assert out.text == llm.tokenizer.decode(ref)
    assert (
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|user|>\nhi\n<|assistant|>\n"
    )


BAD_ENGINE_VALUES = [
    (["--replay-window", "0"], {"replay_window": 0}),
    (["--max-num-seqs", "0"], {"max_num_seqs": 0}),
    (["--gpu-memory-utilization", "1.5"], {"gpu_memory_utilization": 1.5}),
    (["--memory-budget", "0"], {"memory_budget": 0}),
    (["--state-dtype", "int8"], {"state_dtype": "int8"}),
    (["--device", "tpu"], {"device": "tpu"}),
    (["--prefix-checkpoint-interval", "24"], {"prefix_checkpoint_interval": 24}),
    (["--speculative-method", "beam"], {"speculative_method": "beam"}),
    (["--num-speculative-tokens", "4", "--replay-window", "4"],
     {"num_speculative_tokens": 4, "replay_window": 4}),
]


@pytest.mark.parametrize("flags, kwargs", BAD_ENGINE_VALUES)
def test_bad_engine_value_same_message_in_api_and_cli(flags, kwargs, capsys):
    """A bad engine field value is rejected by its config dataclass with one message: LLM(...) raises it
    as ValueError, and `generate` and `serve` print it as their one error line (status 2)."""
    with pytest.raises(ValueError) as api:
        LLM("demo", **kwargs)
    message = str(api.value)
    assert main(["generate", "--model", "demo", "--prompt", "x", *flags]) == 2
    assert capsys.readouterr().err == f"replayssm generate: error: {message}\n"
    pytest.importorskip("uvicorn")
    assert main(["serve", "--model", "demo", *flags]) == 2
    assert capsys.readouterr().err == f"replayssm serve: error: {message}\n"
