"""Fresh interpreters for the tests that need one (import order, import hooks, environment variables read at import),
forked from a warm one instead of started: most of a new interpreter's start is importing torch and the torch modules
transformers pulls in (about 4 of the 6 to 7 seconds ``from transformers import GPTNeoForCausalLM`` takes in a new
interpreter on 4.55, with bytecode cached), and every test env spawns a dozen.

The warm interpreter (one per pytest process, started on first use, ``python -W OPTION`` like the runs it stands in
for) imports torch and those modules and nothing else: neither transformers, nor neofix, nor wrapt, which it checks.
Each run is a child forked from it with the environment given, a new ``__main__`` module, ``sys.argv == ["-c"]``, its
own stdout and stderr, and the exit status of ``python -c CODE``.  What differs from a started interpreter: torch is
already imported (neofix reads nothing of that), and so are the standard modules the warm one uses; what torch warned
about on import was said once, by the warm one; ``atexit`` handlers do not run.  Runs that must not find torch
imported (``import neofix`` loads nothing heavy) start their own interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap

#: The warm interpreter: imports torch and what transformers imports of it, then forks one child per request (a JSON
#: line on stdin), answering each with the child's exit status (a JSON line on stdout).
SERVER = r"""
import importlib, json, os, sys, traceback, types
import torch
for name in ("torch._dynamo", "torch.distributed.tensor", "torch.fx.experimental.symbolic_shapes"):
    try:
        importlib.import_module(name)
    except Exception:
        pass
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "neofix", "wrapt"})
assert not loaded, f"the warm interpreter must not have imported {loaded}"
ready = sys.stdout
ready.write("ready\n")
ready.flush()


def child(request):
    status = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["-c"]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        child(json.loads(line))
    _, code = os.waitpid(pid, 0)
    ready.write(json.dumps(os.waitstatus_to_exitcode(code)) + "\n")
    ready.flush()
"""

_servers: dict[tuple[str, ...], subprocess.Popen] = {}


def _server(warnoptions: tuple[str, ...]) -> subprocess.Popen:
    server = _servers.get(warnoptions)
    if server is not None and server.poll() is None:
        return server
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NEOFIX_")}
    flags = [item for option in warnoptions for item in ("-W", option)]
    server = subprocess.Popen(
        [sys.executable, *flags, "-c", SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=environment,
        start_new_session=True,  # a run that hangs is killed with its server, children and all
    )
    if server.stdout.readline() != "ready\n":
        server.kill()
        raise RuntimeError("the warm interpreter did not start (its error is above)")
    _servers[warnoptions] = server
    return server


def _stop(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()


@atexit.register
def _stop_all() -> None:
    for server in _servers.values():
        _stop(server)
    _servers.clear()


def run(
    code: str, env: dict[str, str], warnoptions: tuple[str, ...] = (), timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python [-W OPTION ...] -c CODE`` with environment ``env``, as a child of the warm interpreter: its exit
    status, stdout and stderr (text).  A run past ``timeout`` seconds raises ``subprocess.TimeoutExpired``."""
    server = _server(warnoptions)
    with tempfile.TemporaryDirectory(prefix="neofix-fresh-") as folder:
        paths = {name: os.path.join(folder, name) for name in ("stdout", "stderr")}
        for path in paths.values():
            open(path, "w").close()
        request = {"code": textwrap.dedent(code), "env": env, "cwd": os.getcwd(), **paths}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        if not select.select([server.stdout], [], [], timeout)[0]:
            _stop(server)
            raise subprocess.TimeoutExpired(["python", "-c", code], timeout)
        returncode = json.loads(server.stdout.readline())
        with open(paths["stdout"]) as out, open(paths["stderr"]) as err:
            return subprocess.CompletedProcess(["python", "-c", code], returncode, out.read(), err.read())
