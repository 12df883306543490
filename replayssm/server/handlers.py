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
            structured=structured)

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
        try:
            text = state.tokenizer.apply_chat_template(messages) if state.tokenizer is not None else None
        except ValueError as exc:
            raise APIError(400, f"chat template rejected the messages: {exc}", param="messages") from exc
        if text is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        # The template already spells out BOS and the like; encoding must not add them again.
        ids = state.encode(text, "messages", add_special_tokens=False)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.engine_requests = build_requests(
            req, self.id, [ids], max_tokens, state.max_model_len,
            default_max_tokens=None, logprobs=logprobs, param="messages", structured=structured)

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
        if self.include_usage:
            yield self._chunk(None, usage_of(self.engine_requests, group.latest))
