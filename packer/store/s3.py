"""Objects in S3 or an S3-compatible store (``s3://bucket/prefix``), over :mod:`packer.store.http`
with botocore's SigV4 signer and credential chain used on their own: credentials, region and
endpoint come the standard AWS way (``AWS_ACCESS_KEY_ID``/profiles/SSO/instance roles,
``AWS_REGION``, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` or a profile's ``endpoint_url``),
and a bucket without credentials (or with ``AWS_NO_SIGN_REQUEST=true``) is read anonymously.
botocore's own client is not used: its per-request overhead halved the GET rate measured on one
connection pool (docs/PERFORMANCE.md, "Object storage clients")."""

from __future__ import annotations

import os
from typing import Any, Optional
from urllib.parse import quote, urlsplit

from .base import StoreError
from .http import HttpStore

DEFAULT_REGION = "us-east-1"


def _botocore() -> Any:
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.credentials
        import botocore.session
    except ImportError:
        raise StoreError("s3:// URLs need botocore: pip install 'packer[s3]'") from None
    return botocore


class S3Store(HttpStore):
    """Objects under ``s3://bucket/prefix``: path-style requests to a configured endpoint, virtual-
    hosted ones to AWS; each signed with the credentials current at the time (they may refresh)."""

    def __init__(self, url: str, *, settings: Optional[dict[str, Any]] = None) -> None:
        super().__init__(url, settings=settings)
        parts = urlsplit(self.url)
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        if not self.bucket:
            raise StoreError(f"{url}: no bucket named (s3://bucket/prefix)")
        botocore = _botocore()
        if settings is not None:  # resolved by the process that opened the dataset
            self.base, self.region = settings["base"], settings["region"]
            keys = settings["keys"]
            if keys is not None:  # static keys: the same ones; else (anonymous or refreshing) as there
                self._credentials: Optional[Any] = botocore.credentials.Credentials(*keys)
            else:
                anonymous = settings["anonymous"]
                self._credentials = None if anonymous else botocore.session.get_session().get_credentials()
            return
        session = botocore.session.get_session()
        self.region = session.get_config_variable("region") or DEFAULT_REGION
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if not endpoint:
            try:
                endpoint = session.get_scoped_config().get("endpoint_url")
            except botocore.exceptions.ProfileNotFound as e:
                raise StoreError(f"{url}: {e}") from None
        if endpoint:
            self.base = f"{endpoint.rstrip('/')}/{quote(self.bucket)}"
        elif "." in self.bucket:  # a dotted name breaks the TLS wildcard of a virtual host
            self.base = f"https://s3.{self.region}.amazonaws.com/{quote(self.bucket)}"
        else:
            self.base = f"https://{self.bucket}.s3.{self.region}.amazonaws.com"
        anonymous = os.environ.get("AWS_NO_SIGN_REQUEST", "").lower() in ("1", "true", "yes")
        self._credentials = None if anonymous else session.get_credentials()

    def settings(self) -> dict[str, Any]:
        """Endpoint, region and, for static credentials, the keys themselves (handed to DataLoader
        workers through their pipe, never written anywhere); refreshing credentials (instance roles,
        SSO) are resolved again by each process's own chain."""
        credentials, keys = self._credentials, None
        if credentials is not None and not isinstance(credentials, _botocore().credentials.RefreshableCredentials):
            frozen = credentials.get_frozen_credentials()
            keys = (frozen.access_key, frozen.secret_key, frozen.token)
        return {"base": self.base, "region": self.region, "keys": keys, "anonymous": credentials is None}

    def object_url(self, key: str) -> str:
        path = f"{self.prefix}/{key}" if self.prefix else key
        return f"{self.base}/{quote(path)}"

    def headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        if self._credentials is None:
            return headers
        botocore = _botocore()
        request = botocore.awsrequest.AWSRequest(method=method, url=url, headers=headers)
        signer = botocore.auth.S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self.region)
        signer.add_auth(request)
        return dict(request.headers.items())
