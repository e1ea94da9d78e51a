"""Save and restore model parameters with orbax-checkpoint (a CheckpointManager directory)."""
from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx


def _manager(directory: str | Path, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save_params(directory: str | Path, step: int, params, max_to_keep: int | None = None) -> None:
    """Save an nnx params state (or a pure dict of arrays) as `step` under directory."""
    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    with _manager(directory, max_to_keep) as mngr:
        mngr.save(step, args=ocp.args.StandardSave(pure))
        mngr.wait_until_finished()


def latest_step(directory: str | Path) -> int | None:
    with _manager(directory) as mngr:
        return mngr.latest_step()


def restore_params(directory: str | Path, abstract_params, step: int | None = None):
    """Restore into the structure (and shardings, if set) of abstract_params; latest step by default.

    abstract_params: an nnx State of arrays or ShapeDtypeStructs. Returns (step, params state).
    """
    with _manager(directory) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint steps in {directory}")
        if step not in mngr.all_steps():
            raise FileNotFoundError(f"checkpoint step {step} not in {directory} (have {sorted(mngr.all_steps())})")
        target = jax.tree_util.tree_map(_as_abstract, nnx.to_pure_dict(abstract_params))
        pure = mngr.restore(step, args=ocp.args.StandardRestore(target))
    nnx.replace_by_pure_dict(abstract_params, pure)
    return step, abstract_params


def _as_abstract(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
