"""The suite's node template (``test_utils/zygote.py``): a node process forked from it must look and behave
like the one ``subprocess.Popen`` starts (its pid, session, command line, working directory, environment,
exit code, output, its p2p daemon, a graceful stop), and the launcher must fall back to ``subprocess.Popen``
where the template cannot give that. A CLI run forked from it (``run_cli``) must give what ``subprocess.run``
gives, and the nodes it starts must fork from its own copy of the template and stop with it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from blocktrain.node.swarm.launcher import LocalSwarm, ManagedProcess, NodeProc
from blocktrain.node.swarm.run import SWARM_DEFAULTS
from test_utils import zygote
from test_utils.configs import TEST_CORPUS
from test_utils.wire_procs import group_alive

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "blocktrain.cli.main"]
NODE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _env(**extra) -> dict:
    return {**NODE_ENV, **os.environ, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(autouse=True)
def fresh_templates():
    """Each test starts from no template (what earlier tests of this worker left does not count)."""
    zygote.close()
    yield


def _start(tmp_path, name: str, args: list[str], env: dict, use_template: bool) -> ManagedProcess:
    m = ManagedProcess(name, tmp_path / f"{name}.log")
    m.popen = staticmethod(zygote.popen if use_template else subprocess.Popen)
    m.start_process([*CLI, *args], env=env)
    return m


def _tiny_seed(base) -> tuple[LocalSwarm, NodeProc]:
    sw = LocalSwarm(base, run_id="template-test", overrides=SWARM_DEFAULTS, data=str(TEST_CORPUS),
                    extra_args=["--device", "cpu", "--max-steps", "1"])
    return sw, sw.start_seed(0)


@pytest.mark.parametrize("use_template", [True, False], ids=["template", "popen"])
def test_a_node_is_the_same_process_either_way(tmp_path, monkeypatch, use_template):
    if not use_template:
        monkeypatch.setattr(ManagedProcess, "popen", staticmethod(subprocess.Popen))
    sw, node = _tiny_seed(tmp_path)
    try:
        assert isinstance(node.proc, zygote.TemplateChild) is use_template, zygote.fallbacks
        pid = node.proc.pid
        p = psutil.Process(pid)
        shown = [a for a in p.cmdline() if a.strip()]   # the template's padding is a last argument of spaces
        assert shown[:len(CLI) + len(node.args)] == [*CLI, *node.args] and str(node.ready_file) in shown
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid
        assert p.cwd() == os.getcwd()
        daemons = [c for c in p.children(recursive=True) if c.name() == "p2pd"]
        assert daemons and all(c.ppid() == pid for c in daemons)
        assert node.get("/v1/status")["self"]["block"] == 0
        assert node.alive and node.wait(0.5) is None
        assert node.stop(60) == 0   # SIGTERM: a graceful leave
        assert not node.alive and not group_alive(pid)
        _, still = psutil.wait_procs(daemons, timeout=10)
        assert not still, "the node's p2p daemon outlived it"
        with pytest.raises(psutil.NoSuchProcess):   # reaped: no zombie left behind
            psutil.Process(pid).status()
    finally:
        sw.stop_all(10)


@pytest.mark.parametrize("use_template", [True, False], ids=["template", "popen"])
def test_exit_code_output_and_environment_are_the_childs(tmp_path, use_template):
    bad = _start(tmp_path, "bad", ["seed", "--no-such-flag"], _env(), use_template)
    assert bad.wait(60) == 2
    assert "No such option '--no-such-flag'" in bad.tail() and "RuntimeWarning" not in bad.tail()
    # the environment the launcher passed is the child's: click wraps help to COLUMNS (at most 100) at run time
    for columns, widest in (("200", range(81, 101)), ("80", range(40, 81))):
        helped = _start(tmp_path, "help" + columns, ["seed", "--help"], _env(COLUMNS=columns), use_template)
        assert helped.wait(60) == 0
        assert max(len(line) for line in helped.tail(1000).splitlines()) in widest, columns


def test_what_the_template_cannot_give_starts_as_usual(tmp_path):
    """Another program, a command that is not a node's: ``subprocess.Popen``."""
    not_a_node = _start(tmp_path, "version", ["--version"], _env(), True)
    other_program = ManagedProcess("py", tmp_path / "py.log")
    other_program.popen = staticmethod(zygote.popen)
    other_program.start_process([sys.executable, "-c", "print('hi')"], env=_env())
    for m in (not_a_node, other_program):
        assert isinstance(m.proc, subprocess.Popen), m.name
        assert m.wait(60) == 0, m.tail()


