"""Tokenizer loading (``tokenizers`` library, no transformers) and incremental detokenization."""

from __future__ import annotations

import json
import os
from typing import Any

FALLBACK_CHAT_FORMAT = "<|{role}|>\n{content}\n"  # used when jinja2 is missing; ends with "<|assistant|>\n"
LONG_TEXT = 65536  # characters from which `Tokenizer.encode` releases the GIL while it works


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as {"content": ...}.
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def read_eos_token_ids(model_dir: str) -> list[int]:
    """End-of-sequence ids from generation_config.json, else config.json (int or list)."""
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(os.path.join(model_dir, name)).get("eos_token_id")
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


class Tokenizer:
    """``tokenizer.json`` plus the special tokens and chat template of ``tokenizer_config.json``.

    ``chat_template_renderer`` says how ``apply_chat_template`` renders: "jinja2" (the
    checkpoint's template, sandboxed), "fallback" (jinja2 is not installed: every message is
    ``<|role|>\\ncontent\\n`` and the prompt ends with ``<|assistant|>\\n``), or None (no template).
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        self._tok = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.chat_template = self._find_chat_template(path, cfg)
        self.chat_template_renderer: str | None = None
        if self.chat_template is not None:
            try:
                import jinja2  # noqa: F401

                self.chat_template_renderer = "jinja2"
            except ImportError:
                self.chat_template_renderer = "fallback"

    @staticmethod
    def _find_chat_template(path: str, cfg: dict[str, Any]) -> str | None:
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` of tokenizer.json (structured output reads its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_TEXT:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # The library's encode holds the GIL throughout (seconds for a megabyte of text), which stalls
        # every other thread of the process (a server's event loop, the engine loop); encode_batch
        # releases it and returns the same ids.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str | None:
        """Render chat messages to a prompt string; None when the checkpoint has no template. kwargs:
        extra template variables (e.g. enable_thinking); they cannot replace messages, bos_token or
        eos_token (the fallback renderer ignores them)."""
        if self.chat_template is None:
            return None
        if self.chat_template_renderer == "jinja2":
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            reserved = ("messages", "add_generation_prompt", "bos_token", "eos_token")
            return env.from_string(self.chat_template).render(
                **{k: v for k, v in kwargs.items() if k not in reserved},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        text = "".join(FALLBACK_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer in ``path``, or None when it has no ``tokenizer.json`` (token-id prompts only)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    return Tokenizer(path)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Decodes a small window ``ids[prefix_offset:]`` each step and emits what it adds beyond
    ``ids[prefix_offset:read_offset]``; a trailing U+FFFD means a multi-byte character is
    still incomplete, so nothing is emitted until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (an incomplete character, as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
