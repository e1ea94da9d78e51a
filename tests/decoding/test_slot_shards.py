"""Slot shards (decoding/slot_shards.py): a decoder whose slots are split over several devices
decodes exactly what the one-placement decoder does, in every cache mode, whichever slots share a
step, and compiles nothing after warm-up."""
import jax
import numpy as np
import pytest

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.slot_shards import (per_shard_counts, replicated, shard_rows, shards_of, slot_mesh,
                                                slot_sharding)
from fastdecode_support import prompts, run_to_end

LENGTH, BLOCK, GEN = 64, 16, 40


@pytest.fixture(scope="module")
def make(sharp_model, shared_compiled):
    """Decoders sharing one executable cache (keyed by placement, so sharded and plain steps differ)."""
    cfg, graphdef, params = sharp_model

    def build(mode: str, slots: int, shards: int, warm_up: bool = False) -> SlotDecoder:
        return SlotDecoder(cfg, graphdef, params, DecoderConfig(slots, (LENGTH,), (BLOCK,), CacheMode(mode),
                                                                slot_shards=shards),
                           compiled=shared_compiled, warm_up=warm_up, progress=False)
    return build


def test_rows_of_a_gathered_step_are_grouped_by_shard():
    # 8 slots over 2 shards (slots 0-3 and 4-7), per-shard part of 4 rows
    index, tau, rows = shard_rows([5, 1, 6, 2], [0.5, 0.6, 0.7, 0.8], 8, 2, 4, in_place=False)
    assert rows == [4, 0, 5, 1]
    assert index.tolist() == [1, 2, 4, 4, 1, 2, 4, 4]  # local indices, then the shard's slot count (padding)
    assert tau.tolist() == pytest.approx([0.6, 0.8, 1.0, 1.0, 0.5, 0.7, 1.0, 1.0])
    assert per_shard_counts([5, 1, 6, 2, 7], 8, 2) == [2, 3]


def test_rows_of_an_in_place_step_are_the_local_slots():
    index, tau, rows = shard_rows([6, 1], [0.5, 0.9], 8, 2, 4, in_place=True)
    assert rows == [6, 1]  # in the order of the slots given
    assert index.tolist() == [4, 1, 4, 4, 4, 4, 2, 4]
    assert tau.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0])


def test_one_shard_keeps_the_plain_layout():
    index, tau, rows = shard_rows([3, 1], [0.5, 0.9], 4, 1, 2, in_place=False)
    assert (index.tolist(), rows) == ([3, 1], [0, 1])
    index, _, rows = shard_rows([3, 1], [0.5, 0.9], 4, 1, 4, in_place=True)
    assert (index.tolist(), rows) == ([4, 1, 4, 3], [3, 1])


def test_config_checks_the_split():
    with pytest.raises(ValueError, match="divide"):
        DecoderConfig(6, (64,), slot_shards=4)
    with pytest.raises(ValueError, match="positive"):
        DecoderConfig(4, (64,), slot_shards=0)
    assert DecoderConfig(8, (64,), slot_shards=2).batch_buckets == (2, 4, 8)
    assert DecoderConfig(8, (64,), slot_shards=2).shard_batch_buckets == (1, 2, 4)
    assert DecoderConfig(8, (64,)).batch_buckets == (1, 2, 4, 8)


def _decode(dec: SlotDecoder, schedule: list[list[int]], reqs: list, taus: dict[int, float]):
    """Admit reqs[i] into slot i, then step the slots in the groups of `schedule` until all finish;
    returns answers and commits per step."""
    for slot, (prompt, gen) in enumerate(reqs):
        dec.admit(slot, prompt, gen, BLOCK)
    commits = run_to_end(dec, taus, groups=schedule)
    return [dec.answer(s) for s in range(len(reqs))], commits


