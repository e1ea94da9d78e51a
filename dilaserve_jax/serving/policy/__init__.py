"""Pure serving policy: the request state machine, scheduler, threshold and load control, the
quality budget, latency and capacity models, the cluster controller, the router and the
snapshot types instances publish. Python + numpy only (a test enforces it), so the simulator
runs these objects unchanged."""
