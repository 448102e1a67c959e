"""The ``peers`` option: the other instances a management call is sent on to
(:mod:`mmserver.api.peers`)."""

from __future__ import annotations

from mmserver.errors import ConfigError

#: A peer's address, or a name to resolve at each call and its port.
Address = tuple[str, int]


def parse_peers(spec: str) -> tuple[tuple[Address, ...], Address | None]:
    """The ``peers`` option: its ``host:port`` addresses, or for ``dns:NAME:PORT`` no address
    and ``(NAME, PORT)`` to resolve at each call. :class:`ConfigError` saying what is
    expected."""
    text = spec.strip()
    expected = "a comma-separated list of host:port, or dns:NAME:PORT"
    if text.startswith("dns:"):
        name, _, port = text[4:].rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"option peers={spec!r}: must be {expected}")
        return (), (name, int(port))
    pairs: list[Address] = []
    for item in (i.strip() for i in text.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"option peers={spec!r}: {item!r} is not host:port; must be {expected}"
            )
        pairs.append((host.strip("[]"), int(port)))
    return tuple(pairs), None
