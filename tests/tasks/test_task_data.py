"""Training rows: prompt, answer, EOS padding to the answer area; fixed shapes per answer-area group."""
import numpy as np

from dilaserve_jax.models.tokenizer import CharTokenizer
from dilaserve_jax.tasks.data import batches, collate, group_seq_len
from dilaserve_jax.tasks.suite import TASKS, Problem

TOK = CharTokenizer()


def test_collate_pads_answers_with_eos_and_rows_with_pad():
    p = Problem("sort", TASKS["sort"].prompt_of(("312",)), ("312",))
    b = collate([(p, "123")], seq_len=48)
    prompt = TOK.encode(p.prompt)
    gen = TASKS["sort"].gen_length
    row = b.tokens[0]
    assert row[:len(prompt)].tolist() == prompt
    assert row[len(prompt):len(prompt) + 3].tolist() == TOK.encode("123")
    assert (row[len(prompt) + 3:len(prompt) + gen] == TOK.eos_id).all()
    assert (row[len(prompt) + gen:] == TOK.pad_id).all()
    assert b.valid_len[0] == len(prompt) + gen
    assert b.answer_mask[0].sum() == gen and b.answer_mask[0, len(prompt)]
    assert not b.answer_mask[0, :len(prompt)].any()


def test_batches_have_one_fixed_shape_per_group_and_are_deterministic():
    weights = {name: 1.0 for name in TASKS}
    a = [b for b, _ in zip(batches(0, 3072, weights), range(12))]
    again = [b for b, _ in zip(batches(0, 3072, weights), range(12))]
    shapes = {b.shape for b in a}
    assert shapes <= {(3072 // group_seq_len(g), group_seq_len(g)) for g in {t.gen_length for t in TASKS.values()}}
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, again))
    for b in a:
        assert (b.valid_len <= b.shape[1]).all()
