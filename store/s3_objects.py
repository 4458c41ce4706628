"""The boto3 boundary of the shared cold tier: an `ObjectStore` over S3.

Every call blocks (HTTP): the shell runs them off the Trio thread
(`trio.to_thread.run_sync`), never on the engine thread. botocore's
"standard" retry mode bounds the retries (`max_attempts`) with exponential
backoff and jitter, and treats 5xx, 503 SlowDown and connection errors as
retryable; the connect and read timeouts bound each attempt. What is left
after that becomes one of `SharedStoreError`'s family here, `raise ... from`
the library's error, so the tier above sees no botocore type.

Conditional put: `put_if_absent` sends `If-None-Match: *`; S3, MinIO, R2 and
moto (checked: 5.2.5 answers 412 PreconditionFailed) refuse it when the key
exists. It also asks HEAD first, which saves the upload when the key is
already there; on a store that ignored the header, that HEAD is all that
stands between two writers, and the race it leaves (both HEADs miss, both
PUTs land, the later manifest wins) loses nothing: each manifest names its
own object by sha256, and neither writer deletes an object after a success.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kvcellar.errors import SharedKeyTaken, SharedObjectMissing, SharedStoreError
from kvcellar.store.disk import Disk

DOWNLOAD_CHUNK_BYTES = 1 << 20
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_TAKEN_CODES = frozenset({"PreconditionFailed", "412"})


class ObjectStore(Protocol):
    """What the shared tier needs of an object store (S3 here; the simulator's model)."""

    def exists(self, key: str) -> bool: ...
    def put_if_absent(self, key: str, body: bytes) -> None: ...
    def put_file(self, key: str, reader: io.RawIOBase, length_bytes: int) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_into(self, key: str, sink: Callable[[bytes], None]) -> int: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...


class S3ObjectStore:
    """An `ObjectStore` over one bucket through a boto3 client (thread-safe)."""

    def __init__(self, client: Any, bucket: str) -> None:
        self._client = client
        self.bucket = bucket

    @classmethod
    def open(
        cls,
        bucket: str,
        *,
        endpoint_url: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_attempts: int,
    ) -> S3ObjectStore:
        """Credentials and region come from the standard AWS environment and
        config files; `endpoint_url` selects MinIO, R2 or a local server
        (path-style addressing, which they all take)."""
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"mode": "standard", "max_attempts": max_attempts},
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        session = boto3.session.Session()
        client = session.client(
            "s3", endpoint_url=endpoint_url, config=config, region_name=session.region_name or "us-east-1"
        )
        return cls(client, bucket)

    def exists(self, key: str) -> bool:
        try:
            with _converted(key):
                self._client.head_object(Bucket=self.bucket, Key=key)
        except SharedObjectMissing:
            return False
        return True

    def put_if_absent(self, key: str, body: bytes) -> None:
        """Raises `SharedKeyTaken` when the key exists (HEAD or a 412)."""
        if self.exists(key):
            raise SharedKeyTaken(f"{key} exists")
        with _converted(key):
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")

    def put_file(self, key: str, reader: io.RawIOBase, length_bytes: int) -> None:
        with _converted(key):
            self._client.put_object(Bucket=self.bucket, Key=key, Body=reader, ContentLength=length_bytes)

    def get_bytes(self, key: str) -> bytes:
        chunks: list[bytes] = []
        self.get_into(key, chunks.append)
        return b"".join(chunks)

    def get_into(self, key: str, sink: Callable[[bytes], None]) -> int:
        """Stream the object into `sink` chunk by chunk; returns the bytes
        received. Raises `SharedStoreError` when the stream ends short of its
        Content-Length (a partial download) or breaks."""
        received = 0
        with _converted(key):
            reply = self._client.get_object(Bucket=self.bucket, Key=key)
            expected = int(reply.get("ContentLength", -1))
            body = reply["Body"]
            try:
                for chunk in iter(lambda: body.read(DOWNLOAD_CHUNK_BYTES), b""):
                    sink(chunk)
                    received += len(chunk)
            finally:
                body.close()
        if expected >= 0 and received != expected:
            raise SharedStoreError(f"{key}: partial download ({received} of {expected} bytes)")
        return received

    def list_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        with _converted(prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                keys.extend(item["Key"] for item in page.get("Contents", ()))
        return keys

    def delete(self, key: str) -> None:
        with _converted(key):
            self._client.delete_object(Bucket=self.bucket, Key=key)


@contextlib.contextmanager
def _converted(key: str) -> Iterator[None]:
    """Turns botocore's and the network's errors into `SharedStoreError`s."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except SharedStoreError:
        raise
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _MISSING_CODES or status == "404":
            raise SharedObjectMissing(f"{key}: not in the store") from e
        if code in _TAKEN_CODES or status == "412":
            raise SharedKeyTaken(f"{key}: already written (412)") from e
        raise SharedStoreError(f"{key}: {code or status}: {e}") from e
    except (BotoCoreError, OSError, ValueError) as e:
        raise SharedStoreError(f"{key}: {type(e).__name__}: {e}") from e


class DiskFileReader(io.RawIOBase):
    """A seekable reader over one file through `Disk` (botocore re-reads a
    body to retry it and to checksum it), so uploads stream from the SSD
    tier's file instead of holding the entry in memory. `pause` runs before
    every read, on botocore's thread."""

    def __init__(self, disk: Disk, handle: Any, length_bytes: int, pause: Callable[[], None] = lambda: None) -> None:
        self._disk = disk
        self._handle = handle
        self._length = length_bytes
        self._position = 0
        self._pause = pause  # called before each read: the shared tier holds uploads while the engine decodes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._length - self._position)
        if wanted <= 0:
            return 0
        self._pause()
        got = self._disk.read_into(self._handle, self._position, view[:wanted])
        self._position += got
        return got


def iter_file_chunks(
    disk: Disk, handle: Any, length_bytes: int, pause: Callable[[], None] = lambda: None
) -> Iterator[memoryview]:
    """The file's bytes in `DOWNLOAD_CHUNK_BYTES` chunks, through `Disk`; `pause` before each."""
    buffer = bytearray(DOWNLOAD_CHUNK_BYTES)
    offset = 0
    while offset < length_bytes:
        pause()
        view = memoryview(buffer)[: min(DOWNLOAD_CHUNK_BYTES, length_bytes - offset)]
        got = disk.read_into(handle, offset, view)
        if got <= 0:
            return
        yield view[:got]
        offset += got
