"""The front door over the real tiny model: in-process cluster, and `serve` as a subprocess."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.models import load_model
from dilaserve_jax.serving.build import ServeConfig, build_cluster
from dilaserve_jax.serving.fake_runner import fake_profile
from dilaserve_jax.tasks.suite import TASKS, unique_problems
from tests.frontend.conftest import ServerThread

pytestmark = pytest.mark.slow
TAU = 0.9


def _prompts(n):
    names = ["sort", "repeat"]
    per = -(-n // len(names))
    probs = [p for name in names for p in unique_problems(name, "heldout", per, seed=3)]
    return [(p.prompt, TASKS[p.task].gen_length) for p in probs[:n]]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    fake_profile().save(profile)  # scheduling only: answers do not depend on step-time predictions
    cfg = ServeConfig(model="tiny", mesh="2x1", slots=4, length_buckets=(64,), block_buckets=(16,),
                      default_block_length=16, default_max_new_tokens=16, profile=str(profile),
                      allow_unused_devices=True, default_slo_ms=600_000)
    server = ServerThread(build_cluster(cfg, say=lambda _m: None)).ready()
    yield server
    server.stop()


def test_64_concurrent_requests_match_the_decoding_path(tiny_server):
    prompts = _prompts(64)
    replies, errors = {}, []

    def call(i, text, gen):
        try:
            with tiny_server.client() as c:
                replies[i] = c.generate(text, max_new_tokens=gen, block_length=16, tau_min=TAU, tau_max=TAU)
        except grpc.RpcError as err:  # recorded, then asserted on the main thread
            errors.append((i, err.code(), err.details()))

    threads = [threading.Thread(target=call, args=(i, t, g)) for i, (t, g) in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors and len(replies) == 64
    assert {r.instance for r in replies.values()} == {"instance-0", "instance-1"}  # both instances served

    model = load_model("tiny")
    decoder = SlotDecoder(model.config, model.graphdef, model.params,
                          DecoderConfig(4, (64,), (16,)), progress=False)
    requests = [DecodeRequest(tuple(model.tokenizer.encode(t)), g, 16, TAU) for t, g in prompts]
    expected, _ = generate_many(decoder, requests)
    for i, result in enumerate(expected):
        assert list(replies[i].token_ids) == result.answer[:prompts[i][1]], prompts[i][0]


def test_stream_over_the_real_model_ends_with_the_unary_answer(tiny_server):
    text, gen = _prompts(1)[0]
    with tiny_server.client() as c:
        unary = c.generate(text, max_new_tokens=gen, block_length=16, tau_min=TAU, tau_max=TAU)
        events = list(c.generate_stream(text, max_new_tokens=gen, block_length=16, tau_min=TAU, tau_max=TAU))
    assert events[-1].final.text == unary.text and events[-2].update.canvas == unary.text
    assert len(events) - 1 == unary.steps


def test_reload_weights_swaps_between_steps(tiny_server, tmp_path):
    from dilaserve_jax.models.checkpoint import save_params
    from dilaserve_jax.models.registry import save_model_config

    model = load_model("tiny")
    save_model_config(tmp_path, model.config)
    save_params(tmp_path, 5, model.params)
    with tiny_server.client() as c:
        reply = c.reload_weights(str(tmp_path))
        assert reply.model.endswith("@5") and reply.seconds > 0
        assert c.cluster_state().model == reply.model
        assert c.generate("sort 312=", max_new_tokens=12, block_length=12).text
        with pytest.raises(grpc.RpcError) as info:
            c.reload_weights(str(tmp_path / "missing"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_serve_command_starts_answers_and_stops_on_sigterm(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the command must present its own CPU devices
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilaserve_jax.serve", "--mesh", "2x4", "--port", "0", "--metrics-port", "-1",
         "--slots", "2", "--compile-cache", str(tmp_path / "xla")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines, port = [], None
    try:
        deadline = time.time() + 480
        while time.time() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"listening on grpc://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
            if line.startswith("ready:"):
                break
        log = "".join(lines)
        assert port and "ready:" in log, log[-3000:]
        assert "presenting 8 CPU devices" in log and "2x4 = TP4[0-3] + TP4[4-7]" in log
        out = subprocess.run([sys.executable, "-m", "dilaserve_jax.client", "--target", f"127.0.0.1:{port}",
                              "--max-new-tokens", "12", "--block-length", "12", "--tau-min", "1", "--tau-max", "1",
                              "--json", "sort 93142="], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        model = load_model("tiny")
        decoder = SlotDecoder(model.config, model.graphdef, model.params, DecoderConfig(1, (128,), (32,)),
                              progress=False)
        [expected], _ = generate_many(decoder, [DecodeRequest(tuple(model.tokenizer.encode("sort 93142=")),
                                                              12, 12, 1.0)])
        assert reply["text"] == model.tokenizer.decode(expected.answer)
        assert reply["steps"] == expected.steps and reply["mean_tau"] == 1.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
