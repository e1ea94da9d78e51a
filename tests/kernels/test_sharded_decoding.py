"""The tiny model decoding on tensor-parallel layouts with attention="pallas" (the per-shard kernel,
interpret mode on 8 fake CPU devices) gives exactly the tokens of attention="xla", and a TP-4
step's compiled HLO gathers no q/k/v.

Like serving, one CompiledSteps per (attention, cache mode) is shared by every instance, so the
AOT cache keys must keep instances apart. Decoding runs are memoised per (attention, cache mode,
devices): the TP-4 instance on devices 0-3 is the same placement in "2x4" and "4+2+1+1".
"""
from __future__ import annotations

import functools
import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from dilaserve_jax.decoding.buckets import StepShape, StepType
from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.compiled import CompiledSteps, leaf_placement
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.decoding.state import init_state, state_shardings
from dilaserve_jax.kernels import flash, partition, sharded
from dilaserve_jax.mesh import Layout, kv_cache_sharding, load_into_layout
from dilaserve_jax.models.hf import abstract_params
from dilaserve_jax.tasks.suite import problems

pytestmark = pytest.mark.slow  # each instance compiles its own executables (~3 s each on 2 cores)

LENGTH, BLOCK = 32, 16


@functools.cache
def tiny_on(spec: str):
    layout = Layout.build(spec)
    loaded, per_instance = load_into_layout("tiny", layout)
    return layout, loaded, per_instance


@functools.cache
def requests(tokenizer) -> tuple[DecodeRequest, ...]:
    sort, repeat = problems("sort", "heldout", 1)[0], problems("repeat", "heldout", 1)[0]
    return (DecodeRequest(tuple(tokenizer.encode(sort.prompt)), 12, 12, tau=0.9),
            DecodeRequest(tuple(tokenizer.encode(repeat.prompt)), 12, 12, tau=0.7))


@functools.cache
def shared_compiled(impl: str, mode: str) -> CompiledSteps:
    _, loaded, _ = tiny_on("2x4")
    cfg = loaded.config.replace(attention=impl)
    return CompiledSteps(cfg, abstract_params(cfg)[0])


def _state_sharding(instance, cfg, mode):
    template = init_state(cfg, 1, 1, with_cache=mode != "none")
    return state_shardings(template, kv_cache_sharding(instance, cfg), instance.sharding(P()))


_RUNS: dict = {}


def decode_on(spec: str, index: int, impl: str, mode: str):
    """Decode the requests on instance `index` of `spec`: (answers, query-head counts the kernel saw,
    {step shape: executable} compiled for this instance).

    Pallas runs are kept per placement. XLA runs are kept per TP degree: instances of one degree
    run the same XLA program on other devices, and the tests compare Pallas on every instance.
    """
    layout, loaded, per_instance = tiny_on(spec)
    instance = layout.instances[index]
    key = (impl, mode, instance.device_ids if impl == "pallas" else instance.tp)
    if key not in _RUNS:
        _RUNS[key] = _decode(instance, per_instance[index], loaded.tokenizer, shared_compiled(impl, mode), mode)
    return _RUNS[key]


def _decode(instance, params, tokenizer, compiled: CompiledSteps, mode: str):
    config = DecoderConfig(num_slots=1, length_buckets=(LENGTH,), block_buckets=(BLOCK,), cache_mode=CacheMode(mode))
    heads_seen, real_kernel = [], flash.flash_attention

    def counting_kernel(q, *args, **kwargs):
        heads_seen.append(q.shape[2])
        return real_kernel(q, *args, **kwargs)

    known = set(compiled.executables)
    flash.flash_attention = counting_kernel  # every executable built here is traced afresh
    try:
        decoder = SlotDecoder(compiled.cfg, compiled.graphdef, params, config, compiled=compiled,
                              state_sharding=_state_sharding(instance, compiled.cfg, mode), warm_up=False,
                              progress=False)
        results, _ = generate_many(decoder, requests(tokenizer))
    finally:
        flash.flash_attention = real_kernel
    assert decoder.devices == frozenset(instance.devices)
    built = {key[0]: exe for key, exe in compiled.executables.items() if key not in known}
    return [r.answer for r in results], set(heads_seen), built


