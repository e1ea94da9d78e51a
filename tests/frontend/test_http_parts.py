"""The HTTP API's parts without a real model: chat templates as HF renders them, the committed-text
release, and over fake-runner instances its availability answers (503, 429), drain and no template."""
import json
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilaserve_jax.core.cli import config_from_args
from dilaserve_jax.frontend.http.app import default_model_id
from dilaserve_jax.frontend.http.chat_template import load_template, model_directory
from dilaserve_jax.frontend.http.errors import ApiError
from dilaserve_jax.frontend.http.options import HttpOptions
from dilaserve_jax.frontend.http.streaming import CommittedText, cut_at_stop
from dilaserve_jax.models import CharTokenizer
from dilaserve_jax.models.registry import ASSETS
from dilaserve_jax.serve import build_parser
from tests.frontend.conftest import ServerThread, fake_cluster

# LLaDA-8B-Instruct's template (its tokenizer_config.json), with the bos token it names
LLADA = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
         "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
         "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
         "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}")
MESSAGES = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi, é?"}]


def _checkpoint(tmp_path, config=None, jinja=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return f"hf:{tmp_path}"


def test_the_checkpoint_template_renders_as_hf_does(tmp_path):
    source = _checkpoint(tmp_path, {"bos_token": {"content": "<|startoftext|>"}, "chat_template": LLADA})
    assert load_template(source).render(MESSAGES) == (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi, é?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # HF's environment: trim_blocks/lstrip_blocks, tojson keeping non-ASCII, loop controls, {% generation %}
    hf = ("{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
          "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}")
    assert load_template(_checkpoint(tmp_path / "b", {"chat_template": hf})).render(MESSAGES) == \
        '{"role": "user", "content": "Hi, é?"}'


def test_template_sources_and_refusals(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ add_generation_prompt }}"}]
    assert load_template(_checkpoint(tmp_path / "named", {"chat_template": named})).render(MESSAGES) == "DTrue"
    both = _checkpoint(tmp_path / "both", {"chat_template": "config"}, jinja="file")
    assert load_template(both).render(MESSAGES) == "file"  # chat_template.jinja wins, as in transformers
    for source, words in [(_checkpoint(tmp_path / "none", {"bos_token": "<s>"}), "no chat template"),
                          ("preset:test (random, seed 0)", "no chat template"),
                          (_checkpoint(tmp_path / "broken", {"chat_template": "{% for %}"}), "does not compile"),
                          (_checkpoint(tmp_path / "raises", {"chat_template": "{{ raise_exception('no tools') }}"}),
                           "no tools")]:
        with pytest.raises(ApiError) as info:
            load_template(source).render(MESSAGES)
        assert info.value.status == 400 and words in str(info.value) and info.value.param == "messages"
    with pytest.raises(ApiError):  # the sandbox refuses what a template must not reach
        load_template(_checkpoint(tmp_path / "escape", {"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})).render(MESSAGES)


def test_the_tiny_models_template_sends_the_last_user_message():
    template = load_template(f"hf:{ASSETS / 'tiny'}")
    assert template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "sort 1="},
                            {"role": "assistant", "content": "1"}, {"role": "user", "content": "sort 93142="}]) == \
        "sort 93142="
    with pytest.raises(ApiError):
        template.render([{"role": "assistant", "content": "hi"}])


def test_model_ids_and_directories():
    assert default_model_id("hf:/x/assets/tiny") == "tiny" and default_model_id("orbax:/runs/r1@5") == "r1"
    assert default_model_id("preset:test (random, seed 0)") == "test" and default_model_id("fake") == "fake"
    assert str(model_directory("orbax:/runs/r1@5")) == "/runs/r1" and model_directory("memory:initial") is None


def test_serve_has_the_http_flags():
    parser = build_parser()
    assert "--http-port" in parser.format_help() and "--served-model-name" in parser.format_help()
    options = [config_from_args(HttpOptions, parser.parse_args(a), parser) for a in ([], ["--http-port", "-1"])]
    assert options[0].http_port == 8000 and options[1].http_port is None
    with pytest.raises(ValueError):
        HttpOptions(http_port=70000)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="ab c", min_size=1, max_size=12), stop=st.text(alphabet="ab c", max_size=3),
       order=st.randoms(use_true_random=False), eos=st.booleans())
