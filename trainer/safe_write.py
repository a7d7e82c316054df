"""Writing beside what is already there without losing it: an earlier file is moved aside (never
overwritten, never deleted), and new outputs are written under unique temporary names, then put in
place by a rename."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from trainer.errors import ConfigError


def aside_name(path: Path, tag: str) -> Path:
    """A free name beside `path` for keeping it, the tag and the time before its suffix
    (metrics.jsonl -> metrics.before-20261202-101500.jsonl), a folder's at its end
    (step_4 -> step_4.damaged-20261202-101500)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    file = path.suffix and not path.is_dir()
    stem, suffix = (path.stem, path.suffix) if file else (path.name, "")
    for n in range(1, 10_000):
        again = "" if n == 1 else f"-{n}"
        candidate = path.with_name(f"{stem}.{tag}-{stamp}{again}{suffix}")
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"no free name beside {path}")


def move_aside(path: Path, tag: str) -> Path:
    """Renames `path` to aside_name(path, tag); returns where it went."""
    aside = aside_name(path, tag)
    path.rename(aside)
    return aside


def temporary_beside(out: Path, folder: bool = False) -> Path:
    """A new, empty file (or folder) of a name no one else has, beside `out`, to write `out` into
    and rename: a crash leaves only it, and nothing of the same name is replaced."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.tmp-"
    if folder:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=out.parent)
        os.close(fd)
        path = Path(name)
    # (tempfile makes them private to their owner; the output is as open as any file written)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if folder else 0o666) & ~umask)
    return path


def check_new_output(out: Path, inputs=()) -> None:
    """A config error when output `out` exists (a file, or a folder that is not empty) or is one of
    `inputs`: nothing a user has is overwritten."""
    for source in inputs:
        if out.exists() and Path(source).exists() and os.path.samefile(source, out):
            raise ConfigError(f"{out} is also one of the inputs; write to a new path")
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if out.exists() or out.is_symlink():
        raise ConfigError(f"{out} exists{' and is not empty' if out.is_dir() else ''}; choose a "
                          "new path (nothing is overwritten)")
