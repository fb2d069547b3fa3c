"""A stand-in for llama.cpp's `llama-server`, slow on purpose, for tests that must catch a run in
the middle of generating (Ctrl-C, a progress display). It takes llama-server's command line
(only `--port` and `-np` matter), answers GET /health and GET /slots (each slot's `n_decoded`),
and POST /completion with `n_predict` token ids that never include EOS, one every
$STAND_IN_TOKEN_S seconds (default 0.05). It reads no model. With $STAND_IN_PID_FILE set it
appends its process id to that file once it listens.

    DRAFTSMITH_LLAMA_SERVER=<a script that runs this file> python train.py ...
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _arg(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    port, slots = int(_arg("--port", "0")), int(_arg("-np", "1"))
    token_s = float(os.environ.get("STAND_IN_TOKEN_S", "0.05"))
    decoded = [None] * slots  # tokens so far of the request each slot holds (None: idle)
    free = threading.Semaphore(slots)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, doc) -> None:
            data = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._reply({"status": "ok"})
            elif self.path == "/slots":
                with lock:
                    self._reply(
                        [
                            {
                                "id": i,
                                "is_processing": n is not None,
                                "next_token": [{"n_decoded": n or 0}],
                            }
                            for i, n in enumerate(decoded)
                        ]  # fmt: skip
                    )
            else:
                self.send_error(404)

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with free:
                with lock:
                    slot = decoded.index(None)
                    decoded[slot] = 0
                prompt = body["prompt"] if isinstance(body["prompt"], list) else [0]
                start = 100 + sum(prompt) % 1000
                tokens = []
                for i in range(int(body["n_predict"])):
                    time.sleep(token_s)
                    tokens.append(start + i % 50)
                    with lock:
                        decoded[slot] = len(tokens)
                with lock:
                    decoded[slot] = None
            self._reply(
                {
                    "tokens": tokens,
                    "content": "",
                    "stop_type": "limit",
                    "timings": {"predicted_n": len(tokens)},
                }  # fmt: skip
            )

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    if os.environ.get("STAND_IN_PID_FILE"):
        with open(os.environ["STAND_IN_PID_FILE"], "a") as f:
            f.write(f"{os.getpid()}\n")
    print(f"stand-in llama-server listening on 127.0.0.1:{port}, {slots} slots", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
