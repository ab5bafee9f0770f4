"""Record what aider sends over two turns of each edit format: tests/fixtures/aider-<version>-sent.json, against which
tests/benchmarks/test_edit_formats.py checks benchmarks/edit_formats.py's replay.

Run with aider installed (its own environment: `pip install aider-chat`), not uag's:
    python benchmarks/aider_layout/record.py tests/fixtures/aider-0.86.2-sent.json

Aider edits a two-line file (`calc.py`) through an OpenAI-compatible server started here on a free port (standard
library only), which records each request and answers, streamed, with the next of `REPLIES`: well-formed edits, so
that aider applies them and the second turn carries the first in its history.
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata

FILE, CONTENT = "calc.py", "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
REQUESTS = ["Rename add to plus.", "Add a docstring to plus."]
PLUS = "def plus(a, b):\n    return a + b\n\n\nprint(plus(1, 2))\n"
DOC = 'def plus(a, b):\n    """Sum."""\n    return a + b\n\n\nprint(plus(1, 2))\n'
REPLIES = {
    "whole": [f"Renamed.\n\n{FILE}\n```python\n{PLUS}```\n", f"Docstring.\n\n{FILE}\n```python\n{DOC}```\n"],
    "diff": [
        f"Rename it.\n\n{FILE}\n```python\n<<<<<<< SEARCH\ndef add(a, b):\n=======\ndef plus(a, b):\n"
        f">>>>>>> REPLACE\n```\n\n{FILE}\n```python\n<<<<<<< SEARCH\nprint(add(1, 2))\n=======\nprint(plus(1, 2))\n"
        ">>>>>>> REPLACE\n```\n",
        f'Docstring.\n\n{FILE}\n```python\n<<<<<<< SEARCH\ndef plus(a, b):\n=======\ndef plus(a, b):\n    """Sum."""\n'
        ">>>>>>> REPLACE\n```\n",
    ],
}


class Recorder(BaseHTTPRequestHandler):
    sent: list = []
    replies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.sent.append(body["messages"])
        text = Recorder.replies[min(len(Recorder.sent), len(Recorder.replies)) - 1]
        delta = {"role": "assistant", "content": text}
        chunk = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        done = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in (json.dumps(chunk), json.dumps(done), "[DONE]"):
            self.wfile.write(f"data: {event}\n\n".encode())

    def log_message(self, *_args):
        pass


def record(edit_format: str) -> list:
    from capture import aider_coder  # beside this script; it imports aider

    Recorder.sent, Recorder.replies = [], REPLIES[edit_format]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ.update(OPENAI_API_BASE=f"http://127.0.0.1:{server.server_port}/v1", OPENAI_API_KEY="none")
    coder = aider_coder(edit_format, FILE, CONTENT)
    for request in REQUESTS:
        coder.run(with_message=request)
    server.shutdown()
    return Recorder.sent


if __name__ == "__main__":
    path = os.path.abspath(sys.argv[1])  # aider prints to stdout: the record goes to a file
    formats = {f: {"replies": REPLIES[f], "sent": record(f)} for f in ("whole", "diff")}
    out = {
        "aider": metadata.version("aider-chat"),
        "file": FILE,
        "content": CONTENT,
        "requests": REQUESTS,
        "formats": formats,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
