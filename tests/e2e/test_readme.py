"""
test_readme.py - every shell command in README.md and examples/*/README.md runs
as written, against a server started the way `make run` starts one, and prints
what the README shows under it. So the walk-through cannot rot.

How a README is written so that this test reads it (the convention):

* Shell commands live in fenced blocks tagged ```sh. Blocks tagged bash,
  shell or console are refused (say sh), and so is a command-looking line in
  an indented code block: every command is either run or marked not-run.
* A block that must not run (`make run` itself, docker, a training run of
  minutes) has `<!-- not-run: REASON -->` on the line before its fence. The
  number of such blocks per file is fixed in NOT_RUN below, so adding one is
  a visible decision.
* A command is one line plus its `\\` continuation lines and here-document
  bodies. The lines starting with `# ` (or a lone `#`) right after a command
  are its expected standard output, pasted from a real run; a comment that
  is not output goes at the end of the command line (`cmd  # why`). A
  command with no such lines has its output ignored; it must still exit 0,
  as every command must.
* Comparing an expected output with the real one:
  - If the expected lines together are one JSON value spread over several
    lines, the whole output is parsed as JSON; otherwise line by line, with
    the same number of lines, unless the last expected line is `...`
    (more lines may follow).
  - A line starting with `{` or `[` is JSON, shown as it is printed (when the
    output line has no space outside its strings, as `jq -c` prints, the
    README's has none either): objects match by the keys shown
    (the real one may have more), arrays element by element (a final "..."
    element: more may follow), integers and strings exactly, other numbers
    within a relative 1e-4 (BLAS differs between machines in the last bits),
    the string "..." matches any value and "j..." any string starting "j"
    (job ids, sha256 values, times).
  - Any other line is text where `...` matches anything.
* Each README file runs in order in one bash process (variables carry over,
  e.g. JOB=$(...)) from the repository root, against a fresh server started
  by examples/serve.sh (what `make run` runs) with a temporary store. Before
  running, `127.0.0.1:8080` becomes the server's port, `/tmp/` the test's
  temporary directory and `./modeld` the binary under test (MODELD_BIN: a
  sanitizer build under `make asan`), in commands and expected outputs alike.
* Running a README must leave the repository as it was (git status).

The training scripts get a test of their own: a tiny bounded run with no
--out writes into a new temporary directory and touches no committed file.
"""
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from conftest import REPO, TSCALE, child_env, free_port, modeld_bin

READMES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in REPO.glob("examples/*/README.md"))
# not-run blocks allowed per file: keep these small
NOT_RUN = {
    "README.md": 7,                          # make run / make test; docker; buildah; docker compose;
                                             # kubectl; several hosts (PostgreSQL, S3, compose, k8s);
                                             # a job over S3 (test_jobs_s3.py runs it on s3rver)
    "examples/fashion_mnist/README.md": 1,   # the full training run (a minute)
    "examples/fashion_cnn/README.md": 1,     # the full training run (a minute)
}
TRAINING_SCRIPTS = ["examples/fashion_mnist/train.py", "examples/fashion_cnn/train.py"]

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN_MARK = re.compile(r"^<!--\s*not-run:\s*(\S.*?)\s*-->$")
SHELLISH = re.compile(r"^(curl|make|\./modeld|/usr/bin/python3|python3|docker|examples/)\b")


class Command:
    def __init__(self, file, line, text, expected):
        self.file, self.line, self.text, self.expected = file, line, text, expected


