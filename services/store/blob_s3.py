"""S3-compatible blob backend for several store replicas (tested against a real SeaweedFS server).

Object key: `<prefix><tenant>/<doc_id>/<digest[:2]>/<digest>`. One PUT publishes a blob atomically (an
S3 object is visible whole or not at all); uploads are staged in a local spool directory first, because
the digest must be verified before anything is published."""
from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .blob import BlobKey, BlobMissing, BlobUnavailable
from .keys import HEX64

_MISSING = {"NoSuchKey", "404", "NotFound"}


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Blobs:
    name = "s3"

    def __init__(self, *, endpoint: str, bucket: str, spool: str | Path, prefix: str = "", region: str = "us-east-1",
                 access_key: str | None = None, secret_key: str | None = None, create_bucket: bool = True):
        self.bucket, self.prefix = bucket, prefix
        self.spool = Path(spool).resolve()
        self.spool.mkdir(parents=True, exist_ok=True)
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint or None, region_name=region, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"},
                          max_pool_connections=64, connect_timeout=5, read_timeout=60))
        if create_bucket:
            self._ensure_bucket()

    def _ensure_bucket(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) not in _MISSING and _code(e) != "NoSuchBucket":
                raise BlobUnavailable(f"s3: bucket {self.bucket}: {e}") from e
            self.client.create_bucket(Bucket=self.bucket)
        except BotoCoreError as e:
            raise BlobUnavailable(f"s3: {e}") from e

    def object_key(self, key: BlobKey) -> str:
        return self.prefix + "/".join(key.parts())

    def spool_dir(self) -> Path:
        return self.spool

    def put_file_blocking(self, key: BlobKey, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                self.client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=f)
        except (ClientError, BotoCoreError, OSError) as e:
            raise BlobUnavailable(f"s3: cannot publish blob {key.digest[:16]}: {e}") from e
        finally:
            path.unlink(missing_ok=True)

    def open_blocking(self, key: BlobKey) -> BinaryIO:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.object_key(key))["Body"]
        except ClientError as e:
            if _code(e) in _MISSING:
                raise BlobMissing(key.digest) from None
            raise BlobUnavailable(f"s3: cannot read blob {key.digest[:16]}: {e}") from e
        except BotoCoreError as e:
            raise BlobUnavailable(f"s3: cannot read blob {key.digest[:16]}: {e}") from e

    def size_blocking(self, key: BlobKey) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))["ContentLength"])
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            raise BlobUnavailable(f"s3: cannot stat blob {key.digest[:16]}: {e}") from e
        except BotoCoreError as e:
            raise BlobUnavailable(f"s3: {e}") from e

    def delete_blocking(self, key: BlobKey) -> int:
        size = self.size_blocking(key)
        if size is None:
            return 0
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        except (ClientError, BotoCoreError) as e:
            raise BlobUnavailable(f"s3: cannot delete blob {key.digest[:16]}: {e}") from e
        return size

    def list_blocking(self, tenant: str, doc_id: str) -> list[tuple[str, int]]:
        prefix = self.prefix + f"{tenant}/{doc_id}/"
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    digest = obj["Key"].rsplit("/", 1)[-1]
                    if HEX64.match(digest):
                        out.append((digest, int(obj["Size"])))
        except (ClientError, BotoCoreError) as e:
            raise BlobUnavailable(f"s3: cannot list {prefix}: {e}") from e
        return out

    def remove_stale_spool_blocking(self, older_than_s: float) -> int:
        cutoff, n = time.time() - older_than_s, 0
        for f in self.spool.iterdir():
            try:
                if f.stat().st_mtime < cutoff:
                    f.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n
