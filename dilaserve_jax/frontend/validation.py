"""Checks a GenerateRequest against the model's limits and turns it into a GenerateSpec.

Every failure names the offending field, so a client can fix its call; the service maps
InvalidRequest to INVALID_ARGUMENT.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.serving.policy.limits import MAX_REQUEST_ID_CHARS, Limits

__all__ = ["GenerateSpec", "InvalidRequest", "Limits", "validate"]


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    request_id: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int  # what the caller asked for
    answer_length: int  # answer area on the canvas: max_new_tokens rounded up to whole blocks
    block_length: int
    slo_s: float | None  # from the request field; None = not given
    tau_min: float
    tau_max: float
    temperature: float
    seed: int
    max_accuracy_drop: float | None = None  # the request's own loss bound (points); None = the server's
    strict_admission: bool | None = None  # refuse it if it cannot meet its deadline; None = the server's rule


def _tau(value: float, field: str) -> float:
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise InvalidRequest(field, f"must be in (0, 1], got {value}")
    return float(value)


def validate(req: pb.GenerateRequest, tokenizer, limits: Limits) -> GenerateSpec:
    which = req.WhichOneof("prompt")
    if which == "text":
        if not req.text:
            raise InvalidRequest("text", "prompt is empty")
        if len(req.text) > limits.max_prompt_chars:
            raise InvalidRequest("text", f"prompt has {len(req.text)} characters, limit {limits.max_prompt_chars}")
        try:
            prompt = tuple(tokenizer.encode(req.text))
        except ValueError as err:
            raise InvalidRequest("text", str(err)) from None
        if not prompt:
            raise InvalidRequest("text", "prompt encodes to no tokens")
    elif which == "token_ids":
        prompt = tuple(req.token_ids.ids)
        if not prompt:
            raise InvalidRequest("token_ids", "prompt is empty")
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size or t in limits.reserved_ids]
        if bad:
            raise InvalidRequest("token_ids", f"ids outside the vocabulary [0, {limits.vocab_size}) or reserved "
                                 f"(mask/pad): {bad[:8]}")
    else:
        raise InvalidRequest("prompt", "set either text or token_ids")

    block = req.block_length if req.HasField("block_length") else limits.default_block_length
    if not 0 < block <= limits.max_block_length:
        raise InvalidRequest("block_length", f"must be in [1, {limits.max_block_length}], got {block}")
    room = limits.max_len - len(prompt)
    if room <= 0:
        raise InvalidRequest("text" if which == "text" else "token_ids",
                             f"prompt has {len(prompt)} tokens; the model's limit is {limits.max_len} in all")
    max_new = req.max_new_tokens if req.HasField("max_new_tokens") else min(limits.default_max_new_tokens, room)
    if max_new <= 0:
        raise InvalidRequest("max_new_tokens", f"must be positive, got {max_new}")
    block = min(block, max_new)
    answer = math.ceil(max_new / block) * block
    if len(prompt) + answer > limits.max_len:
        raise InvalidRequest("max_new_tokens", f"prompt ({len(prompt)}) + answer area ({answer}, max_new_tokens "
                             f"rounded up to whole blocks of {block}) exceeds the model's limit {limits.max_len}")

    slo_s = None
    if req.HasField("slo_ms"):
        if not math.isfinite(req.slo_ms) or req.slo_ms <= 0:
            raise InvalidRequest("slo_ms", f"must be positive, got {req.slo_ms}")
        slo_s = req.slo_ms / 1000.0
    tau_min = _tau(req.tau_min, "tau_min") if req.HasField("tau_min") else limits.default_tau_min
    tau_max = _tau(req.tau_max, "tau_max") if req.HasField("tau_max") else limits.default_tau_max
    if req.HasField("tau_min") and not req.HasField("tau_max"):
        tau_max = max(tau_max, tau_min)
    if req.HasField("tau_max") and not req.HasField("tau_min"):
        tau_min = min(tau_min, tau_max)
    if tau_min > tau_max:
        raise InvalidRequest("tau_min", f"floor {tau_min} is above the ceiling tau_max {tau_max}")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise InvalidRequest("temperature", f"must be >= 0, got {req.temperature}")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
    request_id = req.request_id or uuid.uuid4().hex
    drop = None
    if req.HasField("max_accuracy_drop"):
        if not math.isfinite(req.max_accuracy_drop) or req.max_accuracy_drop < 0:
            raise InvalidRequest("max_accuracy_drop", f"must be a finite number of points >= 0, got {req.max_accuracy_drop}")
        drop = float(req.max_accuracy_drop)
    strict = bool(req.strict_admission) if req.HasField("strict_admission") else None
    return GenerateSpec(request_id, prompt, max_new, answer, block, slo_s, tau_min, tau_max,
                        float(req.temperature), int(req.seed), drop, strict)
