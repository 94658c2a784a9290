"""A TCP proxy for tests that break a connection between two live processes.

A shard started with `--advertise 127.0.0.1:<proxy port>` is reached through the proxy by everyone who
connects to it. `hold()` keeps what the connecting sides send from reaching the shard (the proxy reads
it and keeps it); `drop()` then closes every connection and loses what was held, as a network that
fails mid-stream does. Connections made after `drop()` are forwarded as usual.
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Forwards each connection to 127.0.0.1:<port> to `target` (set once the target listens)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target: tuple[str, int] | None = None
        self._target_known = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._holding = False
        self.held_bytes = 0
        self._closed = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def forward_to(self, address: str) -> None:
        """Where connections go (host:port)."""
        host, _, port = address.rpartition(":")
        self._target = (host, int(port))
        self._target_known.set()

    def hold(self) -> None:
        """From now on, bytes toward the target are read and kept back, not forwarded."""
        with self._lock:
            self._holding = True

    def drop(self) -> None:
        """Closes every connection made so far, losing what was held; later connections are forwarded again."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
            self._holding = False
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._target_known.wait()
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, toward_target: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    holding = toward_target and self._holding
                    if holding:
                        self.held_bytes += len(data)
                if not holding:
                    sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # dropped: the other pump sees it too
