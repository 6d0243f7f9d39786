"""The listening socket of a worker or the gateway, taken before anything else starts."""

import socket


def listen(host: str, port: int, prog: str) -> socket.socket:
    """A socket bound and listening on host:port, or exit with one line saying why (a port in
    use, an address not on this host). Taken first, so a busy port fails before a model loads
    and before anything prints "serving"; uvicorn then serves on this very socket."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise SystemExit(f"{prog}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SystemExit(f"{prog}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
