"""Discrete-event cluster simulator on the serving policy code (pure Python + numpy; never imports JAX).

The real `Engine`, `Scheduler`, `ThresholdController`, `Router`, `ClusterController` and
`Autoscaler.round` run unchanged on virtual time over modelled runners (`executor`): step times from a
latency profile, commits and answer validity from measured eval trajectories or a published table
(`quality`). `python -m dilaserve_jax.sim --help` runs one simulation; `bench.sim_validate` checks
it against the real engine; `sim.evaluate` runs the paper's comparison. See docs/simulation.md.
"""
