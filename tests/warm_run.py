"""A run forked by the suite's warm launcher (tests/launch_server.py), as its client holds it: what
the tests use of subprocess.Popen (pid, poll, wait, send_signal). Only the standard library:
torchrun's stand-in for train.py (tests/warm/train.py) imports this and nothing heavier."""

from __future__ import annotations

import json
import socket
import subprocess

HEADER = 16  # bytes: the request's length, sent with the files


class WarmRun:
    """Asks the warm launcher at `path` for `request` (see tests/launch_server.py), the child to use
    the open files `stdio` (stdin, stdout, stderr). `args` names the run in errors."""

    def __init__(self, path: str, request: dict, stdio: tuple[int, int, int], args: list[str]):
        self.args, self.returncode, self._buffer = args, None, b""
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(path)
        payload = json.dumps(request).encode()
        socket.send_fds(self._conn, [f"{len(payload):{HEADER - 1}d}\n".encode()], list(stdio))
        self._conn.sendall(payload)
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str:
        while b"\n" not in self._buffer:
            self._conn.settimeout(timeout)
            data = self._conn.recv(64)  # BlockingIOError with timeout 0, TimeoutError after one
            if not data:
                raise ConnectionError("the warm launcher went away")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._ended(int(self._line(0.0)))
            except (BlockingIOError, TimeoutError):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._ended(int(self._line(timeout)))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._conn.close()

    def send_signal(self, signum: int) -> None:
        """`signum` to the run (and its ranks)."""
        self._conn.sendall(f"{signum}\n".encode())

    def close(self) -> None:
        """Lets go of the run: one still going is killed."""
        self._conn.close()
