"""Models by name: `REPO[:QUANT]` fetched into huggingface_hub's cache and returned as a local path.

huggingface_hub (its cache under `HF_HOME`, its endpoint `HF_ENDPOINT`, its token) downloads the files
that `hub_select.select_files` picks from the repository's listing, with its progress bars on stderr.
What it checks itself (huggingface_hub 2.4): a dropped connection is resumed with a range request (five
tries, from the last 10 MiB it wrote), and a file whose length differs from the hub's is refused. It
checks no hash, and it deletes a partial download when its process ends; so large files served over
plain HTTP are downloaded by `hub_blob` (resumed by the next process, sha256 checked), and every other
file downloaded here is hashed against the listing (sha256 of an LFS file, git blob id of any other)
and deleted from the cache when it differs.

Offline (`HF_HUB_OFFLINE=1`, or the hub unreachable) the listing huggingface_hub cached at the download
(else the files of the cached snapshot) stands in for the hub's, and a file not in the cache is one
error.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError
from moestream.store.hub_blob import digest, download_blob, resumable
from moestream.store.hub_select import HubSpec, Selection, parse_spec, select_files

REVISION = "main"


def fetch(text: str) -> Path:
    """The local checkpoint `REPO[:QUANT]` names: a GGUF file (the first part of a split) or a
    safetensors directory in the HF cache, downloaded first where it is not there.

    Raises:
        CheckpointError: a malformed name, a repository that does not exist or is gated, a quant that
            names no model or several, a failed or corrupt download, or a file that is not cached while
            the hub cannot be reached.
    """
    spec = parse_spec(text)
    listing, commit, offline = _listing(spec)
    selection = select_files(spec, sorted(listing))
    if offline is not None:
        return _cached(spec, selection, offline)
    return _download(spec, selection, listing, commit)


def _listing(spec: HubSpec) -> tuple[dict[str, Any], str, str | None]:
    """The repository's files (path -> RepoFile), its commit and None; or the cached files, "" and why
    the hub was not asked."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if _offline_mode(constants):
        return _cached_listing(spec, "HF_HUB_OFFLINE is set")
    api = HfApi()
    try:
        commit = api.model_info(spec.repo, revision=REVISION).sha or REVISION
        tree = api.list_repo_tree(spec.repo, recursive=True, revision=commit)
        return {f.path: f for f in tree if hasattr(f, "blob_id")}, commit, None
    except GatedRepoError:
        raise CheckpointError(
            f"{spec.repo} is gated: accept its terms on {api.endpoint}/{spec.repo} and log in "
            "(`hf auth login`, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{api.endpoint} has no model repository {spec.repo} (or it is private: log in with "
            "`hf auth login`, or set HF_TOKEN)"
        ) from None
    except HfHubHTTPError as exc:  # the hub is down or refuses: what is cached may still do
        return _cached_listing(spec, f"{api.endpoint} answered {_first_line(exc)}")
    except Exception as exc:
        if not _network_error(exc):
            raise
        return _cached_listing(spec, f"{api.endpoint} cannot be reached ({_first_line(exc)})")


def _network_error(exc: BaseException) -> bool:
    """No connection: an OSError (huggingface_hub's offline error is one) or an HTTP client's error."""
    clients = ("httpx", "httpx2", "httpcore", "requests", "urllib3")
    return isinstance(exc, OSError) or any(t.__module__.split(".")[0] in clients for t in type(exc).__mro__)


def _offline_mode(constants: Any) -> bool:
    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if check is not None else constants.HF_HUB_OFFLINE)


