"""A stand-in for the model hub's HTTP API on 127.0.0.1, enough for ``huggingface_hub.snapshot_download``.

It serves one repository's files (``/api/models/<repo>/revision/<rev>``, ``/api/models/<repo>/tree/<sha>``,
``HEAD``/``GET /<repo>/resolve/<sha>/<file>``), can answer the first N requests with a status code (or drop the
connection), and records every request, so tests synchronise on what was really asked.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repo: str, files: dict[str, bytes]) -> None:
        self.repo, self.files = repo, files
        self.requests: list[tuple[str, str]] = []
        self.fail_next: list[int | None] = []  # answers to the next requests: a status, 0 = drop, None = serve
        self.status_for_repo: int | None = None  # a fixed answer (404, 401, 403) for every request
        self.status_by_repo: dict[str, int] = {}  # a fixed answer for every request naming that (other) repository
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, name: str) -> int:
        """GET requests of one file's content."""
        return sum(1 for m, p in self.requests if m == "GET" and p.endswith(f"/resolve/{SHA}/{name}"))

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", path))
            fail = self.fail_next.pop(0) if self.fail_next else None
        if fail == 0:
            h.close_connection = True
            h.connection.close()  # a reset connection: the client sees a transport error
            return
        status = fail if fail is not None else next(
            (code for repo, code in self.status_by_repo.items() if f"/{repo}/" in path or path.endswith(f"/{repo}")),
            self.status_for_repo)
        if status:
            body = json.dumps({"error": f"fake hub answers {status}"}).encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            if status in (401, 403, 404):
                h.send_header("X-Error-Code", "RepoNotFound" if status in (401, 404) else "GatedRepo")
                h.send_header("X-Error-Message", "Repository not found" if status != 403 else "Access to this repo is restricted")
            h.end_headers()
            if not head:
                h.wfile.write(body)
            return
        info = f"/api/models/{self.repo}/revision/"
        tree = f"/api/models/{self.repo}/tree/{SHA}"
        resolve = f"/{self.repo}/resolve/"
        if path.startswith(info):
            self._json(h, {"id": self.repo, "sha": SHA, "siblings": [{"rfilename": n} for n in self.files]}, head)
        elif path.startswith(tree):
            self._json(h, [{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                           for n, b in self.files.items()], head)
        elif path.startswith(resolve) and path.split("/resolve/", 1)[1].split("/", 1)[1] in self.files:
            name = path.split("/resolve/", 1)[1].split("/", 1)[1]
            body = self.files[name]
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
            h.send_header("X-Repo-Commit", SHA)
            h.end_headers()
            if not head:
                h.wfile.write(body)
        else:
            h.send_response(404)
            h.send_header("X-Error-Code", "EntryNotFound")
            h.send_header("Content-Length", "0")
            h.end_headers()

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj, head: bool) -> None:
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)


def tokenizer_files(src: Path) -> dict[str, bytes]:
    """The builtin tokenizer's files, as a hub repository would serve them."""
    return {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}
