"""The job's own HTTP/1.1 client (:mod:`mmserver.commands.transform.connections`) and the sender's
retries over it, against a real HTTP peer on a loopback port that answers as each test scripts
it: busy (503, 429) with ``Retry-After``, a connection dropped before the answer, an answer in
chunks or ended by the close, kept-alive connections reused, a timeout; over TLS, with a
certificate the job trusts and with one it does not. (The e2e tests send
jobs to the real server and cluster with it.)"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mmserver.commands.transform.connections import Connections, Unreachable
from mmserver.commands.transform.failures import FileFailed, TransformError
from mmserver.commands.transform.sender import ATTEMPTS, Sender

#: An answer: its raw bytes; DROP closes the connection without one; HANG never answers.
DROP = b"drop"
HANG = b"hang"


def answer(status: int, body: bytes = b"", *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X", *headers, f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode() + body


@dataclass
class Peer:
    """A loopback HTTP peer answering each request with the next of ``script``."""

    script: list[bytes]
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body)
    connections: int = 0
    url: str = ""
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.requests.append((head, await reader.readexactly(length)))
                step = self.script.pop(0)
                if step == DROP:
                    return
                if step == HANG:
                    await self.stop.wait()
                    return
                writer.write(step)
                await writer.drain()
                if b"Connection: close" in step:
                    return
        finally:
            writer.close()


@asynccontextmanager
async def peer(*script: bytes, tls: ssl.SSLContext | None = None) -> AsyncIterator[Peer]:
    found = Peer(list(script))
    server = await asyncio.start_server(found.handle, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls else "http"
    found.url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with server:
            yield found
    finally:
        found.stop.set()


async def test_answers_come_whole_over_one_kept_alive_connection() -> None:
    body = b"0.5\n" * 100_000
    async with peer(
        answer(200, body, "Content-Type: application/json"),
        answer(200, b"2"),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    ) as server:
        connections = Connections(server.url + "/base/", 2, 30.0)
        try:
            first = await connections.request("POST", "/p", b"1,2\n" * 5, {"Accept": "x/y"})
            assert (first.status, first.body) == (200, body)
            assert first.headers["content-type"] == "application/json"
            assert (await connections.request("POST", "/q", b"", {})).body == b"2"
            assert (await connections.request("GET", "/r", b"", {})).body == b"abcde"
        finally:
            await connections.close()
    assert server.connections == 1
    head, sent = server.requests[0]
    assert head.startswith(b"POST /base/p HTTP/1.1\r\n")
    assert b"\r\nAccept: x/y\r\n" in head and b"\r\nContent-Length: 20\r\n" in head
    assert sent == b"1,2\n" * 5
    assert server.requests[2][0].startswith(b"GET /base/r HTTP/1.1\r\n")


async def test_an_answer_ended_by_the_close_and_a_closed_connection_are_not_reused() -> None:
    async with peer(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
        answer(200, b"again"),
    ) as server:
        connections = Connections(server.url, 1, 30.0)
        try:
            assert (await connections.request("POST", "/", b"x", {})).body == b"until the end"
            assert (await connections.request("POST", "/", b"x", {})).body == b"again"
        finally:
            await connections.close()
    assert server.connections == 2


async def test_a_dropped_connection_or_no_server_is_unreachable() -> None:
    async with peer(DROP) as server:
        connections = Connections(server.url, 1, 30.0)
        with pytest.raises(Unreachable, match="the connection was lost"):
            await connections.request("POST", "/", b"x", {})
        await connections.close()
    nobody = Connections(server.url, 1, 30.0)  # the peer has stopped listening
    with pytest.raises(Unreachable, match=r"refused|Connect call failed"):
        await nobody.request("POST", "/", b"x", {})


async def test_the_sender_waits_out_a_busy_server_and_a_dropped_connection() -> None:
    async with peer(
        answer(503, b'{"message": "busy"}', "Retry-After: 0"),
        DROP,
        answer(429, b"", "Retry-After: 0.01"),
        answer(200, b'{"predictions": [1]}', "Content-Type: application/json"),
    ) as server:
        async with Sender(server.url, "m/2", "application/json", 2, 30.0) as sender:
            got = await sender.send(b"1\n", "text/csv")
    assert got == (b'{"predictions": [1]}', "application/json")
    assert len(server.requests) == 4
    assert all(head.startswith(b"POST /predictions/m/2 HTTP/1.1") for head, _ in server.requests)
    assert all(body == b"1\n" for _, body in server.requests)
    assert server.connections == 2  # the dropped one and its successor


async def test_a_server_busy_at_every_attempt_fails_the_file_with_its_message() -> None:
    busy = answer(503, b'{"message": "all workers busy"}', "Retry-After: 0")
    async with peer(*[busy] * ATTEMPTS) as server:
        async with Sender(server.url, "m", "application/json", 1, 30.0) as sender:
            with pytest.raises(FileFailed, match="the server answered 503: all workers busy"):
                await sender.send(b"1\n", "text/csv")
    assert len(server.requests) == ATTEMPTS


async def test_an_unknown_model_stops_the_job_and_a_refusal_fails_the_file() -> None:
    async with peer(
        answer(404, b'{"message": "Model not found: m"}'),
        answer(400, b"bad row 3"),
    ) as server:
        async with Sender(server.url, "m", "application/json", 1, 30.0) as sender:
            with pytest.raises(TransformError, match=r"model .m. at .*: Model not found: m"):
                await sender.send(b"1\n", "text/csv")
            with pytest.raises(FileFailed, match="the server answered 400: bad row 3"):
                await sender.send(b"1\n", "text/csv")
    assert server.connections == 1


async def test_connections_dropped_at_every_attempt_stop_the_job() -> None:
    async with peer(*[DROP] * ATTEMPTS) as server:
        async with Sender(server.url, "m", "application/json", 1, 30.0) as sender:
            with pytest.raises(TransformError, match="cannot be reached: the connection was lost"):
                await sender.send(b"1\n", "text/csv")
    assert len(server.requests) == ATTEMPTS


async def test_an_answer_later_than_the_timeout_fails_the_file() -> None:
    async with peer(HANG, answer(200, b"1")) as server:
        async with Sender(server.url, "m", "text/csv", 1, 0.2) as sender:
            with pytest.raises(FileFailed, match=r"no answer from .* in 0\.2 s"):
                await sender.send(b"1\n", "text/csv")
            # The timed-out connection is not used again.
            assert await sender.send(b"1\n", "text/csv") == (b"1", "")
    assert server.connections == 2


def self_signed(folder: Path, address: str = "127.0.0.1") -> tuple[ssl.SSLContext, Path]:
    """A TLS context serving a self-signed certificate for ``address``, and that certificate's
    file (what a client given it in SSL_CERT_FILE trusts)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mmserver test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(IPv4Address(address))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file


