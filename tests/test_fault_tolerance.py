"""Per-step fault tolerance (torchft): a lighthouse and two replica groups of two ranks (FSDP inside
each). A group killed mid-run costs the other no restart and no step, a group started again recovers
from its peer, and the losses are those of one uninterrupted job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ENV, REPO, WarmLauncher, read_metrics, train_metrics
from warm_run import WarmRun

pytest.importorskip("torchft")

STEPS = 32  # long enough that group 1, started again at step 8, finds group 0 still training
RUN = ("+recipe=llama_fsdp", "model=llama_debug", "+smoke=cpu", f"training.steps={STEPS}",
       "training.seq_len=64", "training.global_batch_size=8", "training.lr=3e-3",
       "training.warmup_steps=2", "metrics.log_every=1")
FT = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "fault_tolerance.enabled=true",
      "fault_tolerance.timeout_s=20", "distributed.timeout_s=60")
# losses, and each final weight tensor (relative norm); measured: 1.1e-7 and equal (0.0)
RTOL = 1e-5
LAYOUT_RTOL = 1e-4  # another layout: the fp32 parity bound
# group 1 is killed after its step 4, started again when group 0 is at step 8
KILL_AFTER, RESTART_AT = 4, 8


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """A process in a session of its own (so that it and its children are killed together)."""
    return subprocess.Popen(cmd, cwd=REPO, env={**ENV, **(env or {})}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _kill(process: subprocess.Popen | WarmRun) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def _steps_done(folder: Path) -> int:
    metrics = folder / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _wait_for(condition, what: str, processes: list[WarmRun], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for p in processes:
            assert p.poll() is None or p.returncode == 0, \
                f"a process exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def lighthouse(tmp_path):
    port = _free_port()
    process = _start([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas",
                      "1", "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "3000", "--bind",
                      f"127.0.0.1:{port}"],  # loopback only, as scripts/ft_local.sh starts it
                     tmp_path / "lighthouse.log")
    yield f"http://127.0.0.1:{port}"
    _kill(process)


def _group(group: int, address: str, out: Path, *extra: str) -> WarmRun:
    """A replica group of 2 ranks (tests/launch.py forked from the warm launcher, in a session of
    its own)."""
    overrides = [*RUN, *FT, *extra, f"fault_tolerance.replica_group={group}",
                 f"fault_tolerance.lighthouse={address}", f"output_dir={out}"]
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"group{group}.{int(time.time() * 1000)}.log").open("w") as log:
        return WarmLauncher.get().start(2, overrides, None, log)


def _lose_and_regain_group_1(address: str, out: Path,
                             *extra: str) -> tuple[list[dict], list[dict], float, str]:
    """Groups 0 and 1 train; group 1 is killed (SIGKILL, launcher and ranks) after its step
    KILL_AFTER and started again once group 0 is at step RESTART_AT. -> both groups' metrics, the
    seconds from the kill to group 0's next step, and the returning group's log."""
    groups = [_group(g, address, out, *extra) for g in (0, 1)]
    folders = [out / f"replica_group_{g}" for g in (0, 1)]
    try:
        _wait_for(lambda: _steps_done(folders[1]) >= KILL_AFTER, f"group 1 at step {KILL_AFTER}",
                  groups)
        survivor_pids = _session_pids(groups[0])
        killed_at = time.time()
        _kill(groups[1])
        _wait_for(lambda: _steps_done(folders[0]) >= RESTART_AT, f"group 0 at step {RESTART_AT}",
                  groups[:1])
        assert _session_pids(groups[0]) == survivor_pids, (
            "group 0's processes changed: it restarted")
        groups[1] = _group(1, address, out, *extra)
        for g in groups:
            assert g.wait(timeout=120) == 0
    finally:
        for g in groups:
            _kill(g)
    survivor = read_metrics(folders[0])
    # (a group that starts a moment after the other may receive the first step from it)
    first = survivor[0]["step"]
    assert [r["step"] for r in survivor] == list(range(first, STEPS + 1)), (
        "group 0 repeated or skipped a step")
    next_step = min(r["time"] for r in survivor if r["time"] > killed_at)
    returned_log = sorted(out.glob("group1.*.log"))[-1].read_text()
    # (its rows before the kill kept)
    returned = [r for r in read_metrics(folders[1]) if r["step"] > RESTART_AT]
    return survivor, returned, next_step - killed_at, returned_log


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_lost_group_costs_no_restart_and_a_returning_one_recovers_live(lighthouse, tmp_path):
    """The whole global batch every step: the curve and the final weights are those of the same two
    groups as one uninterrupted HSDP job (2 replicas x 2 shards). On chat data, whose replica shares
    hold different numbers of supervised tokens: a step's loss is the mean over the whole global
    batch's, counted across the groups (or by the survivor alone, which trains both shares)."""
    from test_chat import digits_conversations, write_chat

    path, template = write_chat(tmp_path / "chat", digits_conversations(400))
    chat = ("data.source=json", f"data.path={path}", "data.format=chat",
            f"data.chat_template={template}")
    save = ("checkpoint.enabled=true", f"checkpoint.interval={STEPS // 2}", *chat)
    reference = [r["loss"] for r in train_metrics(4, *RUN, *save, "parallel.dp_replicate=2",
                                                  "parallel.dp_shard=2",
                                                  output_dir=tmp_path / "reference")]
    survivor, returned, to_next_step, log = _lose_and_regain_group_1(lighthouse, tmp_path / "ft",
                                                                     *save)
    first = survivor[0]["step"]
    losses = [r["loss"] for r in survivor]
    recovery = log.split("recovered from a peer group")[1].splitlines()[0]
    difference = _worst(losses, reference[first - 1:])
    print(f"from the kill to the survivor's next step: {to_next_step:.2f}s; recovered{recovery}; "
          f"losses against the uninterrupted job: {difference:.1e}")
    assert "no checkpoint read" in recovery
    assert difference <= RTOL, (losses, reference)
    joined = returned[0]["step"]
    assert recovery.startswith(f" at step {joined - 1} "), (
        "the returning group trained before it recovered")
    assert [r["loss"] for r in returned] == losses[joined - first:], (
        "the groups disagree after the recovery")
    # The last checkpoint (saved by the quorum's first group) holds the uninterrupted job's weights.
    checkpoints = tmp_path / "ft" / "replica_group_0" / "checkpoints"
    final = _weights(checkpoints / f"step_{STEPS}")
    expected = _weights(tmp_path / "reference" / "checkpoints" / f"step_{STEPS}")
    worst = max(((final[k] - v).norm() / v.norm()).item() for k, v in expected.items())
    print(f"final weights against the uninterrupted job: {worst:.1e} (relative norm, worst tensor)")
    assert worst <= RTOL
    # The whole job started again, longer: every group goes on from the last checkpoint (only group
    # 0's folder holds one), none from step 0.
    again = [_group(g, lighthouse, tmp_path / "ft", *save, f"training.steps={STEPS + 2}")
             for g in (0, 1)]
    try:
        assert [g.wait(timeout=120) for g in again] == [0, 0]
    finally:
        for g in again:
            _kill(g)
    last = []
    for g in (0, 1):
        rows = [r for r in read_metrics(tmp_path / "ft" / f"replica_group_{g}")
                if r["step"] > STEPS]
        # (or it joined at the last)
        assert [r["step"] for r in rows] in ([STEPS + 1, STEPS + 2], [STEPS + 2]), g
        last.append(rows[-1]["loss"])
        log = sorted((tmp_path / "ft").glob(f"group{g}.*.log"))[-1].read_text()
        trained = [int(line.split()[1]) for line in log.splitlines() if line.startswith("step ")]
        assert trained and min(trained) > STEPS, (g, trained)
    assert last[0] == last[1]
    # A checkpoint one group saved mid-run resumes as an ordinary job, here on one process.
    resumed = train_metrics(1, *RUN, *chat,
                            f"checkpoint.resume={checkpoints / f'step_{STEPS // 2}'}",
                            output_dir=tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
    assert _worst([r["loss"] for r in resumed], reference[STEPS // 2:]) <= LAYOUT_RTOL


def _worst(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference)
    return max(abs(a - b) / b for a, b in zip(losses, reference))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_without_keeping_the_global_batch_a_step_trains_the_survivors_share(lighthouse, tmp_path):
    out = tmp_path / "ft"
    survivor, returned, _, _ = _lose_and_regain_group_1(lighthouse, out,
                                                        "fault_tolerance.keep_global_batch=false")
    log = sorted(out.glob("group0.*.log"))[0].read_text()
    assert "1 of 2 replica groups in this step; it trains 1 of 2 shares of the global batch" in log
    assert returned[-1]["step"] == STEPS


def _weights(path: Path) -> dict:
    from trainer import build_model, load_weights

    model = build_model("llama_debug")
    load_weights(model, path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _session_pids(process: WarmRun) -> list[int]:
    """The launcher and ranks of a group (its session's processes)."""
    out = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout
    return sorted(int(pid) for pid in out.split())


def test_fault_tolerance_without_torchft_is_a_config_error(monkeypatch):
    from trainer.errors import ConfigError
    from trainer.faults.tolerance import torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # as if torchft were not installed
    with pytest.raises(ConfigError,
                       match=r'^fault_tolerance.enabled=true needs torchft: pip install -e '
                             r'".\[ft\]"'):
        torchft()