def parse_readme(rel, root=REPO):
    """Returns (commands, not_run_reasons) of one README; fails on a shell
    command outside a fenced sh block."""
    lines = (root / rel).read_text().split("\n")
    commands, not_run = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("    ") and SHELLISH.match(lines[i].strip()):
                pytest.fail(f"{rel}:{i + 1}: a command in an indented code block is never "
                            f"run by this test; put it in a ```sh block: {lines[i].strip()!r}")
            i += 1
            continue
        tag, start = m.group(2), i
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        assert j < len(lines), f"{rel}:{start + 1}: fenced block never closed"
        body = lines[start + 1:j]
        i = j + 1
        if tag in ("bash", "shell", "console", "shell-session"):
            pytest.fail(f"{rel}:{start + 1}: tag shell blocks ```sh so that they are run")
        if tag != "sh":
            continue
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = NOT_RUN_MARK.match(prev)
        if mark:
            not_run.append(f"{rel}:{start + 1}: {mark.group(1)}")
            continue
        commands.extend(split_commands(rel, start + 2, body))
    return commands, not_run


def take_heredocs(rel, first_line, body, k, text):
    """Append the bodies of the here-documents that line k opens; returns the
    index of the last line taken."""
    for word in re.findall(r"<<-?\s*'?\"?(\w+)", body[k]):
        start = k
        k += 1
        while k < len(body) and body[k].strip() != word:
            text.append(body[k])
            k += 1
        assert k < len(body), f"{rel}:{first_line + start}: here-document {word} not closed"
        text.append(body[k])
    return k


def bash_complete(text):
    """Whether `text` is a whole shell command (no open quote, `\\`, loop...)."""
    r = subprocess.run(["bash", "-n"], input=text + "\n", capture_output=True, text=True)
    return r.returncode == 0 or not re.search(r"unexpected (end of file|EOF)", r.stderr)


def split_commands(rel, first_line, body):
    commands = []
    k = 0
    while k < len(body):
        line = body[k]
        if not line.strip():
            k += 1
            continue
        assert not line.startswith("#"), (
            f"{rel}:{first_line + k}: output lines (# ...) with no command before them; "
            f"put prose outside the block or at the end of a command line")
        start, text = k, [line]
        k = take_heredocs(rel, first_line, body, k, text)
        while ((text[-1].endswith("\\") or not bash_complete("\n".join(text)))
               and k + 1 < len(body)):
            k += 1
            text.append(body[k])
            k = take_heredocs(rel, first_line, body, k, text)
        k += 1
        expected = []
        while k < len(body) and (body[k].startswith("# ") or body[k] == "#"):
            expected.append(body[k][2:])
            k += 1
        commands.append(Command(rel, first_line + start, "\n".join(text), expected))
    return commands


# ---- comparing outputs ---------------------------------------------------


def json_match(exp, act, where="$"):
    """None when `act` matches `exp` under the convention above, else why not."""
    if isinstance(exp, str):
        if exp == "...":
            return None
        if exp.endswith("..."):
            if isinstance(act, str) and act.startswith(exp[:-3]):
                return None
            return f"{where}: expected a string starting {exp[:-3]!r}, got {act!r}"
        return None if exp == act else f"{where}: expected {exp!r}, got {act!r}"
    if isinstance(exp, dict):
        if not isinstance(act, dict):
            return f"{where}: expected an object, got {act!r}"
        for key, value in exp.items():
            if key not in act:
                return f"{where}: key {key!r} missing from {sorted(act)}"
            why = json_match(value, act[key], f"{where}.{key}")
            if why:
                return why
        return None
    if isinstance(exp, list):
        if not isinstance(act, list):
            return f"{where}: expected an array, got {act!r}"
        open_end = bool(exp) and exp[-1] == "..."
        shown = exp[:-1] if open_end else exp
        if len(act) < len(shown) or (not open_end and len(act) != len(shown)):
            return f"{where}: expected {len(shown)}{'+' if open_end else ''} elements, got {len(act)}"
        for n, (e, a) in enumerate(zip(shown, act)):
            why = json_match(e, a, f"{where}[{n}]")
            if why:
                return why
        return None
    if isinstance(exp, bool) or exp is None:
        return None if act is exp else f"{where}: expected {exp!r}, got {act!r}"
    if isinstance(exp, int) and isinstance(act, int) and not isinstance(act, bool):
        return None if exp == act else f"{where}: expected {exp}, got {act}"
    if isinstance(act, (int, float)) and not isinstance(act, bool):
        if math.isclose(exp, act, rel_tol=1e-4, abs_tol=1e-6):
            return None
    return f"{where}: expected {exp!r}, got {act!r}"