def test_committed_text_is_released_left_to_right_never_past_a_stop(text, stop, order, eos):
    tok = CharTokenizer()
    area = list(tok.encode(text)) + ([tok.eos_id] if eos else [])
    positions = list(range(len(area)))
    order.shuffle(positions)
    answer = [tok.mask_id] * len(area)
    release, sent = CommittedText(tok, len(area), (stop,) if stop else ()), ""
    final, _ = cut_at_stop(text, (stop,) if stop else ())
    for pos in positions:
        answer[pos] = area[pos]
        sent += release.advance(answer)
        committed = "".join(chr(t) for t in answer[:next((i for i, t in enumerate(answer) if t == tok.mask_id),
                                                             len(answer))] if t != tok.eos_id)
        assert committed.startswith(sent) and final.startswith(sent)  # only committed text, never a stop
    sent += release.finish(final)
    assert sent == final


def _slow_server(name=None, **kw):
    return ServerThread(fake_cluster(**kw), http=HttpOptions(http_port=0, served_model_name=name))


def test_warming_draining_and_a_checkpoint_without_a_template_over_http():
    server = _slow_server(name="my-model")
    body = {"model": "my-model", "prompt": "hi", "max_tokens": 16}
    try:
        r = httpx.post(server.http_base + "/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "warming up" in r.json()["error"]["message"]
        assert httpx.get(server.http_base + "/health").status_code == 503
        server.ready()
        assert httpx.get(server.http_base + "/health").json() == {"status": "serving", "model": "my-model"}
        assert [m["id"] for m in httpx.get(server.http_base + "/v1/models").json()["data"]] == ["my-model"]
        assert httpx.post(server.http_base + "/v1/completions", json={**body, "model": "fake"}).status_code == 404
        assert httpx.post(server.http_base + "/v1/completions", json=body).status_code == 200
        r = httpx.post(server.http_base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        server.running.service.draining = True
        r = httpx.post(server.http_base + "/v1/completions", json=body)
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert httpx.get(server.http_base + "/health").json()["reason"].startswith("server is draining")
    finally:
        server.stop()


def test_a_full_queue_is_429_with_retry_after():
    server = _slow_server(instances=1, slots=1, max_queue=1, step_scale=20.0, policy="fcfs-static").ready()
    answers, lock = [], threading.Lock()

    def one(i):
        r = httpx.post(server.http_base + "/v1/completions", timeout=60,
                       json={"prompt": f"req {i}", "max_tokens": 16, "slo_ms": 60000})
        with lock:
            answers.append(r)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        full = [r for r in answers if r.status_code == 429]
        assert full and any(r.status_code == 200 for r in answers)
        assert all(r.headers["retry-after"] == "1" and "queue full" in r.json()["error"]["message"] for r in full)
    finally:
        server.stop()


def test_drain_waits_for_http_calls_in_flight():
    server = _slow_server(instances=1, slots=2, step_scale=5.0).ready()
    answers = []
    t = threading.Thread(target=lambda: answers.append(httpx.post(
        server.http_base + "/v1/completions", json={"prompt": "in flight", "max_tokens": 32}, timeout=30)))
    t.start()
    while server.running.service.in_flight == 0 and t.is_alive():
        time.sleep(0.005)
    assert server.call(server.running.drain_and_stop(20.0)) is True
    t.join(10)
    server.cluster.stop()
    server.loop.call_soon_threadsafe(server.loop.stop)
    assert answers[0].status_code == 200 and len(answers[0].json()["choices"][0]["text"]) == 32
