"""A TCP forwarder to stand in for a server that dies: `python -m tests.integration.proxy PORT TARGET_HOST TARGET_PORT`.

Killing it (SIGKILL) is, for the trainer's HTTP requests, what a server process dying is: open connections reset, new
ones refused. The test session's one vLLM server behind it lives on for the other tests.
"""

from __future__ import annotations

import socket
import sys
import threading


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(port: int, host: str, target_port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    print("listening", flush=True)
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection((host, target_port))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
