"""`lmcache-r3 inspect` against something that is not a healthy LMCache server says what answered and what to fix,
instead of claiming that nothing answers."""

import http.server
import threading

import pytest

from lmcache_r3.cli import main


@pytest.fixture
def http_answering():
    """A real HTTP server on loopback that answers every GET with the status and body a test sets."""
    answer = {"status": 200, "body": b"{}"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            self.send_response(answer["status"])
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answer
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "code", "says"),
    [
        (500, b"boom", 1, "/status answered HTTP 500 Internal Server Error: something answers there, but not"),
        (200, b"<html>a web page</html>", 1, "/status did not answer with JSON"),
        (200, b'{"is_healthy": true}', 0, None),
        (200, b"[1, 2]", 1, "answered JSON that is not an LMCache status (a list, not an object)"),
    ],
)
def test_inspect_says_what_answered(http_answering, capsys, status, body, code, says):
    url, answer = http_answering
    answer.update(status=status, body=body)
    assert main(["inspect", "--url", url]) == code
    out, err = capsys.readouterr()
    if says is None:
        assert '"healthy": true' in out and err == ""
    else:
        assert says in err and url in err and "no LMCache server answers" not in err


def test_an_inspect_url_without_its_scheme_is_refused_with_the_form_it_needs(capsys):
    assert main(["inspect", "--url", "127.0.0.1:8080"]) == 2
    assert "needs its scheme, e.g. http://127.0.0.1:8080" in capsys.readouterr().err


def test_a_bad_config_file_stops_inspect_with_the_key(tmp_path, capsys):
    file = tmp_path / "c.yaml"
    file.write_text("server: {extra_args: [--port, '6000']}\n")
    assert main(["inspect", "--config", str(file)]) == 2
    assert "server: extra_args: '--port' sets what the port key sets" in capsys.readouterr().err


def test_inspect_pointed_at_a_port_that_does_not_speak_http_says_so(capsys):
    """e.g. the server's ZMQ request port: it answers with bytes that are no HTTP status line."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_in_zmtp():
        conn, _ = listener.accept()
        conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")  # a ZMTP greeting's first bytes
        conn.recv(4096)
        conn.close()

    thread = threading.Thread(target=answer_in_zmtp, daemon=True)
    thread.start()
    try:
        assert main(["inspect", "--url", f"http://127.0.0.1:{listener.getsockname()[1]}"]) == 1
    finally:
        listener.close()
    assert "did not answer in HTTP" in capsys.readouterr().err
