"""`python tests/launch_server.py SOCKET`: the trainer imported once for the whole suite, runs
forked from it.

Every run of the suite would otherwise import torch, torch.distributed and the trainer first (~2.5 s
a process on two cores). This server imports them once and, for each request on the Unix socket
SOCKET, forks a child that is what the request names after that import:

- `{"nproc": N, "overrides": [...]}`: `python tests/launch.py N overrides...` (a whole local job,
  its ranks forked in turn);
- `{"script": path, "args": [...]}`: `python path args...` (tests/warm/run.py; a rank as torchrun
  starts it: tests/warm/train.py).

The request (a 16-byte length, then JSON with the environment and working folder) comes with the
client's stdin, stdout and stderr (SCM_RIGHTS): the child uses those very files, in a session of its
own (so it and its ranks are killed together). The server answers the child's pid, then its exit
status; a number the client sends meanwhile is a signal for the child, and a client that goes away
takes its child with it. Runs may overlap (torchrun starts its ranks together). Only settings read
after start-up may differ between requests (tests/helpers.py sends the others to a fresh process).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADER = 16  # bytes: the JSON's length


def serve(path: str) -> None:
    sys.path.insert(0, str(REPO))
    import launch

    import trainer.run.job  # noqa: F401  (the import every run shares)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    runs: dict[int, socket.socket] = {}  # pid of a child -> its client
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is server:
                _start(server.accept()[0], selector, runs, launch)
            else:
                _from_client(key.fileobj, key.data, selector)
        _reap(runs, selector)


def _start(conn: socket.socket, selector: selectors.BaseSelector, runs: dict, launch) -> None:
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError):  # a client gone before it finished asking
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()
        conn.close()
        os._exit(_child(request, fds, launch))
    for fd in fds:
        os.close(fd)
    runs[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)
    _send(conn, pid)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, HEADER, 3)
    while len(header) < HEADER:
        header += _recv(conn, HEADER - len(header))
    payload = b""
    while len(payload) < int(header):
        payload += _recv(conn, int(header) - len(payload))
    return json.loads(payload), fds


def _recv(conn: socket.socket, n: int) -> bytes:
    data = conn.recv(n)
    if not data:
        raise ValueError("the client went away")
    return data


def _from_client(conn: socket.socket, pid: int, selector: selectors.BaseSelector) -> None:
    """Signals for the child (one number a line), or the client gone: then the child goes too."""
    try:
        data = conn.recv(1024)
    except OSError:
        data = b""
    if not data:
        selector.unregister(conn)
        _signal(pid, signal.SIGKILL)
        return
    for number in data.split():
        _signal(pid, int(number))


def _reap(runs: dict, selector: selectors.BaseSelector) -> None:
    while runs:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = runs.pop(pid)
        if conn in selector.get_map():
            selector.unregister(conn)
        _send(conn, os.waitstatus_to_exitcode(status))
        conn.close()


def _send(conn: socket.socket, number: int) -> None:
    try:
        conn.sendall(f"{number}\n".encode())
    except OSError:  # the client gave up on the run (and killed it)
        pass


def _signal(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def _child(request: dict, fds: list[int], launch) -> int:
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "script" in request:
            return launch.run_script(request["script"], request["args"])
        return launch.main(request["nproc"], request["overrides"])
    except BaseException as e:  # noqa: BLE001  (whatever happens, the child must exit, not serve)
        print(f"launch_server: {e!r}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
