"""The suite's own servers get ports no other listener takes, and one that loses its port starts again.

No SGLang here: a stand-in process that logs SGLang's bind error the first time and serves the second.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import server
from server import Server, free_port

STAND_IN = textwrap.dedent("""
    import http.server, os, sys, time
    port, flag = int(sys.argv[1]), sys.argv[2]
    if not os.path.exists(flag):  # the first start: SGLang's message when its port is taken, then no exit
        open(flag, "w").close()
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        time.sleep(600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def test_ports_are_free_distinct_and_outside_the_ranges_others_pick_from():
    low, high = server._PORTS
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(low <= p < min(high, ephemeral_low) for p in ports), ports
    with socket.socket() as taken:  # a port another process holds now is skipped
        nxt = max(ports) + 1
        taken.bind(("127.0.0.1", nxt))
        assert free_port() != nxt


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path):
    flag = tmp_path / "bound-once"
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    class StandIn(Server):
        def command(self) -> list[str]:
            return [sys.executable, str(script), str(self.port), str(flag)]

    srv = StandIn("stand-in", "no-model", [], str(tmp_path))
    try:
        first = srv.start().port
        srv.wait_ready(60)
        assert srv.error is None, srv.log()
        assert srv.port != first and flag.exists()
        assert f"port {first} was taken" in (tmp_path / f"stand-in.log.port-{first}").read_text()
        assert os.path.exists(srv.log_path) and "bind" not in srv.log()
    finally:
        srv.stop()