@pytest.mark.parametrize("use_template", [True, False], ids=["template", "popen"])
def test_piped_stdio_is_the_same_either_way(tmp_path, use_template):
    """The launcher's piped stdio (JSON-lines test processes): stdin and stdout text pipes, stderr on the log."""
    m = ManagedProcess("piped", tmp_path / "piped.log")
    m.popen = staticmethod(zygote.popen if use_template else subprocess.Popen)
    m.start_process([*CLI, "seed", "--help"], env=_env(), pipe_stdio=True)
    assert isinstance(m.proc, zygote.TemplateChild) is use_template, zygote.fallbacks
    assert m.proc.stdout.read().startswith("Usage: ") and m.wait(60) == 0, m.tail()
    probe = ManagedProcess("probe", tmp_path / "probe.log")   # a JSON-lines test program: lines both ways
    probe.popen = staticmethod(zygote.popen if use_template else subprocess.Popen)
    probe.start_process([sys.executable, os.path.join(os.path.dirname(zygote.__file__), "dht_probe.py")],
                        env=_env(), pipe_stdio=True)
    try:
        assert isinstance(probe.proc, zygote.TemplateChild) is use_template, zygote.fallbacks
        assert json.loads(probe.proc.stdout.readline())["event"] == "ready", probe.tail()
        probe.proc.stdin.write('{"cmd": "check"}\n')
        assert json.loads(probe.proc.stdout.readline())["result"]["answers"] is True, probe.tail()
        probe.proc.stdin.write('{"cmd": "quit"}\n')
        assert probe.wait(60) == 0, probe.tail()
    finally:
        probe.stop(5)


def test_nodes_die_with_the_template_and_their_cpu_is_counted(tmp_path):
    before = zygote.children_cpu()
    quick = _start(tmp_path, "quick", ["seed", "--help"], _env(), True)
    assert isinstance(quick.proc, zygote.TemplateChild), zygote.fallbacks
    two = _start(tmp_path, "two", ["seed", "--help"], _env(OMP_NUM_THREADS="2"), True)   # read as torch loads:
    assert isinstance(two.proc, zygote.TemplateChild) and two.proc._t is not quick.proc._t   # its own template
    assert two.wait(60) == 0
    assert quick.wait(60) == 0
    assert zygote.children_cpu() > before   # the exited child's CPU, as RUSAGE_CHILDREN would count it
    sw, node = _tiny_seed(tmp_path / "net")
    try:
        assert isinstance(node.proc, zygote.TemplateChild), zygote.fallbacks
        pid = node.proc.pid
        zygote.close()   # the next node starts a new template
        deadline = time.monotonic() + 60
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "a node outlived its template"
            time.sleep(0.2)
        assert not node.alive
    finally:
        sw.stop_all(10)


def test_a_cli_run_gives_what_subprocess_run_gives():
    """``run_cli`` (the tests' CLI runs, forked from a template) against ``subprocess.run`` of the same
    command and environment: the same exit code, stdout and stderr."""
    env = {**NODE_ENV, **os.environ, "COLUMNS": "120"}
    for args in (["seed", "--no-such-flag"], ["--help"], ["bench", "swarm", "--help"], ["export", "--json"]):
        before = zygote.counts["cli_forked"]
        forked = zygote.run_cli(args, timeout=120, env=env)
        assert zygote.counts["cli_forked"] == before + 1, zygote.fallbacks
        plain = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                               env={**env, "PYTHONUNBUFFERED": "1"})
        assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
        assert forked.args == plain.args


