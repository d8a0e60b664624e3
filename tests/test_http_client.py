"""``bt-node generate --http`` and ``bt-node status --http`` against a node that answers wrongly or
hostilely (``node/http/client.py``, ``cli/render.py``).

The node asked may be anyone's. Before: an answer that was JSON but not an object, or of another shape,
ended in a Python traceback; a peer id or state holding rich markup (``[/]``) crashed the output
(``MarkupError``) or restyled it; generated text with escape sequences went to the terminal as is
(clear the screen, OSC 52 writes the clipboard); an answer trickled a byte a second was waited for
forever (the timeout was per read), and an endless one was read into memory.
"""
from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from blocktrain.cli.render import terminal_safe
from blocktrain.node.http import client as node_http

EVIL = "\x1b[2J\x1b]52;c;ZXZpbA==\x07"   # clear the screen; write "evil" to the clipboard


def _generate_answer(**over):
    a = {"text": "ok", "bytes_generated": 2, "mode": "one_sweep", "route": [{"block": 0, "peer": "12D3KooWabcdefgh"}],
         "traversals": 1, "latency_ms": 1.0}
    a.update(over)
    return json.dumps(a).encode()


ANSWERS = {
    "/not-json": (200, b"<html>a web server</html>"),
    "/a-list": (200, b"[1, 2]"),
    "/no-text": (200, json.dumps({"route": [], "mode": "x"}).encode()),
    "/bad-route": (200, _generate_answer(route=5)),
    "/markup": (200, _generate_answer(route=[{"block": 0, "peer": "12D3Koo[/o][b]x"}], mode="[/]")),
    "/escapes": (200, _generate_answer(text=EVIL + "done")),
    "/error": (500, json.dumps({"detail": {"nested": 1}}).encode()),
    "/status-markup": (200, json.dumps({
        "run": {"run_id": "r[/]", "objective": "[blink]p", "config_hash": "abc", "n_blocks": 1},
        "blocks": [{"block": 0, "holders": [{"peer_id": "[/not-a-tag]", "state": "online[/]", "step": 3,
                                              "throughput": 1.5}]}]}).encode()),
}


class _Hostile(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _answer(self):
        base = self.path.rsplit("/v1/", 1)[0] or self.path
        if base == "/trickle":   # a byte a second, forever (until the client leaves)
            self.send_response(200)
            self.send_header("content-length", "1000000")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                return
        if base == "/endless":
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b" " * 65536)
            except OSError:
                return
        code, body = ANSWERS[base]
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer()


@pytest.fixture(scope="module")
def hostile():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def bt(*args):
    return subprocess.run([sys.executable, "-m", "blocktrain.cli.main", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def _one_line_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("Error:"), err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("path,needles", [
    ("/not-json", ["not a JSON object"]), ("/a-list", ["not a JSON object"]),
    ("/no-text", ["unexpected shape", "text"]), ("/bad-route", ["unexpected shape", "route"]),
    ("/error", ["answered 500"])])
def test_a_wrong_answer_is_one_clear_error(hostile, path, needles):
    _one_line_error(bt("generate", "hi", "--http", hostile + path), *needles)
    if path in ("/not-json", "/error"):   # the same reader serves status (its shape: the markup test)
        _one_line_error(bt("status", "--http", hostile + path), *needles[:1])


def test_markup_in_an_answer_is_printed_as_text(hostile):
    r = bt("generate", "hi", "--http", hostile + "/markup")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "b0@[/o][b]x" in r.stderr and "mode [/]" in r.stderr, r.stderr
    r = bt("status", "--http", hostile + "/status-markup")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "[/not-a-tag]" in r.stderr and "online[/]" in r.stderr and "r[/]" in r.stderr, r.stderr
    assert r.stdout.strip() == "1/1 blocks held"


def test_escape_sequences_reach_a_terminal_only_as_text(hostile):
    """On a terminal (a pseudo-terminal here) the generated text's control characters are shown, not
    obeyed; piped output is not a terminal's (exact bytes: ``--json``)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "blocktrain.cli.main", "generate", "hi", "--http", hostile + "/escapes"],
                         stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(60) == 0
    assert b"\x1b" not in out and b"\x07" not in out, bytes(out)
    assert b"hi\\x1b[2J\\x1b]52;c;ZXZpbA==\\x07done" in bytes(out), bytes(out)
    piped = bt("generate", "hi", "--http", hostile + "/escapes")   # (click drops colour codes from piped output)
    assert piped.returncode == 0 and piped.stdout.startswith("hi") and piped.stdout.endswith("done\n"), piped.stdout


class _Tty:
    def isatty(self):
        return True


def test_terminal_safe_keeps_text_and_shows_controls():
    assert terminal_safe("line one\n\tline two é ✓", _Tty()) == "line one\n\tline two é ✓"
    assert terminal_safe("a\x1b[31mb\rc\x7f\x9b", _Tty()) == "a\\x1b[31mb\\x0dc\\x7f\\x9b"
    assert terminal_safe("a\x1bb", sys.stderr if not sys.stderr.isatty() else None) in ("a\x1bb", "a\\x1bb")


def test_an_answer_is_read_within_its_deadline_and_size(hostile):
    t0 = time.monotonic()
    with pytest.raises(node_http.NodeAnswerError, match="did not finish its answer within 2 s"):
        node_http.call(hostile + "/trickle", "/v1/status", timeout=2)
    assert time.monotonic() - t0 < 10
    with pytest.raises(node_http.NodeAnswerError, match="more than 1048576 bytes"):
        node_http.call(hostile + "/endless", "/v1/status", max_answer_bytes=1 << 20)
