"""uvicorn serving the HTTP app as a task of the running event loop (the one grpc.aio runs on).

One loop for both frontends: the shared generation path (frontend/calls.py) is asyncio code whose
state (in-flight count, drain, the futures engine threads resolve) belongs to one loop, so HTTP
handlers call it directly, with no hand-off between threads. uvicorn installs no signal handlers
here: `serve` owns SIGINT/SIGTERM and drains both frontends together.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process's signals are serve's
        yield

    def install_signal_handlers(self) -> None:  # the same, for uvicorn releases before capture_signals
        pass


class HttpListener:
    def __init__(self, server: _Server, task: asyncio.Task, port: int):
        self.server, self.task, self.port = server, task, port

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close idle connections, give running responses `timeout_s`, then cancel them."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s + 1.0)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def start_http(app, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                     grace_s: float = 5.0) -> HttpListener:
    """Listen on host:port (0: any free port) and serve `app` on this loop; returns once accepting."""
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                            http="h11", ws="none", ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                            timeout_graceful_shutdown=max(1, int(grace_s)), backlog=2048)
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what start-up raised
            raise OSError(f"the HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    return HttpListener(server, task, sock.getsockname()[1])
