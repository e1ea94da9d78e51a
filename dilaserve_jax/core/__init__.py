"""The vocabulary every layer shares, pure Python: step kinds and cache modes (`kinds`), the
mesh-spec grammar and instance naming (`layouts`) and the shape-bucket rule (`buckets`). It sits
below everything else, so decoding, serving and the simulator spell these things one way."""
