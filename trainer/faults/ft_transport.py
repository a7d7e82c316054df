"""How a recovering replica group receives a peer's state under fault tolerance: over HTTP, as
torchft's own transport does, but loaded as data and served only where the peers are.

torchft's HTTPTransport listens on every interface and unpickles what it receives with
weights_only=False, so whoever can answer a recovering group can run code in it. Here the server
listens on this host's address on the route to the lighthouse (loopback when the lighthouse runs
here), each state is served at a path holding a random token that only the quorum's metadata
carries, and the receiver loads with weights_only=True: tensors, numbers, strings and containers,
nothing else.
"""

from __future__ import annotations

import secrets
import socket
import threading
import urllib.request
import warnings
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import torch


def listen_address(lighthouse: str) -> str:
    """This host's address on the route to `lighthouse` (a URL): the one its peers reach it by."""
    url = urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    family, _, _, _, target = socket.getaddrinfo(url.hostname, url.port or 29510,
                                                 type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)  # (a datagram socket's connect sends nothing: it picks the route)
        return probe.getsockname()[0]


def _stream_save(obj, f) -> None:
    """torch.save to a stream that cannot seek (a socket). torch.distributed._serialization is
    private (torch 2.13), and the one pair that streams both ways; kept to this function and the
    next."""
    from torch.distributed._serialization import _streaming_save

    _streaming_save(obj, f)


def _stream_load(f):
    from torch.distributed._serialization import _streaming_load

    with warnings.catch_warnings():  # (its tensors view read-only bytes; they are copied in)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return _streaming_load(f, weights_only=True)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class SafeHTTPTransport:
    """torchft's CheckpointTransport interface: metadata, send_checkpoint, disallow_checkpoint,
    recv_checkpoint, shutdown."""

    def __init__(self, address: str, timeout: timedelta):
        self.timeout, self.token = timeout, secrets.token_urlsafe(16)
        self.state, self.step, self.readers = None, None, 0
        self.changed = threading.Condition()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                transport.serve(self)

            def log_message(self, *args):  # (one line per request otherwise, on stderr)
                pass

        server_class = type("Server", (ThreadingHTTPServer,),
                            {"address_family": socket.AF_INET6 if ":" in address
                             else socket.AF_INET, "daemon_threads": True})
        self.server = server_class((address, 0), Handler)
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{self.server.server_address[1]}/{self.token}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name="ft-transport")
        self.thread.start()

    def metadata(self) -> str:
        return self.url

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        with self.changed:
            self.state, self.step = _to_cpu(state_dict), step
            self.changed.notify_all()

    def disallow_checkpoint(self) -> None:
        """Once every read under way has ended: the state may change from here on."""
        with self.changed:
            self.step = None
            self.changed.wait_for(lambda: self.readers == 0, self.timeout.total_seconds())
            self.state = None

    def serve(self, request: BaseHTTPRequestHandler) -> None:
        token, _, step = request.path.strip("/").partition("/")
        with self.changed:
            ready = (secrets.compare_digest(token, self.token) and step.isdigit()
                     and self.changed.wait_for(lambda: self.step == int(step),
                                               self.timeout.total_seconds()))
            if ready:
                self.readers += 1
        if not ready:
            request.send_error(404)
            return
        try:
            request.send_response(200)
            request.send_header("Content-Type", "application/octet-stream")
            request.end_headers()
            _stream_save(self.state, request.wfile)
        finally:
            with self.changed:
                self.readers -= 1
                self.changed.notify_all()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        with urllib.request.urlopen(f"{metadata}{step}",
                                    timeout=timeout.total_seconds()) as response:
            return _stream_load(response)

    def shutdown(self, wait: bool = True) -> None:
        self.server.shutdown()
        self.server.server_close()
        if wait:
            self.thread.join()


def safe_transport(lighthouse: str, timeout: timedelta) -> SafeHTTPTransport:
    """The transport of a replica group that the lighthouse at `lighthouse` (a URL) coordinates."""
    return SafeHTTPTransport(listen_address(lighthouse), timeout)
