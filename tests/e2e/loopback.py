"""Loopback HTTP servers for the end-to-end tests: the "internal services" and
file servers that modeld downloads from. Each listens on 127.0.0.1 on a free
port, serves from a thread of its own, counts GETs per path, and never logs.
modeld refuses to connect to loopback unless started with
--allow-private-urls 1 (ALLOW_LOOPBACK)."""

import http.server
import threading

ALLOW_LOOPBACK = ("--allow-private-urls", "1")


class LoopbackServer:
    """An http.server on 127.0.0.1:<free port>. `respond(handler)` answers each
    GET (handler is the BaseHTTPRequestHandler); the count is taken first."""

    def __init__(self, respond):
        self.counts = {}
        self.lock = threading.Lock()
        srv = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 (http.server's naming)
                with srv.lock:
                    srv.counts[self.path] = srv.counts.get(self.path, 0) + 1
                respond(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def gets(self, path):
        with self.lock:
            return self.counts.get(path, 0)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def send_file(handler, directory, rel, before_body=None):
    """Answer with the file `rel` directly in `directory` (404 for anything
    else: a missing file or a path with a folder in it); `before_body()`, when
    given, runs between the headers and the body."""
    f = directory / rel.lstrip("/")
    if "/" in rel.lstrip("/") or not f.is_file():
        handler.send_error(404)
        return
    data = f.read_bytes()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if before_body:
        before_body()
    handler.wfile.write(data)
