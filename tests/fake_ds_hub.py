"""A minimal local stand-in for the Hub's *dataset* API (tests/fake_hub.py serves models only):
dataset_info, tree, paths-info, resolve (with Range), revisions as commits, private repos
(token), and an injected failure after N resolve requests (tests/test_data_prepare.py)."""

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

from .fake_hub import send

TOKEN = "hf_test_token_0123456789"


class FakeDatasetHub:
    def __init__(self):
        self.repos = {}  # repo -> {"private": bool, "commits": [(sha, {path: bytes})]}
        self.log, self.fail_after, self.resolves = [], None, 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def commit(self, repo, files, private=False):
        r = self.repos.setdefault(repo, {"private": private, "commits": []})
        sha = hashlib.sha1(
            json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode()
            + str(len(r["commits"])).encode()
        ).hexdigest()
        r["commits"].append((sha, dict(files)))
        return sha

    def _files(self, repo, rev):
        r = self.repos[repo]
        if rev in ("main", None):
            return r["commits"][-1]
        for sha, f in r["commits"]:
            if sha == rev:
                return sha, f
        return None

    def _handler(hub):
        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None, js=None):
                send(self, code, body, headers, js)

            def _at(self, repo, rev):  # (sha, files) of a readable repo at rev, else answered
                if self._repo(repo) is None:
                    return None
                got = hub._files(repo, rev)
                if got is None:
                    self._err(404, "Revision not found", "RevisionNotFound")
                return got

            def _err(self, code, msg, ec=None):
                self._send(
                    code,
                    headers={"X-Error-Message": msg, **({"X-Error-Code": ec} if ec else {})},
                    js={"error": msg},
                )

            def do_GET(self):
                self._route()

            def do_HEAD(self):
                self._route()

            def do_POST(self):
                self._route()

            def _repo(self, repo):
                r = hub.repos.get(repo)
                if r is None:
                    return self._err(404, "Repository not found", "RepoNotFound") or None
                if r["private"] and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._err(401, "Repository not found", "RepoNotFound") or None
                return r

            def _route(self):
                u = urlparse(self.path)
                path = unquote(u.path)
                q = parse_qs(u.query)
                body = (
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    if self.command == "POST"
                    else b""
                )
                hub.log.append(f"{self.command} {path}")
                m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if m:
                    got = self._at(m.group(1), m.group(2))
                    if got is None:
                        return
                    sha, files = got
                    return self._send(
                        200,
                        js={
                            "id": m.group(1),
                            "sha": sha,
                            "private": hub.repos[m.group(1)]["private"],
                            "gated": False,
                            "disabled": False,
                            "tags": [],
                            "cardData": {},
                            "siblings": [{"rfilename": f} for f in sorted(files)],
                        },
                    )
                m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
                if m:
                    got = self._at(m.group(1), m.group(2))
                    if got is None:
                        return
                    pre = (m.group(3) or "").strip("/")
                    rec = q.get("recursive", ["false"])[0].lower() in ("true", "1")
                    ents, dirs = [], set()
                    for f, data in sorted(got[1].items()):
                        if pre and not f.startswith(pre + "/"):
                            continue
                        rest = f[len(pre) + 1 :] if pre else f
                        if "/" in rest:
                            parts = rest.split("/")
                            for i in range(1, len(parts) if rec else 2):
                                d = "/".join(([pre] if pre else []) + parts[:i])
                                if d not in dirs:
                                    dirs.add(d)
                                    ents.append({"type": "directory", "path": d, "oid": "0" * 40})
                            if not rec:
                                continue
                        ents.append(
                            {
                                "type": "file",
                                "path": f,
                                "size": len(data),
                                "oid": hashlib.sha1(data).hexdigest(),
                            }
                        )
                    return self._send(200, js=ents)
                m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/paths-info/([^/]+)", path)
                if m:
                    got = self._at(m.group(1), m.group(2))
                    if got is None:
                        return
                    want = parse_qs(body.decode()).get("paths", [])
                    if not want and body.startswith(b"{"):
                        want = json.loads(body).get("paths", [])
                    out = []
                    for p in want:
                        p = p.strip("/")
                        if p in got[1]:
                            out.append(
                                {
                                    "type": "file",
                                    "path": p,
                                    "size": len(got[1][p]),
                                    "oid": hashlib.sha1(got[1][p]).hexdigest(),
                                }
                            )
                        elif any(f.startswith(p + "/") for f in got[1]) or p == "":
                            out.append({"type": "directory", "path": p, "oid": "0" * 40})
                    return self._send(200, js=out)
                m = re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    got = self._at(m.group(1), m.group(2))
                    if got is None:
                        return
                    if m.group(3) not in got[1]:
                        return self._err(404, "Entry not found", "EntryNotFound")
                    data = got[1][m.group(3)]
                    if self.command == "GET":
                        hub.resolves += 1
                        if hub.fail_after is not None and hub.resolves > hub.fail_after:
                            return self._err(503, "Service Unavailable")
                    h = {
                        "X-Repo-Commit": got[0],
                        "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                        "Accept-Ranges": "bytes",
                    }
                    rng = self.headers.get("Range")
                    if rng and self.command == "GET":
                        a, _, b = rng.removeprefix("bytes=").partition("-")
                        a = int(a)
                        b = min(int(b) if b else len(data) - 1, len(data) - 1)
                        h["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
                        return self._send(206, data[a : b + 1], h)
                    return self._send(200, data, h)
                return self._err(404, f"no route {self.command} {path}")

        return H
