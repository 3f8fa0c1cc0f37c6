"""Object-store failures as one-line user errors: bucket missing, access denied / bad credentials,
endpoint unreachable. Each names the URI and the fix; none carries a credential.

s3fs turns botocore's ``ClientError`` into ``FileNotFoundError`` / ``PermissionError`` and keeps the
original as ``__cause__``; a refused connection comes through as botocore's
``EndpointConnectionError`` after botocore's own bounded retries (a few seconds). We read the error
code from anywhere in the cause chain.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from runtime.errors import TransientError, UserError

CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials that may "
                    "read and write this bucket")
ENDPOINT_HINT = ("check AWS_ENDPOINT_URL (or FSSPEC_S3_ENDPOINT_URL, or endpoint_url in the fsspec s3 config) "
                 "and that the server is up")

_BUCKET_CODES = {"NoSuchBucket"}
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden",
                 "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
                 "InvalidSecurity", "AuthorizationHeaderMalformed", "NotSignedUp"}
_UNREACHABLE_NAMES = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                      "ClientConnectorError", "ServerDisconnectedError", "ProxyConnectionError"}


class StorageError(UserError):
    """The run's object store cannot be used as configured."""


class BucketMissingError(StorageError):
    pass


class StorageAccessError(StorageError):
    pass


class StorageUnreachableError(StorageError, TransientError):
    """Also a TransientError: a Prefect task retries it; the CLI prints it as one line when retries are spent."""


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _code(err: BaseException) -> str | None:
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        if code:
            return str(code)
    return None


def classify(err: BaseException) -> tuple[str, str] | None:
    """("bucket" | "access" | "unreachable", short reason) for an object-store failure, else None."""
    for e in _chain(err):
        names = {c.__name__ for c in type(e).__mro__}
        code = _code(e)
        if code in _BUCKET_CODES:
            return "bucket", code
        if code in _ACCESS_CODES:
            return "access", f"HTTP {code}" if code.isdigit() else code
        if names & _UNREACHABLE_NAMES:
            return "unreachable", type(e).__name__
        if "NoCredentialsError" in names or "PartialCredentialsError" in names:
            return "access", "no credentials found"
    # s3fs without a recognisable cause
    if isinstance(err, PermissionError):
        return "access", " ".join(str(err).split())[:120] or "PermissionError"
    if isinstance(err, FileNotFoundError) and "specified bucket does not exist" in str(err):
        return "bucket", "NoSuchBucket"
    return None


def _endpoint(err: BaseException) -> str | None:
    for e in _chain(err):
        url = (getattr(e, "kwargs", None) or {}).get("endpoint_url")
        if url:
            p = urlsplit(str(url))
            return f"{p.scheme}://{p.hostname}" + (f":{p.port}" if p.port else "")
    return None


def bucket_of(uri: str) -> str:
    return urlsplit(str(uri)).netloc.rsplit("@", 1)[-1]


def translate(err: BaseException, uri: str) -> StorageError | None:
    """The one-line StorageError for ``err`` raised while using ``uri``; None when it is no store failure
    (a plain missing object stays a FileNotFoundError)."""
    kind = classify(err)
    if kind is None:
        return None
    what, reason = kind
    bucket = bucket_of(uri)
    if what == "bucket":
        return BucketMissingError(f"{uri}: bucket '{bucket}' does not exist ({reason}); create it "
                                  f"(e.g. `aws s3 mb s3://{bucket}`) or fix the URI (storage.root / the source)")
    if what == "access":
        return StorageAccessError(f"{uri}: access denied ({reason}); the credentials are wrong or may not use "
                                  f"bucket '{bucket}': {CREDENTIALS_HINT}")
    where = _endpoint(err) or "the S3 endpoint"
    return StorageUnreachableError(f"{uri}: cannot reach {where} ({reason}); {ENDPOINT_HINT}")
