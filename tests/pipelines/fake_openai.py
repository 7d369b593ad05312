"""A Chat Completions server on loopback for the judge's tests: it checks what a real endpoint checks (the key, the
model, an image part) and answers with scripted replies, counting every request."""
from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rating_of(png: bytes) -> int:
    """The default reply: a rating fixed by the image's bytes, so different images get different ratings."""
    return hashlib.sha256(png).digest()[0] % 5 + 1


class FakeOpenAI:
    """``with FakeOpenAI(key="k", model="gpt-4o") as server:`` -> ``server.base_url`` (``http://127.0.0.1:PORT/v1``).

    ``script``: a list of ``(status, reply text or error message, headers)`` served first, in order; afterwards
    every valid request gets 200 with ``reply(png)`` (default: the digit of :func:`rating_of`); a scripted reply
    given as bytes is the whole response body, sent as it is (``b'{"choices": ['``: JSON cut short). ``azure=True``
    expects the key in an ``api-key`` header instead of ``Authorization: Bearer``."""

    def __init__(self, key: str = "test-key", model: str = "gpt-4o", reply=None, azure: bool = False,
                 require_image: bool = True):
        self.key, self.model, self.azure, self.require_image = key, model, azure, require_image
        self.reply = reply or (lambda png: str(rating_of(png)))
        self.script: list[tuple[int, str, dict]] = []
        self.requests: list[dict] = []  # every request: {"path", "headers" (lower-case names), "body", "time"}
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length)
                with fake.lock:
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    fake.requests.append({"path": self.path, "headers": headers, "body": raw, "time": time.monotonic()})
                    scripted = fake.script.pop(0) if fake.script else None
                status, payload, headers = fake._answer(self.path, self.headers, raw, scripted)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def _answer(self, path, headers, raw, scripted):
        if not path.split("?")[0].endswith("/chat/completions"):
            return 404, _error("unknown path"), {}
        given = headers.get("api-key") if self.azure else headers.get("Authorization", "").removeprefix("Bearer ")
        if given != self.key:
            return 401, _error("Incorrect API key provided: sk-abc123***. You can find your API key at ..."), {}
        try:
            body = json.loads(raw)
            parts = body["messages"][0]["content"]
            if isinstance(parts, str):  # a plain text message (MM-Vet's judge, the preflight probe)
                parts = [{"type": "text", "text": parts}]
            text = [p["text"] for p in parts if p["type"] == "text"]
            urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return 400, _error(f"malformed request: {exc}"), {}
        if body.get("model") != self.model:
            return 404, _error(f"The model `{body.get('model')}` does not exist"), {}
        if body.get("temperature") != 0 or not text:
            return 400, _error("expected temperature 0 and a text part"), {}
        if not self.require_image and not urls:
            png = b""
        elif len(urls) != 1 or not urls[0].startswith("data:image/png;base64,"):
            return 400, _error("expected one data:image/png;base64 image part"), {}
        else:
            png = base64.b64decode(urls[0].split(",", 1)[1])
            if not png.startswith(PNG_MAGIC):
                return 400, _error("the image part is not a PNG"), {}
        if scripted is not None:
            status, content, extra = scripted
            if status != 200:
                return status, _error(content), extra
            if isinstance(content, bytes):  # a raw body, sent as it is (e.g. JSON cut short)
                return status, content, extra
        else:
            content = self.reply(png)
        return 200, {"id": "chatcmpl-1", "object": "chat.completion", "model": f"{self.model}-2024-11-20",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": "stop"}]}, {}


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}
