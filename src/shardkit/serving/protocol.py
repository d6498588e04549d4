"""OpenAI's completions and chat requests read strictly, and the bodies the server answers with.

A request body is checked field by field before anything is queued: a wrong type, a value out
of range, an argument the server does not know or does not implement is a :class:`RequestError`
(HTTP 400, OpenAI's error body naming the ``param``), never silently ignored. What is checked
against the model (its name, the prompt and ``max_tokens`` against its positions, token ids
against its vocabulary) is checked in :func:`to_generation`, once the prompt is tokenized.

Defaults are OpenAI's: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions and the
rest of the context for chat. Extensions (as vLLM names them): ``top_k`` (0: no cut) and
``stop_token_ids``; ``stop`` takes strings, as OpenAI's does.

>>> body = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0})
>>> body.prompt, body.max_tokens, body.sampling.temperature, body.stream
('hi', 4, 0.0, False)
>>> parse_completion({"model": "m", "prompt": "hi", "max_tokens": 0})
Traceback (most recent call last):
...
shardkit.serving.protocol.RequestError: max_tokens must be at least 1, got 0
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .requests import Finish, GenerationRequest, Sampling

#: OpenAI's limit on ``stop`` strings per request.
MAX_STOP = 4
#: The largest seed torch's generator takes.
MAX_SEED = 2**64 - 1


class RequestError(ValueError):
    """A request the server refuses: ``status`` (400 unless told), OpenAI's error ``type`` and ``code``,
    and the ``param`` at fault (None when it is the whole body)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Parsed:
    """One checked request: ``prompt`` is text, token ids (completions) or chat messages (chat)."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | tuple[int, ...] | tuple[dict[str, str], ...]
    max_tokens: int | None  # None: the rest of the context
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# Arguments OpenAI defines that the server accepts only at their no-op value: name -> that value's test.
_NO_OP = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v == 1,
    "echo": lambda v: v is False,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None,
    "suffix": lambda v: v is None,
    "presence_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "frequency_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "logit_bias": lambda v: v is None or v == {},
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None,
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
           "stream_options", "user", "n", "presence_penalty", "frequency_penalty", "logit_bias"}
_KNOWN = {
    "completion": _COMMON | {"prompt", "best_of", "echo", "logprobs", "suffix"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
                       "tool_choice", "parallel_tool_calls"},
}


def parse_completion(body: object) -> Parsed:
    """A ``POST /v1/completions`` body checked; :class:`RequestError` naming the first wrong field."""
    body = _object(body, "completion")
    prompt = _prompt(body.get("prompt", _MISSING))
    return _parsed("completion", body, prompt, _optional_int(body, "max_tokens", 16, low=1))


def parse_chat(body: object) -> Parsed:
    """A ``POST /v1/chat/completions`` body checked; :class:`RequestError` naming the first wrong field."""
    body = _object(body, "chat")
    messages = _messages(body.get("messages", _MISSING))
    if "max_completion_tokens" in body and "max_tokens" in body:
        raise RequestError("give max_completion_tokens or max_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return _parsed("chat", body, messages, _optional_int(body, name, None, low=1))


_MISSING = object()


def _object(body: object, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_type(body)}")
    unknown = sorted(set(body) - _KNOWN[kind])
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, is_no_op in _NO_OP.items():
        if name in body and not is_no_op(body[name]):
            raise RequestError(f"{name}={body[name]!r} is not supported by this server (only its default)", name)
    return body


def _parsed(kind: str, body: dict[str, Any], prompt, max_tokens: int | None) -> Parsed:
    model = body.get("model", _MISSING)
    if model is _MISSING:
        raise RequestError("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {_type(model)}", "model")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(f"stream_options must be an object with only include_usage, got {options!r}",
                               "stream_options")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    if "user" in body and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {_type(body['user'])}", "user")
    sampling = Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=_int(body, "top_k", 0, low=0),
        seed=_optional_int(body, "seed", None, low=0, high=MAX_SEED),
    )
    return Parsed(kind, model, prompt, max_tokens, sampling, _stop(body.get("stop")),
                  frozenset(_ids(body.get("stop_token_ids", []), "stop_token_ids")), stream, include_usage)


def _type(value: object) -> str:
    names = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{param or name} must be a boolean, got {_type(value)}", param or name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, default: int, low: int, high: int | None = None) -> int:
    value = _optional_int(body, name, default, low, high)
    return default if value is None else value


def _optional_int(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, got {_type(value)}", name)
    if value < low:
        raise RequestError(f"{name} must be at least {low}, got {value}", name)
    if high is not None and value > high:
        raise RequestError(f"{name} must be at most {high}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {_type(value)}", name)
    if value > high or value < low or (open_low and value == low):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise RequestError(f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _prompt(prompt: object) -> str | tuple[int, ...]:
    if prompt is _MISSING:
        raise RequestError("you must provide a prompt parameter", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return tuple(_ids(prompt, "prompt"))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"one prompt per request, got a batch of {len(prompt)}; send them as separate "
                           f"requests (they are batched by the server)", "prompt")
    raise RequestError(f"prompt must be a string or an array of token ids, got {_type(prompt)}"
                       + (" (empty)" if prompt == [] else ""), "prompt")


def _ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(f"{name} must be an array of integer token ids, got {_type(value)}", name)
    negative = [t for t in value if t < 0]
    if negative:
        raise RequestError(f"{name} holds {negative[0]}: token ids are >= 0", name)
    return value


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop must be a string or an array of strings, got {_type(stop)}"
                           + (" (give token ids as stop_token_ids)" if isinstance(stop, (int, list)) else ""), "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise RequestError("stop holds an empty string", "stop")
    return tuple(stops)


def _messages(messages: object) -> tuple[dict[str, str], ...]:
    if messages is _MISSING:
        raise RequestError("you must provide a messages parameter", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty array, got {_type(messages)}", "messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{param} must be an object, got {_type(message)}", param)
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"{param}.role must be one of 'system', 'developer', 'user', 'assistant', got "
                               f"{role!r}", f"{param}.role")
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"{param}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                   f"supported", f"{param}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{param}.content must be a string, got {_type(content)}", f"{param}.content")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise RequestError(f"{param}: unsupported field {extra[0]!r}", f"{param}.{extra[0]}")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def to_generation(parsed: Parsed, prompt_ids: list[int], *, model: str, positions: int | None,
                  vocab: int | None, eos_ids: frozenset[int]) -> GenerationRequest:
    """The engine's request for a checked, tokenized ``parsed``: the model name, the prompt and
    ``max_tokens`` against the positions, ids against the vocabulary (:class:`RequestError` otherwise).

    >>> p = parse_completion({"model": "m", "prompt": [5, 6], "max_tokens": 30})
    >>> to_generation(p, [5, 6], model="m", positions=32, vocab=256, eos_ids=frozenset()).max_new_tokens
    30
    >>> to_generation(p, [5, 6], model="m", positions=16, vocab=256, eos_ids=frozenset())
    Traceback (most recent call last):
    ...
    shardkit.serving.protocol.RequestError: This model's maximum context length is 16 tokens. However, you requested 32 tokens (2 in the prompt, 30 in the completion). Please reduce the prompt or max_tokens.
    """
    if parsed.model != model:
        raise RequestError(f"The model {parsed.model!r} does not exist; this server serves {model!r}", "model",
                           code="model_not_found")
    if not prompt_ids:
        raise RequestError("the prompt is empty once tokenized", "messages" if parsed.kind == "chat" else "prompt")
    for name, ids in (("prompt", prompt_ids), ("stop_token_ids", sorted(parsed.stop_ids))):
        if vocab is not None and ids and max(ids) >= vocab:
            raise RequestError(f"{name} holds token id {max(ids)}, but the model's vocabulary has {vocab} tokens "
                               f"(ids 0 to {vocab - 1})", name)
    max_tokens = parsed.max_tokens
    if positions is not None:
        if len(prompt_ids) >= positions:
            raise RequestError(f"This model's maximum context length is {positions} tokens. However, your prompt "
                               f"has {len(prompt_ids)} tokens, leaving none to generate. Please reduce the prompt.",
                               "messages" if parsed.kind == "chat" else "prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = positions - len(prompt_ids)
        if len(prompt_ids) + max_tokens > positions:
            raise RequestError(f"This model's maximum context length is {positions} tokens. However, you requested "
                               f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in "
                               f"the completion). Please reduce the prompt or max_tokens.",
                               "max_completion_tokens" if parsed.kind == "chat" and max_tokens else "max_tokens",
                               code="context_length_exceeded")
    if max_tokens is None:
        raise RequestError("the model has no position limit: give max_tokens", "max_tokens")
    return GenerationRequest(parsed.id, tuple(prompt_ids), max_tokens, parsed.sampling, parsed.stop_ids | eos_ids)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(finish: Finish | None) -> str | None:
    """OpenAI's ``finish_reason``: ``stop`` (an eos, a stop id or string) or ``length``."""
    return None if finish is None else "length" if finish is Finish.LENGTH else "stop"


def response(parsed: Parsed, model: str, text: str, finish: Finish, prompt_tokens: int,
             completion_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) answer: a ``text_completion`` or a ``chat.completion``."""
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason(finish)}
        return {"id": f"chatcmpl-{parsed.id}", "object": "chat.completion", "created": parsed.created,
                "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(finish)}
    return {"id": f"cmpl-{parsed.id}", "object": "text_completion", "created": parsed.created, "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk(parsed: Parsed, model: str, text: str | None, finish: Finish | None = None, *, first: bool = False,
          usage_counts: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed event: a ``text_completion`` (completions) or a ``chat.completion.chunk`` (chat); with
    ``usage_counts``, the last one of ``stream_options.include_usage`` (no choices)."""
    if parsed.kind == "chat":
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(finish)}]
        out = {"id": f"chatcmpl-{parsed.id}", "object": "chat.completion.chunk", "created": parsed.created,
               "model": model, "choices": [] if usage_counts else choices}
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason(finish)}]
        out = {"id": f"cmpl-{parsed.id}", "object": "text_completion", "created": parsed.created, "model": model,
               "choices": [] if usage_counts else choices}
    if parsed.include_usage:
        out["usage"] = usage_counts
    return out
