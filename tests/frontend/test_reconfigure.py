"""Reconfiguration under load over gRPC with the real tiny model on 8 fake CPU devices."""
import threading
import time

import grpc
import pytest

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.models import load_model
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
from dilaserve_jax.serving.cluster.fake_runner import fake_tp_profile
from dilaserve_jax.tasks.suite import unique_problems
from tests.frontend.conftest import ServerThread, status_of

pytestmark = pytest.mark.slow
SEQUENCE = ["8x1", "4+2+1+1", "1x8", "2x4"]


def _replay(decoder, prompt, gen, taus):
    """The offline decoder (cache none) stepped at the τ sequence a request recorded."""
    decoder.admit(0, prompt, gen, 16)
    try:
        for k, tau in enumerate(taus):
            out = decoder.step(StepKind.REFRESH, [0], [tau])[0]
            if out.request_finished:
                assert k == len(taus) - 1, "finished before its recorded steps ran out"
                return decoder.answer(0)
        raise AssertionError("did not finish within its recorded steps")
    finally:
        decoder.release(0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    fake_tp_profile((1, 2, 4, 8)).save(profile)  # scheduling only: cache none answers do not depend on it
    cfg = ServeConfig(model="tiny", mesh="2x4", slots=2, length_buckets=(64,), block_buckets=(16,),
                      default_block_length=16, profile=str(profile), cache_mode="none", controller="paused",
                      default_slo_ms=600_000, tau_min=0.7)
    srv = ServerThread(build_cluster(cfg, say=lambda _m: None)).ready()
    yield srv
    srv.stop()


def test_reconfigure_under_load_loses_nothing_and_answers_exactly(server):
    prompts = [(p.prompt, 12) for n in ("sort", "repeat") for p in unique_problems(n, "heldout", 24, seed=9)]
    replies, errors, stop = [], [], threading.Event()

    def client(k):
        i = k
        with server.client() as c:
            while not stop.is_set() or i < 64:
                text, gen = prompts[i % len(prompts)]
                try:
                    replies.append((text, gen, c.generate(text, max_new_tokens=gen, block_length=16)))
                except grpc.RpcError as err:
                    errors.append((text, err.code(), err.details()))
                i += 8

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    builder = server.cluster.builder
    states, counts = [], []
    with server.client() as admin:
        for spec in SEQUENCE:
            counts.append(builder.compile_count())
            states.append(admin.reconfigure(spec, timeout=900))
            time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    assert [s.layout for s in states] == SEQUENCE
    assert builder.compile_count() == counts[-1], "returning to 2x4 compiled again"
    assert len(replies) >= 64
    assert any(r.moves for _, _, r in replies), "no call was in flight during a switch"
    model = load_model("tiny")
    decoder = SlotDecoder(model.config, model.graphdef, model.params, DecoderConfig(1, (64,), (16,), "none"),
                          progress=False)
    for text, gen, r in replies:
        answer = _replay(decoder, model.tokenizer.encode(text), gen, list(r.taus))
        assert list(r.token_ids) == answer[:gen], (text, list(r.taus))
    state = states[-1]
    assert {i.name for i in state.instances} == {"tp4@0-3", "tp4@4-7"} and len(state.reconfigurations) == 4


def test_reconfigure_statuses(server):
    with server.client(retries=False) as c:
        code, details = status_of(lambda: c.reconfigure("3x3"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("mesh:")
        c.set_controller_mode("auto")
        try:
            code, details = status_of(lambda: c.reconfigure("8x1"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "auto" in details
        finally:
            c.set_controller_mode("paused")
        assert c.cluster_state().controller_mode == "paused"
