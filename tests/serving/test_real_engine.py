"""One instance (Engine over a JaxRunner) serves 50 mixed requests end to end; every answer equals
what the decoding path alone produces when replayed one request at a time with the exact step kinds
and τ sequence the scheduler chose for it.

Uses the embedded tiny model when it is present, else the `test` preset with a sharpened LM head
(confident proposals, so τ < 1 commits several tokens and the τ sequence matters).
"""
import time

import numpy as np
import pytest
from flax import nnx

from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.models import CharTokenizer, init_model, load_model, test
from dilaserve_jax.models.registry import ASSETS
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.executor.profiling import measure_profile
from dilaserve_jax.serving.policy.request import RequestState, make_request
from dilaserve_jax.serving.executor.runner import JaxRunner
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.tasks.suite import unique_problems

SLOTS, LENGTH, BLOCK_BUCKET = 4, 64, 16
N_REQUESTS = 50
TASKS = ("sort", "repeat")  # prompts <= 12 characters: one 64-token length bucket


def _model():
    if (ASSETS / "tiny" / "config.json").exists():
        m = load_model("tiny")
        return m.config, m.graphdef, m.params, m.tokenizer
    cfg = test()
    model = init_model(cfg, seed=0)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 12.0
    graphdef, params = nnx.split(model)
    return cfg, graphdef, params, CharTokenizer()


def _prompts(tokenizer):
    per_task = -(-N_REQUESTS // len(TASKS))
    problems = [p for t in TASKS for p in unique_problems(t, "heldout", per_task, seed=3)]
    order = np.random.default_rng(0).permutation(len(problems))[:N_REQUESTS]
    return [tokenizer.encode(problems[i].prompt) for i in order]


def _replay(dec: SlotDecoder, req) -> tuple[list[int], list[int]]:
    """Decode `req` alone in slot 0 with its recorded kinds and τ; (answer, tokens committed per step)."""
    dec.admit(0, req.prompt_tokens, req.answer_length, req.block_length, temperature=req.temperature, seed=req.seed)
    committed = []
    for i, rec in enumerate(req.steps):
        assert (rec.kind == StepKind.REFRESH) == dec.needs_refresh(0), f"{req.id}: step {i} kind differs"
        out = dec.step(rec.kind, [0], [rec.tau])[0]
        committed.append(out.n_committed)
        assert out.request_finished == (i == len(req.steps) - 1), f"{req.id}: finished at a different step"
    answer = dec.answer(0)
    dec.release(0)
    return answer, committed


@pytest.mark.slow
def test_engine_answers_equal_the_decoding_path_at_the_same_tau_sequence():
    cfg, graphdef, params, tokenizer = _model()
    runner = JaxRunner(cfg, graphdef, params, num_slots=SLOTS, length_buckets=(LENGTH,),
                       block_buckets=(BLOCK_BUCKET,), progress=False)
    profile = measure_profile(runner, batches=(1, 2, 3, 4), lengths=(LENGTH,), blocks=(8, 16), repeats=2,
                              progress=False)
    latency = LatencyModel.from_profile(profile)
    sched = Scheduler(SchedulerConfig(SLOTS, policy="dilaserve"), latency)
    rng = np.random.default_rng(1)
    shapes = [(8, 8), (16, 8), (16, 16), (32, 8), (32, 16)]  # (answer length, block length)
    specs, arrival = [], 0.0
    for i, prompt in enumerate(_prompts(tokenizer)):
        answer, block = shapes[int(rng.integers(len(shapes)))]
        kw = dict(tau_min=float(rng.choice([0.3, 0.5, 0.7])), tau_max=float(rng.choice([0.9, 1.0])),
                  temperature=0.8 if i % 5 == 4 else 0.0, seed=i)  # some sampled: seeds must replay too
        idle = sched.request_time(make_request("probe", prompt, answer, block, 0.0, 1.0, **kw), 1, 0.9)
        arrival += float(rng.exponential(0.4 * idle))  # about twice what one instance keeps up with at τ = 0.9
        specs.append((arrival, prompt, answer, block, float(rng.uniform(0.8, 5.0)) * idle, kw))

    # The loop runs on this thread (step_once is the engine thread's loop body), so arrivals are
    # applied at once and a tight SLO is never rejected just because the engine thread was busy.
    engine = Engine(runner, sched)
    handles, requests, t0 = [], [], engine.clock()
    while len(requests) < len(specs) or not all(h.done() for h in handles):
        while len(requests) < len(specs) and engine.clock() - t0 >= specs[len(requests)][0]:
            _, prompt, answer, block, slo, kw = specs[len(requests)]
            req = make_request(f"r{len(requests)}", prompt, answer, block, engine.clock(), slo, **kw)
            requests.append(req)
            handles.append(engine.submit(req))
        if not engine.step_once() and len(requests) < len(specs):
            time.sleep(0.001)
    results = [h.result(timeout=0) for h in handles]
    assert engine.error is None
    bad = [(r.request_id, r.state.name, r.reject_reason) for r in results if r.state != RequestState.FINISHED_OK]
    assert not bad, bad

    taus = [rec.tau for req in requests for rec in req.steps]
    varied = [req for req in requests if len({rec.tau for rec in req.steps}) > 1]
    assert len(set(taus)) >= 3, f"τ hardly varied: {sorted(set(taus))}"
    assert len(varied) >= 3, "too few requests changed τ between their own steps"

    replay = SlotDecoder(cfg, graphdef, params, DecoderConfig(SLOTS, (LENGTH,), (BLOCK_BUCKET,)),
                         compiled=runner.compiled, warm_up=False, progress=False)  # same shapes: no compile
    mismatches = []
    for req, res in zip(requests, results):
        answer, committed = _replay(replay, req)
        if list(res.tokens) != answer or committed != [rec.n_committed for rec in req.steps]:
            mismatches.append(req.id)
    assert not mismatches, f"{len(mismatches)} of {len(requests)} answers differ from the replay: {mismatches}"
