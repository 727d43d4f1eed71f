"""URLs and settings without a server: which schemes are served, what the others are told, cache sizes."""

from __future__ import annotations

import pytest

from packer.read.remote import parse_limit
from packer.store import StoreError, is_url, open_store


def test_schemes() -> None:
    assert is_url("s3://b/x") and is_url("https://h/x") and not is_url("/data/x") and not is_url("rel/x")
    with pytest.raises(StoreError, match=r"gs:// is not supported; use its S3-compatible endpoint"):
        open_store("gs://bucket/train")
    with pytest.raises(StoreError, match=r"ftp:// is not supported; packer reads s3://, http://, https://"):
        open_store("ftp://host/train")
    with pytest.raises(StoreError, match="no bucket"):
        open_store("s3:///train")


def test_cache_limit_sizes() -> None:
    assert parse_limit(None) is None and parse_limit(1000) == 1000
    assert (
        parse_limit("200GB") == 200 * 10**9
        and parse_limit("1.5GiB") == 3 * 2**29
        and parse_limit("64 MB") == 64 * 10**6
    )
    for bad in ("lots", "-1GB", 0, "0"):
        with pytest.raises(ValueError, match="cache_limit"):
            parse_limit(bad)


def test_anonymous_refused_clearly(s3_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS_NO_SIGN_REQUEST reads a bucket unsigned; one that needs credentials says so at once."""
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "true")
    with pytest.raises(StoreError, match=r"s3://packer/anything/manifest\.json: access denied \(HTTP 403"):
        open_store("s3://packer/anything").get("manifest.json")
