"""Object stores the read side can open a dataset from, chosen by URL scheme from one table
(:data:`STORES`); the interface each provides is :class:`~packer.store.base.Store`. Local paths
never come here (:func:`is_url`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

from ..errors import ObjectChanged, ObjectNotFound, PreconditionFailed, StoreError, is_url
from .base import Listed, ObjectInfo, Store, Upload
from .http import HttpStore
from .s3 import S3Store

__all__ = [
    "STORES",
    "Listed",
    "ObjectChanged",
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "Store",
    "StoreError",
    "Upload",
    "is_url",
    "open_store",
]

#: Every store by the URL scheme that names it.
STORES: dict[str, Callable[..., Store]] = {"s3": S3Store, "http": HttpStore, "https": HttpStore}
#: Schemes users will try that no store here serves, and what to do instead.
ELSEWHERE = {
    "gs": "use its S3-compatible endpoint: s3://BUCKET/... with AWS_ENDPOINT_URL=https://storage.googleapis.com "
    "and HMAC keys as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
    "az": "serve the container over https:// (a SAS URL's path), or through an S3-compatible gateway",
}

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_store(url: str, *, settings: Optional[dict[str, Any]] = None) -> Store:
    """The store of ``url``'s scheme at ``url`` (StoreError for a scheme none serves); ``settings``:
    another process's :meth:`Store.settings` for the same URL, used instead of this environment."""
    found = _SCHEME.match(url)
    scheme = found.group(1).lower() if found else ""
    if scheme not in STORES:
        advice = ELSEWHERE.get(scheme, f"packer reads {', '.join(f'{s}://' for s in STORES)} URLs")
        raise StoreError(f"{url}: {scheme}:// is not supported; {advice}")
    return STORES[scheme](url, settings=settings)