def test_a_cli_runs_nodes_fork_from_its_copy_and_stop_with_it_past_its_timeout(tmp_path):
    """A ``swarm`` run killed at its timeout (serving, after 1 s of training) raises ``TimeoutExpired``; the
    nodes it started (forked from its own copy of the template) stop with it, and nothing of it is left in /tmp."""
    workdir, tmp = tmp_path / "sw", tempfile.gettempdir()
    zygote.run_cli(["--version"], timeout=60)   # this worker's template made: its folder is there before and after
    before = sorted(os.listdir(tmp))
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run_cli(["swarm", "--nodes", "2", "--budget", "1s", "--keep-running", "--data", str(TEST_CORPUS),
                        "--set", "n_blocks=2", "--workdir", str(workdir)], timeout=25)
    deadline = time.monotonic() + 60
    while left := [p for p in psutil.process_iter(["cmdline", "status"])
                   if str(workdir) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left running: {[p.pid for p in left]}"
        time.sleep(0.2)
    ready = list(workdir.rglob("ready.json"))
    assert ready, "no node of the swarm came up within the timeout (nothing was checked)"
    assert [n for n in os.listdir(tmp) if n.startswith("bt-zygote-") and n not in before] == []   # nothing left


def test_a_cli_runs_nodes_are_forked_from_its_copy(tmp_path):
    log = tmp_path / "cpu.jsonl"
    r = zygote.run_cli(["swarm", "--nodes", "2", "--budget", "3s", "--data", str(TEST_CORPUS), "--set", "n_blocks=2",
                        "--workdir", str(tmp_path / "sw"), "--json"], timeout=300, env={**os.environ, "BT_CPU_LOG": str(log)})
    assert r.returncode == 0, r.stderr[-3000:]
    started = [x["cli_template"] for x in map(json.loads, log.read_text().splitlines()) if "cli_template" in x]
    assert started == [{"forked": len(json.loads(r.stdout)["nodes"]), "fallbacks": 0, "templates": 1,
                        "cli_forked": 0}], started


def test_which_commands_fork():
    """Node commands fork: plain, through this folder's node wrappers, inside ``ip netns exec NS``; so do this
    folder's test programs that import what the template has; other programs and commands do not."""
    utils = os.path.join(os.path.dirname(os.path.abspath(zygote.__file__)))
    probe, faulty = os.path.join(utils, "pipeline_probe.py"), os.path.join(utils, "faulty_node.py")
    assert zygote._command([*CLI, "join", "--x"]) == {"args": ["join", "--x"], "script": None, "netns": None}
    assert zygote._command([sys.executable, probe, "seed"]) == {"args": ["seed"], "script": probe, "netns": None}
    assert zygote._command([sys.executable, faulty, "nan_hops", "join"]) == \
        {"args": ["nan_hops", "join"], "script": faulty, "netns": None}
    assert zygote._command(["ip", "netns", "exec", "btn1-h0", *CLI, "seed"]) == \
        {"args": ["seed"], "script": None, "netns": "btn1-h0"}
    for other in ([*CLI, "--version"], [*CLI, "bench", "swarm"], [sys.executable, faulty, "join"],
                  [sys.executable, "-c", "pass"], ["faketime", "-f", "-120s", *CLI, "join"],
                  [sys.executable, os.path.join(utils, "netns.py")], [sys.executable, zygote.__file__, "x"]):
        assert zygote._command(other) is None, other
    wire = os.path.join(utils, "wire_node.py")   # a test program that imports what the template has
    assert zygote._command([sys.executable, wire, "--x"]) == {"args": ["--x"], "script": wire, "netns": None}
