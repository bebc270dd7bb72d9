"""A stand-in in front of an engine that fails at chosen moments. It relays every request to the
engine (answers whole, not streamed). In front of a prefill engine, once armed, it runs a kill
hook after the engine has answered and before the router gets that answer (which carries the dead
engine's `kv_transfer_params`); in front of a decode engine, while `drop_handoffs` is set, it
closes the connection of every request carrying a handoff without answering, as an engine that
dies on it does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tandem.common.ports import free_port


class EngineStandIn:
    def __init__(self, target: str) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kill_hook: Callable[[], None] | None = None
        self.kills = 0
        self.drop_handoffs = False
        self.dropped = 0
        standin = self

        class Relay(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def relay(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                if standin.drop_handoffs and body and b'"kv_transfer_params"' in body:
                    standin.dropped += 1
                    self.close_connection = True
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() in ("content-type", "x-request-id", "authorization")
                }
                try:
                    answer = httpx.request(
                        method,
                        standin.target + self.path,
                        content=body,
                        headers=headers,
                        timeout=120,
                    )
                except httpx.HTTPError:
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                hook, standin.kill_hook = (
                    (standin.kill_hook, None) if method == "POST" else (None, standin.kill_hook)
                )
                if hook is not None:
                    hook()
                    standin.kills += 1
                self.send_response(answer.status_code)
                self.send_header(
                    "content-type", answer.headers.get("content-type", "application/json")
                )
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:
                self.relay("GET")

            def do_POST(self) -> None:
                self.relay("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Relay)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def arm(self, kill: Callable[[], None]) -> None:
        """Run `kill` after the next prefill answer, before relaying it."""
        self.kill_hook = kill

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
