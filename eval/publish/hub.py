"""Upload an export folder to the Hugging Face Hub as one commit, and check what arrived.

`push_folder(folder, repo_id)` creates the model repo (private unless told otherwise), commits
every file of `folder` in a single commit, then lists the repo at that commit and compares each
file's size and hash with the local copy. The commit URL is returned only when all of them match;
every failure is a `HubUploadError` that says what went wrong, what state the Hub was left in and
what to do.

The token is read from the environment only (`HF_TOKEN`, else `HUGGING_FACE_HUB_TOKEN`) and is
passed explicitly to `HfApi`, so huggingface_hub never falls back to a token file. It is never
logged, and it is scrubbed from every error message raised here. The endpoint is the argument,
else `HF_ENDPOINT` read at call time (huggingface_hub reads it once, at import).

Written against huggingface_hub 2.x, whose HTTP client is httpx2.
"""

from __future__ import annotations

import hashlib
import logging
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import httpx2
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.hf_api import CommitInfo, RepoFile

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_HASH_CHUNK = 1 << 20


class HubUploadError(RuntimeError):
    """An upload that did not complete; the message names the problem and the fix."""


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = True,
    commit_message: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Commit every file under `folder` to the model repo `repo_id`; return the commit URL.

    private: visibility when the repo is created. An existing public repo is refused while
        `private` is True, so a draft meant to stay private is never published by accident.
    endpoint: the Hub's base URL (default: `HF_ENDPOINT`, else https://huggingface.co).
    Raises HubUploadError (no token, unauthorised, unreachable, refused, incomplete upload).
    """
    folder = Path(folder)
    local = _local_files(folder)  # {path in repo: file on disk}
    token = _token_from_environment(folder)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    kept = f"the folder is still at {folder}"

    log.info("creating %s model repo %s on %s", _visibility(private), repo_id, endpoint)
    with _hub_errors(token, repo_id, endpoint, f"nothing was uploaded; {kept}"):
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        public = private and api.model_info(repo_id).private is False
    if public:
        raise HubUploadError(
            f"{repo_id} already exists on {endpoint} and is public; push_folder(private=True) "
            f"will not upload into it (nothing was uploaded; {kept}). Make the repo private on "
            "the Hub, or pass private=False to publish the draft."
        )

    size = sum(path.stat().st_size for path in local.values())
    log.info("uploading %d files (%d bytes) from %s to %s", len(local), size, folder, repo_id)
    operations = [CommitOperationAdd(name, str(path)) for name, path in local.items()]
    message = commit_message or f"Upload {folder.name} with draftsmith"
    with _hub_errors(token, repo_id, endpoint, f"no commit was made; {kept}"):
        commit = api.create_commit(repo_id, operations, commit_message=message, repo_type="model")

    _check_arrived(api, repo_id, commit, local, token)
    log.info("uploaded and verified %d files: %s", len(local), commit.commit_url)
    return commit.commit_url


def _check_arrived(
    api: HfApi, repo_id: str, commit: CommitInfo, local: dict[str, Path], token: str
) -> None:
    """List the repo at `commit` and raise unless every local file is there, byte for byte."""
    unverified = (
        f"commit {commit.oid} was made but its files could not be checked; look at "
        f"{commit.commit_url} before relying on it, or run push_folder again"
    )
    with _hub_errors(token, repo_id, api.endpoint, unverified):
        listing = api.list_repo_tree(repo_id, recursive=True, revision=commit.oid)
        remote = {entry.path: entry for entry in listing if isinstance(entry, RepoFile)}
    problems = _mismatches(local, remote)
    if problems:
        raise HubUploadError(
            f"The upload to {repo_id} is incomplete: commit {commit.oid} was made, but "
            f"{'; '.join(problems)}. Run push_folder again to upload the folder once more."
        )


def _visibility(private: bool) -> str:
    return "private" if private else "public"


def _local_files(folder: Path) -> dict[str, Path]:
    """Files under `folder` by POSIX path relative to it, without .git and HF cache metadata."""
    if not folder.is_dir():
        raise HubUploadError(f"{folder} is not a folder: export the draft first, then push it.")
    files = {}
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if ".git" in parts or parts[:2] == (".cache", "huggingface") or not path.is_file():
            continue
        files["/".join(parts)] = path
    if not files:
        raise HubUploadError(f"{folder} has no files to upload: export the draft first.")
    return files


def _token_from_environment(folder: Path) -> str:
    for name in TOKEN_VARIABLES:
        token = (os.environ.get(name) or "").strip()
        if token:
            return token
    raise HubUploadError(
        "No Hugging Face token in the environment: set HF_TOKEN to a token with write access "
        f"(https://huggingface.co/settings/tokens) and push again. The folder was written "
        f"locally at {folder}; nothing was uploaded."
    )


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "<HF_TOKEN>")


def _raise_without_token(message: str, cause: BaseException, token: str) -> NoReturn:
    """Raise HubUploadError(message), chained to `cause` only if no trace of it shows the token."""
    shown = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    raise HubUploadError(_scrub(message, token)) from (None if token in shown else cause)


@contextmanager
def _hub_errors(token: str, repo_id: str, endpoint: str, consequence: str) -> Iterator[None]:
    """Turn huggingface_hub / httpx2 failures into HubUploadError; `consequence` says what the
    Hub was left with."""
    try:
        yield
    except OfflineModeIsEnabled as err:
        _raise_without_token(
            f"HF_HUB_OFFLINE is set, so {endpoint} was not contacted: {consequence}. "
            "Unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) and push again.",
            err,
            token,
        )
    except httpx2.TransportError as err:
        _raise_without_token(
            f"Could not reach the Hub at {endpoint} (offline or endpoint unreachable: "
            f"{type(err).__name__}: {err}): {consequence}. Check the network connection and "
            "HF_ENDPOINT, then push again.",
            err,
            token,
        )
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            server = (err.server_message or "").replace("\n", "; ")
            said = f" (the Hub said: {server})" if server else ""
            message = (
                f"Unauthorised (HTTP {status} from {endpoint}){said}: the token in HF_TOKEN is "
                f"invalid or lacks write access to {repo_id}: {consequence}. Set HF_TOKEN to a "
                "write token of an account that may write to that namespace, then push again."
            )
        else:
            message = (
                f"The Hub at {endpoint} refused the upload to {repo_id} (HTTP {status}): "
                f"{consequence}. What it said: {err}"
            )
        _raise_without_token(message, err, token)


def _mismatches(local: dict[str, Path], remote: dict[str, RepoFile]) -> list[str]:
    """What differs between the local files and the repo listing (empty when all arrived)."""
    problems = []
    missing = sorted(set(local) - set(remote))
    if missing:
        problems.append(f"missing from the repo: {', '.join(missing)}")
    for name in sorted(set(local) & set(remote)):
        path, entry = local[name], remote[name]
        size = path.stat().st_size
        if entry.size != size:
            problems.append(f"{name} has {entry.size} bytes on the Hub, {size} locally")
        elif entry.lfs is not None and entry.lfs.sha256 != _sha256(path):
            problems.append(f"{name} has a different sha256 on the Hub")
        elif entry.lfs is None and entry.blob_id != _git_blob_sha1(path):
            problems.append(f"{name} has a different git blob id on the Hub")
    return problems


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    """The git object id of a regular (non-LFS) file: sha1 of 'blob <size>\\0' + content."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
