"""The allocator snapshot's peak: the live blocks walked back from the end through the trace."""

import torch

from trainer.observe.memory_snapshot import live_at_peak, origin, report, side_stream_bytes

OURS = [{"filename": "/x/trainer/run/loop.py", "line": 7, "name": "train_step"}]
TORCH = [{"filename": "/y/torch/optim/adamw.py", "line": 3, "name": "step"}]


def snapshot():
    """Blocks of 100 (weights, before recording) and 40 live at the end; during the trace 50 (our
    code, from torch's optimizer) and 30 were allocated and freed: the peak (220) had 100, 40, 50,
    30."""
    segments = [{"device": 0, "address": 1000, "stream": 0, "total_size": 200, "blocks": [
        {"size": 100, "state": "active_allocated"},
        {"size": 60, "state": "inactive"},
        {"size": 40, "state": "active_allocated", "frames": OURS}]}]
    trace = [{"action": "alloc", "addr": 1100, "size": 50, "frames": OURS + TORCH},
             {"action": "alloc", "addr": 2000, "size": 30, "frames": OURS},
             {"action": "alloc", "addr": 1160, "size": 40, "frames": OURS},
             {"action": "free_requested", "addr": 1100, "size": 50, "frames": []},
             {"action": "free_completed", "addr": 1100, "size": 50, "frames": []},
             {"action": "free_completed", "addr": 2000, "size": 30, "frames": []},
             {"action": "alloc", "addr": 3000, "size": 10, "frames": []},
             {"action": "free_completed", "addr": 3000, "size": 10, "frames": []}]
    return {"segments": segments, "device_traces": [trace]}


def test_the_peak_is_the_largest_live_set_and_names_its_blocks():
    peak, at, blocks = live_at_peak(snapshot())
    assert (peak, at) == (220, 2)
    assert sorted(b["size"] for b in blocks) == [30, 40, 50, 100]
    assert {b["address"]: b["frames"] for b in blocks}[1100] == OURS + TORCH  # from its alloc event
    assert origin(OURS + TORCH) == "loop.py:7 train_step <- adamw.py:3 step"
    weight = torch.empty(25)  # 100 bytes, standing for a block allocated before recording
    text = report(snapshot() | {"segments": [{**snapshot()["segments"][0],
                                              "address": weight.data_ptr()}],
                                "device_traces": [[]]}, {"weights": [weight]})
    assert "peak 0.00 GiB" in text and "weights" in text


def test_side_streams_reserve_what_their_segments_hold():
    side = {"device": 0, "address": 5000, "stream": 7, "total_size": 64,
            "blocks": [{"size": 64, "state": "inactive"}]}
    data = snapshot()
    assert side_stream_bytes(data) == 0
    assert side_stream_bytes(data | {"segments": [*data["segments"], side]}) == 64
