"""Launcher of the harness presets (run inside the sandbox): make the agent's own writable home,
write its config files there, then exec the agent.

    python3 -I launch.py -- ARGV...

``$HOME`` names the home (a path on the sandbox's private tmpfs); ``$ROLLOUTD_HOME_FILES`` is a
JSON object of paths relative to it and their contents (the handler has already filled in the
endpoint's address and key). XDG_* directories that point into the home are created too. The
variable is removed from the environment before the exec: the agent never sees it.
"""
import json
import os
import sys


def main(argv):
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.stderr.write("usage: launch.py -- ARGV...\n")
        return 2
    cmd = argv[argv.index("--") + 1:]
    home = os.environ.get("HOME", "")
    if not home.startswith("/"):
        sys.stderr.write("launch.py: HOME must be an absolute path\n")
        return 2
    files = json.loads(os.environ.pop("ROLLOUTD_HOME_FILES", "{}") or "{}")
    os.makedirs(home, mode=0o700, exist_ok=True)
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME"):
        d = os.environ.get(var, "")
        if d.startswith(home + "/"):
            os.makedirs(d, mode=0o700, exist_ok=True)
    for rel, text in files.items():
        path = os.path.normpath(os.path.join(home, rel))
        if not path.startswith(home.rstrip("/") + "/"):
            sys.stderr.write("launch.py: %r is outside HOME\n" % rel)
            return 2
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write("launch.py: cannot start %s: %s\n" % (cmd[0], e.strerror or e))
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
