"""One source tree's side of the batch-scaling benchmark (bench/scaling.py), run as a script:

    python path/to/scaling_worker.py SOURCE_TREE CHECKPOINT [SLOT_SHARDS]

It imports `dilaserve_jax` from SOURCE_TREE (so two trees can be timed side by side in one run),
loads CHECKPOINT with `load_model` and answers JSON commands, one per line on stdin, with one JSON
line on stdout. It uses only the decoding API both trees share (SlotDecoder, generate_many), and
with SLOT_SHARDS > 1 decoders whose slots are split over that many devices
(DecoderConfig.slot_shards; trees that have it).

  {"op": "generate", "cache": "dual", "batch": 8, "prompt": 32, "answer": 128, "block": 32, "seed": 0}
      -> {"seconds", "cpu_seconds", "tokens", "digest"}: one generate_many over `batch` requests
      (τ 1, greedy) on a decoder with `batch` slots, built on first use; cpu_seconds is the process's
      CPU time meanwhile (all threads); digest hashes every answer in order. An optional
      "run_answer" decodes answers of that length instead on the same decoder (same canvas bucket,
      same executables): a cheaper warm-up. An optional "rows": [start, stop] decodes only those
      requests of the `batch` (on a decoder with stop - start slots), and "answers": true adds the
      answers themselves: how several workers split one cell between them (bench/scaling.py).
  {"op": "breakdown", ...same keys..., "repeats": 5, "top_ops": 0}
      -> bench/step_profile.py's timings of one refresh and one reuse step of that shape, loaded
      from the benchmark's own tree (the stage split needs the named scopes of that tree's steps),
      with each step's `top_ops` largest XLA operations.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path


def answers_digest(answers) -> str:
    """A short hash of the answers in order (token lists), as every side of the benchmark computes it."""
    return hashlib.sha256(json.dumps([list(a) for a in answers]).encode()).hexdigest()[:16]


def _load_step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", Path(__file__).with_name("step_profile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    tree, checkpoint = sys.argv[1], sys.argv[2]
    shards = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    sys.path.insert(0, tree)
    import numpy as np

    import dilaserve_jax
    from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
    from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
    from dilaserve_jax.models import load_model

    if not Path(dilaserve_jax.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"imported dilaserve_jax from {dilaserve_jax.__file__}, not from {tree}")
    model = load_model(checkpoint)
    decoders: dict[tuple, SlotDecoder] = {}

    def slots_for(batch: int) -> int:  # every shard holds as many slots (batch 1 on 2 shards: 2 slots)
        return -(-batch // shards) * shards

    def decoder(cmd: dict, slots: int) -> SlotDecoder:
        length = cmd["prompt"] + cmd["answer"]
        split = {"slot_shards": shards} if shards > 1 else {}
        return SlotDecoder(model.config, model.graphdef, model.params,
                           DecoderConfig(slots, (length,), (cmd["block"],), cmd["cache"], **split),
                           warm_up=False, progress=False)

    def requests(cmd: dict) -> list:
        rng = np.random.default_rng(cmd["seed"])
        low = max(model.config.mask_id, model.config.eos_id, model.config.pad_id) + 1
        answer = cmd.get("run_answer", cmd["answer"])
        return [DecodeRequest(tuple(rng.integers(low, model.config.vocab_size, cmd["prompt"]).tolist()),
                              answer, cmd["block"], 1.0) for _ in range(cmd["batch"])]

    print(json.dumps({"ready": dilaserve_jax.__file__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            start, stop = cmd.get("rows", (0, cmd["batch"]))
            key = (cmd["cache"], stop - start, cmd["prompt"], cmd["answer"], cmd["block"])
            if key not in decoders:
                decoders[key] = decoder(cmd, slots_for(stop - start))
            cpu0 = time.process_time()
            results, stats = generate_many(decoders[key], requests(cmd)[start:stop])
            cpu = time.process_time() - cpu0
            answers = [r.answer for r in results]
            reply = {"seconds": stats.wall_seconds, "cpu_seconds": cpu, "tokens": stats.committed,
                     "digest": answers_digest(answers), "answer_tokens": [len(a) for a in answers]}
            if cmd.get("answers"):
                reply["answers"] = [list(a) for a in answers]
        elif cmd["op"] == "breakdown":
            profile = _load_step_profile()
            reply = {}
            for kind, refresh in (("refresh", True), ("reuse", False)):
                dec = decoder(cmd, slots_for(cmd["batch"]))  # throwaway: direct executable calls bypass its mirror
                slots = list(range(cmd["batch"]))
                for slot, req in zip(slots, requests(cmd)):
                    dec.admit(slot, req.prompt, req.answer_length, req.block_length)
                dec.step(profile.step_kind(dec, True), slots, [1.0] * len(slots))
                parts = profile.time_step_parts(dec, refresh, slots, cmd["repeats"])
                parts["shape"] = str(parts["shape"])
                parts.update(profile.stage_profile(dec, refresh, slots, repeats=3, top_ops=cmd.get("top_ops", 0)))
                reply[kind] = parts
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
