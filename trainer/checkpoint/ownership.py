"""Which checkpoints a run may delete, clean up or resume: only those it can prove it wrote.

Every save records its run in the manifest: an id drawn when a run starts afresh and kept by the
runs that go on from its checkpoints (resume=auto); an explicit checkpoint.resume=PATH branches off
as a new run. An unfinished save carries a marker from its first moment. So rotation deletes only
the run's own checkpoints, never the one just published; start-up removes only marked unfinished
saves; and before its first save a run renames aside (never deletes) every checkpoint in its folder
that it does not continue, so that no later rerun resumes it or rotation takes it by mistake.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from trainer.checkpoint.folders import MANIFEST, checkpoint_steps, run_of
from trainer.safe_write import move_aside

# In a save's folder from its first moment (and in the checkpoint it becomes): the run's id.
SAVE_MARKER = ".trainer-save"


def continued_run(resume: str, resumed: Path | None) -> str:
    """The run a job is: under resume=auto, the resumed checkpoint's own; else (a fresh start, a
    checkpoint of a version that recorded none, or resume=PATH) a new one."""
    inherited = run_of(resumed) if resumed is not None and resume == "auto" else None
    return inherited or uuid.uuid4().hex


def is_own_save(folder: Path) -> bool:
    return (folder / SAVE_MARKER).is_file()


def start_save(tmp: Path, run: str, log) -> None:
    """Rank 0: the folder of a save, marked from its first moment. One of that name left by an
    unfinished save of ours is removed first; one that is not ours is moved aside, kept."""
    if tmp.exists():
        if is_own_save(tmp):
            shutil.rmtree(tmp)
        else:
            log(f"checkpoint: {tmp} is not a save of this trainer (no {SAVE_MARKER}): moved it "
                f"to {move_aside(tmp, 'kept')}")
    tmp.mkdir(parents=True)
    (tmp / SAVE_MARKER).write_text(run)


def clean_unfinished(folder: Path, log) -> None:
    """Rank 0 at start-up: the unfinished saves (step_N.tmp) of this trainer are removed; any other
    folder of such a name is left as it is, and said."""
    others = []
    for stale in sorted(folder.glob("step_*.tmp")):
        if is_own_save(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            others.append(stale.name)
    if others:
        log(f"checkpoint: left {', '.join(others)} in {folder} as they are: not unfinished saves "
            f"of this trainer (no {SAVE_MARKER})")


def set_aside_others(folder: Path, run: str, resumed: Path | None, log) -> None:
    """Rank 0, before a run's first save: each published checkpoint in `folder` that the run does
    not continue is renamed aside, byte for byte: another run's (step_N.before-DATE), and the run's
    own newer than the one resumed, which resume=auto skipped as damaged (step_N.damaged-DATE)."""
    resumed_step = (int(resumed.name.partition("_")[2])
                    if resumed is not None and resumed.name.partition("_")[2].isdigit() else None)
    moved = []
    for step, path in checkpoint_steps(folder):
        if path == resumed or not (path / MANIFEST).is_file():
            continue
        own = run_of(path) == run
        if own and resumed_step is not None and step <= resumed_step:
            continue
        moved.append(f"{path.name} -> {move_aside(path, 'damaged' if own else 'before').name}")
    if moved:
        log(f"checkpoint: set aside {len(moved)} checkpoint{'s' if len(moved) > 1 else ''} this "
            f"run does not continue, kept as they are, never resumed or rotated by it: "
            f"{', '.join(moved)}")


def rotate(folder: Path, run: str, keep_last: int, published: Path) -> None:
    """Rank 0, after publishing `published`: deletes the run's own older checkpoints beyond the
    newest `keep_last` (`published` among them; 0 keeps all)."""
    if keep_last <= 0:
        return
    own = [path for _, path in checkpoint_steps(folder)
           if path != published and run_of(path) == run]
    for old in own[:max(0, len(own) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)
