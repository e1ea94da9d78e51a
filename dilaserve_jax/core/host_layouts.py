"""Layouts over several hosts, in plain numbers: one layout per host, and which of them a switch
changes.

A hosts layout is one layout (TP degrees, widest first) per host, in the cluster's host order;
its text joins the hosts' mesh specs with '|' ("2x4|8"). A TP group never spans hosts, so the
layouts a cluster of hosts can run are the per-host partitions of each host's devices into
power-of-two TP groups, combined.

The cluster controller prices a layout by its instances alone (the router spreads requests over
every instance, wherever it runs), so two hosts layouts with the same instances, such as "2|2x1"
and "2x1|2", are the same candidate to it. `flat_candidates` lists each such multiset of TP
degrees once; `assign_to_hosts` then picks, among the hosts layouts with those instances, the one
that changes the fewest hosts (then moves the fewest bytes): a host whose layout already fits
stays as it is, with its instances and requests untouched.
"""
from __future__ import annotations

import itertools
from collections import Counter
from functools import lru_cache
from typing import Sequence

from dilaserve_jax.core.layouts import binary_partitions, layout_text, moved_fraction, parse_layout

HostsLayout = tuple[tuple[int, ...], ...]
MAX_CANDIDATES = 2048  # distinct instance multisets enumerated in full (8 hosts of 8 devices: 969)


def parse_hosts_layout(text: str) -> HostsLayout:
    """"2x1|2" -> ((1, 1), (2,)); MeshSpecError for a malformed part."""
    return tuple(parse_layout(part.strip()) for part in text.split("|"))


def hosts_layout_text(layout: Sequence[Sequence[int]]) -> str:
    """((1, 1), (2,)) -> "2x1|1x2" (each host's canonical mesh spec)."""
    return "|".join(layout_text(part) for part in layout)


def flatten(layout: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Every instance's TP degree, widest first, whatever its host."""
    return tuple(sorted((tp for part in layout for tp in part), reverse=True))


def host_partitions(devices: int, tp_degrees: Sequence[int], allowed: Sequence[str] = ()) -> list[tuple[int, ...]]:
    """The layouts one host of `devices` devices may run: every partition into the given TP degrees,
    or only those of `allowed` (mesh specs) that cover exactly its devices."""
    if allowed:
        specs = [parse_layout(s) for s in allowed]
        return list(dict.fromkeys(s for s in specs if sum(s) == devices and set(s) <= set(tp_degrees)))
    return binary_partitions(devices, [t for t in tp_degrees if t <= devices])


def flat_candidates(per_host: Sequence[Sequence[tuple[int, ...]]],
                    limit: int = MAX_CANDIDATES) -> list[tuple[int, ...]]:
    """The distinct instance multisets (widest first) reachable by giving each host one of its
    layouts (`per_host[i]`: host i's), in the order the hosts' options give them (one host: its
    options as given). Past `limit` of them (many hosts), only those where the hosts with the same
    choices split between at most two layouts (`two_layout_candidates`)."""
    reachable: dict[tuple[int, ...], None] = {(): None}
    for options in per_host:
        reachable = dict.fromkeys(_merge(have, opt) for have in reachable for opt in options)
        if len(reachable) > limit:
            return two_layout_candidates(per_host)
    return list(reachable)


def two_layout_candidates(per_host: Sequence[Sequence[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Instance multisets where each group of hosts with the same choices runs one layout, or two
    (k hosts one, the others another): every uniform layout, and every change of some hosts of a
    group from one layout to another."""
    groups = Counter(tuple(options) for options in per_host)
    out: dict[tuple[int, ...], None] = {(): None}
    for options, hosts in groups.items():
        mixes = dict.fromkeys(_times(a, hosts) for a in options)
        for a, b in itertools.combinations(options, 2):
            mixes.update(dict.fromkeys(_merge(_times(a, k), _times(b, hosts - k)) for k in range(1, hosts)))
        out = dict.fromkeys(_merge(have, mix) for have in out for mix in mixes)
    return list(out)


def _merge(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(a + b, reverse=True))


def _times(part: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(sorted(part * n, reverse=True))


def assign_to_hosts(target: Sequence[int], current: HostsLayout,
                    per_host: Sequence[Sequence[tuple[int, ...]]]) -> HostsLayout | None:
    """The hosts layout whose instances are `target` that changes the fewest hosts of `current`,
    then moves the fewest model bytes (`moved_fraction`, summed over hosts); None if no choice of
    the hosts' layouts (`per_host`) makes `target`."""
    want = Counter(target)
    hosts = len(current)
    if len(per_host) != hosts:
        raise ValueError(f"{len(per_host)} hosts' options for a layout of {hosts} hosts")

    @lru_cache(maxsize=None)
    def best(i: int, left: tuple[tuple[int, int], ...]) -> tuple[tuple[int, float], tuple] | None:
        if i == hosts:
            return ((0, 0.0), ()) if not left else None
        remaining = Counter(dict(left))
        found = None
        for part in per_host[i]:
            need = Counter(part)
            if any(remaining[tp] < n for tp, n in need.items()):
                continue
            rest = best(i + 1, tuple(sorted((remaining - need).items())))
            if rest is None:
                continue
            changed = tuple(part) != tuple(current[i])
            cost = (rest[0][0] + changed, rest[0][1] + (moved_fraction(current[i], part) if changed else 0.0))
            if found is None or cost < found[0]:
                found = (cost, (tuple(part), *rest[1]))
        return found

    result = best(0, tuple(sorted(want.items())))
    return None if result is None else result[1]


def changed_hosts(old: HostsLayout, new: HostsLayout) -> list[int]:
    """Indexes of the hosts whose layout differs."""
    return [i for i, (a, b) in enumerate(zip(old, new)) if tuple(a) != tuple(b)]
