"""`python tests/warm/run.py SCRIPT ARGS...`: `python SCRIPT ARGS...` forked from the suite's warm
launcher (tests/launch_server.py, named by WARM_LAUNCHER) instead of importing torch and the trainer
anew (~2.5 s a process on two cores). The script runs with this process's arguments, environment,
working folder and open files; the signals this process gets go to it; this process ends as it does
(its exit status, or killed by the same signal), and if this process is killed, so is the script.
Without WARM_LAUNCHER it runs the script itself."""

import os
import signal
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def main(script: str, args: list[str]) -> None:
    path = os.environ.get("WARM_LAUNCHER")
    if not path:
        os.execv(sys.executable, [sys.executable, script, *args])
    sys.path.insert(0, str(TESTS))
    from warm_run import WarmRun

    request = {"script": str(Path(script).resolve()), "args": args, "env": dict(os.environ),
               "cwd": os.getcwd()}
    run = WarmRun(path, request, (0, 1, 2), [script, *args])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _: run.send_signal(signum))
    code = run.wait()
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