def text_match(exp, act):
    pattern = ".*".join(re.escape(part) for part in exp.split("..."))
    return None if re.fullmatch(pattern, act) else f"expected {exp!r}, got {act!r}"


def spaced(text):
    """Whether JSON text has whitespace outside its strings (`jq -c` and
    modeld's own answers have none)."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def line_match(exp, act):
    if exp.startswith(("{", "[")):
        try:
            want = json.loads(exp)
        except ValueError as e:
            pytest.fail(f"expected output {exp!r} looks like JSON but does not parse: {e}")
        try:
            got = json.loads(act)
        except ValueError:
            return f"expected JSON like {exp!r}, got {act!r}"
        # the README shows a compact line as it comes, not re-spaced
        if spaced(exp) and not spaced(act):
            return f"expected {exp!r} has spaces that the output has not: {act!r}"
        return json_match(want, got)
    return text_match(exp, act)


def output_match(expected, actual):
    """None when the output matches the expected lines, else why not."""
    if len(expected) > 1:
        try:
            want = json.loads("\n".join(expected))
        except ValueError:
            want = None
        if want is not None:
            try:
                got = json.loads(actual)
            except ValueError:
                return f"expected one JSON value, got {actual!r}"
            return json_match(want, got)
    got_lines = actual.rstrip("\n").split("\n") if actual.strip() else []
    open_end = expected[-1] == "..."
    shown = expected[:-1] if open_end else expected
    if len(got_lines) < len(shown) or (not open_end and len(got_lines) != len(shown)):
        return (f"expected {len(shown)}{'+' if open_end else ''} lines, got {len(got_lines)}:\n"
                + actual)
    for n, (e, a) in enumerate(zip(shown, got_lines)):
        why = line_match(e, a)
        if why:
            return f"line {n + 1}: {why}"
    return None


def test_output_convention_can_fail():
    """The comparison is strict where the README is exact."""
    assert output_match(['{"version":1,"scores":[[0.8953627]]}'],
                        '{"model":"x","version":1,"scores":[[0.89536]]}\n') is None
    assert output_match(['{"version":1}'], '{"version":2}') is not None
    assert output_match(['{"scores":[[0.8953627]]}'], '{"scores":[[0.8963627]]}') is not None
    assert output_match(['{"id":"j..."}'], '{"id":"x123"}') is not None
    assert output_match(['{"id":"j..."}'], '{"id":"j123"}') is None
    assert output_match(["a", "b"], "a\n") is not None
    assert output_match(["a", "..."], "a\nb\nc\n") is None
    assert output_match(["same"], "differ\n") is not None
    assert output_match(['[1, "..."]'], "[1, 2, 3]") is None
    assert output_match(['[1, 2]'], "[1, 2, 3]") is not None
    assert output_match(['{"a": true}'], '{"a": 1}') is not None
    # a compact line (jq -c) is shown as it comes: no spaces added
    assert output_match(['{"a": 1, "b": [2, 3]}'], '{"a":1,"b":[2,3]}') is not None
    assert output_match(['{"a":1,"b":[2,3]}'], '{"a":1,"b":[2,3]}') is None
    assert output_match(['["x y", "..."]'], '["x y","z"]') is not None
    assert output_match(['["x y","..."]'], '["x y","z"]') is None
    assert output_match(['{"a": 1}'], '{"a": 1}') is None  # spaced output, spaced line


PARSER_SAMPLE = r"""text
```sh
curl -d '{"a": 1,
  "b": 2}' x | jq .a
# 1
cat <<'EOF' \
  | wc -l
one
EOF
# 1
echo done  # a note
```
<!-- not-run: docker -->
```sh
docker run x
```
```json
{"not": "shell"}
```
"""


def test_readme_parser(tmp_path):
    """Commands span quotes, continuations and here-documents; the output
    lines go with the command above them; not-run blocks are counted and
    commands outside sh blocks refused."""
    (tmp_path / "R.md").write_text(PARSER_SAMPLE)
    commands, not_run = parse_readme("R.md", tmp_path)
    assert [c.text.split("\n")[0] for c in commands] == [
        "curl -d '{\"a\": 1,", "cat <<'EOF' \\", "echo done  # a note"]
    assert commands[0].text.endswith("\"b\": 2}' x | jq .a") and commands[0].expected == ["1"]
    assert commands[1].text.split("\n")[1:] == ["  | wc -l", "one", "EOF"]
    assert commands[1].expected == ["1"] and commands[2].expected == []
    assert [c.line for c in commands] == [3, 6, 11]
    assert len(not_run) == 1 and not_run[0].endswith("docker")
    (tmp_path / "I.md").write_text("Run:\n\n    curl http://127.0.0.1:8080/healthz\n")
    with pytest.raises(pytest.fail.Exception, match="indented code block"):
        parse_readme("I.md", tmp_path)
    (tmp_path / "B.md").write_text("```bash\nls\n```\n")
    with pytest.raises(pytest.fail.Exception, match="tag shell blocks"):
        parse_readme("B.md", tmp_path)


# ---- the server `make run` starts ---------------------------------------------


class ServeSh:
    """examples/serve.sh on a free port with a store under tmp_path."""

    def __init__(self, tmp_path, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        env = child_env({"MODELD_PORT": self.port, "MODELD_STORE": tmp_path / "store",
                         "MODELD_ACCESS_LOG": tmp_path / "access.log",
                         "MODELD_DRAIN_SECONDS": 0, "MODELD": modeld_bin(), **(env or {})})
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen([str(REPO / "examples/serve.sh")], cwd=str(REPO), env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_deployed(self, timeout=60.0):
        deadline = time.monotonic() + timeout * TSCALE
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve.sh exited with {self.proc.returncode}:\n"
                            f"{self.log.read_text(errors='replace')}")
            try:
                if requests.get(self.url + "/models/fashion", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        pytest.fail(f"serve.sh did not deploy `fashion` within {timeout * TSCALE:.0f} s:\n"
                    f"{self.log.read_text(errors='replace')}")

    def stop(self):
        """SIGTERM to serve.sh, which passes it on; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20 * TSCALE)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            self._log.close()


