"""train.py as torchrun starts it in the suite's launcher tests: the rank forked from the warm
launcher (tests/warm/run.py). Torchrun, its agents and every signal stay real; a Slurm test's job
runs in this folder, so its train.py is this one."""

import sys
from pathlib import Path

from run import main

if __name__ == "__main__":
    main(str(Path(__file__).resolve().parent.parent.parent / "train.py"), sys.argv[1:])
