"""A Dream checkpoint directory served like `serve --model DIR`, over a mixed layout, in every cache
mode: the answers are the single-device decoder's, and GetClusterState names the family."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.models import load_model, test_dream
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from tests.dream_support import write_dream_checkpoint
from tests.frontend.conftest import ServerThread

pytestmark = pytest.mark.slow
PROMPTS = [[5, 9, 11, 40, 7, 3, 88, 21], [60, 61, 62, 12, 90], [33, 34, 35, 36, 37, 38, 39, 40, 41, 42]]
ANSWER, BLOCK = 16, 8  # a whole number of blocks: the server rounds the answer area up to blocks


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dream_serving")
    fake_profile().save(root / "profile.json")  # scheduling only: answers do not depend on it
    return write_dream_checkpoint(root / "ckpt", test_dream(), seed=8, head_scale=12.0), root / "profile.json"


@pytest.mark.parametrize("cache, mesh", [("dual", "2+1"), ("prefix", "1x1"), ("none", "1x1")])
def test_dream_directory_is_served_in_every_cache_mode(dream_dir, cache, mesh):
    """The mixed TP-2 + TP-1 layout runs the default (dual) cache; TP equality in every layout is
    tests/mesh/test_dream_layouts.py's, so the other modes run on one device to keep this short."""
    path, profile = dream_dir
    cfg = ServeConfig(model=str(path), mesh=mesh, cache_mode=cache, slots=1, length_buckets=(32,),
                      block_buckets=(BLOCK,), default_block_length=BLOCK, profile=str(profile),
                      allow_unused_devices=True, default_slo_ms=600_000)
    server = ServerThread(build_cluster(cfg, say=lambda _m: None)).ready()
    direct = {}
    try:
        with server.client() as client, ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            state = client.cluster_state()
            # concurrent calls; the router sends each to the earliest predicted finish, which on a
            # mixed layout may be one instance for the whole burst (its predictions follow the
            # steps' measured times), so an instance it left idle is asked directly
            replies = list(pool.map(lambda p: client.generate(p, max_new_tokens=ANSWER, block_length=BLOCK,
                                                              tau_min=0.7, tau_max=0.7), PROMPTS * 2))
        for info in state.instances:
            if info.name not in {r.instance for r in replies}:
                direct[info.name] = [_direct(server.cluster, info.name, f"{info.name}-{i}", p)
                                     for i, p in enumerate(PROMPTS)]
    finally:
        server.stop()
    assert state.family == "dream" and state.layout == mesh
    if mesh == "2+1":
        assert [i.tp_degree for i in state.instances] == [2, 1]
        assert {r.instance for r in replies} | set(direct) == {i.name for i in state.instances}

    model = load_model(path)
    decoder = SlotDecoder(model.config, model.graphdef, model.params,
                          DecoderConfig(1, (32,), (BLOCK,), CacheMode(cache)), warm_up=False, progress=False)
    expected, _ = generate_many(decoder, [DecodeRequest(tuple(p), ANSWER, BLOCK, 0.7) for p in PROMPTS])
    for reply, want in zip(replies, expected * 2):
        assert list(reply.token_ids) == want.answer[:ANSWER]
    for tokens in direct.values():  # each instance the router did not use, asked directly
        assert tokens == [want.answer[:ANSWER] for want in expected]


def _direct(cluster, instance: str, rid: str, prompt) -> list[int]:
    now = cluster.clock()
    req = Request(rid, tuple(prompt), ANSWER, BLOCK, now, now + 600, tau_min=0.7, tau_max=0.7)
    result = cluster.submit(req, instance=instance).result(120)
    assert result.state == RequestState.FINISHED_OK and result.instance == instance
    return list(result.tokens)
