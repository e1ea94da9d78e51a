"""Streaming a diffusion model's answer over SSE: the committed prefix as OpenAI deltas, the
whole provisional canvas beside it, and the response that stops the work when the client leaves.

A diffusion model fills its answer area in any order, so the text a standard client sees
(`delta.content`, or `text` for completions) is only the **committed prefix**: the answer's
leading positions once every one of them is committed, up to the first EOS and at most
`max_tokens`. It is released left to right and never retracted; text that may still be cut by a
stop string (a tail that begins one) or that ends inside an unfinished character is held back
until it is certain. The `dilaserve` object of each chunk carries the whole canvas of the step.
"""
from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator, Awaitable, Callable

from dilaserve_jax.frontend.calls import Finished, Step, render_canvas

REPLACEMENT = "\ufffd"  # what a byte-level decoder shows for an unfinished UTF-8 sequence


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The text before the first stop string in it, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_tail(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string (it may become one)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class CommittedText:
    """The text released so far of one answer, and the next piece to release."""

    def __init__(self, tokenizer, max_new_tokens: int, stops: tuple[str, ...] = ()):
        self.tok, self.max_new, self.stops = tokenizer, max_new_tokens, stops
        self.sent = ""
        self.prefix = 0  # leading answer positions committed (what `sent` covers, in positions)

    def advance(self, answer) -> str:
        """The new text once `answer` (the whole answer area, mask ids where still masked) holds."""
        tok, tokens, ended = self.tok, [], False
        for t in answer[:self.max_new]:
            if t == tok.mask_id:
                break
            if t in (tok.eos_id, tok.pad_id):
                ended = True
                break
            tokens.append(t)
        self.prefix = len(tokens) + (1 if ended else 0)
        ended = ended or len(tokens) == self.max_new
        text, stopped = cut_at_stop(tok.decode(tokens), self.stops)
        if not (ended or stopped):
            text = text.rstrip(REPLACEMENT)
            text = text[:len(text) - _held_tail(text, self.stops)]
        return self._release(text)

    def finish(self, final_text: str) -> str:
        """What remains to release of the final text (the stop strings already cut from it)."""
        return self._release(final_text)

    def _release(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def canvas_view(tok, step: Step, max_new_tokens: int, committed_prefix: int) -> dict:
    """The `dilaserve` object of a step's chunk: the canvas as the gRPC stream's StepUpdate shows it."""
    answer = step.answer[:max_new_tokens]
    ended_at = next((i for i, t in enumerate(answer) if t == tok.eos_id), None)
    visible = answer if ended_at is None else answer[:ended_at]
    p = step.progress
    return {"step": step.step, "step_kind": p.kind.label, "tau": p.tau, "canvas": render_canvas(tok, answer),
            "masked": [i for i, t in enumerate(visible) if t == tok.mask_id], "ended_at": ended_at,
            "committed_prefix": min(committed_prefix, len(answer)), "tokens_committed": len(p.positions),
            "total_committed": step.total_committed}


def result_view(done: Finished) -> dict:
    """The `dilaserve` object of a finished answer (the gRPC GenerateResponse's figures)."""
    r = done.result
    start = r.start if r.start is not None else r.finish
    return {"request_id": done.spec.request_id, "steps": r.steps, "mean_tau": _finite(r.mean_tau or 0.0),
            "predicted_accuracy_loss": _finite(r.predicted_loss), "deadline_met": r.deadline_met,
            "deadline_ms": _finite((done.request.deadline - done.request.arrival) * 1e3), "instance": r.instance,
            "moves": r.moves, "queue_ms": _finite((start - r.arrival) * 1e3),
            "decode_ms": _finite((r.finish - start) * 1e3), "total_ms": _finite((r.finish - r.arrival) * 1e3),
            "taus": [_finite(t) for t in r.taus]}


def _finite(x: float) -> float | None:
    """JSON has no inf or NaN: None stands for them."""
    return x if math.isfinite(x) else None


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


async def wait_disconnect(receive) -> None:
    """Returns once the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """An ASGI response that sends `events` as they come, and, when the client disconnects, stops
    sending and cancels them (the running generator gets CancelledError); `on_close` runs in every
    case (the calls behind the stream are ended there, even if it never started)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict | None = None):
        self.events, self.on_close = events, on_close
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]
        self.headers += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        async def produce():
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        sending = asyncio.ensure_future(produce())
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, gone):
                task.cancel()
            await asyncio.gather(sending, gone, return_exceptions=True)
            await self.on_close()
        if sending.done() and not sending.cancelled() and isinstance(sending.exception(), Exception) \
                and not isinstance(sending.exception(), OSError):
            raise sending.exception()
