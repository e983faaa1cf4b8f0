"""Where the coordinator is and which local address reaches it: the IP an
IP provider binds (HERRING_FI_IFACE, or the address towards the
coordinator). Without jax, so that a server-only process never imports it
(herring_jax/_src/launcher/serving.py)."""

from __future__ import annotations

import socket

from herring_jax._src.process import knobs


def split_address(coordinator: str) -> tuple[str, str]:
    """``host:port`` (or ``[v6]:port``) -> (host, port); host defaults to 127.0.0.1."""
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]") or "127.0.0.1", port


def local_address_towards(coordinator: str | None) -> str:
    """The local IP this host uses to reach the coordinator (no packet is sent)."""
    if not coordinator:
        return "127.0.0.1"
    host, port = split_address(coordinator)
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port or 1)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


# Providers that bind an IP address (HERRING_FI_IFACE, or the one towards the coordinator).
IP_PROVIDERS = ("tcp", "udp", "sockets", "net")


def fabric_interface(provider: str, coordinator: str | None) -> str:
    """HERRING_FI_IFACE, or for an IP provider (or the default) the local
    address this host reaches the coordinator from; "" lets the provider pick."""
    interface = knobs.get("HERRING_FI_IFACE")
    if not interface and (provider == "" or provider.split(";")[0] in IP_PROVIDERS):
        interface = local_address_towards(coordinator)
    return interface
