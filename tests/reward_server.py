"""An HTTP reward server on loopback for tests (unit and integration): each POST is answered by ``answer(payload)``.

``answer`` returns a JSON-able object (sent with status 200), or ``(status, body bytes)`` for a raw answer: an
error status, a body that is not JSON. The server binds 127.0.0.1 only, on a free port, and stops with ``close``.
"""

import http.server
import json
import threading


class RewardServer:
    """Answers each POST with ``answer(payload)`` after ``delay`` seconds.

    ``close`` cuts a delay short and waits for every request's thread: a client that gave up (a hanging server's
    test) is answered into a closed socket, and that BrokenPipeError is swallowed, not printed by a thread still
    asleep when pytest has moved on or ended.
    """

    def __init__(self, answer, delay=0.0):
        outer = self
        self.requests, self.handlers, self.closing = [], [], threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                outer.handlers.append(threading.current_thread())
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(payload)
                outer.closing.wait(delay)
                reply = answer(payload)
                status, body = reply if isinstance(reply, tuple) else (200, json.dumps(reply).encode())
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = False  # so server_close joins the request threads
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
