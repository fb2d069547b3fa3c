"""push_folder against a local stand-in Hub: a threaded HTTP server on 127.0.0.1.

The stand-in implements the slice of the Hub HTTP API that huggingface_hub 2.4 calls for
create_repo + model_info + create_commit + list_repo_tree:

    POST /api/repos/create                           create (409 when it exists)
    GET  /api/models/{ns}/{name}                     repo info (id, private, sha)
    POST /api/validate-yaml                          README.md metadata check (always valid)
    POST /api/models/{ns}/{name}/preupload/{rev}     every file "regular": contents come inline
    POST /api/models/{ns}/{name}/commit/{rev}        NDJSON: header line + one base64 line a file
    GET  /api/models/{ns}/{name}/tree/{rev}          file listing (path, size, git blob oid)

It records every request's Authorization header and the decoded files of each commit, can answer
401 to everything, and can leave a file out of (or misreport it in) the listing. Anything else
gets a 404 and is recorded as unhandled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import socket
import threading
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub
import huggingface_hub.constants as hf_constants
import pytest

from eval.publish.hub import HubUploadError, push_folder

TOKEN = "hf_standinTOKEN0123456789abcdefXYZ"
REPO = "someone/tiny-draft"


@dataclass
class StandInHub:
    base_url: str = ""
    unauthorised: bool = False
    hide_from_listing: set[str] = field(default_factory=set)
    misreport_in_listing: set[str] = field(default_factory=set)
    repos: dict[str, dict] = field(default_factory=dict)  # repo_id -> {"private", "files"}
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, auth
    commits: list[dict] = field(default_factory=list)  # {"repo", "summary", "files": {path: bytes}}
    created: list[dict] = field(default_factory=list)  # create payloads
    unhandled: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _blob_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: StandInHub  # set on the subclass built per fixture

    def log_message(self, format, *args):  # noqa: A002 - keep the stand-in quiet
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _reply(self, status: int, payload, headers: dict[str, str] | None = None):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _dispatch(self, method: str):
        hub = self.hub
        path = self.path.split("?")[0]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization")
        with hub.lock:
            hub.requests.append((method, path, auth))
        if hub.unauthorised:
            # The body echoes the rejected credentials, so push_folder's message must scrub them.
            message = "Invalid credentials in Authorization header"
            self._reply(401, {"error": f"{message} ({auth})"}, {"X-Error-Message": message})
            return
        parts = path.strip("/").split("/")  # api, models, ns, name, verb, revision
        if method == "POST" and path == "/api/repos/create":
            self._create(json.loads(body))
        elif method == "POST" and path == "/api/validate-yaml":
            self._reply(200, {"errors": [], "warnings": []})
        elif parts[:2] == ["api", "models"] and len(parts) == 4 and method == "GET":
            self._info("/".join(parts[2:4]))
        elif parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, verb = "/".join(parts[2:4]), parts[4]
            if repo_id not in hub.repos:
                self._not_found()
            elif method == "POST" and verb == "preupload":
                self._preupload(json.loads(body))
            elif method == "POST" and verb == "commit":
                self._commit(repo_id, body)
            elif method == "GET" and verb == "tree":
                self._tree(repo_id)
            else:
                self._unhandled(method, path)
        else:
            self._unhandled(method, path)

    def _not_found(self):
        self._reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})

    def _unhandled(self, method: str, path: str):
        with self.hub.lock:
            self.hub.unhandled.append(f"{method} {path}")
        self._reply(404, {"error": f"stand-in Hub does not implement {method} {path}"})

    def _create(self, payload: dict):
        repo_id = f"{payload['organization']}/{payload['name']}"
        url = f"{self.hub.base_url}/{repo_id}"
        with self.hub.lock:
            self.hub.created.append(payload)
            if repo_id in self.hub.repos:  # the Hub answers 409 with the existing repo's url
                self._reply(409, {"error": "You already created this model repo", "url": url})
                return
            private = payload.get("visibility") == "private"
            self.hub.repos[repo_id] = {"private": private, "files": {}}
        self._reply(200, {"url": url, "name": repo_id})

    def _info(self, repo_id: str):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._not_found()
            return
        self._reply(200, {"id": repo_id, "private": repo["private"], "sha": "0" * 40})

    def _preupload(self, payload: dict):
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
            for f in payload["files"]
        ]
        self._reply(200, {"files": files})

    def _commit(self, repo_id: str, body: bytes):
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        assert lines[0]["key"] == "header"
        files = {}
        for line in lines[1:]:
            assert line["key"] == "file" and line["value"]["encoding"] == "base64", line
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        oid = hashlib.sha1(body).hexdigest()
        with self.hub.lock:
            self.hub.repos[repo_id]["files"].update(files)
            summary = lines[0]["value"]["summary"]
            self.hub.commits.append({"repo": repo_id, "summary": summary, "files": files})
        url = f"{self.hub.base_url}/{repo_id}/commit/{oid}"
        self._reply(200, {"commitUrl": url, "commitOid": oid})

    def _tree(self, repo_id: str):
        entries = []
        for path, content in sorted(self.hub.repos[repo_id]["files"].items()):
            if path in self.hub.hide_from_listing:
                continue
            if path in self.hub.misreport_in_listing:
                content = bytes(len(content))  # same size, other bytes
            entries.append(
                {"type": "file", "path": path, "size": len(content), "oid": _blob_oid(content)}
            )
        self._reply(200, entries)


@pytest.fixture
def hub():
    """The stand-in Hub, serving on a random port of 127.0.0.1 for the test's duration."""
    state = StandInHub()
    handler = type("Handler", (_Handler,), {"hub": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(autouse=True)
def hub_environment(monkeypatch, tmp_path):
    """No saved token, no offline mode (conftest sets HF_HUB_OFFLINE, read at import), no proxy."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    huggingface_hub.close_session()  # the shared client reads proxy settings when built
    yield
    huggingface_hub.close_session()


@pytest.fixture
def export_folder(tmp_path):
    """A small export: config.json, model.safetensors (random bytes), README.md, a plot."""
    folder = tmp_path / "export"
    (folder / "plots").mkdir(parents=True)
    files = {
        "config.json": json.dumps({"architectures": ["EagleDraft"], "hidden_size": 32}).encode(),
        "model.safetensors": os.urandom(4096),
        "README.md": b"---\nlicense: apache-2.0\n---\n# tiny draft\n",
        "plots/tau.png": os.urandom(300),
    }
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder, files


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_push_uploads_every_file_to_a_private_repo(hub, export_folder, monkeypatch):
    folder, files = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.base_url)  # read at call time, not huggingface_hub's

    url = push_folder(folder, REPO, commit_message="draft v1")

    assert url.startswith(f"{hub.base_url}/{REPO}/commit/")
    assert len(hub.commits) == 1
    assert hub.commits[0]["files"] == files
    assert hub.commits[0]["summary"] == "draft v1"
    assert hub.repos[REPO]["private"] is True
    assert hub.created[0]["visibility"] == "private"
    assert hub.requests and {auth for _, _, auth in hub.requests} == {f"Bearer {TOKEN}"}
    assert not hub.unhandled


def test_legacy_token_variable_and_endpoint_argument(hub, export_folder, monkeypatch):
    folder, files = export_folder
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # argument wins

    url = push_folder(folder, REPO, private=False, endpoint=hub.base_url + "/")

    assert url.startswith(hub.base_url)
    assert hub.repos[REPO]["private"] is False
    assert hub.commits[0]["files"] == files
    assert {auth for _, _, auth in hub.requests} == {f"Bearer {TOKEN}"}


def test_token_never_logged_or_printed(hub, export_folder, monkeypatch, caplog, capfd):
    folder, _ = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")

    push_folder(folder, REPO, endpoint=hub.base_url)
    hub.unauthorised = True
    with pytest.raises(HubUploadError):
        push_folder(folder, REPO, endpoint=hub.base_url)

    names = {record.name for record in caplog.records}
    hub_logs = any(n.startswith("huggingface_hub") for n in names)
    assert "eval.publish.hub" in names and hub_logs, names
    assert TOKEN not in caplog.text
    assert all(TOKEN not in record.getMessage() for record in caplog.records)
    out, err = capfd.readouterr()
    assert TOKEN not in out and TOKEN not in err


def test_no_token_is_an_error_even_with_a_saved_token_file(hub, export_folder):
    folder, _ = export_folder
    token_file = os.environ["HF_HOME"] + "/token"
    os.makedirs(os.environ["HF_HOME"], exist_ok=True)
    with open(token_file, "w") as f:
        f.write(TOKEN)  # huggingface_hub's own fallback would find this

    with pytest.raises(HubUploadError) as info:
        push_folder(folder, REPO, endpoint=hub.base_url)

    message = str(info.value)
    assert "HF_TOKEN" in message and str(folder) in message and "nothing was uploaded" in message
    assert TOKEN not in message
    assert hub.requests == []


def test_unauthorised_is_reported_without_the_token(hub, export_folder, monkeypatch):
    folder, _ = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.unauthorised = True

    with pytest.raises(HubUploadError) as info:
        push_folder(folder, REPO, endpoint=hub.base_url)

    message = str(info.value)
    assert "Unauthorised" in message and "HTTP 401" in message and REPO in message
    assert "nothing was uploaded" in message
    assert TOKEN not in message
    assert TOKEN not in "".join(traceback.format_exception(info.value))
    assert hub.requests, "the stand-in was never asked"
    assert hub.commits == [] and hub.repos == {}


def test_unreachable_endpoint_says_offline(export_folder, monkeypatch):
    folder, _ = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    endpoint = f"http://127.0.0.1:{_closed_port()}"

    with pytest.raises(HubUploadError) as info:
        push_folder(folder, REPO, endpoint=endpoint)

    message = str(info.value)
    assert "Could not reach the Hub" in message and "offline" in message and endpoint in message
    assert "nothing was uploaded" in message and TOKEN not in message


def test_offline_mode_is_reported(hub, export_folder, monkeypatch):
    folder, _ = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)

    with pytest.raises(HubUploadError, match="HF_HUB_OFFLINE"):
        push_folder(folder, REPO, endpoint=hub.base_url)
    assert hub.requests == []


@pytest.mark.parametrize("fault", ["hide", "misreport"])
def test_incomplete_upload_is_not_reported_as_done(hub, export_folder, monkeypatch, fault):
    folder, _ = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    if fault == "hide":
        hub.hide_from_listing.add("model.safetensors")
    else:
        hub.misreport_in_listing.add("model.safetensors")

    with pytest.raises(HubUploadError, match="incomplete") as info:
        push_folder(folder, REPO, endpoint=hub.base_url)

    assert "model.safetensors" in str(info.value)
    assert len(hub.commits) == 1  # the server took the commit; push_folder still refused it


def test_existing_public_repo_is_refused_when_private(hub, export_folder, monkeypatch):
    folder, _ = export_folder
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.repos[REPO] = {"private": False, "files": {}}

    with pytest.raises(HubUploadError, match="public"):
        push_folder(folder, REPO, endpoint=hub.base_url)
    assert hub.commits == []


def test_missing_or_empty_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(HubUploadError, match="not a folder"):
        push_folder(tmp_path / "absent", REPO, endpoint="http://127.0.0.1:9")
    (tmp_path / "empty" / ".git").mkdir(parents=True)
    (tmp_path / "empty" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with pytest.raises(HubUploadError, match="no files"):
        push_folder(tmp_path / "empty", REPO, endpoint="http://127.0.0.1:9")


# ---- heads.from_pretrained: a local folder, or hf://owner/name -----------------------------------


@pytest.fixture
def downloads(monkeypatch):
    """Replace huggingface_hub.snapshot_download: record each call, answer with `answer`."""
    calls: list[str] = []
    state = {"answer": None}

    def fake(repo_id, **kwargs):
        calls.append(repo_id)
        if state["answer"] is None:
            raise AssertionError(f"downloaded {repo_id}")
        return str(state["answer"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return calls, state


def _medusa_folder(target, folder):
    from heads.medusa import MedusaConfig, MedusaHeads

    MedusaHeads.for_target(MedusaConfig(num_heads=2), target).save_pretrained(folder)
    return folder


def test_a_mistyped_local_path_is_never_downloaded(tiny_llama, downloads, tmp_path, monkeypatch):
    import heads

    calls, _ = downloads
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no folder outputs/head here .*hf://outputs/head"):
        heads.from_pretrained("outputs/head", tiny_llama)
    with pytest.raises(FileNotFoundError, match=r"no folder \./missing here") as err:
        heads.from_pretrained("./missing", tiny_llama)
    assert "hf://" not in str(err.value)  # not a repo id: no Hub hint
    assert calls == []


def test_a_local_two_part_path_loads_without_the_hub(tiny_llama, downloads, tmp_path, monkeypatch):
    import heads

    calls, _ = downloads
    monkeypatch.chdir(tmp_path)
    _medusa_folder(tiny_llama, tmp_path / "runs" / "head")
    assert heads.from_pretrained("runs/head", tiny_llama).method == "medusa"
    assert calls == []


def test_an_hf_path_downloads_the_repo_then_loads_it(tiny_llama, downloads, tmp_path):
    import heads

    calls, state = downloads
    state["answer"] = _medusa_folder(tiny_llama, tmp_path / "snapshot")
    head = heads.from_pretrained("hf://someone/medusa-draft", tiny_llama)
    assert head.method == "medusa" and calls == ["someone/medusa-draft"]
    with pytest.raises(ValueError, match="write a Hub repo as hf://owner/name"):
        heads.from_pretrained("hf://someone/medusa-draft/extra", tiny_llama)


def test_an_hf_path_offline_says_what_to_do(tiny_llama, monkeypatch):
    import heads

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="hf://someone/eagle3-draft: downloading it from"):
        heads.from_pretrained("hf://someone/eagle3-draft", tiny_llama)
