"""Fixtures for the S3 tests (defined in tests/support/s3server.py with the server and the fault proxy they start)."""

from support.s3server import bucket, fault_proxy, s3_env, s3_server  # noqa: F401 - fixtures
