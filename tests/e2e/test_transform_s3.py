"""``mmserver transform`` between objects on a real S3-compatible server (moto, in server mode),
with the S3 settings of the model store: a prefix, a manifest, and the errors a user meets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.transform_process import csv_rows, predictions, run_transform, write_csv_files
from tests.integration.s3server import s3_environment
from tests.models import make_pipeline_dir

pytestmark = pytest.mark.e2e


def _floats(data: bytes) -> list[float]:
    return [float(line) for line in data.decode().splitlines()]


async def test_objects_under_a_prefix_and_in_a_manifest(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model = make_pipeline_dir(store / "pipe")
    local = tmp_path / "local"
    write_csv_files(local, {"in/a.csv": 50, "in/sub/b.csv": 9, "other/c.csv": 12}, features=3)
    home = tmp_path / "home"
    home.mkdir()
    with s3_environment(home, "data") as s3:
        client = s3.client()
        for path in sorted(local.rglob("*.csv")):
            client.put_object(
                Bucket="data", Key=path.relative_to(local).as_posix(), Body=path.read_bytes()
            )
        manifest = [{"prefix": "s3://data/other/"}, "c.csv", "missing.csv"]
        client.put_object(Bucket="data", Key="m/manifest.json", Body=json.dumps(manifest))

        def read(key: str) -> bytes:
            return bytes(client.get_object(Bucket="data", Key=key)["Body"].read())

        def keys(prefix: str) -> list[str]:
            listed = client.list_objects_v2(Bucket="data", Prefix=prefix).get("Contents", [])
            return sorted(str(item["Key"]) for item in listed)

        env = {"HOME": str(home)}
        async with ServerProcess(
            store, tmp_path / "server.log", "--backend-processes", "1"
        ) as server:
            common = ("--url", server.url, "--model", "pipe", "--max-payload-mb", "0.001")
            code, text = await run_transform(
                *common, "--input", "s3://data/in/", "--output", "s3://data/out", env=env
            )
            assert code == 0, text
            assert keys("out/") == ["out/a.csv.out", "out/sub/b.csv.out"]
            for name in ("a.csv", "sub/b.csv"):
                expected = predictions(model, csv_rows(local / "in" / name))
                assert _floats(read(f"out/{name}.out")) == pytest.approx(
                    expected.tolist(), rel=1e-12
                )
            # The job's progress is kept in the user's cache for an s3:// output.
            digest = hashlib.sha256(b"s3://data/out").hexdigest()[:16]
            done = home / ".cache/mmserver/transform" / digest / "done"
            assert sorted(json.loads(line) for line in done.read_text().splitlines()) == [
                "a.csv",
                "sub/b.csv",
            ]

            code, text = await run_transform(
                *common,
                "--data-type",
                "ManifestFile",
                "--input",
                "s3://data/m/manifest.json",
                "--output",
                "s3://data/listed/",
                env=env,
            )
            assert code == 1, text
            assert keys("listed/") == ["listed/c.csv.out", "listed/missing.csv.error"]
            expected = predictions(model, csv_rows(local / "other/c.csv"))
            assert _floats(read("listed/c.csv.out")) == pytest.approx(expected.tolist(), rel=1e-12)
            missing = "s3://data/other/missing.csv"
            assert read("listed/missing.csv.error").decode() == (
                f"{missing}: the input {missing} does not exist\n"
            )

            code, text = await run_transform(
                *common, "--input", "s3://data/nothing/", "--output", "s3://data/o3", env=env
            )
            assert code == 2, text
            assert "no objects under s3://data/nothing/: check the bucket and prefix" in text
            code, text = await run_transform(
                *common, "--input", "s3://nobucket/x", "--output", "s3://data/o3", env=env
            )
            assert code == 2, text
            assert "the input s3://nobucket/x cannot be listed" in text
            assert "NoSuchBucket" in text
            assert keys("o3") == []
