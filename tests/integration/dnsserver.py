"""A DNS server for the tests, as a cluster's DNS answers for a headless Service's pods: on UDP on
127.0.0.1, an A record (or several) for each name it holds, NXDOMAIN for any other name, and
no record (NOERROR, an empty answer) for another type of query of a name it holds.

The names it holds are changed while it runs (:meth:`DnsServer.set`, :meth:`DnsServer.remove`),
as a pod is made, replaced at a new address or deleted. It answers the questions of RFC 1035's
wire format (one question, a name of uncompressed labels), which is what a resolver's query is;
an EDNS record in a query's additional section is read past, not answered.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterable
from types import TracebackType

TYPE_A = 1
CLASS_IN = 1
RCODE_NXDOMAIN = 3
TTL_S = 1


def question(packet: bytes) -> tuple[str, int, int, int]:
    """(name, type, class, end offset) of a query's first question."""
    labels = []
    offset = 12
    while packet[offset]:
        length = packet[offset]
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii").lower())
        offset += 1 + length
    qtype, qclass = struct.unpack_from("!HH", packet, offset + 1)
    return ".".join(labels), qtype, qclass, offset + 5


def answer(packet: bytes, records: dict[str, list[str]]) -> bytes:
    """The response to the query ``packet``, from ``records`` (name → IPv4 addresses)."""
    (query_id,) = struct.unpack_from("!H", packet)
    name, qtype, qclass, end = question(packet)
    addresses = records.get(name.rstrip("."))
    # QR (a response), AA (authoritative), RD copied, RA.
    flags = 0x8400 | (struct.unpack_from("!H", packet, 2)[0] & 0x0100) | 0x0080
    found: list[str] = []
    if addresses is None:
        flags |= RCODE_NXDOMAIN
    elif qtype == TYPE_A and qclass == CLASS_IN:
        found = addresses
    header = struct.pack("!HHHHHH", query_id, flags, 1, len(found), 0, 0)
    body = b"".join(
        # The name as a pointer to the question's (offset 12), then the record.
        struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_S, 4) + socket.inet_aton(address)
        for address in found
    )
    return header + packet[12:end] + body


class DnsServer:
    """The server, in a thread of its own from ``with`` to its end."""

    def __init__(self) -> None:
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._closing = False
        #: The names asked, in order (each query's name and type).
        self.asked: list[tuple[str, int]] = []

    def set(self, name: str, addresses: Iterable[str]) -> None:
        with self._lock:
            self._records[name] = list(addresses)

    def remove(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)

    def _serve(self) -> None:
        while True:
            packet, peer = self._socket.recvfrom(4096)
            if self._closing:
                return
            try:
                with self._lock:
                    response = answer(packet, self._records)
                    self.asked.append(question(packet)[:2])
            except (IndexError, UnicodeDecodeError, struct.error):
                continue  # not a query this server reads
            self._socket.sendto(response, peer)

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # A datagram of its own wakes the thread, which then sees it is closing.
        self._closing = True
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as waker:
            waker.sendto(b"", ("127.0.0.1", self.port))
        self._thread.join(timeout=5)
        self._socket.close()
