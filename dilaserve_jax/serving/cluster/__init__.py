"""The engine loop (one owner thread per instance) and the cluster actuator: routing, failover,
reshaping, migration and weight swaps. Pure: it drives runners only through the `Runner`
contract, so the same code runs over the JAX executor, the fake runner and the simulator."""
