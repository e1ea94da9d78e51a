"""The vocabulary every layer shares, pure Python: step kinds and cache modes (`kinds`), the
mesh-spec grammar, placement and instance naming (`layouts`), how TP splits attention heads
(`heads`) and the shape-bucket rule (`buckets`). It sits below everything else, so decoding,
serving and the simulator spell these things one way."""
