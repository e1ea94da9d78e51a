"""The OpenAI-compatible HTTP API (Starlette): routes, bearer auth, and the translation of a call
into requests on the shared generation path (frontend/calls.py), which the gRPC service uses too:
one cluster, one request-id space, one set of outcome counters, one drain.

    POST /v1/completions, POST /v1/chat/completions   (stream: SSE, see streaming.py)
    GET  /v1/models, /v1/models/{id}
    GET  /health     200 while serving; 503 while compiling, draining, or with every instance failed
    GET  /metrics    the Prometheus registry itself (the same one --metrics-port serves)
"""
from __future__ import annotations

import hmac
import time
import uuid
from pathlib import PurePath

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dilaserve_jax.frontend.calls import CallError, Calls
from dilaserve_jax.frontend.http.chat_template import Templates
from dilaserve_jax.frontend.http.errors import ApiError, from_call_error
from dilaserve_jax.frontend.http.job import Job
from dilaserve_jax.frontend.http.requests import (MAX_BODY_BYTES, ChatBody, CompletionBody, GenerationBody, check_n,
                                                  generate_request, parse_body, request_timeout)


def default_model_id(model_source: str) -> str:
    """The id /v1/models lists by default: the preset's or the checkpoint directory's name."""
    kind, _, rest = model_source.partition(":")
    if kind in ("hf", "orbax"):
        return PurePath(rest.rpartition("@")[0] if kind == "orbax" and "@" in rest else rest).name or rest
    if kind == "preset":
        return rest.split(" ", 1)[0]
    return kind or model_source


class HttpFrontend:
    def __init__(self, calls: Calls, metrics=None, *, model_id: str | None = None, auth_token: str | None = None,
                 admin_token: str | None = None):
        self.calls, self.cluster, self.metrics = calls, calls.cluster, metrics
        self.model_id = model_id or default_model_id(self.cluster.model_source)
        self.templates = Templates(self.cluster)
        self.created = int(time.time())
        self._tokens = [f"Bearer {t}".encode() for t in (auth_token, admin_token) if t] if auth_token else []
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})

    # --- generation ---
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse_body(await _read_body(request), CompletionBody)
        self._check(body)
        fields = {"text": "prompt", "token_ids": "prompt", "prompt": "prompt", "max_new_tokens": "max_tokens"}
        return await self._generate(request, body, body.prompts(), (body.max_tokens, "max_tokens"), fields, False)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse_body(await _read_body(request), ChatBody)
        self._check(body)
        if not body.messages:
            raise ApiError(400, "messages: must hold at least one message", param="messages")
        limit = body.answer_tokens()
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        prompt = self.templates.current().render(messages)
        fields = {"text": "messages", "token_ids": "messages", "prompt": "messages", "max_new_tokens": limit[1]}
        return await self._generate(request, body, [prompt], limit, fields, True)

    def _check(self, body: GenerationBody) -> None:
        if body.model is not None and body.model != self.model_id:
            raise ApiError(404, f"the model {body.model[:128]!r} does not exist here; this server serves "
                           f"{self.model_id!r} (GET /v1/models)", param="model", code="model_not_found")
        check_n(body)

    async def _generate(self, request: Request, body: GenerationBody, prompts: list, limit: tuple[int | None, str],
                        fields: dict[str, str], chat: bool) -> Response:
        timeout_s = request_timeout(request.headers)
        stops = body.stops()
        base = uuid.uuid4().hex
        several = len(prompts) > 1
        specs = []
        for i, prompt in enumerate(prompts):
            name = f"prompt[{i}]" if several else fields["text"]
            req = generate_request(prompt, body, limit, f"{base}-{i}" if several else base, name)
            try:
                specs.append(self.calls.accept(req))
            except CallError as err:
                raise from_call_error(err, fields, name if several else None) from None
        job = Job(self.calls, chat=chat, model=self.model_id, request_id=base, body=body, specs=specs, stops=stops,
                  timeout_s=timeout_s, fields=fields)
        return await (job.stream(request.receive) if body.stream else job.respond(request.receive))

    def _authorize(self, request: Request) -> None:
        if not self._tokens:
            return
        supplied = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(supplied, t) for t in self._tokens):
            raise ApiError(401, "wrong bearer token" if supplied else
                           "missing bearer token: send 'Authorization: Bearer <token>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    # --- the rest ---
    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "dilaserve",
                "max_model_len": self.cluster.limits.max_len}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["model"]
        if name != self.model_id:
            raise ApiError(404, f"the model {name[:128]!r} does not exist here", param="model",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        refusal = self.calls.refusal()
        if refusal is None:
            return JSONResponse({"status": "serving", "model": self.model_id})
        return JSONResponse({"status": "not serving", "reason": refusal}, status_code=503, headers={"Retry-After": "1"})

    async def prometheus(self, request: Request) -> Response:
        if self.metrics is None:
            raise ApiError(404, "this server keeps no metrics")
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _read_body(request: Request) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"body: over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"body: over {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise ApiError(400, "body: the client disconnected while sending it") from None
    return bytes(body)


async def _api_error(request: Request, err: ApiError) -> Response:
    return err.response()


async def _http_error(request: Request, err: HTTPException) -> Response:
    message = {404: f"no such endpoint: {request.method} {request.url.path[:200]}",
               405: f"method {request.method} not allowed on {request.url.path[:200]}"}.get(err.status_code, err.detail)
    return ApiError(err.status_code, message, code="not_found" if err.status_code == 404 else None,
                    headers=err.headers).response()


async def _server_error(request: Request, err: Exception) -> Response:
    return ApiError(500, f"server error: {type(err).__name__}", code="internal_error").response()
