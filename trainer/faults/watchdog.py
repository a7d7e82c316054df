"""Turns a hang into an error. A thread on every rank watches the step loop: when a step (or a
checkpoint save, or a validation) runs past its time, it prints where this rank is (the step, the
phase, the last collective it entered on each of its process groups, the Python stacks), writes
the same report and torch's flight-recorder trace under output_dir, and ends the process with a
non-zero status, so that torchrun or Slurm can restart the job from its last checkpoint.

Side by side, the ranks' reports show which rank is missing from which collective: the ranks
waiting in a collective name it with its sequence number on its group, and the rank that never
arrived names an older one, or shows in its stack what it is doing instead.

Marking a phase is an attribute write: nothing is synchronised and nothing waits on the device.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from trainer.step_parts import StepPart

EXIT_STATUS = 3  # a rank the watchdog stopped; different from a Python error's 1
# Every rank of a hung job fires within a short time of the others; each waits this long after
# writing its report before exiting, so that the launcher, which stops the other ranks once one
# has exited, does not cut their reports short.
GRACE_S = 5.0
# Collectives the flight recorder keeps per process (torch's ring buffer).
TRACE_ENTRIES = 2000


def enable_flight_recorder(output_dir: str) -> None:
    """Has torch record each collective (and NCCL dump its record on a timeout) into
    output_dir/flight_recorder/rank_N. Read at process-group creation: call before it. A user's own
    settings win."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(TRACE_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE",
                          str(Path(output_dir, "flight_recorder", "rank_")))


def flight_record(json_form: bool):
    """This process's flight-recorder record: JSON text, or the pickle NCCL's own dumps are. The
    dump functions are private in torch 2.13; kept to this one function. None when the recorder is
    off or unavailable."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json
        return _dump_fr_trace_json(True, False) if json_form else _dump_fr_trace(True, True, False)
    except Exception:  # noqa: BLE001 - a report without the record is still a report
        return None


def last_collectives(now_ns: int, groups: dict[str, str]) -> list[str]:
    """One line per process group: the last collective this rank entered on it. `groups` names the
    mesh dimensions of each group, by the group's name."""
    record = flight_record(json_form=True)
    if record is None:
        return ["(no flight record: TORCH_FR_BUFFER_SIZE is 0)"]
    last = {}
    for entry in json.loads(record).get("entries", []):
        last[tuple(entry["process_group"])] = entry
    lines = []
    for (name, desc), e in sorted(last.items(), key=lambda item: item[1]["time_created_ns"],
                                  reverse=True):
        group = groups.get(name) or desc.removeprefix("mesh_") or name
        seq = e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"]
        op = e["profiling_name"].partition(":")[2] or e["profiling_name"]
        shapes = ", ".join(str(list(s)) for s in e.get("input_sizes", []))
        age = (now_ns - e["time_created_ns"]) / 1e9
        lines.append(f"{group}: {op} #{seq} of shape {shapes} "
                     f"{', '.join(e.get('input_dtypes', []))}, entered {age:.1f}s ago")
    return lines or ["(none yet)"]


def thread_stacks() -> str:
    """The Python stack of every thread but this one, the main thread first."""
    frames = sys._current_frames()
    threads = sorted(threading.enumerate(), key=lambda t: t is not threading.main_thread())
    out = []
    for thread in threads:
        if thread.ident == threading.get_ident() or thread.ident not in frames:
            continue
        out.append(f"thread {thread.name}:\n"
                   + "".join(traceback.format_stack(frames[thread.ident])))
    return "".join(out)


class Watchdog(StepPart):
    """Watches this rank's steps, as a step part. `start_step(n)` opens step n with `step_timeout_s`
    to finish (the first one gets `timeout_s`: compilation and warm-up), `phase(name)` says what it
    is doing, `slow(name)` starts a phase allowed `timeout_s` (a checkpoint save, a validation)."""

    def __init__(self, step_timeout_s: float | None, timeout_s: float, output_dir: str):
        self.step_timeout_s, self.timeout_s, self.output_dir = (step_timeout_s, timeout_s,
                                                                Path(output_dir))
        self.rank = dist.get_rank()
        self.current, self.name = 0, "start-up"
        # the mesh dimensions of each process group, once there is a mesh
        self.groups: dict[str, str] = {}
        self.started = time.monotonic()
        # the key and the seconds the current step may take
        self.limit = ("distributed.timeout_s", timeout_s)
        self.stopped = threading.Event()
        self.first = True
        if step_timeout_s is not None:
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def start_step(self, n: int) -> None:
        if self.step_timeout_s is None:
            return
        self.current, self.name, self.started = n, "data", time.monotonic()
        if self.first:
            self.first = False
            self.limit = ("distributed.timeout_s", self.timeout_s)
        else:
            self.limit = ("distributed.step_timeout_s", self.step_timeout_s)

    def allow_slow_step(self) -> None:
        """The next step may take `timeout_s`, like the first (it compiles again)."""
        self.first = True

    def phase(self, name: str) -> None:
        self.name = name

    def before_forward(self, step: int) -> None:
        self.phase("forward")

    def after_backward(self, step: int) -> None:
        self.phase("optimizer")

    def enter(self, phase: str, long: bool = False) -> None:
        if long:
            self.slow(phase)
        else:
            self.phase(phase)

    def slow(self, name: str) -> None:
        self.name, self.started = name, time.monotonic()
        self.limit = ("distributed.timeout_s", self.timeout_s)

    def shutdown(self) -> None:
        """Stops watching (the job's last act: the loop's parts close before it)."""
        self.stopped.set()

    def _watch(self) -> None:
        poll = min(5.0, self.step_timeout_s / 10)
        while not self.stopped.wait(poll):
            if time.monotonic() > self.started + self.limit[1]:
                self._fire()

    def _fire(self) -> None:
        waited = time.monotonic() - self.started
        head = f"watchdog: rank {self.rank}"
        report = "\n".join([
            f"{head}: step {self.current}, phase {self.name}: no progress for {waited:.1f}s "
            f"({self.limit[0]}={self.limit[1]:g})",
            *(f"{head}: last collective on {line}"
              for line in last_collectives(time.time_ns(), self.groups)),
            f"{head}: Python stacks:",
            thread_stacks().rstrip(),
        ])
        saved = self._save(report)
        sys.stderr.write(f"{report}\n{head}: {saved}exiting with status {EXIT_STATUS} (a launcher "
                         "with restarts resumes from the last checkpoint)\n")
        sys.stderr.flush()
        time.sleep(GRACE_S)
        os._exit(EXIT_STATUS)

    def _save(self, report: str) -> str:
        """Writes the report and the flight record under output_dir; says where."""
        try:
            folder = self.output_dir / "watchdog"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank_{self.rank}.txt").write_text(report + "\n")
            record = flight_record(json_form=False)
            if record is not None:
                traces = self.output_dir / "flight_recorder"
                traces.mkdir(exist_ok=True)
                (traces / f"rank_{self.rank}").write_bytes(record)
            return f"report in {folder}/rank_{self.rank}.txt; "
        except OSError as e:
            return f"report not saved ({e}); "

