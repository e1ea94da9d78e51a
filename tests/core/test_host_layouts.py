"""Layouts over several hosts: candidates per host, and the hosts a switch changes."""
from collections import Counter

from dilaserve_jax.core.host_layouts import (assign_to_hosts, changed_hosts, flat_candidates, flatten,
                                             host_partitions, hosts_layout_text, parse_hosts_layout,
                                             two_layout_candidates)
from dilaserve_jax.core.layouts import binary_partitions

TPS = (1, 2, 4, 8)


def _splits(flat, per_host):
    """Whether some choice of one layout per host makes exactly `flat` (brute force)."""
    import itertools

    return any(Counter(flatten(pick)) == Counter(flat) for pick in itertools.product(*per_host))


def test_every_candidate_keeps_each_tp_group_on_one_host():
    per_host = [host_partitions(4, TPS), host_partitions(2, TPS)]
    got = flat_candidates(per_host)
    assert len(got) == len(set(got))
    assert all(_splits(c, per_host) for c in got)
    # one TP-8 instance would need both hosts' devices, and a TP 4 does not fit the 2-device host twice
    assert (8,) not in got and (4, 4) not in got and (4, 2) in got and (1,) * 6 in got
    brute = {tuple(sorted(flatten(p), reverse=True)) for p in __import__("itertools").product(*per_host)}
    assert set(got) == brute


def test_one_host_keeps_the_one_host_candidates_in_their_order():
    assert flat_candidates([host_partitions(8, TPS)]) == binary_partitions(8, TPS)


def test_allowed_layouts_are_those_that_cover_the_host():
    assert host_partitions(4, TPS, allowed=("2x2", "4", "8", "2x1")) == [(2, 2), (4,)]


def test_many_hosts_fall_back_to_one_or_two_layouts_per_group_of_alike_hosts():
    per_host = [host_partitions(2, TPS)] * 3
    full = flat_candidates(per_host)
    assert set(two_layout_candidates(per_host)) == set(full)  # with two options per host nothing is lost
    assert flat_candidates(per_host, limit=2) == two_layout_candidates(per_host)
    many = [host_partitions(8, TPS)] * 64
    got = flat_candidates(many)
    assert (1,) * 512 in got and (8,) * 64 in got and (8,) * 63 + (4, 4) in got  # change one host of 64


def test_a_switch_changes_the_fewest_hosts():
    per_host = [host_partitions(2, TPS)] * 2
    current = parse_hosts_layout("2|2x1")
    assert assign_to_hosts((2, 1, 1), current, per_host) == current  # already there: no host changes
    to_wide = assign_to_hosts((2, 2), current, per_host)
    assert to_wide == ((2,), (2,)) and changed_hosts(current, to_wide) == [1]
    to_narrow = assign_to_hosts((1, 1, 1, 1), current, per_host)
    assert changed_hosts(current, to_narrow) == [0]
    assert assign_to_hosts((4,), current, per_host) is None


def test_hosts_of_different_sizes_keep_the_host_that_already_fits():
    per_host = [host_partitions(8, TPS), host_partitions(4, TPS)]
    current = parse_hosts_layout("2x4|4x1")
    new = assign_to_hosts((4, 4, 2, 2), current, per_host)
    assert new == ((4, 4), (2, 2)) and hosts_layout_text(new) == "2x4|2x2"
    new = assign_to_hosts((8, 1, 1, 1, 1), current, per_host)
    assert new == ((8,), (1, 1, 1, 1)) and changed_hosts(current, new) == [0]
