"""The bodies of /v1/completions and /v1/chat/completions, and their translation into the gRPC
API's `GenerateRequest`, which the shared path (frontend/calls.py) validates exactly as for a gRPC
call.

Types are strict (a string where a number belongs is a 400, not a conversion); fields this server
does not know are ignored, as OpenAI's servers do. The extension fields (`slo_ms`, `tau_min`,
`tau_max`, `max_accuracy_drop`, `block_length`, `strict_admission`) sit at the top level of the
body: the official client sends them with `extra_body={...}`.
"""
from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend.http.errors import ApiError

MAX_BODY_BYTES = 16 * 1024 * 1024  # as gRPC's message limit
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each is its own request)
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_STOP_CHARS = 256
INT32 = 2 ** 31
TIMEOUT_HEADER = "x-request-timeout"  # seconds: a hard deadline (504 once passed)
MAX_TIMEOUT_S = 86_400.0
PROMPT_TYPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class GenerationBody(_Body):
    """Fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extension fields (extra_body)
    slo_ms: float | None = None
    tau_min: float | None = None
    tau_max: float | None = None
    max_accuracy_drop: float | None = None
    block_length: int | None = None
    strict_admission: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"stop: each stop string has at most {MAX_STOP_CHARS} characters", param="stop")
        return tuple(s for s in stops if s)


class CompletionBody(GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt: is empty", param="prompt")
        if isinstance(p[0], int):
            return [p]
        if len(p) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts in one call, got {len(p)}", param="prompt")
        return list(p)


class TextPart(_Body):
    type: str
    text: str | None = None


class Message(BaseModel):
    """A chat message; fields beyond role and content (name, tool_calls, ...) reach the template as given."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{index}].content[{j}]: only text parts are supported, got "
                                   f"type {part.type[:64]!r}", param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatBody(GenerationBody):
    messages: list[Message]
    max_completion_tokens: int | None = None

    def answer_tokens(self) -> tuple[int | None, str]:
        """(max new tokens, the field it came from): max_completion_tokens wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def parse_body(raw: bytes, kind: type[GenerationBody]) -> GenerationBody:
    """The checked body, or a 400 naming the first offending field."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise ApiError(400, f"body: not valid JSON ({str(err)[:200]})", param=None) from None
    if not isinstance(data, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        raise _field_error(err) from None
    except RecursionError:
        raise ApiError(400, "body: nested too deeply") from None


def _field_error(err: ValidationError) -> ApiError:
    first = err.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    if loc and loc[0] == "prompt":
        return ApiError(400, f"prompt: must be {PROMPT_TYPES}", param="prompt")
    if loc and loc[0] == "messages" and first["type"] != "missing":
        where = "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc[1:3])
        return ApiError(400, f"messages{where}: must be a list of {{role, content}} objects with text content "
                        f"({first['msg']})", param="messages")
    name = loc[0] if loc else "body"
    path = ".".join(x for x in loc if x not in ("str", "int", "list[str]", "list[int]")) or "body"
    return ApiError(400, f"{path}: {first['msg'].lower() if first['type'] != 'missing' else 'required'}",
                    param=name)


def generate_request(prompt: str | list[int], body: GenerationBody, max_tokens: tuple[int | None, str],
                     request_id: str, prompt_field: str) -> pb.GenerateRequest:
    """The GenerateRequest of one prompt (validated later, by the shared path)."""
    req = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        if any(not 0 <= t < INT32 for t in prompt):
            raise ApiError(400, f"{prompt_field}: token ids must be in [0, the vocabulary size)", param="prompt")
        req.token_ids.ids.extend(prompt)
    limit, name = max_tokens
    if limit is not None:
        req.max_new_tokens = _int32(limit, name)
    if body.block_length is not None:
        req.block_length = _int32(body.block_length, "block_length")
    if body.seed is not None:
        if not 0 <= body.seed < 2 ** 64:
            raise ApiError(400, f"seed: must be in [0, 2**64), got {body.seed}", param="seed")
        req.seed = body.seed
    if body.temperature is not None:
        req.temperature = body.temperature
    for field in ("slo_ms", "tau_min", "tau_max", "max_accuracy_drop", "strict_admission"):
        value = getattr(body, field)
        if value is not None:
            setattr(req, field, value)
    return req


def _int32(value: int, name: str) -> int:
    if not -INT32 <= value < INT32:
        raise ApiError(400, f"{name}: out of range, got {value}", param=name)
    return value


def request_timeout(headers) -> float | None:
    """The X-Request-Timeout header's seconds (a hard deadline), or None when absent."""
    text = headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails too
        raise ApiError(400, f"X-Request-Timeout: must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got "
                       f"{text[:64]!r}", param="X-Request-Timeout")
    return value


def check_n(body: GenerationBody) -> None:
    if body.n is not None and body.n != 1:
        raise ApiError(400, f"n: only 1 choice per prompt is supported, got {body.n}", param="n")


def json_dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
