"""Offline generation with the reference sampler: `python -m dilaserve_jax.generate --model tiny "prompt"`."""
from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.generate",
        description="Generate an answer offline with the reference (uncached) diffusion sampler and print "
                    "it with the number of denoising steps and the time taken.")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--model", default="tiny", help="preset name (tiny, test) or checkpoint directory (default: tiny)")
    p.add_argument("--gen-length", type=int, default=64, help="answer area in tokens (default 64)")
    p.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block length (default 32)")
    p.add_argument("--threshold", type=float, default=0.9, help="confidence threshold tau in (0, 1] (default 0.9)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = Gumbel sampling")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--attention", default=None, choices=("auto", "xla", "pallas"), help="attention implementation")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dilaserve_jax.decoding.reference import generate
    from dilaserve_jax.models import load_model

    try:
        t0 = time.perf_counter()
        model = load_model(args.model, attention=args.attention)
        load_s = time.perf_counter() - t0
        prompt = model.tokenizer.encode(args.prompt)
        result = generate(model.graphdef, model.params, model.config, prompt, args.gen_length,
                          args.block_length, args.threshold, args.temperature, args.seed)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = model.tokenizer.decode(result.answer)
    if args.json:
        print(json.dumps({"model": model.source, "answer": text, "tokens": result.answer, "steps": result.steps,
                          "committed_per_step": result.committed_per_step, "seconds": round(result.seconds, 4)}))
    else:
        print(text)
        print(f"[{model.source}] {len(result.answer)} tokens in {result.steps} steps, "
              f"{result.seconds:.3f} s (includes compilation; model load {load_s:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
