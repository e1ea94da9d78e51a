"""The policies benchmark's per-task block lengths tile every answer area of the suite."""
import pytest

from dilaserve_jax.tasks.suite import TASKS, task_block


def test_every_task_answer_area_is_whole_blocks():
    for t in TASKS.values():
        block = task_block(t.gen_length)
        assert 0 < block <= 32 and t.gen_length % block == 0


def test_untileable_answer_area_is_rejected():
    with pytest.raises(ValueError, match="whole number"):
        task_block(40)
