"""The CUDA allocator's history around one step (`metrics.memory_snapshot_step`), and what was live
at its peak.

Recording starts as the step before it begins, so that everything the steady state allocates (the
optimizer's state exists from the first update on) carries the stack that allocated it. After the
step, each rank writes `output_dir/memory/rank_R.pickle` (drop it on https://pytorch.org/memory_viz)
and `rank_R.txt`: the tensors live at the recorded peak, grouped by where they were allocated, those
allocated before recording named by what they are (weights, gradients, optimizer state).
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from pathlib import Path

import torch

from trainer.step_parts import StepPart
from trainer.tensors import local_tensor

GIB = 2**30
# allocator events kept: two steps of a large model hold a few hundred thousand
MAX_ENTRIES = 2_000_000


def _record_history(enabled: bool) -> None:
    # torch.cuda.memory's history recorder and snapshot are documented but still underscored (2.13).
    torch.cuda.memory._record_memory_history("all" if enabled else None, stacks="python",
                                             max_entries=MAX_ENTRIES)


def _snapshot() -> dict:
    return torch.cuda.memory._snapshot()


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, int, list[dict]]:
    """(peak bytes, the trace event index after which it was reached, the blocks live then) from an
    allocator snapshot: its live blocks at the end walked back through the recorded trace. A block
    is {"address", "size", "frames"} (frames: [] when allocated before recording began)."""
    live = {b["address"]: {"address": b["address"], "size": b["size"],
                           "frames": b.get("frames", [])}
            for segment in snapshot["segments"] if segment.get("device", device) == device
            for b in _blocks(segment) if b["state"] == "active_allocated"}
    trace = snapshot["device_traces"][device] if snapshot["device_traces"] else []
    total = sum(b["size"] for b in live.values())
    peak, at = total, len(trace) - 1
    for i in range(len(trace) - 1, -1, -1):  # the state after event i is `total`; undo event i
        event = trace[i]
        if event["action"] == "alloc":
            total -= event["size"]
        elif event["action"] == "free_completed":
            total += event["size"]
        if total >= peak and i > 0:  # (the earliest event reaching it)
            peak, at = total, i - 1
    for event in reversed(trace[at + 1:]):  # the live set after event `at`
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            live[event["addr"]] = {"address": event["addr"], "size": event["size"], "frames": []}
    allocated = {e["addr"]: e["frames"] for e in trace[:at + 1] if e["action"] == "alloc"}
    for block in live.values():
        block["frames"] = block["frames"] or allocated.get(block["address"], [])
    return peak, at, sorted(live.values(), key=lambda b: -b["size"])


def side_stream_bytes(snapshot: dict, device: int = 0) -> int:
    """Bytes the allocator holds for streams other than the default one (stream 0): memory that
    only work on those streams can use. FSDP's communication streams should hold little of it."""
    return sum(s["total_size"] for s in snapshot["segments"] if s.get("device", device) == device
               and s["stream"] != 0)


def _blocks(segment: dict):
    address = segment["address"]
    for block in segment["blocks"]:
        yield {**block, "address": address}
        address += block["size"]


def origin(frames: list[dict]) -> str:
    """Where a block was allocated, in a line: the innermost frame of this trainer's code and the
    innermost of torch's (the allocating library call), or "-" when no stack was recorded."""
    ours = next((f for f in frames if "/trainer/" in f["filename"]), None)
    torch_frame = next((f for f in frames if "/torch/" in f["filename"]), None)
    named = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in (ours, torch_frame)
             if f is not None]
    return " <- ".join(named) or (f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "-")


def report(snapshot: dict, known: dict[str, list[torch.Tensor]], device: int = 0) -> str:
    """The blocks live at the recorded peak grouped by origin, largest first; a block holding one of
    `known`'s tensors (name -> tensors, e.g. the weights) is counted under that name."""
    peak, at, blocks = live_at_peak(snapshot, device)
    # (a CUDA device's addresses and the host's never overlap: every tensor can be looked up)
    starts = [(t.data_ptr(), name) for name, tensors in known.items() for t in tensors
              if t is not None]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for block in blocks:
        start, end = block["address"], block["address"] + block["size"]
        name = next((n for address, n in starts if start <= address < end), None)
        group = groups[name or origin(block["frames"])]
        group[0] += block["size"]
        group[1] += 1
    lines = [f"peak {peak / GIB:.2f} GiB of live tensors (after allocator event {at}); by origin:",
             *(f"{size / GIB:8.3f} GiB {count:6d} blocks  {name}"
               for name, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]))]
    return "\n".join(lines) + "\n"


def known_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What the report names blocks allocated before recording by: this rank's weights and
    optimizer state (gradients are allocated in each step's backward, so recorded)."""
    return {"weights": lambda: [local_tensor(p) for p in model.parameters()],
            "optimizer state": lambda: [local_tensor(v) for state in optimizer.state.values()
                                        for v in state.values()
                                        if isinstance(v, torch.Tensor)]}


class MemorySnapshot(StepPart):
    """Records the CUDA allocator from the start of step `step - 1` (or `step`) to the end of
    `step`; `known` maps names to a callable giving the tensors to name in the report
    (known_tensors)."""

    def __init__(self, step: int, output_dir: str, rank: int, device: torch.device, known: dict):
        self.step = step
        self.folder, self.rank, self.device, self.known = (Path(output_dir) / "memory", rank,
                                                           device, known)
        self.recording = False

    def start_step(self, step: int) -> None:
        if self.step is not None and not self.recording and step >= self.step - 1:
            _record_history(True)
            self.recording = True

    def after_step(self, step: int) -> None:
        if not self.recording or step != self.step:
            return
        torch.cuda.synchronize(self.device)
        snapshot = _snapshot()
        _record_history(False)
        self.recording = False
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank_{self.rank}.pickle", "wb") as f:
            pickle.dump(snapshot, f)
        known = {name: list(tensors()) for name, tensors in self.known.items()}
        text = report(snapshot, known, self.device.index or 0)
        (self.folder / f"rank_{self.rank}.txt").write_text(f"step {step}, rank {self.rank}\n{text}")

    def close(self) -> None:
        if self.recording:
            _record_history(False)
