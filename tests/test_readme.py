"""Every command the README shows that names its job in full runs as written: each train.py launch
(torchrun, trainer-run, python) passes every rule a rank checks first, for the world it launches,
and each plan.py command exits 0. Commands with placeholders (`...`, `$HEAD`), data or weights the
reader brings, Slurm and the set-up lines are left to the tests of what they run."""

import re
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from trainer.checks.job import check_config
from trainer.checks.overrides import compose_job
from trainer.models import import_modules
from trainer.plan.auto import auto_device, choose_layout, pinned_keys
from trainer.plan.profiles import get_device
from trainer.run.launcher import world_of

sys.path.insert(0, str(REPO / "scripts"))
import plan  # noqa: E402

# Overrides naming what a reader brings (files, weights, their own modules): not this checkout's.
BROUGHT = re.compile(r"(path|initial|mix|imports|plan\.device)=")


def commands() -> list[list[str]]:
    """The README's shell commands, one word list each (continued lines joined, comments
    dropped)."""
    text = (REPO / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def launches() -> list[tuple[int, list[str]]]:
    """(world, overrides) of each train.py launch that names its job in full."""
    found = []
    for words in commands():
        if "train.py" not in words or "&&" in words or "..." in words or words[0] == "sbatch":
            continue
        launcher, overrides = words[:words.index("train.py")], words[words.index("train.py") + 1:]
        if any(BROUGHT.search(arg) for arg in overrides) or "--cfg" in overrides:
            continue
        options = dict(arg[2:].split("=", 1) for arg in launcher if arg.startswith("--")
                       and "=" in arg)
        nodes = options.get("nnodes", "1").partition(":")[0]  # an elastic range: the fewest nodes
        found.append((world_of(options.get("nproc_per_node", "1"), nodes), overrides))
    return found


@pytest.mark.parametrize("world, overrides", launches(),
                         ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_a_readme_launch_passes_the_checks_every_rank_makes(world, overrides):
    job = compose_job(overrides)
    import_modules(job.imports)
    if job.parallel.auto:  # on the device the recipe names (a GPU's launch chooses for the GPU)
        device = get_device(job.plan.device) if job.plan.device not in (None, "cpu") else \
            auto_device(torch.device("cpu"), world)
        job = choose_layout(job, world, device, pinned_keys(overrides))[0]
    check_config(job, world)


PLANS = [words[2:] for words in commands() if words[:2] == ["python", "scripts/plan.py"]
         and "--calibrate" not in words]


@pytest.mark.parametrize("argv", PLANS, ids=" ".join)
def test_a_readme_plan_command_runs(argv, capsys):
    assert plan.main(argv) == 0, capsys.readouterr().out[-2000:]


def test_the_readme_shows_the_commands_these_tests_run():
    assert len(launches()) >= 5 and len(PLANS) == 3


@pytest.mark.tool
@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_what_the_readme_s_scripts_write_leaves_git_status_clean():
    """scripts/chat_example.py data/chat and plan.py --calibrate --name NAME write into the
    checkout."""
    written = ["data/chat/chat.jsonl", "devices/my-box.json",
               "devices/my-box.json.before-2026-11-28"]
    result = subprocess.run(["git", "check-ignore", *written], cwd=REPO, capture_output=True,
                            text=True, timeout=30)
    assert result.stdout.split() == written, result.stdout + result.stderr
