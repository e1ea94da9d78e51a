"""JaxRunner: the Runner protocol on real steps, compiled once at start-up, never again."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dilaserve_jax.decoding.state import state_shardings
from dilaserve_jax.serving.executor.runner import JaxRunner
from dilaserve_jax.serving.policy.types import Runner
from dilaserve_jax.core.kinds import StepKind
from fastdecode_support import prompts


class CompileEvents:
    """Counts XLA backend compilations anywhere in the process while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def serve(runner, requests, rng):
    """A minimal engine loop: admit into free slots, refresh those that need it, reuse the rest."""
    queue, live, answers = list(requests), {}, {}
    while queue or live:
        for slot in range(runner.num_slots):
            if queue and slot not in live:
                i, (prompt, gen, block, temp) = queue.pop()
                runner.admit(slot, prompt, gen, block, temperature=temp, seed=i)
                live[slot] = i
        need = [s for s in sorted(live) if runner.decoder.needs_refresh(s)]
        rest = [s for s in sorted(live) if s not in need]
        for kind, group in ((StepKind.REFRESH, need), (StepKind.REUSE, rest)):
            if not group:
                continue
            taus = rng.choice([1.0, 0.95, 0.8, 0.6, 0.3], size=len(group)).tolist()  # τ changes every step
            for out in runner.step(kind, group, taus):
                assert out.n_committed == len(out.positions) >= 1
                if out.request_finished:
                    assert list(out.answer) == runner.decoder.answer(out.slot)
                    answers[live.pop(out.slot)] = list(out.answer)
                    assert len(runner.decoder.canvas(out.slot)) > 0
                    runner.release(out.slot)
    return answers


@pytest.mark.slow
def test_serving_varied_requests_adds_no_compilation_after_warm_up(sharp_model):
    cfg, graphdef, params = sharp_model
    runner = JaxRunner(cfg, graphdef, params, num_slots=2, length_buckets=(32, 64), block_buckets=(8,),
                       cache_mode="dual", progress=False)
    assert isinstance(runner, Runner)
    warm = runner.compiled.compile_count
    assert warm == 1 + 2 * 2 * 2  # admission + (refresh, reuse) x batch {1, 2} x length {32, 64}
    assert runner.warm_up_seconds > 0
    rng = np.random.default_rng(0)
    ps = prompts(10, seed=9, lo=3, hi=24)
    requests = list(enumerate((p, int(rng.integers(4, 41)) if len(p) + 40 <= 64 else 20, int(rng.choice([4, 8])),
                               float(rng.choice([0.0, 0.0, 0.8]))) for p in ps))
    new_weights = jax.tree.map(lambda x: x * 1.0, params)  # (eager ops compile: make them before counting)
    with CompileEvents() as events:
        answers = serve(runner, requests, rng)
        runner.reload(new_weights)  # new weights, same placement
        answers2 = serve(runner, requests[:3], rng)
    assert sorted(answers) == list(range(10)) and len(answers2) == 3
    assert runner.compiled.compile_count == warm
    assert events.count == 0, f"{events.count} XLA compilations after warm-up"


@pytest.mark.slow
def test_kv_cache_sharded_over_kv_heads_gives_the_same_tokens(sharp_model):
    """The same steps run on a 2-device mesh (params replicated, K/V split over kv heads)."""
    cfg, graphdef, params = sharp_model
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    on_mesh = jax.device_put(params, NamedSharding(mesh, P()))
    plain = JaxRunner(cfg, graphdef, params, num_slots=1, length_buckets=(32,), block_buckets=(8,),
                      warm_up=False, progress=False)
    template = plain.decoder.state
    sharding = state_shardings(template, NamedSharding(mesh, P(None, None, "model", None)), NamedSharding(mesh, P()))
    sharded = JaxRunner(cfg, graphdef, on_mesh, num_slots=1, length_buckets=(32,), block_buckets=(8,),
                        state_sharding=sharding, compiled=plain.compiled, warm_up=False, progress=False)
    assert sharded.tp_degree == 2
    kv_heads_split = NamedSharding(mesh, P(None, None, "model", None))
    assert sharded.decoder.state.kv[0].k.sharding.is_equivalent_to(kv_heads_split, 4)
    prompt = prompts(1, seed=4)[0][:12]
    results = []
    for runner in (plain, sharded):
        runner.admit(0, prompt, 16, 8)
        while True:
            kind = StepKind.REFRESH if runner.decoder.needs_refresh(0) else StepKind.REUSE
            if runner.step(kind, [0], [0.7])[0].request_finished:
                break
        results.append(runner.decoder.canvas(0))
    assert results[0] == results[1]
    assert sharded.decoder.state.kv[0].k.sharding.is_equivalent_to(kv_heads_split, 4)  # stays split after steps
    keys = {key[1] for key in plain.compiled.executables}
    assert len(keys) == 2  # one placement per device set, executables cached separately
    built = plain.compiled.compile_count
    sharded.release(0)
    sharded.reload(on_mesh)  # same weights and layout after steps changed the state: nothing to build
    sharded.admit(0, prompt, 16, 8)
    sharded.step(StepKind.REFRESH, [0], [0.7])
    assert plain.compiled.compile_count == built
