"""What rank 0 and a server-only process say to each other, and where they
meet: lines of JSON over a TCP connection to the coordinator's port + 1 (or
HERRING_SERVER_PORT). Without jax, like the server-only process that uses it
(herring_jax/_src/launcher/serving.py); rank 0's side is servers.py, which
turns RendezvousError into a HerringError."""

from __future__ import annotations

import json

from herring_jax._src.process import knobs
from herring_jax._src.process.addresses import split_address


class RendezvousError(Exception):
    """The rendezvous between rank 0 and a server-only process failed."""


def rendezvous_address(coordinator: str) -> tuple[str, int]:
    """(host, port) where rank 0 waits for servers, given the coordinator's host:port."""
    host, port = split_address(coordinator)
    chosen = knobs.get("HERRING_SERVER_PORT")
    if chosen:
        return host, chosen
    try:
        return host, int(port) + 1
    except ValueError:
        raise RendezvousError(f"coordinator address {coordinator!r} is not host:port") from None


def send(f, message: dict) -> None:
    """Writes one message to the connection's file `f`."""
    f.write((json.dumps(message) + "\n").encode())
    f.flush()


def receive(f, what: str) -> dict:
    """Reads one message (`what` names it in the error if the other side has closed)."""
    line = f.readline()
    if not line:
        raise RendezvousError(f"the other side closed the server rendezvous before {what}")
    return json.loads(line)
