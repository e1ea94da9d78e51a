"""One /v1/completions or /v1/chat/completions call: its requests (one per prompt) run through the
shared path, the whole answer or its SSE stream, and the end of every request when the client
leaves (its generator is closed: the request is aborted, its slot freed, counted cancelled)."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

from starlette.responses import JSONResponse, Response

from dilaserve_jax.frontend.calls import CallError, Calls, Finished, Step, Submitted
from dilaserve_jax.frontend.http.errors import ApiError, from_call_error
from dilaserve_jax.frontend.http.requests import GenerationBody, json_dumps
from dilaserve_jax.frontend.http.streaming import (DONE, CommittedText, EventStream, canvas_view, cut_at_stop,
                                                   result_view, sse, wait_disconnect)
from dilaserve_jax.frontend.validation import GenerateSpec

log = logging.getLogger(__name__)
CLIENT_GONE = 499  # the answer to a client that has left (nobody reads it)


class Job:
    def __init__(self, calls: Calls, *, chat: bool, model: str, request_id: str, body: GenerationBody,
                 specs: list[GenerateSpec], stops: tuple[str, ...], timeout_s: float | None,
                 fields: dict[str, str]):
        self.calls, self.tok = calls, calls.cluster.tokenizer
        self.chat, self.model, self.body = chat, model, body
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.specs, self.stops, self.timeout_s, self.fields = specs, stops, timeout_s, fields
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.headers = {"x-request-id": request_id}

    # --- running ---
    def _run(self, spec: GenerateSpec, stream: bool):
        return self.calls.run(spec, stream=stream, deadline_s=self.timeout_s, hard=self.timeout_s is not None)

    async def _collect(self, spec: GenerateSpec) -> Finished:
        async with aclosing(self._run(spec, False)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    return event
        raise RuntimeError(f"request {spec.request_id} ended without a result")

    async def _pump(self, index: int, spec: GenerateSpec, queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self._run(spec, True)) as events:
                async for event in events:
                    if not isinstance(event, Submitted):
                        queue.put_nowait((index, event))
        except Exception as err:  # noqa: BLE001 - CallError, or a fault: reported in the stream
            queue.put_nowait((index, err))

    def _error(self, err: BaseException, index: int) -> ApiError:
        if isinstance(err, CallError):
            return from_call_error(err, self.fields, f"prompt[{index}]" if len(self.specs) > 1 else None)
        log.error("request %s failed", self.specs[index].request_id, exc_info=err)
        return ApiError(500, f"server error: {type(err).__name__}: {err}", code="internal_error")

    # --- the whole answer ---
    async def respond(self, receive) -> Response:
        tasks = [asyncio.ensure_future(self._collect(s)) for s in self.specs]
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            waiting = set(tasks)
            while waiting:
                done, _ = await asyncio.wait(waiting | {gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    return Response(status_code=CLIENT_GONE)
                for task in done:
                    waiting.discard(task)
                    if task.exception() is not None:
                        raise self._error(task.exception(), tasks.index(task))
        finally:
            await _cancel(*tasks, gone)
        finished = [t.result() for t in tasks]
        choices = []
        for i, done in enumerate(finished):
            text, reason = self._final_text(done)
            content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": i, **content, "logprobs": None, "finish_reason": reason,
                            "dilaserve": result_view(done)})
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                             "choices": choices, "usage": self._usage(finished)}, headers=self.headers)

    def _final_text(self, done: Finished) -> tuple[str, str]:
        text, cut = cut_at_stop(self.tok.decode(done.tokens), self.stops)
        return text, "stop" if cut or done.stopped else "length"

    def _usage(self, finished: list[Finished]) -> dict:
        prompt = sum(len(d.spec.prompt_tokens) for d in finished)
        completion = sum(len(d.tokens) for d in finished)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # --- the stream ---
    async def stream(self, receive) -> Response:
        """Starts every request and waits for each one's first step (or its end, or its error) before
        answering, so a refusal (429, 503, ...) keeps its status; then the SSE stream."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(i, s, queue)) for i, s in enumerate(self.specs)]

        async def close() -> None:
            await _cancel(*pumps)

        first, started = [], set()
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            while len(started) < len(pumps):
                getter = asyncio.ensure_future(queue.get())
                try:
                    done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    getter.cancel()
                if gone in done:
                    await close()
                    return Response(status_code=CLIENT_GONE)
                index, event = getter.result()
                if isinstance(event, BaseException):
                    raise self._error(event, index)
                first.append((index, event))
                started.add(index)
        except BaseException:
            await close()
            raise
        finally:
            await _cancel(gone)
        return EventStream(self._events(first, queue), close, self.headers)

    async def _events(self, first: list, queue: asyncio.Queue):
        texts = [CommittedText(self.tok, s.max_new_tokens, self.stops) for s in self.specs]
        fresh = [True] * len(self.specs)
        finished: list[Finished] = []
        while len(finished) < len(self.specs):
            index, event = first.pop(0) if first else await queue.get()
            if isinstance(event, BaseException):
                yield sse(json_dumps(self._error(event, index).body()))
                break
            if isinstance(event, Step):
                delta = texts[index].advance(event.answer)
                ext = canvas_view(self.tok, event, self.specs[index].max_new_tokens, texts[index].prefix)
                yield self._chunk(index, delta, None, ext, fresh[index])
            else:
                text, reason = self._final_text(event)
                yield self._chunk(index, texts[index].finish(text), reason, result_view(event), fresh[index])
                finished.append(event)
            fresh[index] = False
        else:
            if self.body.include_usage:
                yield sse(json_dumps({"id": self.id, "object": self.chunk_object,
                                      "created": self.created, "model": self.model, "choices": [],
                                      "usage": self._usage(finished)}))
        yield DONE

    def _chunk(self, index: int, text: str, reason: str | None, ext: dict, first: bool) -> bytes:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        choice["dilaserve"] = ext
        chunk = {"id": self.id, "object": self.chunk_object,
                 "created": self.created, "model": self.model, "choices": [choice]}
        if self.body.include_usage:
            chunk["usage"] = None
        return sse(json_dumps(chunk))


async def _cancel(*tasks: asyncio.Future) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
