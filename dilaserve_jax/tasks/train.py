"""`python -m dilaserve_jax.tasks.train`: train the tiny masked-diffusion LM on the task suite.

The output directory holds model_config.json and orbax steps of the parameters (a pure dict, the
format `load_model(dir)` and the serving weight reload read), plus `train_state/` (optimizer state
and progress) for resuming. `--export DIR` writes the final model as a bf16 LLaDA-format
checkpoint with TRAINING.json / TRAINING.md records next to it.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging

log = logging.getLogger(__name__)
DEFAULT_WEIGHTS = {"sort": 1.6, "upper": 0.4, "repeat": 0.5, "altcase": 0.9}


@dataclass(frozen=True, slots=True)
class TrainConfig:
    out: str = opt("runs/tiny", "training directory")
    model: str = opt("tiny", "model preset")
    steps: int = opt(640, "optimizer steps")
    batch_tokens: int = opt(6144, "tokens per batch incl. padding")
    lr: float = opt(2e-3, "peak learning rate")
    warmup: int = opt(40, "warm-up steps")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    clip: float = opt(1.0, "global gradient-norm clip")
    eps: float = opt(1e-3, "smallest mask probability (bounds the 1/p loss weights)")
    seed: int = opt(0, "init, data and masking seed")
    compute_dtype: str = opt("bfloat16", "activation dtype while training (params and optimizer stay float32)",
                             choices=("float32", "bfloat16"))
    checkpoint_every: int = opt(100, "steps between checkpoints")
    weights: dict = opt(DEFAULT_WEIGHTS, "task mix as JSON, e.g. '{\"sort\": 1, \"repeat\": 0.5}'", parse=json.loads)
    export: str | None = opt(None, "write the final model as a bf16 LLaDA checkpoint + TRAINING.json/md to DIR "
                                   "(dilaserve_jax/assets/tiny replaces the embedded model)", metavar="DIR")

    def __post_init__(self):
        from dilaserve_jax.tasks.suite import TASKS

        for name in ("steps", "batch_tokens", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (self.lr > 0 and self.clip > 0 and 0 < self.eps < 1 and self.warmup >= 0):
            raise ValueError("need lr > 0, clip > 0, 0 < eps < 1, warmup >= 0")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        unknown = set(self.weights) - set(TASKS)
        if unknown or not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"weights need known tasks ({', '.join(TASKS)}) and one positive weight")


def _tree_leaves_abstract(tree):
    import jax

    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


class _Checkpoints:
    """Params (pure dict) at out/<step>; optimizer leaves + progress at out/train_state/<step>."""

    def __init__(self, out: Path):
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=3, create=True)
        self.params = ocp.CheckpointManager(out.absolute(), options=opts)
        self.state = ocp.CheckpointManager((out / "train_state").absolute(), options=opts)

    def latest(self) -> int | None:
        return self.state.latest_step()  # written last, so a step here has its params too

    def save(self, step: int, params, opt_state, progress: dict) -> None:
        import jax
        import orbax.checkpoint as ocp
        from flax import nnx

        self.params.save(step, args=ocp.args.StandardSave(nnx.to_pure_dict(params)))
        self.params.wait_until_finished()
        self.state.save(step, args=ocp.args.Composite(
            opt=ocp.args.StandardSave(jax.tree.leaves(opt_state)), progress=ocp.args.JsonSave(progress)))
        self.state.wait_until_finished()

    def restore(self, step: int, params, opt_state):
        import jax
        import orbax.checkpoint as ocp
        from flax import nnx

        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(params))
        nnx.replace_by_pure_dict(params, self.params.restore(step, args=ocp.args.StandardRestore(target)))
        got = self.state.restore(step, args=ocp.args.Composite(
            opt=ocp.args.StandardRestore(_tree_leaves_abstract(opt_state)), progress=ocp.args.JsonRestore()))
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), list(got.opt))
        return params, opt_state, dict(got.progress)

    def close(self):
        self.params.close()
        self.state.close()


def train(cfg: TrainConfig, command: str = "", progress_bar: bool = True, export_only: bool = False) -> dict:
    """Train (or resume) and return the training record; export_only: export the latest step as is."""
    import jax
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    from dilaserve_jax.models.config import preset
    from dilaserve_jax.models.llada import init_model
    from dilaserve_jax.models.registry import save_model_config
    from dilaserve_jax.tasks.data import batches
    from dilaserve_jax.tasks.objective import make_optimizer, make_train_step

    out = Path(cfg.out)
    model_cfg = preset(cfg.model)
    save_model_config(out, model_cfg)  # serving config: the preset's own activation dtype
    graphdef, params = nnx.split(init_model(model_cfg.replace(dtype=cfg.compute_dtype), cfg.seed))
    optimizer = make_optimizer(cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay, cfg.clip)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(graphdef, optimizer, mask_id=model_cfg.mask_id, eps=cfg.eps)
    ckpt = _Checkpoints(out)
    start, progress = 0, {"wall_seconds": 0.0, "losses": [], "commands": []}
    latest = ckpt.latest()
    if latest is not None:
        params, opt_state, progress = ckpt.restore(latest, params, opt_state)
        start = latest
        log.info(f"resuming from step {start} in {out}")
    data = batches(cfg.seed, cfg.batch_tokens, cfg.weights)
    for _ in range(start):  # replay the data stream so a resumed run sees the same batches
        next(data)
    base_key = jax.random.key(cfg.seed)
    losses: list[float] = list(progress["losses"])
    end = start if export_only else cfg.steps
    commands = list(progress.get("commands", []))
    if end > start:
        commands.append({"command": command, "from_step": start, "to_step": end})
    wall = float(progress["wall_seconds"])
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=not progress_bar,
               file=sys.stderr, dynamic_ncols=True)
    t_seg, tokens_seg, ema = time.perf_counter(), 0, None
    for step in range(start, end):
        batch = next(data)
        params, opt_state, loss = step_fn(params, opt_state, jax.random.fold_in(base_key, step),
                                          batch.tokens, batch.answer_mask, batch.valid_len)
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step}")
        losses.append(loss)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        tokens_seg += int(batch.valid_len.sum())
        now = time.perf_counter()
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tokens_seg / max(now - t_seg, 1e-9):.0f}")
        bar.update(1)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == end:
            wall += now - t_seg
            t_seg, tokens_seg = time.perf_counter(), 0
            ckpt.save(done, params, opt_state, {"wall_seconds": wall, "losses": losses, "commands": commands})
    bar.close()
    ckpt.close()
    tail = losses[-50:]
    record = {
        "command": command, "history": commands, "seed": cfg.seed, "steps": end, "resumed_from": start,
        "final_loss": round(float(np.mean(tail)), 4) if tail else None,
        "final_loss_window": len(tail), "wall_seconds": round(wall, 1),
        "config": asdict(cfg), "model": asdict(model_cfg),
        "num_params": model_cfg.num_params, "jax_version": jax.__version__,
    }
    if cfg.export:
        export(cfg.export, model_cfg, params, record)
    return record


def _segments(history: list[dict]):
    """(command entry, last step it actually ran): a resume from an earlier step cuts the one before."""
    ends = [h["from_step"] for h in history[1:]] + [history[-1]["to_step"] if history else 0]
    return [(h, min(h["to_step"], e)) for h, e in zip(history, ends)]


def export(directory: str | Path, model_cfg, params, record: dict) -> None:
    """Write params as a bf16 LLaDA-format checkpoint plus the training record."""
    import jax
    import jax.numpy as jnp

    from dilaserve_jax.models.hf import save_hf_checkpoint

    directory = Path(directory)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    save_hf_checkpoint(directory, model_cfg, bf16,
                       extra_config={"dilaserve_tokenizer": "char", "torch_dtype": "bfloat16"})
    (directory / "TRAINING.json").write_text(json.dumps(record, indent=1) + "\n")
    c = record["config"]
    (directory / "TRAINING.md").write_text(
        "# How the embedded tiny model was trained\n\n"
        + "".join(f"- steps {h['from_step']}-{end}: `{h['command']}`\n" for h, end in _segments(record["history"]))
        + f"- seed {record['seed']}, {record['steps']} steps of ~{c['batch_tokens']} tokens, "
        f"AdamW lr {c['lr']} (warm-up {c['warmup']}, cosine to 10%), clip {c['clip']}, "
        f"compute {c['compute_dtype']}\n"
        f"- task weights: {c['weights']}\n"
        f"- final loss (mean of last {record['final_loss_window']} steps): {record['final_loss']}\n"
        f"- wall time: {record['wall_seconds']} s; {record['num_params']:,} parameters, "
        f"jax {record['jax_version']}\n"
        "- weights stored as bfloat16 safetensors (LLaDA names); character tokenizer (id = ord(c))\n")


@dataclass(frozen=True, slots=True)
class TrainCommand:
    """How this run goes, beside what it trains (TrainConfig, which the training record keeps)."""

    export_only: bool = opt(False, "do not train: export the latest checkpoint of --out to --export")
    progress: bool = opt(True, "progress bar on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.tasks.train",
        description="Train the tiny masked-diffusion LM on the synthetic task suite (masked-diffusion "
                    "objective, AdamW + warm-up + cosine decay, orbax checkpoints with resume). Re-running "
                    "with the same --out resumes from its latest checkpoint.")
    add_config_arguments(p, TrainConfig)
    return add_config_arguments(p, TrainCommand)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, command = config_from_args(TrainConfig, args, parser), config_from_args(TrainCommand, args, parser)
    if command.export_only and not cfg.export:
        parser.error("--export-only needs --export DIR")
    setup_logging(log)
    record = train(cfg, "python -m dilaserve_jax.tasks.train " + shlex.join(argv), progress_bar=command.progress,
                   export_only=command.export_only)
    print(json.dumps({k: record[k] for k in ("steps", "final_loss", "wall_seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
