"""train.py as torchrun starts it in the suite's launcher tests, forked from the warm launcher
(tests/launch_server.py, named by WARM_LAUNCHER) instead of importing torch and the trainer anew (~2.5 s
a rank on two cores). The rank gets this process's arguments, environment, working folder and open
files; the signals this process gets go to the rank; this process ends as the rank does (its exit
status, or killed by the same signal), and if it is killed, so is the rank. Torchrun, the agents and
every signal are real. Without WARM_LAUNCHER this is train.py."""

import os
import signal
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    path = os.environ.get("WARM_LAUNCHER")
    if not path:
        os.execv(sys.executable, [sys.executable, str(TESTS.parent / "train.py"), *sys.argv[1:]])
    sys.path.insert(0, str(TESTS))
    from warm_run import WarmRun

    run = WarmRun(path, {"train": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}, (0, 1, 2), sys.argv)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _: run.send_signal(signum))
    code = run.wait()
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
