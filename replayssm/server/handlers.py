"""Per-endpoint handlers: validate and tokenize a request, then shape outputs as OpenAI objects.

A handler is built from a parsed request (raising APIError for bad input before anything
reaches the engine) and exposes `engine_requests`, `stream`, `response(outputs)` for the
non-streaming case and `chunks(group)` yielding SSE events for the streaming one (one choice per
event, as OpenAI sends them; the caller appends `data: [DONE]`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from replayssm.sampling_params import MAX_LOGPROBS
from replayssm.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    check_sampling,
    new_id,
    now_s,
    structured_of,
)
from replayssm.server.serving import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DeltaTracker,
    build_requests,
    chat_logprobs,
    completion_logprobs,
    sse,
    token_strings,
    usage_of,
)


class _Handler:
    def __init__(self, state, req, prefix: str):
        self.state = state
        self.tokenizer = state.tokenizer
        self.id = new_id(prefix)
        self.created = now_s()
        self.model = state.model_name
        self.stream = req.stream
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.return_token_ids = req.return_token_ids
        self.stop = req.stop

    def _token_ids(self, out, start: int = 0) -> list[int] | None:
        return out.tokens_since(start) if self.return_token_ids else None

    def _stopped(self, group, tracker: DeltaTracker):
        """(index, text offset, text delta, first unsent token, output or None) of every choice that
        has not finished: after `updates()` ends, only a group the server stopped (shutdown) has one,
        and each such choice gets a final event with finish_reason "abort"."""
        for i, finished in enumerate(group.finished):
            if not finished:
                out, offset = group.latest[i], len(tracker.text[i])
                delta, start = tracker.advance(i, out, flush=True) if out is not None else ("", 0)
                yield i, offset, delta, start, out

    def _changed(self, tracker: DeltaTracker, index: int, out) -> tuple[str, int, bool]:
        """(text delta, first new token, whether anything is worth sending for this choice)."""
        delta, start = tracker.advance(index, out)
        # Logprobs and token ids are per token: a token with no visible text yet still goes out.
        per_token = out.has_logprobs or self.return_token_ids
        return delta, start, bool(delta) or out.finished or (per_token and out.num_output_tokens > start)


class CompletionHandler(_Handler):
    """POST /v1/completions."""

    prompt_param = "prompt"  # the field an error about the prompt names

    def __init__(self, state, req: CompletionRequest):
        super().__init__(state, req, "cmpl")
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}",
                           param="logprobs")
        check_sampling(req, req.max_tokens)
        structured = state.compile_structured(*structured_of(req))
        prompts = [state.encode(p, "prompt") for p in req.prompts()]
        self.engine_requests = build_requests(
            req, self.id, prompts, req.max_tokens, state.max_model_len,
            default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS, logprobs=req.logprobs, param="prompt",
            defaults=state.generation_defaults, structured=structured)

    def _envelope(self, choices: list[CompletionChoice], usage=None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    def response(self, outputs: list) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text=o.text, logprobs=completion_logprobs(self.tokenizer, o),
                                    finish_reason=o.finish_reason, token_ids=self._token_ids(o))
                   for i, o in enumerate(outputs)]
        return self._envelope(choices, usage_of(self.engine_requests, outputs))

    async def chunks(self, group) -> AsyncIterator[str]:
        tracker = DeltaTracker.for_choices(len(group.request_ids), self.stop)
        async for ready in group.updates():
            for i in ready:
                out = group.latest[i]
                offset = len(tracker.text[i])
                delta, start, send = self._changed(tracker, i, out)
                if send:
                    choice = CompletionChoice(
                        index=i, text=delta, logprobs=completion_logprobs(self.tokenizer, out, start, offset),
                        finish_reason=out.finish_reason if out.finished else None,
                        token_ids=self._token_ids(out, start))
                    yield sse(self._envelope([choice]))
        for i, offset, delta, start, out in self._stopped(group, tracker):
            yield sse(self._envelope([CompletionChoice(
                index=i, text=delta, logprobs=out and completion_logprobs(self.tokenizer, out, start, offset),
                finish_reason="abort", token_ids=out and self._token_ids(out, start))]))
        if self.include_usage:
            yield sse(self._envelope([], usage_of(self.engine_requests, group.latest)))


class ChatHandler(_Handler):
    """POST /v1/chat/completions; the prompt comes from the checkpoint's chat template."""

    prompt_param = "messages"

    def __init__(self, state, req: ChatCompletionRequest):
        super().__init__(state, req, "chatcmpl")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                               f"got {req.top_logprobs}", param="top_logprobs")
        if req.tools or req.tool_choice not in (None, "none"):
            raise APIError(400, "tools and tool_choice are not supported", param="tools")
        check_sampling(req, max_tokens)
        structured = state.compile_structured(*structured_of(req))
        messages = [m.as_template_dict() for m in req.messages]
        state.check_size(sum(len(m["content"]) for m in messages), "messages")
        try:
            kwargs = req.chat_template_kwargs or {}  # extra template variables
            tok = state.tokenizer
            text = None if tok is None else tok.apply_chat_template(messages, **kwargs)
        except ValueError as exc:
            raise APIError(400, f"chat template rejected the messages: {exc}", param="messages") from exc
        if text is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        # The template already spells out BOS and the like; encoding must not add them again.
        ids = state.encode(text, "messages", add_special_tokens=False)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.engine_requests = build_requests(
            req, self.id, [ids], max_tokens, state.max_model_len,
            default_max_tokens=None, logprobs=logprobs, param="messages",
            defaults=state.generation_defaults, structured=structured)

    def _chunk(self, choice: ChatChunkChoice | None, usage=None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                       choices=[choice] if choice else [], usage=usage))

    def response(self, outputs: list) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=o.text),
                              logprobs=chat_logprobs(self.tokenizer, o), finish_reason=o.finish_reason,
                              token_ids=self._token_ids(o))
                   for i, o in enumerate(outputs)]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage_of(self.engine_requests, outputs))

    async def chunks(self, group) -> AsyncIterator[str]:
        k = len(group.request_ids)
        for i in range(k):  # OpenAI opens every choice with a role-only delta
            yield self._chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        tracker = DeltaTracker.for_choices(k, self.stop)
        async for ready in group.updates():
            for i in ready:
                out = group.latest[i]
                delta, start, send = self._changed(tracker, i, out)
                if send:
                    yield self._chunk(ChatChunkChoice(
                        index=i, delta=ChatDelta(content=delta or None),
                        logprobs=chat_logprobs(self.tokenizer, out, start),
                        finish_reason=out.finish_reason if out.finished else None,
                        token_ids=self._token_ids(out, start)))
        for i, _, delta, start, out in self._stopped(group, tracker):
            yield self._chunk(ChatChunkChoice(
                index=i, delta=ChatDelta(content=delta or None),
                logprobs=out and chat_logprobs(self.tokenizer, out, start), finish_reason="abort",
                token_ids=out and self._token_ids(out, start)))
        if self.include_usage:
            yield self._chunk(None, usage_of(self.engine_requests, group.latest))


