"""`serve --watch-checkpoints DIR`: swap in each new step an orbax training directory finalizes.

A half-written step is never read. Orbax's CheckpointManager writes a step into a temporary
directory `<step>.orbax-checkpoint-tmp-<timestamp>` and only after every array and metadata file
of the step is written (and, on orbax 0.12, a `commit_success.txt` marker inside it) renames it to
`<step>` -- one atomic rename on a local/POSIX file system. On object stores without atomic
rename (GCS) orbax instead treats a step as final only once its `commit_success.txt` exists. The
watcher lists steps with orbax's own `checkpoint_steps`, which returns only steps that pass that
finalization check (`is_checkpoint_finalized`), and then restores exactly that step number; a
directory still under its temporary name is never listed, so it is never opened.

A step that is finalized but unreadable (corrupt, deleted meanwhile by the trainer's
`max_to_keep`, another architecture) is skipped with a logged error and never retried; the
weights being served stay. A step is swapped in through `Cluster.reload`, the path of the
`ReloadWeights` call: requests in flight continue on the new weights from a refresh step.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from dilaserve_jax.serving.cluster.cluster import Cluster, ClusterBusy
from dilaserve_jax.serving.cluster.state import CheckpointWatchState

log = logging.getLogger(__name__)


def finalized_steps(directory: str | Path) -> list[int]:
    """Steps orbax considers complete in `directory`, ascending (temporary directories excluded)."""
    from orbax.checkpoint.path import step as step_lib

    return sorted(step_lib.checkpoint_steps(Path(directory).absolute()))


class CheckpointWatcher:
    """Polls `directory` every `interval_s` and reloads the newest finalized step above the one
    served (steps up to `after_step` are taken as already served)."""

    def __init__(self, cluster: Cluster, directory: str | Path, *, interval_s: float = 10.0,
                 after_step: int | None = None, say: Callable[[str], None] | None = None):
        if interval_s <= 0:
            raise ValueError(f"watch interval must be positive, got {interval_s}")
        self.cluster, self.directory, self.interval_s = cluster, Path(directory), interval_s
        self._say = say or log.info
        self._lock = threading.Lock()  # one poll at a time (the thread, or a caller's poll())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_step = after_step  # the newest step swapped in (or served from the start)
        self.skipped: dict[int, str] = {}  # step -> why it could not be swapped in
        self.reloads = 0
        self.polls = 0
        self.last_error = ""
        self.last_reload_seconds = 0.0
        cluster.checkpoint_watch = self.status

    def start(self) -> "CheckpointWatcher":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="checkpoint-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad poll
                log.exception("checkpoint watch: poll of %s failed", self.directory)
            self._stop.wait(self.interval_s)

    def poll(self) -> int | None:
        """One look at the directory; returns the step swapped in, if any."""
        with self._lock:
            self.polls += 1
            try:
                steps = finalized_steps(self.directory)
            except OSError as err:  # the directory may not exist yet
                self.last_error = f"cannot list {self.directory}: {err}"
                return None
            fresh = [s for s in steps if (self.last_step is None or s > self.last_step) and s not in self.skipped]
            if not fresh:
                return None
            step = fresh[-1]
            try:
                report = self.cluster.reload(str(self.directory), step, origin="watch")
            except ClusterBusy:  # a reload or reconfiguration is running: try again at the next poll
                return None
            except Exception as err:  # noqa: BLE001 - any unreadable step is skipped, the old weights stay
                reason = f"{type(err).__name__}: {err}"
                self.skipped[step], self.last_error = reason, f"step {step}: {reason}"
                log.error("checkpoint watch: skipping step %d of %s, the old weights keep serving: %s", step,
                          self.directory, reason)
                return None
            self.last_step, self.last_reload_seconds = step, report.seconds
            self.reloads += 1
            self._say(f"checkpoint watch: step {step} of {self.directory} swapped in ({report.seconds:.2f} s)")
            return step

    def status(self) -> CheckpointWatchState:
        return CheckpointWatchState(str(self.directory), -1 if self.last_step is None else self.last_step,
                                    self.reloads, len(self.skipped), self.last_error, self.last_reload_seconds,
                                    self.polls)


def served_step(model_source: str, directory: str | Path) -> int | None:
    """The step of `directory` being served at start-up ("orbax:DIR@STEP"), if that is the source."""
    kind, _, rest = model_source.partition(":")
    if kind != "orbax" or "@" not in rest:
        return None
    path, step = rest.rsplit("@", 1)
    same = Path(path).expanduser().resolve() == Path(directory).expanduser().resolve()
    return int(step) if same and step.isdigit() else None

