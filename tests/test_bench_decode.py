"""The decode benchmark's single-step timing runs on the shipped model without a slot finishing."""
from dilaserve_jax.bench.decode import time_steps, timing_prompt
from dilaserve_jax.models import load_model


def test_single_step_timing_on_the_shipped_model():
    m = load_model("tiny")
    prompt = timing_prompt(m.tokenizer, 256)
    assert 0 < len(prompt) <= 128
    row = time_steps(m.config, m.graphdef, m.params, batch=2, length=256, block=32, prompt=prompt,
                     repeats=2)
    assert row["refresh_ms"] > 0 and row["reuse_ms"] > 0 and row["canvas"] == 256 and row["batch"] == 2