def _cached_listing(spec: HubSpec, why: str) -> tuple[dict[str, Any], str, str]:
    """The files of the cached snapshot of `spec.repo`'s main branch, from huggingface_hub's cached
    listing (2.x) or else from the snapshot's directory."""
    try:
        from huggingface_hub import get_cached_repo_tree

        return {f.path: f for f in get_cached_repo_tree(spec.repo, revision=REVISION)}, "", why
    except Exception:  # no listing cached (CachedRepoTreeNotFoundError), or a huggingface_hub without it
        pass
    snapshot = _snapshot_dir(spec.repo)
    if snapshot is None or not snapshot.is_dir():
        raise CheckpointError(f"{spec} is not in the HF cache ({_cache_dir()}) and {why}")
    names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if not p.is_dir()]
    return dict.fromkeys(names), "", why


def _cached(spec: HubSpec, selection: Selection, why: str) -> Path:
    snapshot = _snapshot_dir(spec.repo)
    missing = [n for n in selection.files if snapshot is None or not (snapshot / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{spec.repo}'s {_names(missing)} {'is' if len(missing) == 1 else 'are'} not in the HF cache "
            f"({_cache_dir()}) and {why}"
        )
    assert snapshot is not None
    return snapshot / selection.open if selection.open else snapshot


def _download(spec: HubSpec, selection: Selection, listing: dict[str, Any], commit: str) -> Path:
    """Download what is not cached yet (large files resumably, `hub_blob`), check every downloaded
    file against the listing, return the path to open."""
    from huggingface_hub import snapshot_download

    storage = _cache_dir() / _repo_folder(spec.repo)
    current = storage / "snapshots" / commit  # the hub's main branch now
    fresh = [n for n in selection.files if not (current / n).is_file()]
    if not fresh and _snapshot_dir(spec.repo) == current:  # nothing to download, nothing to update
        return current / selection.open if selection.open else current
    if fresh:
        print(f"moestream: downloading {_names(fresh)} of {spec.repo}", file=sys.stderr, flush=True)
    blobs = [n for n in fresh if resumable(listing.get(n))]
    for name in blobs:  # hashed as they land
        download_blob(spec.repo, name, commit, listing[name], storage)
    try:
        # the rest, and every file linked into the snapshot (exact names as patterns: [ ] escaped)
        folder = snapshot_download(
            spec.repo, revision=REVISION, allow_patterns=[glob.escape(n) for n in selection.files]
        )
    except Exception as exc:
        raise CheckpointError(
            f"downloading {spec} failed: {_first_line(exc)} (run the same command again to retry)"
        ) from None
    snapshot = Path(folder)
    for name in selection.files:
        if not (snapshot / name).is_file():
            raise CheckpointError(f"{spec.repo} changed while it was downloaded ({name} is gone); run again")
    for name in fresh:
        if name not in blobs:
            _verify(spec, snapshot / name, listing.get(name))
    return snapshot / selection.open if selection.open else snapshot


def _verify(spec: HubSpec, path: Path, entry: Any) -> None:
    """Hash a file huggingface_hub downloaded against the hub's listing; delete it when it differs."""
    if entry is None:
        return
    kind, got = digest(path, entry)
    size, expected = path.stat().st_size, entry.lfs.sha256 if entry.lfs is not None else entry.blob_id
    if size == entry.size and got == expected:
        return
    for p in {path, path.resolve()}:
        p.unlink(missing_ok=True)
    what = f"{size} bytes" if size != entry.size else f"{kind} {got[:16]}..."
    raise CheckpointError(
        f"{spec.repo}'s {path.name} came down corrupt ({what}, the hub lists {entry.size} bytes, {kind} "
        f"{expected[:16]}...); it was deleted from the cache, run again to download it again"
    )


def _snapshot_dir(repo: str) -> Path | None:
    """The cached snapshot of `repo`'s main branch, or None."""
    storage = _cache_dir() / _repo_folder(repo)
    try:
        commit = (storage / "refs" / REVISION).read_text().strip()
    except OSError:
        return None
    return storage / "snapshots" / commit


def _repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(os.path.expanduser(constants.HF_HUB_CACHE))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


__all__ = ["fetch", "parse_spec"]
