"""Objects in S3 or an S3-compatible store (``s3://bucket/prefix``), over :mod:`packer.store.http`
with botocore's SigV4 signer and credential chain used on their own: credentials, region and
endpoint come the standard AWS way (``AWS_ACCESS_KEY_ID``/profiles/SSO/instance roles,
``AWS_REGION``, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` or a profile's ``endpoint_url``),
and a bucket without credentials (or with ``AWS_NO_SIGN_REQUEST=true``) is read anonymously.
botocore's own client is not used: its per-request overhead halved the GET rate measured on one
connection pool (docs/PERFORMANCE.md, "Object storage clients").

Writes (the publish side, :class:`~packer.store.base.Store`'s put/put_file/delete/list) are the plain
S3 REST calls. Each PUT body carries its Content-MD5, which the store checks (BadDigest otherwise);
botocore's signer then signs the body's SHA-256 over http:// and sends UNSIGNED-PAYLOAD over https://,
where TLS and the MD5 already cover it (its own rule, kept)."""

from __future__ import annotations

import base64
import hashlib
import os
import xml.etree.ElementTree as ET
from datetime import datetime
from typing import Any, Optional
from urllib.parse import quote, urlencode, urlsplit

import urllib3

from .._version import DISTRIBUTION
from .base import Listed, Passing, StoreError, Upload
from .http import HttpStore

DEFAULT_REGION = "us-east-1"
LIST_PAGE = 1000  # keys per listing request (S3's most)


def _session() -> Any:
    """This process's botocore session for the AWS environment variables as they are now (making
    one is a part of a dataset's opening time: docs/PERFORMANCE.md, "A cold first epoch from S3"),
    so a profile's files are read once per process and environment; a forked child makes its own
    (a session's credential providers hold locks a fork could copy held)."""
    aws = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), aws)
    if key not in _SESSIONS:
        _SESSIONS.clear()
        _SESSIONS[key] = _botocore().session.get_session()
    return _SESSIONS[key]


_SESSIONS: dict[tuple[int, tuple[tuple[str, str], ...]], Any] = {}


def _botocore() -> Any:
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.credentials
        import botocore.session
    except ImportError:
        raise StoreError(f"s3:// URLs need botocore: pip install '{DISTRIBUTION}[s3]'") from None
    return botocore


class S3Store(HttpStore):
    """Objects under ``s3://bucket/prefix``: path-style requests to a configured endpoint, virtual-
    hosted ones to AWS; each signed with the credentials current at the time (they may refresh)."""

    writable = True

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
                self._credentials = None if anonymous else _session().get_credentials()
            return
        session = _session()
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

    def headers(self, method: str, url: str, headers: dict[str, str], body: Optional[bytes] = None) -> dict[str, str]:
        if body is not None:
            headers = headers | {"Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode("ascii")}
        if self._credentials is None:
            return headers
        botocore = _botocore()
        request = botocore.awsrequest.AWSRequest(method=method, url=url, headers=headers, data=body)
        signer = botocore.auth.S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self.region)
        signer.add_auth(request)
        return dict(request.headers.items())

    def _xml(
        self,
        method: str,
        key: str,
        *,
        query: dict[str, str],
        headers: Optional[dict[str, str]] = None,
        body: Optional[bytes] = None,
    ) -> ET.Element:
        """The parsed XML answer of one request (``key`` "" : the bucket, for listings). A 200 whose body
        is an <Error> (S3 may answer a CompleteMultipartUpload so, after it began) is passing."""
        url = self.object_url(key) if key else f"{self.base}/"
        url += "?" + urlencode(query, quote_via=quote)
        response = self._send(method, url, key, headers or {}, body)
        try:
            text = response.read()
        except urllib3.exceptions.HTTPError as e:
            raise Passing(f"{type(e).__name__}: {e}") from None
        finally:
            response.release_conn()
        try:
            root = ET.fromstring(text)
        except ET.ParseError:
            raise Passing(f"an unreadable answer ({len(text)} bytes)") from None
        for element in root.iter():
            element.tag = element.tag.rpartition("}")[2]  # S3's namespace off every name
        if root.tag == "Error":
            raise Passing(f"HTTP {response.status}: {root.findtext('Code', '')}")
        return root

    def _put(self, key: str, data: bytes, headers: dict[str, str]) -> str:
        response = self._request("PUT", key, headers, body=data)
        response.release_conn()
        return response.headers.get("ETag", "")

    def _delete(self, key: str, headers: dict[str, str]) -> None:
        self._request("DELETE", key, headers).release_conn()

    def _list(self, prefix: str, token: str) -> tuple[list[Listed], str]:
        base = self.prefix
        query = {"list-type": "2", "max-keys": str(LIST_PAGE), "prefix": (base + "/" if base else "") + prefix}
        if token:
            query["continuation-token"] = token
        root = self._xml("GET", "", query=query)
        skip = len(base) + 1 if base else 0
        page = [
            Listed(
                e.findtext("Key", "")[skip:],
                int(e.findtext("Size", "0")),
                e.findtext("ETag", ""),
                _iso_time(e.findtext("LastModified", "")),
            )
            for e in root.iter("Contents")
        ]
        more = root.findtext("IsTruncated", "false") == "true"
        return page, root.findtext("NextContinuationToken", "") if more else ""

    def _create_upload(self, key: str, headers: dict[str, str]) -> str:
        upload = self._xml("POST", key, query={"uploads": ""}, headers=headers).findtext("UploadId", "")
        if not upload:
            raise Passing("no UploadId in the answer")
        return upload

    def _upload_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        query = urlencode({"partNumber": number, "uploadId": upload}, quote_via=quote)
        response = self._request("PUT", key, {}, query=query, body=data)
        response.release_conn()
        return response.headers.get("ETag", "")

    def _complete_upload(self, key: str, upload: str, etags: list[str]) -> str:
        parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(etags, 1))
        body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
        root = self._xml("POST", key, query={"uploadId": upload}, body=body)
        return root.findtext("ETag", "")

    def _abort_upload(self, key: str, upload: str) -> None:
        query = urlencode({"uploadId": upload}, quote_via=quote)
        self._request("DELETE", key, {}, query=query).release_conn()

    def _uploads(self, prefix: str) -> list[Upload]:
        base = self.prefix
        skip = len(base) + 1 if base else 0
        query = {"uploads": "", "prefix": (base + "/" if base else "") + prefix}
        found: list[Upload] = []
        while True:
            root = self._xml("GET", "", query=query)
            found += [
                Upload(e.findtext("Key", "")[skip:], e.findtext("UploadId", ""), _iso_time(e.findtext("Initiated", "")))
                for e in root.iter("Upload")
            ]
            if root.findtext("IsTruncated", "false") != "true":
                return found
            query |= {
                "key-marker": root.findtext("NextKeyMarker", ""),
                "upload-id-marker": root.findtext("NextUploadIdMarker", ""),
            }


def _iso_time(text: str) -> float:
    """S3's ISO 8601 time (``2024-01-01T00:00:00.000Z``) as seconds since the epoch (0.0 if unreadable)."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
