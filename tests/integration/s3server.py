"""A real S3-compatible server on loopback for the object-store tests and the benchmark's async
section: moto's server, run in a child process (it has its own interpreter, so its request
handling does not compete with the server under test for the GIL), on a free port it picks
itself.

The child reads its standard input until end of file: it stops when :meth:`S3Server.stop` closes
the pipe, and also when the test process dies.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3

_CHILD = """\
import logging, os, sys
os.nice(int(sys.argv[1]))
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""

#: The variables the tests replace: any of them left from the machine would redirect boto3.
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_EC2_METADATA_DISABLED",
)


class S3Server:
    """One moto server process on ``127.0.0.1``, run at ``nice`` (added to this process's
    niceness: a higher one leaves the CPU to the processes measured beside it)."""

    def __init__(self, nice: int = 0) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(nice)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError("the moto server did not start")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server's process."""
        return self._process.pid

    def environment(self, home: str) -> dict[str, str]:
        """The AWS variables that point boto3 at this server with dummy credentials
        (``home``: a folder holding no AWS config or credentials file)."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": f"{home}/config",
            "AWS_SHARED_CREDENTIALS_FILE": f"{home}/credentials",
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": "127.0.0.1,localhost",
        }

    def client(self) -> Any:
        """A boto3 S3 client of this server, for setting objects up."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def enforce_authentication(self, enforce: bool) -> None:
        """Make the server check credentials (the dummy ones are then refused with 403)."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0" if enforce else b"inf",
            # Not a form: the server reads the raw body.
            headers={"Content-Type": "text/plain"},
            method="POST",
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=5) as response:
            assert json.load(response)["status"] == "ok"

    def stop(self) -> None:
        """Stop the server; connections to its port are refused from then on."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        if self._process.stdout is not None:
            self._process.stdout.close()


@contextmanager
def s3_server(nice: int = 0) -> Iterator[S3Server]:
    server = S3Server(nice)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def s3_environment(home: Path, bucket: str) -> Iterator[S3Server]:
    """An S3 server holding an empty ``bucket``, with boto3's environment pointing at it (its
    credentials and configuration files under ``home``) until the end."""
    import pytest  # the tests' own: the benchmark uses the server alone

    with s3_server() as server, pytest.MonkeyPatch.context() as env:
        for name in AWS_VARIABLES:
            env.delenv(name, raising=False)
        for name, text in server.environment(str(home)).items():
            env.setenv(name, text)
        server.client().create_bucket(Bucket=bucket)
        yield server


class Requests:
    """The ``operation`` requests (``GetObject``, ``HeadObject``...) that ``client`` sends,
    each attempt counted, recorded through botocore's event hooks."""

    def __init__(self, client: Any, operation: str) -> None:
        self.paths: list[str] = []
        client.meta.events.register(f"before-send.s3.{operation}", self._record)

    def _record(self, request: Any, **_: Any) -> None:
        self.paths.append(urllib.parse.urlsplit(request.url).path)

    def count(self, key: str = "") -> int:
        """How many were sent (for the object ``key`` only, when given)."""
        return sum(1 for p in self.paths if not key or p.endswith("/" + key))
