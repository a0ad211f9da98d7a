"""The Backend contract, run against every backend (memory, file, moto, SeaweedFS).

The tests themselves ship as :class:`s3kv.testing.storage.BackendTests`, for anyone writing
a backend; the ``backend`` fixture (tests/conftest.py) supplies each of s3kv's in turn.
"""

from __future__ import annotations

import pytest

from s3kv.testing.storage import BackendTests, Quirk

#: What SeaweedFS 4.48 does differently from S3 (see :class:`Quirk`).
SEAWEEDFS_QUIRKS = frozenset({Quirk.LIST_ORDER_BY_DIRECTORY, Quirk.EMPTIED_DIRECTORIES_REMAIN})


class TestBackendContract(BackendTests):
    @pytest.fixture
    def backend_quirks(self, request: pytest.FixtureRequest) -> frozenset[Quirk]:
        seaweedfs = request.node.callspec.params["backend"] == "seaweedfs"
        return SEAWEEDFS_QUIRKS if seaweedfs else frozenset()
