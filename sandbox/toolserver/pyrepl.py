"""Driver of the persistent Python session (run as a script by pysession.py).

Standalone on purpose: it must not import the tool server, so user code sees a clean
interpreter. Requests arrive as length-prefixed JSON frames on one pipe, replies leave on
another; the code's stdout/stderr are the process's own fd 1/2 (a pipe the server reads),
so output of subprocesses started by the code is captured too.
"""
import ast
import json
import os
import signal
import struct
import sys
import traceback

HEADER = struct.Struct("!I")


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def recv(fd):
    head = _read_exact(fd, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    body = _read_exact(fd, n)
    return None if body is None else json.loads(body.decode("utf-8"))


def send(fd, obj):
    body = json.dumps(obj).encode("utf-8")
    data = HEADER.pack(len(body)) + body
    # A late Ctrl-C must not cut a reply in half.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _print_exception(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # hide the driver's own frames
    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb)))


def run(code, ns):
    """Execute like a notebook cell: statements, then echo the last expression's repr."""
    try:
        tree = ast.parse(code, "<python-input>", "exec")
    except SyntaxError as e:
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return "error", 1
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, "<python-input>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<python-input>", "eval"), ns)
            if value is not None:
                ns["_"] = value
                print(repr(value))
        return "ok", 0
    except KeyboardInterrupt as e:
        _print_exception(e)
        return "interrupted", 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        return "exit", code
    except BaseException as e:  # noqa: B902 - report everything, keep the session alive
        _print_exception(e)
        return "error", 1


def main():
    req_fd, resp_fd = int(sys.argv[1]), int(sys.argv[2])
    for fd in (req_fd, resp_fd):  # programs the code starts (os.system) do not get them
        os.set_inheritable(fd, False)
    # Behave like the interactive interpreter: imports resolve from the cwd, not from here.
    sys.path[0] = ""
    sys.argv = [""]
    ns = {"__name__": "__main__", "__builtins__": __builtins__, "__doc__": None}
    send(resp_fd, {"ready": True, "pid": os.getpid(), "version": sys.version.split()[0]})
    while True:
        try:
            req = recv(req_fd)
        except KeyboardInterrupt:
            continue  # an interrupt that arrived after the call finished
        if req is None:
            return
        try:
            status, code = run(req.get("code", ""), ns)
        except KeyboardInterrupt:
            status, code = "interrupted", 130
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        send(resp_fd, {"status": status, "exit_code": code})


if __name__ == "__main__":
    main()
