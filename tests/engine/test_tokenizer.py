"""Tokenizer loading, chat templates and incremental detokenization (no transformers)."""

import json
import threading
import time

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from replayssm.demo import write_demo_tokenizer
from replayssm.engine.tokenizer import LONG_TEXT, IncrementalDetokenizer, load_tokenizer, read_eos_token_ids


class _ByteTokenizer:
    """One token per byte, so multi-byte characters span several tokens."""

    def __init__(self):
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        self.raw = HFTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
        self.raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.raw.decoder = decoders.ByteLevel()

    def decode(self, ids, skip_special_tokens=True):
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", ["héllo wörld ✓ 日本", "plain ascii"])
def test_incremental_detokenizer_matches_full_decode(text):
    """Text emitted token by token (incomplete characters held back) joins to the one-shot decode."""
    tok = _ByteTokenizer()
    ids = tok.raw.encode(text).ids
    assert len(ids) == len(text.encode())
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_load_tokenizer_special_tokens_and_templates(tmp_path, monkeypatch):
    """tokenizer_config.json gives eos/bos ids and the chat template; without jinja2, the stated fallback."""
    write_demo_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_token_id, tok.bos_token_id, tok.chat_template_renderer) == (2, 1, "jinja2")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(msgs)
    assert rendered == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    monkeypatch.setattr(tok, "chat_template_renderer", "fallback")
    assert tok.apply_chat_template(msgs) == rendered  # the demo template matches the fallback format
    assert tok.decode(tok.encode("abc")) == "abc" and tok.encode("abc")[0] == 1


def test_missing_tokenizer_and_eos_sources(tmp_path):
    """No tokenizer.json -> None; eos ids come from generation_config.json before config.json."""
    assert load_tokenizer(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_eos_token_ids(str(tmp_path)) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 11]}))
    assert read_eos_token_ids(str(tmp_path)) == [2, 11]


def test_long_text_encodes_without_holding_the_gil(tmp_path):
    """A long prompt's encode lets other threads run (a server's event loop) and gives the ids of the
    library's plain encode; short texts keep the plain call."""
    write_demo_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    text = "ab c\n" * 120_000  # 600k characters: about a second here
    assert len(text) >= LONG_TEXT
    ticks, done = [0], threading.Event()

    def spin() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    spinner = threading.Thread(target=spin)
    spinner.start()
    start = time.monotonic()
    ids = tok.encode(text)
    elapsed = time.monotonic() - start
    done.set()
    spinner.join()
    # Holding the GIL, the spinner wakes a handful of times at most; released, about once a ms.
    assert ticks[0] >= min(50, elapsed * 1000 / 4), (ticks[0], elapsed)
    assert ids == tok._tok.encode(text).ids
    short = "x" * (LONG_TEXT - 1)
    assert tok.encode(short, add_special_tokens=False) == tok._tok.encode(short, add_special_tokens=False).ids
