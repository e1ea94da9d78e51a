"""The OpenAI-compatible HTTP API over the real tiny model, beside gRPC in the same server: the
official `openai` client, raw SSE, a fuzz of bad bodies, client disconnects, 200 concurrent streams.
One server (one TP-1 instance, one length bucket) for the whole module."""
import asyncio
import json
import threading
import time

import grpc
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilaserve_jax.frontend.http.options import HttpOptions
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
from tests.frontend.conftest import ServerThread, status_of

pytestmark = pytest.mark.slow
TOKEN = "s3cret"
TAU = {"tau_min": 0.9, "tau_max": 0.9, "block_length": 16}
PROMPTS = ["sort 93142=", "repeat 4 qk=", "sort 5061="]


class SlowSteps:
    """An engine step hook that sleeps while set: keeps a request running long enough to leave it."""

    def __init__(self):
        self.on = threading.Event()

    def __call__(self, name, plan, outcomes, t0, t1):
        if self.on.is_set():
            time.sleep(0.1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    fake_profile().save(profile)  # scheduling only: answers do not depend on step-time predictions
    cfg = ServeConfig(model="tiny", mesh="1", slots=8, length_buckets=(64,), block_buckets=(16,),
                      default_block_length=16, default_max_new_tokens=16, profile=str(profile),
                      allow_unused_devices=True, default_slo_ms=600_000, controller="manual")
    cluster = build_cluster(cfg, say=lambda _m: None)
    slow = SlowSteps()
    cluster.add_step_hook(slow)
    server = ServerThread(cluster, http=HttpOptions(http_port=0), auth_token=TOKEN).ready()
    server.slow = slow
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oa(served):
    return openai.OpenAI(base_url=served.http_base + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_answers(served):
    with served.client(auth_token=TOKEN) as c:
        return {p: c.generate(p, max_new_tokens=16, block_length=16, tau_min=0.9, tau_max=0.9) for p in PROMPTS}


def _auth():
    return {"Authorization": f"Bearer {TOKEN}"}


def _counter(served, outcome):
    return served.running.metrics.requests.labels(outcome=outcome)._value.get()


def _wait_idle(cluster, timeout=10.0):
    """True once nothing runs or waits (a left request is aborted at its next step: well within 1.5 s)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = cluster.state()
        if state.in_flight == 0 and all(i.running == 0 and i.waiting == 0 for i in state.instances):
            return True
        time.sleep(0.02)
    return False


def test_completions_through_the_openai_client_equal_the_grpc_answers(served, oa, grpc_answers):
    for prompt, want in grpc_answers.items():
        r = oa.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, seed=0, extra_body=TAU)
        choice = r.choices[0]
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
        assert choice.text == want.text and choice.finish_reason == "stop"
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == len(prompt) + len(want.token_ids)
        ext = choice.dilaserve
        assert ext["steps"] == want.steps and ext["mean_tau"] == pytest.approx(want.mean_tau)
        assert ext["deadline_met"] and ext["instance"] == "tp1@0" and ext["decode_ms"] > 0
        assert {"queue_ms", "predicted_accuracy_loss", "total_ms"} <= set(ext)
    # token ids, several prompts in one call (one choice each, in order), the extension fields
    ids = [[ord(ch) for ch in p] for p in PROMPTS[:2]]
    r = oa.completions.create(model="tiny", prompt=ids[0], max_tokens=16, extra_body=TAU)
    assert r.choices[0].text == grpc_answers[PROMPTS[0]].text
    r = oa.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=16, extra_body=TAU)
    assert [c.text for c in r.choices] == [grpc_answers[PROMPTS[0]].text, grpc_answers[PROMPTS[1]].text]
    r = oa.completions.create(model="tiny", prompt=ids, max_tokens=16,
                              extra_body={**TAU, "slo_ms": 12_345, "max_accuracy_drop": 0.5, "strict_admission": False})
    assert [c.text for c in r.choices] == [grpc_answers[PROMPTS[0]].text, grpc_answers[PROMPTS[1]].text]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].dilaserve["deadline_ms"] == pytest.approx(12_345, rel=1e-3)
    # sampled: the same seed gives the same answer on both paths
    with served.client(auth_token=TOKEN) as c:
        sampled = c.generate(PROMPTS[2], max_new_tokens=16, block_length=16, tau_min=0.9, tau_max=0.9,
                             temperature=0.8, seed=7)
    r = oa.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0.8, seed=7, extra_body=TAU)
    assert r.choices[0].text == sampled.text
    # max_tokens cuts the answer: finish_reason length
    r = oa.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, extra_body=TAU)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) == 2


def test_chat_renders_the_tiny_template_and_answers_as_grpc(oa, grpc_answers):
    r = oa.chat.completions.create(model="tiny", max_completion_tokens=16, extra_body=TAU, messages=[
        {"role": "system", "content": "you sort digits"},
        {"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == grpc_answers[PROMPTS[0]].text
    with pytest.raises(openai.BadRequestError) as info:  # the template's raise_exception: no user message
        oa.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "x"}])
    assert "user message" in info.value.body["message"] and info.value.body["param"] == "messages"


def test_streaming_through_the_openai_client_with_usage(oa, grpc_answers):
    want = grpc_answers[PROMPTS[1]]
    chunks = list(oa.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, stream=True,
                                        stream_options={"include_usage": True}, extra_body=TAU))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "stop"
    assert [c.choices[0].dilaserve["step"] for c in chunks[:-2]] == list(range(1, want.steps + 1))
    chat = list(oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                           stream=True, extra_body=TAU, max_tokens=16))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == want.text
    assert chat[-1].choices[0].finish_reason == "stop" and chat[-1].choices[0].dilaserve["steps"] == want.steps


def test_a_wrong_or_missing_token_is_401(served):
    bad = openai.OpenAI(base_url=served.http_base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model="tiny", prompt="hi")
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    r = httpx.post(served.http_base + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"]
    assert httpx.get(served.http_base + "/health").status_code == 200  # probes stay open


def _sse(response):
    """The JSON chunks of an SSE response, checking the framing and the final [DONE]."""
    events = []
    for block in response.iter_text():
        events.append(block)
    frames = "".join(events).split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", frames[-3:]
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f[len("data: "):]) for f in frames[:-2]]


def test_raw_sse_releases_the_committed_prefix_and_the_canvas_of_every_grpc_step(served, grpc_answers):
    prompt = PROMPTS[0]
    with served.client(auth_token=TOKEN) as c:
        updates = [e.update for e in c.generate_stream(prompt, max_new_tokens=16, block_length=16, tau_min=0.9,
                                                       tau_max=0.9) if e.HasField("update")]
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "stream": True,
            **TAU}
    with httpx.stream("POST", served.http_base + "/v1/chat/completions", json=body, headers=_auth()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
    steps, final = chunks[:-1], chunks[-1]["choices"][0]
    canvases = [s["choices"][0]["dilaserve"] for s in steps]
    assert [v["canvas"] for v in canvases] == [u.canvas for u in updates]  # step for step
    assert [v["step"] for v in canvases] == [u.step for u in updates]
    assert [(v["step_kind"], v["tau"], v["tokens_committed"]) for v in canvases] == \
        [(u.step_kind, pytest.approx(u.tau), u.tokens_committed) for u in updates]
    text = ""
    for s, v in zip(steps, canvases):
        text += s["choices"][0]["delta"]["content"]
        # released as soon as committed: the text is exactly the canvas's committed prefix
        assert text == v["canvas"][:v["committed_prefix"]].split("\u00b7")[0]
        assert all(v["canvas"][i] == "_" for i in v["masked"]) and "_" not in text
    text += final["delta"]["content"]
    assert text == grpc_answers[prompt].text and final["finish_reason"] == "stop"
    for before, after in zip(canvases, canvases[1:]):  # nothing committed ever changes
        assert all(a == b for a, b in zip(before["canvas"], after["canvas"]) if a != "_")
        assert after["committed_prefix"] >= before["committed_prefix"]


def test_a_stop_string_cuts_the_text_and_is_never_released(served, grpc_answers):
    want = grpc_answers[PROMPTS[1]].text
    stop = want[2:4]
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 16, "stop": [stop], **TAU}
    r = httpx.post(served.http_base + "/v1/completions", json=body, headers=_auth())
    assert r.json()["choices"][0]["text"] == want[:want.index(stop)] and r.json()["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", served.http_base + "/v1/completions", json={**body, "stream": True},
                      headers=_auth()) as s:
        chunks = _sse(s)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want[:want.index(stop)]


BAD_VALUES = {
    "model": st.sampled_from(["nope", "TINY", "", 7, None]).filter(lambda m: m is not None),
    "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=100), st.text(max_size=3),
                            st.floats(allow_nan=True), st.booleans()),
    "temperature": st.one_of(st.floats(max_value=-1e-6), st.text(max_size=3), st.lists(st.integers(), max_size=2)),
    "prompt": st.one_of(st.just(""), st.just([]), st.just([[]]), st.just(["a", [65]]), st.just({"a": 1}),
                        st.just("x" * 70_000), st.just([65] * 100_000), st.just("héllo"),
                        st.lists(st.integers(min_value=128), min_size=1, max_size=3), st.just(["a"] * 65)),
    "n": st.one_of(st.integers(min_value=2), st.integers(max_value=0), st.text(max_size=2)),
    "tau_min": st.one_of(st.floats(min_value=1.0001), st.floats(max_value=0), st.just("0.5")),
    "stream": st.one_of(st.integers(), st.text(max_size=3)),
    "stop": st.one_of(st.integers(), st.lists(st.text(min_size=1, max_size=3), min_size=5, max_size=6)),
    "seed": st.integers(max_value=-1),
    "block_length": st.one_of(st.integers(max_value=0), st.integers(min_value=17)),
    "slo_ms": st.one_of(st.floats(max_value=0), st.just("soon")),
}
RAW = st.one_of(st.binary(max_size=64).filter(lambda b: not b.strip().startswith(b"{")),
                st.sampled_from([b"{", b"[1, 2]", b'"text"', b"null", b'{"prompt": "hi",}', b"[" * 5000 + b"]" * 5000]))


BAD_TIMEOUTS = st.sampled_from(["0", "-1", "nan", "inf", "1e308", "soon", ""])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.one_of(st.tuples(st.sampled_from(sorted(BAD_VALUES)), st.data()), RAW, BAD_TIMEOUTS),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bad_bodies_are_4xx_in_openai_shape_and_the_server_keeps_serving(served, case, path):
    headers, good = _auth(), {"model": "tiny", "prompt": "sort 312=", "max_tokens": 8}
    if path.endswith("chat/completions"):
        good = {"model": "tiny", "messages": [{"role": "user", "content": "sort 312="}], "max_tokens": 8}
    if isinstance(case, bytes):
        raw = case
    elif isinstance(case, str):
        raw, headers = json.dumps(good).encode(), {**headers, "X-Request-Timeout": case}
    else:
        field, data = case
        if field == "prompt" and "messages" in good:
            good["messages"][0]["content"] = data.draw(BAD_VALUES[field])
        else:
            good[field] = data.draw(BAD_VALUES[field])
        raw = json.dumps(good).encode()
    r = httpx.post(served.http_base + path, content=raw, headers=headers, timeout=30)
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)


def test_the_server_still_serves_after_the_fuzz(served, oa):
    assert oa.completions.create(model="tiny", prompt="sort 312=", max_tokens=8).choices[0].text


def test_a_client_leaving_mid_stream_or_mid_call_aborts_its_request(served):
    cluster = served.cluster
    cancelled, ok = _counter(served, "cancelled"), _counter(served, "ok")
    body = {"model": "tiny", "prompt": "repeat 4 qk=", "max_tokens": 48, "tau_min": 1.0, "tau_max": 1.0}
    served.slow.on.set()
    try:
        with httpx.Client(base_url=served.http_base, headers=_auth()) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # one step done: the request holds a slot
                request_id = r.headers["x-request-id"]
                assert cluster.instance_of(request_id) == "tp1@0"
                with served.client(auth_token=TOKEN) as c:  # one request-id space for gRPC and HTTP
                    code, _ = status_of(lambda: c.generate("x", request_id=request_id, max_new_tokens=4))
                assert code == grpc.StatusCode.ALREADY_EXISTS
            assert _wait_idle(cluster, timeout=1.5)  # its 48 slow steps would take 5 s
            assert _counter(served, "cancelled") == cancelled + 1
            with pytest.raises(httpx.ReadTimeout):  # a whole-answer call left before its answer
                client.post("/v1/completions", json=body, timeout=0.5)
            assert _wait_idle(cluster, timeout=1.5)
            assert _counter(served, "cancelled") == cancelled + 2 and _counter(served, "ok") == ok
            r = client.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.3"})
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
            assert _wait_idle(cluster, timeout=1.5)
    finally:
        served.slow.on.clear()


def test_a_deadline_that_cannot_be_met_under_strict_admission_is_429(served):
    body = {"model": "tiny", "prompt": "sort 312=", "max_tokens": 16, "slo_ms": 0.01, "strict_admission": True}
    r = httpx.post(served.http_base + "/v1/completions", json=body, headers=_auth())
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and "rejected" in r.json()["error"]["message"]
    with httpx.stream("POST", served.http_base + "/v1/completions", json={**body, "stream": True},
                      headers=_auth()) as s:  # a stream refused before its first step keeps the status
        assert s.status_code == 429


def test_200_concurrent_streams_none_lost(served, grpc_answers):
    ok = _counter(served, "ok")

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True, **TAU}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = "".join([x async for x in r.aiter_text()])
        frames = text.split("\n\n")
        assert frames[-2] == "data: [DONE]"
        chunks = [json.loads(f[6:]) for f in frames[:-2]]
        return prompt, "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=served.http_base, headers=_auth(), limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run())
    assert len(results) == 200
    assert all(text == grpc_answers[p].text and reason == "stop" for p, text, reason in results)
    assert _counter(served, "ok") == ok + 200 and _wait_idle(served.cluster)


def test_models_health_and_metrics(served):
    models = httpx.get(served.http_base + "/v1/models", headers=_auth()).json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 64
    assert httpx.get(served.http_base + "/v1/models/tiny", headers=_auth()).json()["id"] == "tiny"
    assert httpx.get(served.http_base + "/v1/models/other", headers=_auth()).status_code == 404
    assert httpx.get(served.http_base + "/health").json() == {"status": "serving", "model": "tiny"}
    metrics = httpx.get(served.http_base + "/metrics").text
    scraped = httpx.get(f"http://127.0.0.1:{served.running.metrics_port}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('dilaserve_requests_total{outcome="ok"}'))
    assert line in scraped  # the same registry as the metrics port
