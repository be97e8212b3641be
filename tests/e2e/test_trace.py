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


def access_lines(server, done, timeout=10.0):
    """The access log's JSON lines once done(lines) holds. A request's line
    is written when its response has been sent, so it may land a moment
    after the client has the response: wait for it, never take the last."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.access_log.read_text() if server.access_log.exists() else ""
        lines = [json.loads(x) for x in text.splitlines() if x.strip()]
        if done(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_traceparent_echoed_and_logged(server):
    r = server.get("/healthz", headers={"traceparent": GIVEN})
    assert r.status_code == 200
    assert r.headers.get("traceparent") == GIVEN
    lines = access_lines(server, lambda ls: any(l.get("traceparent") == GIVEN for l in ls))
    mine = [l for l in lines if l.get("traceparent") == GIVEN]
    assert len(mine) == 1, lines
    assert mine[0]["path"] == "/healthz"


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
    logged = lambda ls: {l.get("traceparent", "-").split("-")[1] for l in ls}
    lines = access_lines(server, lambda ls: seen <= logged(ls))
    assert seen <= logged(lines), "generated trace ids missing from the access log"


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
    answered = set()
    for value in bad:
        r = server.get("/healthz", headers={"traceparent": value})
        assert r.status_code == 200, value
        tp = r.headers.get("traceparent")
        assert tp and TRACEPARENT.match(tp) and tp != value, (value, tp)
        assert "4bf92f3577b34da6a3ce929d0e0e4736" not in tp, (value, tp)
        answered.add(tp)
    # the log holds what was answered, never the invalid value
    lines = access_lines(server, lambda ls: answered <= {l.get("traceparent") for l in ls})
    assert answered <= {l.get("traceparent") for l in lines}
    for line in lines:
        assert TRACEPARENT.match(line["traceparent"]), line