@pytest.fixture
def serve_sh(tmp_path):
    s = ServeSh(tmp_path)
    yield s
    s.stop()


def git_status():
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                          cwd=str(REPO), capture_output=True, text=True, check=True).stdout


def substitute(text, port, tmp):
    # /tmp/ first, on the README's own text only: the binary under test may
    # itself live under /tmp (a clone there), and must keep its path
    text = text.replace("/tmp/", f"{tmp}/")
    text = re.sub(r"(?<![\w/.])\./modeld(?![\w.-])", lambda m: modeld_bin(), text)
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    return text.replace("localhost:8080", f"localhost:{port}")


def test_serve_sh_deploys_once_and_stops_on_sigint(tmp_path):
    """make run's script: the model is there when it says so, it is not
    deployed twice over a store that has it, and Ctrl-C stops the server."""
    s = ServeSh(tmp_path)
    try:
        s.wait_deployed()
        r = requests.get(s.url + "/models/fashion", timeout=5)
        assert [v["version"] for v in r.json()["versions"]] == [1]
        assert r.json()["versions"][0]["metrics"] == json.loads(
            (REPO / "examples/fashion_mnist/metrics.json").read_text())
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(20 * TSCALE) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(s.url + "/healthz", timeout=2)
    finally:
        s.stop()
    s = ServeSh(tmp_path)  # the same store again
    try:
        s.wait_deployed()
        r = requests.get(s.url + "/models/fashion", timeout=5)
        assert [v["version"] for v in r.json()["versions"]] == [1]
    finally:
        assert s.stop() == 0