@pytest.mark.parametrize("mode,shards", [("none", 2), ("prefix", 2), ("dual", 2), ("dual", 4)])
def test_sharded_decoder_decodes_what_the_plain_one_does(make, mode, shards):
    """8 slots; steps over every slot (on the state where it lies), over a few slots of one shard
    (gathered, the other shards only padding) and over slots spread unevenly across shards."""
    reqs = [(p, GEN - 8 * (i % 3)) for i, p in enumerate(prompts(8, seed=7))]
    taus = {s: [1.0, 0.5, 0.8, 0.6][s % 4] for s in range(8)}
    for schedule in ([list(range(8))], [[0, 1, 2], [3, 4, 5, 6, 7]], [[7], [0, 5, 6], [1, 2, 3, 4]]):
        want = _decode(make(mode, 8, 1), schedule, reqs, taus)
        got = _decode(make(mode, 8, shards), schedule, reqs, taus)
        assert got == want, (mode, shards, schedule)


def test_sharded_resume_matches(make):
    """A request resuming with committed tokens (migration) continues as on one placement."""
    prompt = prompts(1, seed=3)[0]
    committed = [5, 9, None, 11] + [None] * (GEN - 4)
    out = []
    for shards in (1, 2):
        dec = make("dual", 4, shards)
        dec.admit(3, prompt, GEN, BLOCK, committed=committed, steps_done=2)
        run_to_end(dec, {3: 0.7})
        out.append(dec.answer(3))
    assert out[0] == out[1] and out[0][:2] == [5, 9]


def test_sharded_decoder_compiles_nothing_after_warm_up(make):
    before = make("dual", 4, 2).compiled.compile_count
    dec = make("dual", 4, 2, warm_up=True)
    built = dec.compiled.compile_count
    assert built - before <= 1 + len(dec.step_shapes())  # at most admission + every step shape
    assert all((shape, dec._placement) in dec.compiled.executables for shape in dec.step_shapes())
    for slot, p in enumerate(prompts(4, seed=11)):
        dec.admit(slot, p, GEN, BLOCK)
    run_to_end(dec, {0: 0.5, 3: 1.0})  # two slots: one per shard, gathered
    run_to_end(dec, {1: 0.9, 2: 0.6})
    assert dec.compiled.compile_count == built


def test_the_state_lives_in_shards(make):
    dec = make("dual", 4, 2)
    assert shards_of(dec.state.canvas.sharding) == 2
    assert len(dec.devices) == 2
    k = dec.state.kv[0].k
    assert {s.data.shape[0] for s in k.addressable_shards} == {2}  # two slots per device


def test_placement_must_match_the_config(sharp_model):
    cfg, graphdef, params = sharp_model
    mesh = slot_mesh(jax.devices()[:2])
    with pytest.raises(ValueError, match="splits the slots 2 ways, the config 1"):
        SlotDecoder(cfg, graphdef, jax.device_put(params, replicated(mesh)), DecoderConfig(4, (LENGTH,)),
                    state_sharding=slot_sharding(mesh), warm_up=False, progress=False)
    with pytest.raises(ValueError, match="replicate params"):
        from jax.sharding import NamedSharding, PartitionSpec as P
        split = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(*(["slots"] + [None] * (x.ndim - 1)))))
                             if x.ndim and x.shape[0] % 2 == 0 else jax.device_put(x, replicated(mesh)), params)
        SlotDecoder(cfg, graphdef, split, DecoderConfig(4, (LENGTH,), slot_shards=2),
                    state_sharding=slot_sharding(mesh), warm_up=False, progress=False)


def test_too_few_devices_is_a_clear_error(sharp_model):
    cfg, graphdef, params = sharp_model
    n = len(jax.local_devices())
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        SlotDecoder(cfg, graphdef, params, DecoderConfig(2 * n, (LENGTH,), slot_shards=2 * n),
                    warm_up=False, progress=False)


def test_sharded_answers_are_numpy_free_ints(make):
    dec = make("dual", 2, 2)
    dec.admit(1, prompts(1, seed=5)[0], 16, BLOCK)
    run_to_end(dec, {1: 1.0})
    assert all(isinstance(t, int) for t in dec.answer(1)) and len(dec.answer(1)) <= 16
    assert np.all(np.asarray(dec.canvas(1)) != dec.cfg.mask_id)