def tokenize(state, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """POST /tokenize: a prompt, or chat messages rendered by the chat template, to token ids.
    `token_strs` holds each token's decoded text."""
    if isinstance(req, TokenizeChatRequest):
        if req.continue_final_message:
            raise APIError(400, "continue_final_message is not supported", param="continue_final_message")
        messages = [m.as_template_dict() for m in req.messages]
        state.check_size(sum(len(m["content"]) for m in messages), "messages")
        if state.tokenizer is None:
            raise APIError(400, f"{state.model_name} has no tokenizer", param="messages")
        try:
            text = state.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, f"chat template rejected the messages: {exc}", param="messages") from exc
        if text is None:
            raise APIError(400, "this model has no chat template", param="messages")
        ids = state.encode(text, "messages", add_special_tokens=req.add_special_tokens)
    else:
        ids = state.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
    strs = token_strings(state.tokenizer, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


def detokenize(state, req: DetokenizeRequest) -> DetokenizeResponse:
    """POST /detokenize: token ids back to text, special tokens included (a prompt may hold them)."""
    if state.tokenizer is None:
        raise APIError(400, f"{state.model_name} has no tokenizer", param="tokens")
    vocab = state.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens must be ids in [0, {vocab}), got {bad[:5]}", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, skip_special_tokens=False))
