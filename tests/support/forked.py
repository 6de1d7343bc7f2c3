"""New processes for tests without a new ``import torch`` each (about 2 s of CPU apiece).

:class:`Forker` starts one Python process that imports torch, ampkit, Dynamo (which the
first optimizer a process builds loads) and Inductor (a first compile's; nothing of the
test's) and then forks a child for each :meth:`Forker.run`: the child has the fresh
state of a new interpreter (no ampkit state, no test's leftovers, one thread), its own
working folder, environment, stdin, stdout and stderr, and runs ``python -c CODE ARGS``
as the interpreter would (``__main__``, ``sys.argv``, the exit code of ``SystemExit``, a
traceback and exit code 1 for an exception, atexit handlers at the end). Only the
imports done before the fork are shared, so a test that checks what happens at import,
or under another environment at import, starts its own interpreter.

One server per test process (:func:`shared`, started with :func:`fork_env` at its first
use, closed by ``tests/conftest.py`` at the session's end) serves the ``forked_python``
fixture and the tests marked ``fresh_process``; :meth:`Forker.run_script` runs ``python
SCRIPT ARGS``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from locations import ROOT

SERVER = r"""
import atexit, builtins, json, os, sys, threading, traceback
import torch
torch.set_num_threads(1)
import ampkit  # noqa: F401
import torch._dynamo  # noqa: F401  (what the first optimizer a child builds loads: about 1 s each)
import torch._inductor.compile_fx  # noqa: F401  (what a child's first compile loads: about 1 s)
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            reply.close()
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            os.dup2(os.open(req["stdin"], os.O_RDONLY), 0)
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.stdin = open(0, closefd=False)
            sys.argv = ["-c", *req["args"]]
            try:
                exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
                code = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
"""


#: ``python SCRIPT ARGS`` in a forked process: the script as ``__main__``, its folder first on sys.path
AS_SCRIPT = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: ``python -m MODULE ARGS`` in a forked process: the module as ``__main__``, the working folder first on sys.path
AS_MODULE = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path[0] = os.getcwd()
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def fork_env(**extra: str) -> dict[str, str]:
    """This process's environment, one thread, this checkout's ``src`` first on the path
    (what the server was started with), and ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), **extra)


_SHARED: list[Forker] = []


def shared() -> Forker:
    """This process's server, started at the first call."""
    if not _SHARED:
        _SHARED.append(Forker(fork_env()))
    return _SHARED[0]


def close_shared() -> None:
    """Stop this process's server, if one was started."""
    while _SHARED:
        _SHARED.pop().close()


class Forker:
    """One server process (see the module's docstring), started with ``env``; every
    :meth:`run` must ask for the same ``PYTHONPATH`` and thread counts, which decided
    what the server imported."""

    FIXED = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.tmp = tempfile.TemporaryDirectory(prefix="ampkit-forked-")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, text=True, bufsize=1)  # fmt: skip
        self.count = 0

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit code {self.proc.wait()})")
        return json.loads(line)

    def run(self, code: str, args: list[str] = (), *, cwd: Path, env: dict[str, str], input: str = "",
            timeout: float = 240) -> subprocess.CompletedProcess:  # fmt: skip
        """``python -c CODE ARGS`` in a forked child: the completed process, its output as text."""
        for name in self.FIXED:
            assert env.get(name) == self.env.get(name), f"{name}: the server was started with another value"
        self.count += 1
        files = {name: str(Path(self.tmp.name) / f"{self.count}.{name}") for name in ("stdin", "stdout", "stderr")}
        Path(files["stdin"]).write_text(input)
        request = {"code": code, "args": list(args), "cwd": str(cwd), "env": dict(env), **files}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._reply(30)["pid"]
        try:
            rc = self._reply(timeout)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(30)
            raise subprocess.TimeoutExpired(["-c", "<code>", *args], timeout) from None
        out, err = (Path(files[name]).read_text() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(["-c", "<code>", *args], rc, out, err)

    def run_script(self, script: Path, args: list[str] = (), *, cwd: Path | None = None,
                   env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:  # fmt: skip
        """``python SCRIPT ARGS`` in a forked child (``cwd``: this process's; ``env``: :func:`fork_env`)."""
        return self.run(AS_SCRIPT, [str(script), *args], cwd=cwd or Path.cwd(), env=env or fork_env(), timeout=timeout)

    def run_argv(self, argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 240) -> subprocess.CompletedProcess:  # fmt: skip
        """``argv`` (``[sys.executable, SCRIPT, ARGS...]`` or ``[sys.executable, "-m", MODULE, ARGS...]``,
        as a command list hands it to ``subprocess.run``) in a forked child."""
        assert argv[0] == sys.executable and argv[1:], argv
        if argv[1] == "-m":
            return self.run(AS_MODULE, list(argv[2:]), cwd=cwd or Path.cwd(), env=env or fork_env(), timeout=timeout)
        return self.run_script(Path(argv[1]), list(argv[2:]), cwd=cwd, env=env, timeout=timeout)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.tmp.cleanup()
