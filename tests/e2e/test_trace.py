"""
test_trace.py - W3C trace context on the real binary: a valid `traceparent`
request header is echoed on the response and written to the access log; an
absent or invalid one is replaced by a fresh one (random trace and span ids),
so every request can be followed through a load balancer into modeld's log.
"""
import json
import re
import time

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
GIVEN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def access_lines(server, n, timeout=5.0):
    """The access log's JSON lines once there are at least `n`."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.access_log.read_text() if server.access_log.exists() else ""
        lines = [json.loads(x) for x in text.splitlines() if x.strip()]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_traceparent_echoed_and_logged(server):
    r = server.get("/healthz", headers={"traceparent": GIVEN})
    assert r.status_code == 200
    assert r.headers.get("traceparent") == GIVEN
    lines = access_lines(server, 1)
    assert lines[-1]["path"] == "/healthz"
    assert lines[-1]["traceparent"] == GIVEN


def test_traceparent_on_errors_too(server):
    r = server.request("POST", "/models/nope/predict", json=[[1, 2, 3, 4]],
                       headers={"traceparent": GIVEN})
    assert r.status_code == 404
    assert r.headers.get("traceparent") == GIVEN


def test_traceparent_made_when_absent(server):
    seen = set()
    for _ in range(20):
        r = server.get("/healthz")
        tp = r.headers.get("traceparent")
        assert tp and TRACEPARENT.match(tp), tp
        _, trace_id, span_id, _ = tp.split("-")
        assert trace_id != "0" * 32 and span_id != "0" * 16
        seen.add(trace_id)
    assert len(seen) == 20, "generated trace ids repeat"
    lines = access_lines(server, 20)
    assert {l["traceparent"].split("-")[1] for l in lines[-20:]} == seen


def test_invalid_traceparent_replaced(server):
    bad = [
        GIVEN.upper(),                                              # upper-case hex
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        GIVEN[:-1],                                                 # 54 chars
        GIVEN + "0",                                                # 56 chars
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",  # not hex
        "garbage",
    ]
    for value in bad:
        r = server.get("/healthz", headers={"traceparent": value})
        assert r.status_code == 200, value
        tp = r.headers.get("traceparent")
        assert tp and TRACEPARENT.match(tp) and tp != value, (value, tp)
        assert "4bf92f3577b34da6a3ce929d0e0e4736" not in tp, (value, tp)
    lines = access_lines(server, len(bad))
    for line in lines[-len(bad):]:
        assert TRACEPARENT.match(line["traceparent"]), line
