"""kubetitan_trainer.storage without a server: the keep-latest-K rule as a table, the local store's discovery and
deletion on a real folder, URI parsing, and the message a bucket the trainer cannot list gets."""

from __future__ import annotations

import pytest

from kubetitan_core import contract
from kubetitan_trainer import storage
from kubetitan_trainer.errors import ConfigError


class Listed(storage.CheckpointStore):
    def __init__(self, entries: dict[int, bool]) -> None:
        self.root, self._entries = "mem", entries

    def entries(self) -> list[tuple[str, bool]]:
        return [(f"step-{s}", done) for s, done in self._entries.items()] + [("tb", False), ("step-x", True)]


# (id, step -> complete, K, steps keep-latest-K deletes)
PURGE = [
    ("keep-all", {2: True, 4: True, 6: True}, 0, []),
    ("fewer-than-k", {2: True, 4: True}, 3, []),
    ("oldest-complete-go", {2: True, 4: True, 6: True, 8: True}, 2, [2, 4]),
    ("cut-off-between-goes", {2: True, 3: False, 4: True, 6: True}, 2, [2, 3]),
    ("newer-cut-off-is-in-flight", {2: True, 4: True, 6: True, 8: False}, 2, [2]),
    ("cut-off-do-not-count-toward-k", {2: True, 4: False, 6: False, 8: True}, 2, []),
    ("only-cut-off", {2: False, 4: False}, 2, []),
]


@pytest.mark.parametrize("entries, k, gone", [c[1:] for c in PURGE], ids=[c[0] for c in PURGE])
def test_keep_latest_k_table(entries, k, gone):
    assert Listed(entries).to_purge(k) == gone


def test_local_store_discovery_and_delete(tmp_path):
    st = storage.LocalStore(str(tmp_path))
    for step, done in ((2, True), (4, True), (6, False)):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 7)
        if done:
            (d / contract.DCP_METADATA_FILE).write_bytes(b"m")
    assert sorted(st.entries()) == [("step-2", True), ("step-4", True), ("step-6", False)]
    assert st.newest_complete_step() == 4 and st.step_bytes(2) == 8
    assert st.purge(1) == [2] and not (tmp_path / "step-2").exists()
    assert storage.LocalStore(str(tmp_path / "none")).entries() == []


@pytest.mark.parametrize("uri, want", [
    ("s3://bucket/a/b/", ("bucket", "a/b")), ("s3://bucket", ("bucket", "")), ("s3://b/x", ("b", "x"))])
def test_parse_s3_uri(uri, want):
    assert storage.parse_s3_uri(uri) == want
    assert storage.is_remote(uri) and storage.folder_key(uri + "/") == uri.rstrip("/")


def test_parse_s3_uri_refuses_paths():
    with pytest.raises(ValueError):
        storage.parse_s3_uri("/ckpt")
    with pytest.raises(ValueError):
        storage.parse_s3_uri("s3:///x")


S = storage.S3Settings(uri="s3://ck/run", region="us-west-2")
ERRORS = [
    ("missing", "Service error: The bucket does not exist", "does not exist in region us-west-2", "create the bucket 'ck'"),
    ("denied", "Client error: Forbidden: Access Denied", "access to s3://ck was denied", "s3:ListBucket on arn:aws:s3:::ck"),
    ("no-credentials", "Client error: No signing credentials found", "no AWS credentials", "Pod Identity or IRSA"),
    ("other", "Client error: dns lookup failed", "cannot list s3://ck", "endpoint is reachable"),
]


KINDS = [
    # (id, the error's message as s3torchconnector/the CRT client gives it, its kind: None = transient)
    ("no-bucket", "Service error: The bucket does not exist", "no-bucket"),
    ("no-such-bucket", "Client error: NoSuchBucket: The specified bucket does not exist", "no-bucket"),
    ("forbidden", "Client error: Forbidden: Access Denied", "denied"),
    ("access-denied-code", "Service error: AccessDenied (request id: 5XJ4K)", "denied"),
    ("http-403", "Client error: Unknown response error: HTTP status 403", "denied"),
    ("status-code-403", "Client error: Unknown response error: status_code=403", "denied"),
    ("403-in-request-id", "Service error: InternalError (request id: 8A403B2C403F)", None),
    ("403-in-range", "Client error: Response body truncated for range bytes=4030000-4039999", None),
    ("503-slow-down", "Service error: SlowDown: Please reduce your request rate. (HTTP status 503)", None),
    ("no-credentials", "Client error: No signing credentials found", "credentials"),
    ("invalid-key", "Service error: InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our "
                    "records. (check the credentials)", "credentials"),
    ("pod-identity-timeout", "Client error: Failed to load credentials: AWS_AUTH_CREDENTIALS_PROVIDER_ECS_SOURCE_"
                             "FAILURE: AWS_IO_SOCKET_TIMEOUT: socket operation timed out", None),
    ("pod-identity-refused", "Client error: No signing credentials found (credentials provider: connection refused "
                             "at 169.254.170.23)", None),
    ("imds-unavailable", "Client error: credentials provider failed: IMDS temporarily unavailable", None),
    ("dns", "Client error: dns lookup failed", None),
]


@pytest.mark.parametrize("text, kind", [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_access_error_kind_reads_whole_codes_and_leaves_unreachable_credential_providers_transient(text, kind):
    assert storage.access_error_kind(RuntimeError(text)) == kind


@pytest.mark.parametrize("text, problem, fix", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_access_errors_name_the_bucket_and_the_fix(text, problem, fix):
    field, got_problem, got_fix = storage.describe_access_error(S, "ck", RuntimeError(text))
    assert field == "spec.checkpoint.storage.s3.uri" and problem in got_problem and fix in got_fix
    assert "Fix:" in str(ConfigError(field, got_problem, got_fix))