async def test_a_server_over_tls_whose_certificate_is_trusted_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls, cert_file = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
    async with peer(
        answer(503, b'{"message": "busy"}', "Retry-After: 0"),
        answer(200, b'{"predictions": [1]}', "Content-Type: application/json"),
        answer(200, b"2\n", "Content-Type: text/csv"),
        tls=tls,
    ) as server:
        async with Sender(server.url, "m", "application/json", 1, 30.0) as sender:
            assert await sender.send(b"1\n", "text/csv") == (
                b'{"predictions": [1]}',
                "application/json",
            )
            assert await sender.send(b"2\n", "text/csv") == (b"2\n", "text/csv")
    assert server.connections == 1  # kept alive over TLS too
    assert [head.split(b"\r\n")[0] for head, _ in server.requests] == [
        b"POST /predictions/m HTTP/1.1"
    ] * 3
    assert all(body in (b"1\n", b"2\n") for _, body in server.requests)


def counting_handshakes(context: ssl.SSLContext) -> list[None]:
    """A list that gets an item at each TLS handshake ``context`` begins."""
    hellos: list[None] = []
    context.sni_callback = lambda *_: hellos.append(None)  # type: ignore[func-returns-value]
    return hellos


@pytest.mark.parametrize(
    ("address", "trusted", "why"),
    [
        (
            "127.0.0.1",
            False,
            "(self-signed certificate); if a private CA signed it, name a file with that CA's "
            "certificate in SSL_CERT_FILE",
        ),
        ("127.0.0.2", True, "(IP address mismatch, certificate is not valid for '127.0.0.1'.)"),
    ],
)
async def test_a_certificate_that_cannot_be_verified_stops_the_job_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, address: str, trusted: bool, why: str
) -> None:
    tls, cert_file = self_signed(tmp_path, address)
    hellos = counting_handshakes(tls)
    if not trusted:
        other = tmp_path / "other"
        other.mkdir()
        cert_file = self_signed(other)[1]  # another certificate is trusted, not the server's
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
    async with peer(answer(200, b"1"), tls=tls) as server:
        async with Sender(server.url, "m", "text/csv", 1, 30.0) as sender:
            with pytest.raises(TransformError) as stopped:
                await sender.send(b"1\n", "text/csv")
    assert stopped.value.message == f"{server.url}: its TLS certificate cannot be verified {why}"
    assert len(hellos) == 1  # one attempt, not tried again
    assert server.requests == []