@pytest.mark.parametrize("spec", ["2x4", "4+2+1+1", "1x8"])
def test_pallas_decoding_on_layout_gives_xla_tokens(spec):
    """Every instance decodes. The tiny model has 8 heads and 4 kv heads: kv split at TP 2 and 4,
    replicated at TP 8."""
    layout, loaded, _ = tiny_on(spec)
    for inst in layout.instances:
        want, xla_heads, _ = decode_on(spec, inst.index, "xla", "dual")
        got, pallas_heads, built = decode_on(spec, inst.index, "pallas", "dual")
        assert any(want), "the tiny model should answer something"
        assert got == want, f"instance {inst}"
        assert xla_heads == set() and pallas_heads == {loaded.config.n_heads // inst.tp}, "kernel not per shard"
        # The shared cache built admit, refresh and dual for this placement: none came from another instance.
        assert sorted(s if isinstance(s, str) else s.step.value for s in built) == ["admit", "dual", "refresh"]


@pytest.mark.parametrize("mode", ["prefix", "none"])
def test_other_cache_modes_on_tp4(mode):
    layout, loaded, _ = tiny_on("2x4")
    want, _, _ = decode_on("2x4", 0, "xla", mode)
    got, heads, built = decode_on("2x4", 0, "pallas", mode)
    assert got == want and heads == {loaded.config.n_heads // 4}
    expected_step = StepType.PREFIX if mode == "prefix" else StepType.FULL
    assert any(not isinstance(s, str) and s.step is expected_step for s in built)


GATHER = re.compile(r"=\s*[a-z0-9]+\[([\d,]*)\][^=]*\sall-gather(?:-start)?\(.*dimensions=\{(\d+)\}")


def attention_gathers(hlo_text: str, head_dim: int) -> list[str]:
    """All-gathers of q/k/v in compiled HLO text.

    Two kinds: gathers of the kernel's operands after its own reshapes, which XLA names after the
    kernel (metadata op_name); and gathers of whole per-head tensors [B, T, heads, head_dim] along
    the heads axis, which feed attention (XLA names those after their producer, e.g. the cache
    scatter). The model's other gathers (activations [B, T, d_model] after the d_model-split
    embedding, logits statistics) are neither.
    """
    found = []
    for line in hlo_text.splitlines():
        match = GATHER.search(line)
        if not match:
            continue
        dims, axis = [int(d) for d in match.group(1).split(",") if d], int(match.group(2))
        if "flash_attention" in line or (len(dims) == 4 and axis == 2 and dims[3] == head_dim):
            found.append(line.strip())
    return found


def _tp4_dual_step_hlo_built_afresh() -> str:
    layout, loaded, per_instance = tiny_on("2x4")
    instance, params = layout.instances[0], per_instance[0]
    cfg = loaded.config.replace(attention="pallas")
    state = init_state(cfg, 1, LENGTH, sharding=_state_sharding(instance, cfg, "dual"))
    executable = CompiledSteps(cfg, abstract_params(cfg)[0]).get(
        StepShape(StepType.DUAL, 1, LENGTH, BLOCK, BLOCK), params, state, leaf_placement(params) + leaf_placement(state))
    return executable.as_text()


@pytest.mark.parametrize("step", [StepType.REFRESH, StepType.DUAL])
def test_tp4_pallas_step_gathers_no_qkv(step):
    _, _, built = decode_on("2x4", 0, "pallas", "dual")  # the executables the decoding test ran
    (text,) = [exe.as_text() for shape, exe in built.items() if not isinstance(shape, str) and shape.step is step]
    assert "all-reduce" in text  # a real TP-4 program (attn_out and MLP all-reduces)
    assert attention_gathers(text, tiny_on("2x4")[1].config.head_dim) == []


def _without_shard_map(q, k, v, valid_len, *, mesh, **options):
    return flash.flash_attention(q, k, v, valid_len, **options)


def _kv_spec_replicated(n_heads, n_kv_heads, tp):
    return partition.HEADS_SHARDED, P()


@pytest.mark.parametrize("sabotage", ["no shard_map", "K/V spec replicated"])
def test_gather_check_catches_a_gathering_step(monkeypatch, sabotage):
    """Controls: the plain kernel on TP-4 inputs, or the kernel told K/V are whole while the cache
    is split by kv heads, make XLA gather q/k/v, and the check above reports it."""
    if sabotage == "no shard_map":
        monkeypatch.setattr(sharded, "sharded_flash_attention", _without_shard_map)
    else:
        monkeypatch.setattr(sharded, "attention_partition_specs", _kv_spec_replicated)
    jax.clear_caches()
    cfg = tiny_on("2x4")[1].config
    gathers = attention_gathers(_tp4_dual_step_hlo_built_afresh(), cfg.head_dim)
    jax.clear_caches()
    per_layer = 3 if sabotage == "no shard_map" else 2  # q, k, v / k, v
    assert len(gathers) >= per_layer * cfg.n_layers
