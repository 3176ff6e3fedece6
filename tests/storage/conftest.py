"""A SeaweedFS server per module for the storage tests (the ``seaweed`` fixture), and its environment (``s3_env``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.seaweedfix import SeaweedS3


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """The standard AWS_* variables pointing at :func:`seaweed`."""
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return seaweed
