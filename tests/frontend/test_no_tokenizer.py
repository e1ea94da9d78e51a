"""A model whose checkpoint has no tokenizer files is served for token-id prompts; a text prompt
gets FAILED_PRECONDITION naming the files the directory lacks."""
import grpc
import pytest
from flax import nnx

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.models import CharTokenizer, MissingTokenizer, init_model, load_model, test
from dilaserve_jax.models.hf import save_hf_checkpoint
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
from tests.frontend.conftest import ServerThread, status_of

NAMED_FILES = ("tokenizer.json", "vocab.json + merges.txt")


def test_text_fails_precondition_while_token_ids_are_served(fake_server):
    ids = CharTokenizer()  # the fake runner's special ids
    fake_server.cluster.tokenizer = MissingTokenizer("/ckpt/no-tokenizer", vocab_size=ids.vocab_size,
                                                     mask_id=ids.mask_id, eos_id=ids.eos_id, pad_id=ids.pad_id)
    with fake_server.client() as c:
        code, details = status_of(lambda: c.generate("hello", max_new_tokens=16))
        stream_code, _ = status_of(lambda: list(c.generate_stream("hello", max_new_tokens=16)))
        reply = c.generate([5, 6, 7], max_new_tokens=16, block_length=16)
        events = list(c.generate_stream([5, 6, 7], max_new_tokens=16, block_length=16))
    assert code == stream_code == grpc.StatusCode.FAILED_PRECONDITION
    assert "/ckpt/no-tokenizer" in details and all(name in details for name in NAMED_FILES)
    assert len(reply.token_ids) == 16 and reply.text == ""
    assert events[-1].HasField("final") and len(events[-1].final.token_ids) == 16 and len(events) > 1


@pytest.mark.slow
def test_directory_without_tokenizer_is_served_like_serve_model_dir(tmp_path):
    cfg = test().replace(vocab_size=160)  # not the character vocabulary: no tokenizer to fall back on
    save_hf_checkpoint(tmp_path / "ckpt", cfg, nnx.split(init_model(cfg, seed=4))[1])
    fake_profile().save(tmp_path / "profile.json")  # scheduling only: answers do not depend on it
    serve = ServeConfig(model=str(tmp_path / "ckpt"), mesh="1x1", slots=1, length_buckets=(32,), block_buckets=(8,),
                        default_block_length=8, profile=str(tmp_path / "profile.json"), allow_unused_devices=True,
                        default_slo_ms=600_000)
    server = ServerThread(build_cluster(serve, say=lambda _m: None)).ready()
    prompt = [40, 41, 150, 12]
    try:
        with server.client() as c:
            code, details = status_of(lambda: c.generate("hello", max_new_tokens=8))
            reply = c.generate(prompt, max_new_tokens=8, block_length=8, tau_min=0.9, tau_max=0.9)
    finally:
        server.stop()
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(tmp_path / "ckpt") in details and all(name in details for name in NAMED_FILES)
    model = load_model(tmp_path / "ckpt")
    decoder = SlotDecoder(model.config, model.graphdef, model.params, DecoderConfig(1, (32,), (8,), CacheMode.DUAL),
                          warm_up=False, progress=False)
    (want,), _ = generate_many(decoder, [DecodeRequest(tuple(prompt), 8, 8, 0.9)])
    assert list(reply.token_ids) == want.answer[:8] and reply.text == ""
