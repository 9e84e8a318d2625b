"""A compile server: the process a grammar compile runs in, so that one past its deadline can be
killed (``grammar_pool`` drives it). Run as ``python -m worker.engine.structured.grammar_server FD``.
docs/engine.md says more."""

from __future__ import annotations

import os
import select
import signal
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from worker.engine.request import StructuredOutput
from worker.engine.structured.grammar_compile import COMPILE_THREADS, GrammarError, compile_spec


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    threads = int(argv[2]) if len(argv) > 2 else COMPILE_THREADS
    import xgrammar  # noqa: F401 (once, for every slot server and compile process forked from here)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # slot servers that end are reaped by the kernel
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 0
        if message[0] != "slot":
            continue
        handle = recv_handle(conn)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                conn.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a slot server waits for its compile processes
                die_with_parent(me)
                code = serve_slot(Connection(handle), threads)
            finally:
                os._exit(code)
        os.close(handle)
        conn.send(("slot", pid))


def serve_slot(conn: Connection, threads: int) -> int:
    """A slot server: tokenizer infos in, compiles run in compile processes, one at a time."""
    import xgrammar as xgr

    infos: dict[str, xgr.TokenizerInfo] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 0
        if message[0] == "vocabulary":
            _, key, info_json = message
            infos[key] = xgr.TokenizerInfo.deserialize_json(info_json)
            conn.send(("ok",))
        elif message[0] == "compile":
            _, key, kind, value, seconds = message
            conn.send(compile_apart(conn, infos[key], StructuredOutput(kind, value), seconds, threads))


def compile_apart(conn: Connection, info, spec: StructuredOutput, seconds: float, threads: int) -> tuple:
    """Compile ``spec`` in a compile process of its own, within ``seconds``: ("ok", pid), ("error",
    pid, reason), ("timeout", pid) once it is killed and gone, or ("died", pid, how)."""
    import xgrammar as xgr

    r, w = os.pipe()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            conn.close()  # the slot's socket: if the slot server dies, its starter hears of it at once
            die_with_parent(me)
            try:
                compile_spec(xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False), spec)
                result = b"ok"
            except GrammarError as exc:
                result = b"error " + str(exc).encode("utf-8", "backslashreplace")
            os.write(w, result[:1 << 15])  # plain bytes, never unpickled: this process ran on a user's spec
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], seconds)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return ("timeout", pid)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
    if not data:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
        return ("died", pid, how)
    if data == b"ok":
        return ("ok", pid)
    return ("error", pid, data.removeprefix(b"error ").decode("utf-8", "replace"))


def die_with_parent(parent: int) -> None:
    """Linux: be killed when the parent process (pid ``parent``, which forked this one) ends
    (``PR_SET_PDEATHSIG``); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
