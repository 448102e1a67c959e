"""The server's S3 clients (the model store's, asynchronous inference's, data capture's, a batch
transform's), made with one set of settings. Imported only where S3 is used: boto3 takes a while
to import."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config


def client_config(connect_timeout: float = 3.0, read_timeout: float = 10.0) -> Config:
    """The settings of the server's S3 clients (the model store's, asynchronous inference's):
    they fail in seconds when the object store is down: two attempts, short connect and read
    timeouts (the read timeout bounds each wait for data, not a whole download)."""
    return Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": 2, "mode": "standard"},
        max_pool_connections=32,
    )


def make_client(config: Config | None = None) -> Any:
    """An S3 client with :func:`client_config`'s settings; the endpoint, region and credentials
    from the usual AWS environment variables and files. A session is not thread-safe, a client
    is: make one client and share it between threads."""
    session = boto3.session.Session()
    return session.client("s3", config=config or client_config())
