"""`python tests/launch_server.py SOCKET`: tests/launch.py kept warm for the whole suite.

tests/launch.py imports the trainer once per run and forks the ranks from it; that import (torch,
torch.distributed, transformers: ~3 s on two cores) was still paid by every one of the suite's
runs. This server imports it once and, for each request on the Unix socket SOCKET (one JSON line:
nproc, overrides, env, cwd and the files for stdout and stderr), forks a child that is what
`python tests/launch.py` would have been after its import: in a session of its own (so the test can
kill it and its ranks together), with the request's environment and output files. It answers the
child's pid, then its exit status. Requests are served one at a time, as the suite's runs are.
Only settings read after start-up may differ between requests (tests/helpers.py sends the others to
a fresh process).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def serve(path: str) -> None:
    sys.path.insert(0, str(REPO))
    from launch import main as launch_main

    import trainer.job  # noqa: F401  (the import every run shares)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                os._exit(_child(request, launch_main))
            try:
                conn.sendall(f"{pid}\n".encode())
                _, status = os.waitpid(pid, 0)
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the test gave up on the run (and killed it): serve the next
                pass


def _child(request: dict, launch_main) -> int:
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        return launch_main(request["nproc"], request["overrides"])
    except BaseException as e:  # noqa: BLE001  (whatever happens, the child must exit, not serve)
        print(f"launch_server: {e!r}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
