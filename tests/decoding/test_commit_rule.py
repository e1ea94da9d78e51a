"""Property tests of the JAX commit rule, and agreement with the reference's host-side rule."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from dilaserve_jax.decoding import reference
from dilaserve_jax.decoding.commit import compact_commits, request_finished, select_commits
from dilaserve_jax.decoding.commit import propose as propose_any

N = 16  # block width; one shape so the jitted rule compiles once
select = jax.jit(select_commits)
propose = jax.jit(propose_any, static_argnums=1)
finished = jax.jit(lambda c, p, a: request_finished(c, p, a, 2, 1))  # fixed [1, 24] canvas: compiles once

# Confidences from a small set of values make exact ties (and the exactly-1.0 case) common.
conf_values = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.7, 0.9, 0.9, 0.95, 0.99, 1.0])


@st.composite
def blocks(draw):
    masked = np.array(draw(st.lists(st.booleans(), min_size=N, max_size=N)))
    conf = np.array(draw(st.lists(conf_values, min_size=N, max_size=N)), np.float32)
    return masked, conf


def _commit(masked, conf, tau):
    return np.asarray(select(jnp.asarray(masked[None]), jnp.asarray(conf[None]), jnp.asarray([tau], jnp.float32)))[0]


@settings(max_examples=150, deadline=None)
@given(blocks(), st.floats(0.05, 1.0))
def test_commit_rule_properties(block, tau):
    masked, conf = block
    commit = _commit(masked, conf, tau)
    assert not np.any(commit & ~masked)  # only masked positions of the window: never re-commits
    if masked.any():
        assert commit.sum() >= 1
        np.testing.assert_array_equal(commit, reference.commit_mask(masked, conf, tau))
    else:
        assert not commit.any()
    if tau == 1.0:
        assert commit.sum() == int(masked.any())


@settings(max_examples=100, deadline=None)
@given(blocks(), st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_commit_rule_is_monotone_in_tau(block, tau_a, tau_b):
    masked, conf = block
    low, high = sorted((tau_a, tau_b))
    assert not np.any(_commit(masked, conf, high) & ~_commit(masked, conf, low))


def test_ties_go_to_the_lowest_position():
    masked = np.ones(N, bool)
    conf = np.full(N, 0.3, np.float32)
    conf[[5, 9]] = 0.8
    assert np.flatnonzero(_commit(masked, conf, 1.0)).tolist() == [5]


def test_each_slot_obeys_its_own_tau():
    masked = jnp.ones((3, N), bool)
    conf = jnp.tile(jnp.linspace(0.05, 0.95, N, dtype=jnp.float32), (3, 1))
    commit = np.asarray(select(masked, conf, jnp.asarray([1.0, 0.5, 0.1], jnp.float32)))
    counts = commit.sum(axis=1).tolist()
    assert counts[0] == 1 and counts[0] < counts[1] < counts[2]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=12, max_size=12), st.integers(1, 8))
def test_request_finished_matches_reference(answer_codes, prompt_len):
    mask_id, eos_id = 2, 1
    tokens = {0: 65, 1: eos_id, 2: mask_id}
    canvas = np.array([70] * prompt_len + [tokens[c] for c in answer_codes] + [0] * (12 - prompt_len), np.int32)
    got = finished(jnp.asarray(canvas[None]), jnp.asarray([prompt_len]), jnp.asarray([12]))
    want = reference.is_finished(canvas[:prompt_len + 12], prompt_len, mask_id, eos_id)
    assert bool(got[0]) == want


def test_greedy_proposals_match_reference_and_never_propose_the_mask():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, N, 128)).astype(np.float32) * 4
    logits[:, 3, 2] = 100.0  # the mask token would win here
    toks, conf = propose(jnp.asarray(logits), 2, jnp.zeros(2), jnp.stack([jax.random.PRNGKey(0)] * 2))
    for b in range(2):
        want_t, want_c = reference.propose(logits[b], 2, 0.0, None)
        np.testing.assert_array_equal(np.asarray(toks[b]), want_t)
        np.testing.assert_allclose(np.asarray(conf[b]), want_c, rtol=1e-6)
    assert not np.any(np.asarray(toks) == 2)


def test_sampling_is_deterministic_per_key_and_varies_across_keys():
    logits = jnp.zeros((1, N, 128))
    keys = [jax.random.fold_in(jax.random.PRNGKey(s), 0)[None] for s in (1, 1, 2)]
    draws = [np.asarray(propose(logits, 2, jnp.ones(1), k)[0]) for k in keys]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])
    assert not np.any(np.concatenate(draws) == 2)


def test_compact_commits_lists_positions_in_order():
    commit = jnp.asarray([[False, True, False, True], [False, False, False, False]])
    positions = jnp.asarray([[10, 11, 12, 13], [20, 21, 22, 23]])
    pos, tok, n = compact_commits(commit, positions, positions + 100)
    assert np.asarray(n).tolist() == [2, 0]
    assert np.asarray(pos).tolist() == [[11, 13, -1, -1], [-1, -1, -1, -1]]
    assert np.asarray(tok)[0, :2].tolist() == [111, 113]
