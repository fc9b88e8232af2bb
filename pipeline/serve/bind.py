"""The server's listening socket, bound before the model loads: a port in use, a port that
needs root or a host this machine does not have is one `Error:` line (exit 2) at once, not
uvicorn's log line after seconds of loading."""

from __future__ import annotations

import errno
import socket

from pipeline.errors import BadInput


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening: clients are refused, as
    before, until the server starts accepting. Port 0 takes a free port (read it back
    with ``sock.getsockname()[1]``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides
    where = f"--host {host} --port {port}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as failure:
        sock.close()
        raise BadInput(
            f"{where}: cannot resolve host {host!r} ({failure.strerror}); give an address of "
            "this machine, e.g. 127.0.0.1, or 0.0.0.0 for every interface."
        ) from None
    except (OSError, OverflowError) as failure:
        sock.close()
        raise BadInput(f"{where}: {_why(failure, port)}") from None
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def url_host(host: str) -> str:
    """The host as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _why(failure: Exception, port: int) -> str:
    code = getattr(failure, "errno", None)
    if code == errno.EADDRINUSE:
        return (
            "the address is already in use (another lpx serve?); stop that process or pick "
            "another --port (0 takes a free one)."
        )
    if code == errno.EACCES:
        return (
            f"permission denied: port {port} is privileged; use a --port of 1024 or above "
            "(0 takes a free one)."
        )
    if code == errno.EADDRNOTAVAIL:
        return (
            "no interface of this machine has that address; use 127.0.0.1, 0.0.0.0 (every "
            "interface) or one of this machine's addresses."
        )
    return f"cannot listen there ({failure}); check --host and --port."
