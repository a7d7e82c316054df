"""Device profiles: a machine's figures as `scripts/plan.py --calibrate` measured them, in a JSON
file the plan reads wherever a device is named (`plan.device=<profile>`, `--device <profile>`).

A profile is `devices/<name>.json` in the repository, or any path ending in `.json`. It holds the
Device's fields (memory, peaks, link rates, the matmuls' efficiencies) and, for the record, how it
was made: the command, the date, and each calibration run's measured and predicted tokens/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from trainer.errors import ConfigError
from trainer.plan.devices import DEVICES, Device, Efficiency, measure_cpu

PROFILE_DIR = Path(__file__).resolve().parents[2] / "devices"


def get_device(name: str, memory_gib: float | None = None, world: int = 1) -> Device:
    """A device of the table, a profile, or `cpu`: this machine, timed (a matmul, memory shared by
    `world` ranks)."""
    if name == "cpu":
        device = measure_cpu(world)
    elif name in DEVICES:
        device = DEVICES[name]
    else:
        device = load_profile(name)
    return device if memory_gib is None else dataclasses.replace(device, memory_gib=memory_gib)


def profile_path(name: str) -> Path:
    return Path(name) if name.endswith(".json") else PROFILE_DIR / f"{name}.json"


def load_profile(name: str) -> Device:
    """The device a profile describes; a config error names a missing or unreadable one."""
    path = profile_path(name)
    try:
        fields = json.loads(path.read_text())["device"]
        fields["efficiency"] = Efficiency(**fields["efficiency"])
        return Device(**fields)
    except FileNotFoundError:
        known = ", ".join(["cpu", *DEVICES, *sorted(p.stem for p in PROFILE_DIR.glob("*.json"))])
        raise ConfigError(f"device {name} is unknown: no profile {path}; known: {known} "
                          f"(scripts/plan.py --calibrate --name {Path(name).stem} makes a profile "
                          "of this machine)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"device {name}: {path} is not a device profile ({type(e).__name__}: "
                          f"{e}); make it again with scripts/plan.py --calibrate") from None


def save_profile(device: Device, name: str, record: dict) -> Path:
    """Writes the profile, the device named after it (by a rename: a reader never sees half of it);
    `record`: how it was made. A profile already there is kept beside it,
    `NAME.json.before-DATE`."""
    path = profile_path(name)
    device = dataclasses.replace(device, name=path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    saved = {"device": dataclasses.asdict(device), "calibration": record}
    partial.write_text(json.dumps(saved, indent=1) + "\n")
    if path.exists():
        aside = path.with_name(f"{path.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        print(f"profile: the earlier {path.name} is kept as {aside}", flush=True)
    partial.replace(path)
    return path
