"""Management that reaches every instance: the ``peers`` option.

Several instances behind one balancer (``mmserver cluster``, a Kubernetes StatefulSet behind its
Service) each keep their own models, so a management call that one of them answers would change
that one only. With ``peers`` set, an instance that applies a management call (``POST /models``,
``PUT``/``DELETE /models/NAME``, a version's ``set-default``, ``set-canary``, ``set-shadow``, the
Open Inference Protocol's repository ``load`` and ``unload``) sends the same call on to every
peer, marked with :data:`FORWARDED` so that a peer applies it without sending it further. The
answer is the instance's own, with :data:`PEERS_HEADER` saying how many peers applied it and, in
its JSON body, ``peers``: each peer that did not, with its status and message. A peer that is
the instance itself (a DNS name resolves to every pod, itself included) answers that it is, and
is not counted.

``peers`` is a comma-separated list of ``host:port``, or ``dns:NAME:PORT``: every address NAME
resolves to when a call is sent (a headless Service's name gives every pod that is ready).

A new instance (one whose ``rollouts.json`` does not exist yet) takes the versions' rollouts
from the first peer that answers ``GET /peers/rollouts`` before it loads any model
(:func:`adopt_rollouts`), so a default version or canary set before it started applies to it
too; an instance replaced with its ``state_dir`` keeps its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import hdrs

from mmserver.config.peers import parse_peers
from mmserver.errors import answer_message
from mmserver.ops.statefile import write_atomically

log = logging.getLogger(__name__)

#: The header of a call sent on to a peer: the sending instance's id.
FORWARDED = "X-Mmserver-Forwarded"
#: The header of the answer: ``applied/peers`` (the instance itself not counted).
PEERS_HEADER = "X-Mmserver-Peers"
#: The operations of the route table that are sent on to the peers.
FANNED = frozenset(
    {
        "register_model",
        "rescale_model",
        "unload_model",
        "set_default_version",
        "set_canary_version",
        "set_shadow_version",
        "repository_load",
        "repository_unload",
    }
)
#: How long a peer may take to apply a call (a load included) before it counts as failed.
PEER_TIMEOUT_S = 120.0
#: The status a peer answers a call that came from itself.
SELF = 208
#: Headers not sent on: the connection's own, and the body's length (set again).
_NOT_SENT = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        hdrs.CONTENT_LENGTH,
        hdrs.TRANSFER_ENCODING,
        hdrs.KEEP_ALIVE,
        hdrs.UPGRADE,
        hdrs.TE,
        hdrs.ACCEPT_ENCODING,
    )
)


@dataclass
class Peers:
    """The other instances of the ``peers`` option, and this instance's id."""

    spec: str
    #: The management token, sent with this instance's own calls to its peers.
    token: str = ""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    _session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self._parsed = parse_peers(self.spec)

    async def addresses(self) -> list[tuple[str, int]]:
        """Every peer's address now (a DNS name resolved again)."""
        listed, named = self._parsed
        if named is None:
            return list(listed)
        name, port = named
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, port, proto=socket.IPPROTO_TCP
            )
        except OSError as exc:
            log.warning("peers: %s does not resolve: %s", name, exc)
            return []
        return sorted({(str(info[4][0]), port) for info in infos})

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S), auto_decompress=False
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> list[dict[str, Any]]:
        """The call sent to every peer at once: one outcome each (``peer``, ``status``, and
        ``error`` for a failure; the instance itself left out)."""
        sent = {k: v for k, v in headers.items() if k.lower() not in _NOT_SENT}
        sent[FORWARDED] = self.instance
        addresses = await self.addresses()
        outcomes = await asyncio.gather(
            *(self._one(host, port, method, path, body, sent) for host, port in addresses)
        )
        return [o for o in outcomes if o["status"] != SELF]

    async def _one(
        self, host: str, port: int, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            async with self.session().request(
                method, f"http://{where}{path}", data=body, headers=headers
            ) as response:
                text = await response.text(errors="replace")
                outcome: dict[str, Any] = {"peer": where, "status": response.status}
                if response.status >= 300 and response.status != SELF:
                    outcome["error"] = answer_message(text)
                return outcome
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return {"peer": where, "status": 0, "error": f"{type(exc).__name__}: {exc}"}

    async def fetch(self, path: str) -> bytes | None:
        """The body of the first peer (not this instance) that answers ``GET path`` 200."""
        for host, port in await self.addresses():
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                headers = {FORWARDED: self.instance}
                if self.token:
                    headers[hdrs.AUTHORIZATION] = f"Bearer {self.token}"
                async with self.session().get(f"http://{where}{path}", headers=headers) as response:
                    if response.status == 200:
                        return await response.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.info("peers: %s did not answer %s: %s", where, path, exc)
        return None


async def adopt_rollouts(peers: Peers, state_file: Path) -> bool:
    """Give a new instance (``state_file`` does not exist) the rollouts of the first peer that
    has them; whether it took them."""
    if await asyncio.to_thread(state_file.exists):
        return False
    body = await peers.fetch("/peers/rollouts")
    if body is None:
        return False
    try:
        data = json.loads(body)
        if not isinstance(data.get("models"), dict):
            raise ValueError("no models")
    except (ValueError, AttributeError) as exc:
        log.warning("peers: the rollouts a peer answered are malformed and ignored: %s", exc)
        return False
    await asyncio.to_thread(write_atomically, state_file, json.dumps(data, indent=1) + "\n")
    log.info("peers: took the rollouts of %d model(s) from a peer", len(data["models"]))
    return True


__all__ = [
    "FANNED",
    "FORWARDED",
    "PEERS_HEADER",
    "SELF",
    "Peers",
    "adopt_rollouts",
]