def run_serve_sh(tmp_path, *args, env=None, timeout=60.0):
    """examples/serve.sh run to completion, for the cases where it must exit
    by itself: (exit status, its output). Its store is tmp_path/mine."""
    env = child_env({"MODELD_STORE": tmp_path / "mine", "MODELD_DRAIN_SECONDS": 0,
                     "MODELD": modeld_bin(), **(env or {})})
    proc = subprocess.Popen([str(REPO / "examples/serve.sh"), *args], cwd=str(REPO), env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout * TSCALE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"serve.sh {' '.join(args)} still running after {timeout * TSCALE:.0f} s:\n{out}")
    return proc.returncode, out


def test_serve_sh_refuses_a_port_in_use(tmp_path, server):
    """A second `make run` on a taken port stops before starting anything: it
    says the port is busy, exits non-zero, and the server that holds the port
    gets no model (it used to get `fashion`, and serve.sh said it was serving)."""
    rc, out = run_serve_sh(tmp_path, "--port", str(server.port))
    assert rc != 0, out
    assert f"port {server.port}" in out and "already in use" in out, out
    assert "serving" not in out, out
    assert server.get("/models").json()["models"] == []
    assert not (tmp_path / "mine").exists(), "serve.sh started modeld on its store"
    # the port set through the environment
    rc, out = run_serve_sh(tmp_path, env={"MODELD_PORT": server.port})
    assert rc != 0 and f"port {server.port}" in out, out
    assert server.get("/models").json()["models"] == []


