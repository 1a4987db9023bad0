import pytest

from tests.checkpoint.s3_server import s3_bucket, s3_endpoint  # noqa: F401 (fixtures: moto's S3 server)
from tests.multirank import close_all_pools


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_all_pools()
