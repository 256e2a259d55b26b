"""A local stand-in for the Hugging Face Hub HTTP API, for tests of the real `huggingface_hub`
client: whoami, repo creation, branches, README validation, preupload, LFS batch + PUT
(basic transfer), NDJSON commits (inline and LFS files), and file resolution for downloads.
Runs on loopback in a thread; state lives in memory."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

TOKEN = "hf_test_token_0123456789"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt")


def send(h: BaseHTTPRequestHandler, code, body=b"", headers=None, json_body=None) -> None:
    """One response: a JSON body when `json_body` is given, no body to a HEAD request."""
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
    h.send_response(code)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


class FakeHub:
    def __init__(self):
        self.repos: dict[
            str, dict
        ] = {}  # repo_id -> {"private": bool, "branches": {name: {path: (bytes, lfs_oid)}}}
        self.lfs: dict[str, bytes] = {}
        self.commits: list[dict] = []
        self.refuse_commits = False
        self.seen_upload_modes: set[str] = set()
        self.seen_tokens: set[str] = set()
        self.unknown: list[str] = []
        self.snapshots: dict[str, dict] = {}  # commit oid -> files
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()

    def _handler(self):
        hub = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None, json_body=None):
                send(self, code, body, headers, json_body)

            def _err(self, code, msg, error_code=None):
                h = {"X-Error-Message": msg}
                if error_code:
                    h["X-Error-Code"] = error_code
                self._send(code, headers=h, json_body={"error": msg})

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _authed(self) -> bool:
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Bearer "):
                    hub.seen_tokens.add(auth[7:])
                return auth == f"Bearer {TOKEN}"

            # ------------------------------------------------------------ routes
            def do_GET(self):
                self._route("GET")

            def do_HEAD(self):
                self._route("HEAD")

            def do_POST(self):
                self._route("POST")

            def do_PUT(self):
                self._route("PUT")

            def _route(self, method):
                path = unquote(urlparse(self.path).path)
                if path == "/api/whoami-v2":
                    if not self._authed():
                        return self._err(401, "Invalid credentials in Authorization header")
                    return self._send(200, json_body={"type": "user", "name": "tester", "orgs": [{"name": "org"}],
                                                      "auth": {"type": "access_token", "accessToken": {"role": "write"}}})  # fmt: skip
                if path == "/api/repos/create" and method == "POST":
                    if not self._authed():
                        return self._err(401, "Invalid credentials")
                    p = json.loads(self._body())
                    repo = (
                        f"{p['organization']}/{p['name']}"
                        if p.get("organization")
                        else f"tester/{p['name']}"
                    )
                    if repo in hub.repos:
                        msg = "You already created this model repo"
                        return self._send(409, headers={"X-Error-Message": msg},
                                          json_body={"error": msg, "url": f"{hub.url}/{repo}"})  # fmt: skip
                    hub.repos[repo] = {"private": p.get("visibility") == "private" or bool(p.get("private")),
                                       "branches": {"main": {}}}  # fmt: skip
                    return self._send(200, json_body={"url": f"{hub.url}/{repo}", "name": repo})
                if path == "/api/validate-yaml":
                    self._body()
                    return self._send(200, json_body={"errors": [], "warnings": []})
                m = re.fullmatch(r"/api/models/(.+?/.+?)/branch/(.+)", path)
                if m and method == "POST":
                    self._body()
                    repo = hub.repos.get(m.group(1))
                    if repo is None:
                        return self._err(404, "Repository not found", "RepoNotFound")
                    if m.group(2) in repo["branches"]:
                        return self._err(409, "Reference already exists")
                    repo["branches"][m.group(2)] = dict(repo["branches"]["main"])
                    return self._send(200, json_body={})
                m = re.fullmatch(r"/api/models/(.+?/.+?)/preupload/(.+)", path)
                if m:
                    p = json.loads(self._body())
                    if m.group(1) not in hub.repos:
                        return self._err(404, "Repository not found", "RepoNotFound")
                    files = []
                    for f in p["files"]:
                        mode = "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular"
                        hub.seen_upload_modes.add(mode)
                        files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False})
                    return self._send(200, json_body={"files": files})
                m = re.fullmatch(r"/(.+?/.+?)\.git/info/lfs/objects/batch", path)
                if m:
                    p = json.loads(self._body())
                    objs = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                             "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}}
                            for o in p["objects"]]  # fmt: skip
                    return self._send(200, json_body={"transfer": "basic", "objects": objs})
                m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
                if m and method == "PUT":
                    data = self._body()
                    if hashlib.sha256(data).hexdigest() != m.group(1):
                        return self._err(400, "sha256 mismatch")
                    hub.lfs[m.group(1)] = data
                    return self._send(200)
                m = re.fullmatch(r"/api/models/(.+?/.+?)/commit/(.+)", path)
                if m and method == "POST":
                    body = self._body()
                    if not self._authed():
                        return self._err(401, "Invalid credentials")
                    if hub.refuse_commits:
                        return self._err(
                            403, "You don't have the rights to create a commit on this repo"
                        )
                    repo = hub.repos.get(m.group(1))
                    if repo is None:
                        return self._err(404, "Repository not found", "RepoNotFound")
                    branch = repo["branches"].setdefault(m.group(2), {})
                    for line in body.splitlines():
                        item = json.loads(line)
                        v = item["value"]
                        if item["key"] == "file":
                            branch[v["path"]] = (base64.b64decode(v["content"]), None)
                        elif item["key"] == "deletedFile":
                            branch.pop(v["path"], None)
                        elif item["key"] == "lfsFile":
                            if v["oid"] not in hub.lfs:
                                return self._err(422, f"LFS object {v['oid']} was never uploaded")
                            branch[v["path"]] = (hub.lfs[v["oid"]], v["oid"])
                    oid = hashlib.sha1(body).hexdigest()
                    hub.commits.append({"repo": m.group(1), "revision": m.group(2), "oid": oid})
                    hub.snapshots[oid] = dict(branch)
                    return self._send(200, json_body={"commitUrl": f"{hub.url}/{m.group(1)}/commit/{oid}",
                                                      "commitOid": oid, "pullRequestUrl": None})  # fmt: skip
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m and method == "GET":
                    repo = hub.repos.get(m.group(1))
                    files = (
                        None
                        if repo is None
                        else repo["branches"][m.group(2)]  # an empty branch lists no files
                        if m.group(2) in repo["branches"]
                        else hub.snapshots.get(m.group(2))
                    )
                    if files is None:
                        return self._err(404, "Revision not found", "RevisionNotFound")
                    entries = []
                    for f, (data, lfs_oid) in sorted(files.items()):
                        e = {
                            "type": "file",
                            "path": f,
                            "size": len(data),
                            "oid": hashlib.sha1(data).hexdigest(),
                        }
                        if lfs_oid:
                            e["lfs"] = {"oid": lfs_oid, "size": len(data), "pointerSize": 134}
                        entries.append(e)
                    return self._send(200, json_body=entries)
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if m and method == "GET":
                    repo = hub.repos.get(m.group(1))
                    if repo is None or (repo["private"] and not self._authed()):
                        return self._err(401, "Repository not found", "RepoNotFound")
                    rev = m.group(2) or "main"
                    files = (
                        repo["branches"][rev] if rev in repo["branches"] else hub.snapshots.get(rev)
                    )
                    if files is None:
                        return self._err(404, "Revision not found", "RevisionNotFound")
                    sha = next(
                        (c["oid"] for c in reversed(hub.commits) if c["repo"] == m.group(1)),
                        "0" * 40,
                    )
                    return self._send(200, json_body={"id": m.group(1), "modelId": m.group(1), "sha": sha,
                                                      "private": repo["private"],
                                                      "siblings": [{"rfilename": f} for f in sorted(files)]})  # fmt: skip
                m = re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", path)
                if m:
                    repo = hub.repos.get(m.group(1))
                    if repo is None or (repo["private"] and not self._authed()):
                        return self._err(401, "Repository not found", "RepoNotFound")
                    files = repo["branches"].get(m.group(2)) or hub.snapshots.get(m.group(2))
                    if files is None:
                        return self._err(404, "Revision not found", "RevisionNotFound")
                    if m.group(3) not in files:
                        return self._err(404, "Entry not found", "EntryNotFound")
                    data, lfs_oid = files[m.group(3)]
                    commit = next(
                        (c["oid"] for c in reversed(hub.commits) if c["repo"] == m.group(1)),
                        "0" * 40,
                    )
                    etag = lfs_oid or hashlib.sha1(data).hexdigest()
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
                    if lfs_oid:
                        headers.update(
                            {"X-Linked-Etag": f'"{lfs_oid}"', "X-Linked-Size": str(len(data))}
                        )
                    return self._send(200, data, headers)
                hub.unknown.append(f"{method} {self.path}")
                return self._err(404, f"no route for {method} {path}")

        return H
