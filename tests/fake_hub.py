"""A Hugging Face Hub on 127.0.0.1 serving repositories from memory: just the endpoints huggingface_hub
2.4 calls to list and download a model (`HF_ENDPOINT` pointed at it), with faults on demand.

- `GET /api/models/{repo}[/revision/{rev}]`: id, sha (the commit), siblings;
- `GET /api/models/{repo}/tree/{rev}`: every file with its size, git blob id and, for LFS files
  (*.gguf, *.safetensors), `lfs: {oid: sha256, size, pointerSize}`;
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: `X-Repo-Commit`, `ETag` (the git blob id, or for an LFS file
  `X-Linked-Etag` = its sha256 and `X-Linked-Size`), `Content-Length`; a `Range: bytes=N-` gets 206.

Faults: `drop_once[path] = n` sends the first GET of `path` n bytes of its body and closes the connection;
`stall[path] = n` sends n bytes and then holds the connection open until `release` is set;
`corrupt.add(path)` serves `path` with one byte changed (same length). `requests` logs (method, path,
Range header) of every request.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

LFS_SUFFIXES = (".gguf", ".safetensors")


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop_once: dict[str, int] = {}
        self.stall: dict[str, int] = {}
        self.release = threading.Event()
        self.corrupt: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1()
        for name, data in sorted(self.repos[repo].items()):
            digest.update(name.encode() + hashlib.sha256(data).digest())
        return digest.hexdigest()

    def gets(self, path: str) -> list[str | None]:
        """The Range headers of every GET of a file (None: the whole file)."""
        return [rng for method, p, rng in self.requests if method == "GET" and p.endswith("/" + path)]


@contextmanager
def hub_serving(repos: dict[str, dict[str, bytes]], cache: Path) -> Iterator[FakeHub]:
    """A FakeHub serving `repos` ({repo: {path: bytes}}), and huggingface_hub pointed at it (as
    HF_ENDPOINT does) and at the cache `cache` (as HF_HUB_CACHE does), online, Xet off, for the block."""
    from huggingface_hub import constants

    with FakeHub() as hub, pytest.MonkeyPatch.context() as patch:
        for repo, files in repos.items():
            hub.add(repo, files)
        patch.setattr(constants, "ENDPOINT", hub.url)
        patch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        patch.setattr(constants, "HF_HUB_CACHE", str(cache))
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        patch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        yield hub


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    """The files of a checkpoint directory, as a repository's {path: bytes}."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(name: str, data: bytes) -> dict:
    entry = {"type": "file", "path": name, "size": len(data), "oid": blob_id(data)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if path.startswith("/api/models/"):
                return self._api(path[len("/api/models/") :])
            parts = path.strip("/").split("/")  # owner, name, "resolve", revision, path...
            repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
            if len(parts) < 5 or parts[2] != "resolve" or repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            files = hub.repos[repo]
            if filename not in files:
                return self._error(404, "EntryNotFound", repo)
            self._file(repo, filename, files[filename], body)

        def _api(self, rest: str) -> None:
            parts = rest.split("/")
            repo = "/".join(parts[:2])
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            files = hub.repos[repo]
            if len(parts) > 3 and parts[2] == "tree":
                return self._json([_entry(n, d) for n, d in sorted(files.items())])
            siblings = [{"rfilename": n} for n in sorted(files)]
            self._json({"id": repo, "sha": hub.commit(repo), "private": False, "siblings": siblings})

        def _file(self, repo: str, filename: str, data: bytes, body: bool) -> None:
            served = data
            if filename in hub.corrupt:
                served = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[len("bytes=") : -1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.commit(repo))
            if filename.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
            else:
                self.send_header("ETag", f'"{blob_id(data)}"')
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            cut = hub.drop_once.pop(filename, None)
            hold = hub.stall.pop(filename, None)
            if cut is not None or hold is not None:
                self.wfile.write(served[start : start + (cut if cut is not None else hold)])
                self.wfile.flush()
                if hold is not None:
                    hub.release.wait(60)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(served[start:])

        def _json(self, obj: object) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _error(self, status: int, code: str, repo: str | None = None) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if repo is not None:
                self.send_header("X-Repo-Commit", hub.commit(repo))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

    return Handler
