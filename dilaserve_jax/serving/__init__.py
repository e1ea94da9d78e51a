"""Serving, in three layers (bottom to top): `policy/` (pure decisions), `cluster/` (the engine
loop and the actuator, pure too) and `executor/` (JAX). docs/architecture.md shows the layers and
the path of one request."""
