"""The live fixtures' own helpers (``serve.py``, ``ports.py``): no server packages needed.

On 2026-12-03 the live SGLang server's uvicorn found the port the fixture had picked taken
("[Errno 98] ... address already in use"): the port came from ``bind(0)``, inside the kernel's
ephemeral range, and something took it while the server's TP ranks started; the server stayed up
without listening and the fixture waited its whole start-up limit (780 s) before failing.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import serve

sys.path.insert(0, os.path.dirname(serve.HERE))
import ports  # noqa: E402


def test_free_port_lies_outside_the_kernels_ephemeral_range_binds_and_is_never_given_twice() -> None:
    low, high = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(64)]
    assert len(set(got)) == len(got), f"a port given twice: {sorted(got)}"
    for port in got:
        assert not low <= port <= high, f"port {port} lies inside the ephemeral range [{low}, {high}]"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_range_reads_the_kernels_file_and_falls_back_to_linuxs_default(tmp_path) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


#: a stand-in HTTP server: the first start logs uvicorn's bind failure and stays up without
#: listening (what the SGLang server did), every later start answers /health on its port
FLAKY = textwrap.dedent("""
    import http.server, os, sys, time
    port, marker = int(sys.argv[1]), sys.argv[2]
    if not os.path.exists(marker):
        open(marker, "w").close()
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        while True:
            time.sleep(60)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_a_server_whose_port_was_taken_is_stopped_and_started_again_on_another_port(tmp_path) -> None:
    script, marker = tmp_path / "flaky.py", tmp_path / "started-once"
    script.write_text(FLAKY)
    procs: list[serve.Proc] = []
    try:
        # a deadline the first attempt would run out: only the log's bind failure ends it early
        proc, url, _ = serve.start_http("the flaky server", lambda port: [sys.executable, str(script), str(port), str(marker)],
                                        str(tmp_path / "flaky.log"), "/health", 240, procs)
        assert len(procs) == 2 and procs[1] is proc
        assert not procs[0].alive(), "the server whose port was taken still runs"
        assert os.path.exists(tmp_path / "flaky.log") and proc.log == str(tmp_path / "flaky-2.log")
        assert serve.http(url + "/health", timeout=30)[0] == 200
        assert "address already in use" in serve.tail(procs[0].log)
    finally:
        for p in reversed(procs):
            p.stop(grace_s=5)


def test_a_port_taken_on_every_attempt_fails_naming_the_server_and_its_log(tmp_path) -> None:
    script = tmp_path / "taken.py"
    script.write_text("import time\nprint('OSError: [Errno 98] Address already in use', flush=True)\ntime.sleep(600)\n")
    procs: list[serve.Proc] = []
    try:
        try:
            serve.start_http("the unlucky server", lambda port: [sys.executable, str(script)],
                             str(tmp_path / "s.log"), "/health", 240, procs, attempts=2)
        except serve.PortTaken as e:
            assert "the unlucky server" in str(e) and "s-2.log" in str(e)
        else:
            raise AssertionError("start_http returned though every attempt's port was taken")
        assert len(procs) == 2 and not any(p.alive() for p in procs)
    finally:
        for p in procs:
            p.stop(grace_s=5)
