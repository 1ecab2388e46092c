"""The admission webhook's server: kopf's, reading reviews as large as the API server sends.

An UPDATE's AdmissionReview carries the object and the old object, each up to :data:`API_SERVER_MAX_BODY_BYTES`,
in one envelope: a review is read up to :data:`MAX_REVIEW_BYTES` (aiohttp's default, 1 MiB, answered 413 to the
UPDATE of a valid ~543 KB object, so even ``suspend: true`` was refused), and a larger body is answered 413 before
it is read.
"""

from __future__ import annotations

from typing import Any

import aiohttp.web
import kopf

API_SERVER_MAX_BODY_BYTES = 3 * 1024 * 1024
"""The API server's limit on one request body (kube-apiserver's ``MaxRequestBodyBytes``, 3 MiB): no object it
admits is larger."""
REVIEW_ENVELOPE_BYTES = 1024 * 1024
"""Room for the rest of an AdmissionReview: the request's metadata, ``userInfo`` and options, and the JSON the API
server writes around (and into, e.g. ``managedFields``) the objects."""
MAX_REVIEW_BYTES = 2 * API_SERVER_MAX_BODY_BYTES + REVIEW_ENVELOPE_BYTES
"""The largest AdmissionReview body read (7 MiB): an UPDATE's object and old object, each as large as the API
server admits, and the envelope."""


class GuardedServer(kopf.WebhookServer):
    """kopf's webhook server, reading bodies up to :data:`MAX_REVIEW_BYTES`."""

    async def _serve(self, fn: Any, request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:  # type: ignore[override]
        if request.content_length is not None and request.content_length > MAX_REVIEW_BYTES:
            raise aiohttp.web.HTTPRequestEntityTooLarge(max_size=MAX_REVIEW_BYTES,
                                                        actual_size=request.content_length)
        return await kopf.WebhookServer._serve(fn, request.clone(client_max_size=MAX_REVIEW_BYTES))


def server(addr: str, port: int, cert_file: str | None, key_file: str | None, check_seconds: float) -> GuardedServer:
    """The webhook's HTTPS server."""
    return GuardedServer(addr=addr, port=port, certfile=cert_file, pkeyfile=key_file, file_check_interval=check_seconds)
