"""The front door over the real tiny model: in-process cluster, and `serve` as a subprocess."""
import json
import os
import queue
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
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
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
def weights_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, weights_root):
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    fake_profile().save(profile)  # scheduling only: answers do not depend on step-time predictions
    cfg = ServeConfig(model="tiny", mesh="2x1", slots=4, length_buckets=(64,), block_buckets=(16,),
                      default_block_length=16, default_max_new_tokens=16, profile=str(profile),
                      allow_unused_devices=True, default_slo_ms=600_000, controller="manual")
    server = ServerThread(build_cluster(cfg, say=lambda _m: None), weights_roots=(str(weights_root),)).ready()
    yield server
    server.stop()


def call_concurrently(server, prompts, tau=TAU):
    """One gRPC call per prompt, all at once (τ fixed at `tau`); returns (replies by index, errors)."""
    replies, errors = {}, []

    def call(i, text, gen):
        try:
            with server.client() as c:
                replies[i] = c.generate(text, max_new_tokens=gen, block_length=16, tau_min=tau, tau_max=tau)
        except grpc.RpcError as err:  # recorded, then asserted on the main thread
            errors.append((i, err.code(), err.details()))

    threads = [threading.Thread(target=call, args=(i, t, g)) for i, (t, g) in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return replies, errors


def test_64_concurrent_requests_match_the_decoding_path(tiny_server):
    prompts = _prompts(64)
    replies, errors = call_concurrently(tiny_server, prompts)
    assert not errors and len(replies) == 64
    assert {r.instance for r in replies.values()} == {"tp1@0", "tp1@1"}  # both instances served

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
    from dilaserve_jax.frontend.service import END_MARK

    assert events[-1].final.text == unary.text
    assert events[-2].update.canvas == unary.text + END_MARK * (gen - len(unary.text))  # the EOS shows as the end
    assert all(len(e.update.canvas) == gen for e in events[:-1])  # one character per answer position
    assert len(events) - 1 == unary.steps


@pytest.fixture(scope="module")
def shipped_copy(weights_root):
    """The shipped weights as an orbax training directory (step 5) under the weights root."""
    from dilaserve_jax.models.checkpoint import save_params
    from dilaserve_jax.models.registry import save_model_config

    model = load_model("tiny")
    directory = weights_root / "same"
    save_model_config(directory, model.config)
    save_params(directory, 5, model.params)
    return directory


def test_reload_weights_swaps_between_steps(tiny_server, shipped_copy):
    directory = shipped_copy
    with tiny_server.client() as c:
        reply = c.reload_weights(str(directory))
        assert reply.model.endswith("@5") and reply.seconds > 0
        assert c.cluster_state().model == reply.model
        assert c.generate("sort 312=", max_new_tokens=12, block_length=12).text
        with pytest.raises(grpc.RpcError) as info:
            c.reload_weights(str(directory / "missing"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _serve_until_ready(args, deadline_s=480):
    """`serve ARGS` as a subprocess, its log read until `ready:`: (process, the log so far, port,
    the queue that gets the rest of the log)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the command must present its own CPU devices
    proc = subprocess.Popen([sys.executable, "-m", "dilaserve_jax.serve", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines, port = [], None
    # read the log on a thread, so the deadline holds even when the server prints nothing more
    pending: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [pending.put(x) for x in iter(proc.stderr.readline, "")] + [pending.put("")],
                     daemon=True).start()
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        try:
            line = pending.get(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            break
        if not line:
            break
        lines.append(line)
        if m := re.search(r"listening on grpc://127\.0\.0\.1:(\d+)", line):
            port = int(m.group(1))
        # progress bars leave carriage returns and, when two instances compile at once, cursor
        # moves (ANSI escapes) in front of the next line: look for the message, not a line start
        if "ready: serving" in line:
            break
    return proc, "".join(lines), port, pending


def _stop(proc, pending) -> str:
    """SIGTERM, exit 0, and the rest of the log."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    rest = []
    while (x := pending.get(timeout=10)) != "":
        rest.append(x)
    return "".join(rest)


def test_serve_command_starts_answers_and_stops_on_sigterm(tmp_path):
    """Cold: the controller's TP degrees (4 of the layout, 1 on a temporary instance) are measured
    before `ready:`; warm (same caches): read back, nothing measured."""
    args = ["--mesh", "2x4", "--layouts", "2x4,8x1", "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
            "--slots", "2",
            "--compile-cache", str(tmp_path / "xla")]
    proc, log, port, pending = _serve_until_ready(args)
    try:
        assert port and "ready:" in log, log[-3000:]
        assert "presenting 8 CPU devices" in log and "2x4 = TP4[0-3] + TP4[4-7]" in log
        assert "Unable to initialize backend" not in log and "auth: off" in log and "allowed on loopback" in log
        assert "tp4@4-7: compiling decode steps" in log  # the progress bar names its instance
        for tp in (1, 4):
            assert f"latency model of TP {tp}: measured" in log and str(tmp_path / "latency-profiles") in log
        assert "controller: auto" in log and "measuring" not in log
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
        rest = _stop(proc, pending)
        assert "draining" in rest and "latency model" not in rest  # nothing measured after ready
        proc, log, port, pending = _serve_until_ready(args)
        assert port and "ready:" in log, log[-3000:]
        assert "latency model of TP 1: read from" in log and "latency model of TP 4: read from" in log
        assert "measured" not in log
        _stop(proc, pending)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _perturbed_tiny(directory, step, seed):
    """The tiny model with noise on its embeddings, saved as an orbax training directory."""
    import jax
    import numpy as np

    from dilaserve_jax.models.checkpoint import save_params
    from dilaserve_jax.models.registry import save_model_config

    model = load_model("tiny")
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: x, model.params)
    emb = params["wte"]
    emb[...] = emb[...] + (1.5 * rng.standard_normal(emb.shape)).astype(emb.dtype)
    save_model_config(directory, model.config)
    save_params(directory, step, params)
    return model.config, model.graphdef, params


def _offline(params_of, prompts, cache="dual", tau=TAU):
    cfg, graphdef, params = params_of
    model = load_model("tiny")
    decoder = SlotDecoder(cfg, graphdef, params, DecoderConfig(4, (64,), (16,), cache), progress=False)
    requests = [DecodeRequest(tuple(model.tokenizer.encode(t)), g, 16, tau) for t, g in prompts]
    return [r.answer for r in generate_many(decoder, requests)[0]]


def test_reload_racing_in_flight_calls(tiny_server, weights_root, shipped_copy):
    """ReloadWeights while 32+ calls are in flight, three times: nothing fails, and a call that ran
    wholly before (after) a swap has the offline decoder's tokens with the old (new) weights."""
    model = load_model("tiny")
    old = (model.config, model.graphdef, model.params)
    new = _perturbed_tiny(weights_root / "perturbed", 1, seed=0)
    prompts = _prompts(40)
    offline = {"old": _offline(old, prompts), "new": _offline(new, prompts)}
    assert sum(a != b for a, b in zip(offline["old"], offline["new"])) >= 5, "the perturbation must show"
    errors, checked = [], {"old": 0, "new": 0}
    current = "old"
    for target, label in ((weights_root / "perturbed", "new"), (shipped_copy, "old"),
                          (weights_root / "perturbed", "new")):
        results = {}

        def call(i, text, gen):
            t0 = time.monotonic()
            try:
                with tiny_server.client() as c:
                    r = c.generate(text, max_new_tokens=gen, block_length=16, tau_min=TAU, tau_max=TAU)
                results[i] = (t0, time.monotonic(), r)
            except grpc.RpcError as err:
                errors.append((i, err.code(), err.details()))

        threads = [threading.Thread(target=call, args=(i, t, g)) for i, (t, g) in enumerate(prompts[:32])]
        for t in threads:
            t.start()
        time.sleep(0.05)
        swap_start = time.monotonic()
        with tiny_server.client() as c:
            c.reload_weights(str(target))
        swap_end = time.monotonic()
        late = [threading.Thread(target=call, args=(i, t, g)) for i, (t, g) in enumerate(prompts) if i >= 32]
        for t in late:
            t.start()
        for t in threads + late:
            t.join(600)
        assert not errors, errors[:3]
        for i, (t0, t1, r) in results.items():
            weights = current if t1 < swap_start else label if t0 > swap_end else None
            if weights is not None:  # wholly before or after the swap
                assert list(r.token_ids) == offline[weights][i][:prompts[i][1]], (i, weights)
                checked[weights] += 1
        current = label
    assert checked["old"] >= 8 and checked["new"] >= 8, checked


def test_failed_instances_hand_their_calls_to_the_survivor(tmp_path):
    """Over gRPC with the real model (cache none), three of four instances fail mid-run, one way
    each: a runner that raises, an engine loop killed by a scheduler fault, a step that hangs past
    the watchdog. Every call still succeeds with the offline decoder's tokens; the state shows it.
    τ 1.0 commits one token per step, so any instance that is routed a call runs past its faulty
    4th step (at τ 0.9 the tiny model can finish a whole batch in fewer steps)."""
    profile = tmp_path / "profile.json"
    fake_profile().save(profile)
    cfg = ServeConfig(model="tiny", mesh="4x1", slots=4, length_buckets=(64,), block_buckets=(16,),
                      default_block_length=16, profile=str(profile), allow_unused_devices=True, cache_mode="none",
                      default_slo_ms=600_000, policy="fcfs-static", controller="manual", step_timeout_s=3.0,
                      rebuild_failed=False)  # about the survivor: rebuilding is tested in test_recovery.py
    cluster = build_cluster(cfg, say=lambda _m: None)
    raising, dying, hanging = (cluster.engine(f"tp1@{i}") for i in range(3))
    _fault_on_call(raising.runner, "step", 4, lambda: (_ for _ in ()).throw(RuntimeError("injected device fault")))
    _fault_on_call(dying.scheduler, "update", 4, lambda: (_ for _ in ()).throw(KeyError("injected scheduler bug")))
    _fault_on_call(hanging.runner, "step", 4, lambda: time.sleep(8.0))
    server = ServerThread(cluster).ready()
    try:
        prompts = _prompts(24)
        replies, errors = call_concurrently(server, prompts, tau=1.0)
        assert not errors and len(replies) == 24
        model = load_model("tiny")
        expected = _offline((model.config, model.graphdef, model.params), prompts, cache="none", tau=1.0)
        for i, r in replies.items():
            assert list(r.token_ids) == expected[i][:prompts[i][1]], (prompts[i], r.moves, r.instance)
        assert any(r.moves for r in replies.values()), "some call was on a failed instance"
        with server.client() as c:
            state = c.cluster_state()
        by_name = {i.name: i for i in state.instances}
        assert "injected device fault" in by_name["tp1@0"].error and "injected scheduler bug" in by_name["tp1@1"].error
        assert "watchdog" in by_name["tp1@2"].error and by_name["tp1@3"].state == "running"
        assert [i.state for i in state.instances] == ["failed", "failed", "failed", "running"]
        assert state.serving and state.migrations["failure"] >= 1
    finally:
        time.sleep(6.0)  # the hung step returns; its dead loop must leave everything alone
        server.stop()


def _fault_on_call(obj, method, n, fault):
    """Make obj.method run `fault()` instead of itself on its n-th call (an instance attribute)."""
    real, calls = getattr(obj, method), {"n": 0}

    def wrapper(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            fault()
        return real(*a, **kw)
    setattr(obj, method, wrapper)


def _write(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def test_reload_fuzz_cases_are_invalid_argument_with_bounded_messages(tiny_server, weights_root):
    import os as _os

    rnd = _os.urandom
    good_config = (Path(load_model("tiny").source.split(":", 1)[1]) / "config.json").read_bytes()
    cases = {
        "name over 255 bytes": weights_root / ("x" * 300),
        "100 KB name": weights_root / ("y" * 100_000),
        "random safetensors": _write(weights_root / "rand-st", {"config.json": good_config,
                                                               "model.safetensors": rnd(4096)}),
        "bad safetensors header": _write(weights_root / "bad-header", {
            "config.json": good_config,
            "model.safetensors": (64).to_bytes(8, "little") + b'{"a": {"dtype": "F32", "shape": [9], '
                                 b'"data_offsets": [0, 9999]}}' + b" " * 10}),
        "not a config": _write(weights_root / "not-config", {"model_config.json": b'{"not": "a config"}'}),
        "random config.json": _write(weights_root / "rand-config", {"config.json": rnd(512)}),
    }
    with tiny_server.client() as c:
        for name, directory in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                c.reload_weights(str(directory))
            err = info.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.code(), err.details()[:300])
            assert len(err.details()) <= 1024, name
            if name == "random config.json":
                assert "config.json" in err.details(), err.details()
        with pytest.raises(grpc.RpcError) as info:  # outside every weights root
            c.reload_weights("/etc")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert c.generate("sort 312=", max_new_tokens=12, block_length=12).text  # still serving