def test_serve_sh_refuses_a_port_held_by_any_socket(tmp_path):
    """Whatever listens on the port (here a socket that never answers), not
    only a modeld."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(8)
        port = held.getsockname()[1]
        rc, out = run_serve_sh(tmp_path, "--port", str(port))
    assert rc != 0, out
    assert f"port {port}" in out and "already in use" in out, out
    assert not (tmp_path / "mine").exists(), "serve.sh started modeld on its store"


def test_serve_sh_data_adds_to_allowed_paths(tmp_path):
    """`make run DATA=DIR` (serve.sh with DATA set): a file:// deploy and a job
    read under DIR, while the defaults README's commands use still hold and
    a directory named nowhere stays refused."""
    data, other = tmp_path / "data", tmp_path / "other"
    data.mkdir()
    other.mkdir()
    model = REPO / "examples/fashion_mnist/model.pt"
    (data / "model.pt").write_bytes(model.read_bytes())
    (other / "model.pt").write_bytes(model.read_bytes())
    row = json.loads((REPO / "examples/fashion_mnist/row.json").read_text())[0]
    (data / "rows.jsonl").write_text(json.dumps(row) + "\n")
    s = ServeSh(tmp_path, env={"DATA": str(data)})
    try:
        s.wait_deployed()

        def register(path):
            return requests.post(s.url + "/models", timeout=60 * TSCALE, json={
                "name": "fashion", "make_default": False, "source": f"file://{path}"})

        r = register(data / "model.pt")
        assert r.status_code == 201, r.text
        r = register(model)  # README's own: examples/ is still allowed
        assert r.status_code == 201, r.text
        r = register(other / "model.pt")
        assert r.status_code == 400 and r.json()["error"]["code"] == "source_not_allowed", r.text
        r = requests.post(s.url + "/jobs", timeout=10 * TSCALE, json={
            "model": "fashion", "input": {"path": str(data / "rows.jsonl"), "format": "jsonl"}})
        assert r.status_code in (201, 202), r.text
        job = r.json()
        deadline = time.monotonic() + 60 * TSCALE
        while job["status"] in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.05)
            job = requests.get(s.url + f"/jobs/{job['id']}", timeout=10).json()
        assert job["status"] == "succeeded" and job["rows_done"] == 1, job
    finally:
        assert s.stop() == 0


def test_serve_sh_data_must_be_a_directory(tmp_path):
    rc, out = run_serve_sh(tmp_path, env={"DATA": str(tmp_path / "missing")})
    assert rc != 0 and "missing is not a directory" in out, out
    assert not (tmp_path / "mine").exists()


@pytest.mark.parametrize("rel", READMES)
def test_readme_commands(rel, tmp_path, serve_sh):
    commands, not_run = parse_readme(rel)
    assert len(not_run) == NOT_RUN.get(rel, 0), (
        f"{rel} has {len(not_run)} not-run blocks, expected {NOT_RUN.get(rel, 0)} (NOT_RUN):\n"
        + "\n".join(not_run))
    assert commands, f"{rel}: no ```sh commands found"
    serve_sh.wait_deployed()
    before = git_status()

    work = tmp_path / "run"
    work.mkdir()
    script = ["cd " + json.dumps(str(REPO))]
    for n, c in enumerate(commands):
        script.append("{ " + substitute(c.text, serve_sh.port, tmp_path))
        script.append(f"}} > {work}/out.{n} 2> {work}/err.{n}; echo $? > {work}/rc.{n}")
        script.append(f"[ \"$(cat {work}/rc.{n})\" = 0 ] || exit 0")
    try:
        shell = subprocess.run(["bash", "-c", "\n".join(script)], env=child_env(), cwd=str(REPO),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=300 * TSCALE)
    except subprocess.TimeoutExpired:
        done = len(list(work.glob("rc.*")))
        c = commands[min(done, len(commands) - 1)]
        pytest.fail(f"{c.file}:{c.line}: still running after {300 * TSCALE:.0f} s:\n{c.text}")

    for n, c in enumerate(commands):
        where = f"{c.file}:{c.line}: $ {c.text}"
        rc_path = work / f"rc.{n}"
        assert rc_path.exists(), f"{where}\nnever ran; bash said:\n{shell.stderr}"
        out = (work / f"out.{n}").read_text(errors="replace")
        err = (work / f"err.{n}").read_text(errors="replace")
        rc = int(rc_path.read_text())
        assert rc == 0, f"{where}\nexited {rc}\nstdout:\n{out}\nstderr:\n{err}"
        if c.expected:
            expected = [substitute(e, serve_sh.port, tmp_path) for e in c.expected]
            why = output_match(expected, out)
            assert why is None, f"{where}\noutput differs from the README: {why}\nstderr:\n{err}"

    assert git_status() == before, f"running {rel} changed the repository"


def sha256_tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_training_writes_only_into_a_temp_dir(script, tmp_path):
    """A short run without --out leaves every committed file alone and writes
    the three files into a new directory under TMPDIR."""
    examples = REPO / "examples"
    before, status = sha256_tree(examples), git_status()
    r = subprocess.run(["/usr/bin/python3", str(REPO / script), "--epochs", "1", "--limit", "256"],
                       cwd=str(REPO / Path(script).parent), env=child_env({"TMPDIR": tmp_path}),
                       capture_output=True, text=True, timeout=300 * TSCALE)
    assert r.returncode == 0, r.stderr
    made = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(made) == 1, f"expected one new directory in TMPDIR, got {made}"
    assert sorted(p.name for p in made[0].iterdir()) == ["metrics.json", "model.json", "model.pt"]
    # the config the script writes is the committed one
    committed = REPO / Path(script).parent / "model.json"
    assert json.loads((made[0] / "model.json").read_text()) == json.loads(committed.read_text())
    assert str(made[0]) in r.stdout
    assert sha256_tree(examples) == before
    assert git_status() == status
