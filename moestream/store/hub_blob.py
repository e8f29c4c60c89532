"""A repository's large (LFS) file downloaded into huggingface_hub's blob store so that a download
stopped by Ctrl-C, a kill or a reboot resumes where it stopped, in the next process.

huggingface_hub (2.4) writes each download to a temporary file unique to its process and deletes it
when the download fails: it resumes a dropped connection within one process, never across processes.
For a file served over plain HTTP (not Xet, whose client huggingface_hub keeps), moestream appends to
`blobs/<sha256>.part` instead, with range requests through huggingface_hub's own `http_get` (its
retries and progress bar), checks the sha256, and moves the file to `blobs/<sha256>`: the blob that
huggingface_hub would write, which it then only links into the snapshot.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError

_HASH_CHUNK = 8 << 20


def digest(path: Path, entry: Any) -> tuple[str, str]:
    """(what, hex digest) of a file as the hub lists it: the sha256 of an LFS file, the git blob id
    (sha1 of "blob <size>\\0" and the bytes) of any other."""
    size = os.stat(path).st_size
    if entry.lfs is not None:
        kind, h = "sha256", hashlib.sha256()
    else:
        kind, h = "git blob id", hashlib.sha1(f"blob {size}\0".encode())
    if size >= 1 << 30:
        print(f"moestream: checking the {kind} of {path.name}", file=sys.stderr, flush=True)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return kind, h.hexdigest()


def resumable(entry: Any) -> bool:
    """Whether `download_blob` takes this file: an LFS file that huggingface_hub would not fetch with
    Xet, and an `http_get` that resumes."""
    from huggingface_hub import file_download

    if entry is None or getattr(entry, "lfs", None) is None:
        return False
    xet_available = getattr(file_download, "is_xet_available", None)
    if getattr(entry, "xet_hash", None) and (xet_available is None or xet_available()):
        return False
    params = inspect.signature(getattr(file_download, "http_get", lambda: None)).parameters
    return {"resume_size", "expected_size", "displayed_filename"} <= set(params)


def download_blob(repo: str, name: str, commit: str, entry: Any, storage: Path) -> None:
    """Download `name` of `repo` at `commit` into `storage`/blobs/<sha256>, resuming a `.part` left by
    an earlier process, and check its sha256.

    Raises:
        CheckpointError: the download failed (what is downloaded stays for the next try) or the file
            came down corrupt (deleted).
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    sha, size = entry.lfs.sha256, entry.lfs.size
    blob = storage / "blobs" / sha
    if blob.exists():
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(f"{sha}.part")
    with open(part, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the same file downloading in another process: wait for it
        if blob.exists():
            return
        have = f.seek(0, os.SEEK_END)
        if have > size:
            f.truncate(0)
            have = 0
        if have:
            print(f"moestream: resuming {name} at {have} of {size} bytes", file=sys.stderr, flush=True)
        try:
            url = hf_hub_url(repo, name, revision=commit)
            headers = build_hf_headers()
            http_get(url, f, resume_size=have, headers=headers, expected_size=size, displayed_filename=name)
        except Exception as exc:
            f.flush()
            raise CheckpointError(
                f"downloading {name} of {repo} stopped at {os.fstat(f.fileno()).st_size} of {size} bytes "
                f"({_first_line(exc)}); run the same command again to resume it"
            ) from None
        f.flush()
        kind, got = digest(part, entry)
        if got != sha:
            part.unlink(missing_ok=True)
            raise CheckpointError(
                f"{repo}'s {name} came down corrupt ({kind} {got[:16]}..., the hub lists {sha[:16]}...); "
                "it was deleted, run again to download it again"
            )
        os.replace(part, blob)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
