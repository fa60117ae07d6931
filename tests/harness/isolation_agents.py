"""Agent programs for the endpoint isolation test and benchmark (stdlib only: they run with the
sandbox's /usr/bin/python3, no venv). Written into the job's workspace through setup.files.

``NEIGHBOUR``: a well-behaved agent. It makes small multi-turn chat calls for ``seconds`` (at
least ``min_calls``), sending its history back unchanged, and prints ``LAT [...]`` (seconds
per call) as its last line, after ``T0 <time>`` and ``STARTS [...]`` (when each call started, wall clock,
seconds after T0). Any non-200 answer exits 2.

``ATTACKER``: one job's abuse of its own endpoint, chosen by argv[1] (``ctx8xN``: N valid chat
requests of 8 MB of text one after another, for a job whose context window lets them be parsed;
``fitN``: N concurrent requests of ~400 KB that fit a 128k window, not an abuse: exit 0 when all
are answered 200). Each prints ``BEGIN <time>`` and ``END <time>`` (wall clock). It prints ``REFUSED
<what>`` lines for what the endpoint did and exits 3 (the job fails alone); it exits 0 only if
no attack was refused at all (a test then sees the endpoint accepted the abuse).
"""

NEIGHBOUR = r'''
import json, os, sys, time, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
seconds, min_calls = float(sys.argv[1]), int(sys.argv[2])
msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
lat, starts, t_end, i = [], [], time.monotonic() + seconds, 0
while time.monotonic() < t_end or i < min_calls:
    body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/chat/completions", data=body,
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    t = time.perf_counter()
    starts.append(time.time())
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.loads(r.read())
    except Exception as e:
        print("CALL_FAILED", i, type(e).__name__, str(e)[:300])
        sys.exit(2)
    lat.append(round(time.perf_counter() - t, 3))
    msgs.append(reply["choices"][0]["message"])
    msgs.append({"role": "user", "content": "again %d" % i})
    if len(msgs) > 24:  # keep the context small: a new conversation
        msgs = msgs[:2]
    i += 1
    time.sleep(0.1)
# compact: the job's output_tail keeps the last 4,000 characters
print("T0 %.3f" % starts[0])
print("STARTS " + json.dumps([round(x - starts[0], 1) for x in starts]))
print("LAT " + json.dumps(lat))
'''

ATTACKER = r'''
import json, os, re, socket, sys, time
from urllib.parse import urlparse
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
u = urlparse(base)
HOST, PORT = u.hostname, u.port
mode = sys.argv[1]
refused = []
print("BEGIN %.3f" % time.time())

def conn(timeout=60):
    s = socket.create_connection((HOST, PORT), timeout=timeout)
    return s

def head(path, length, extra=b""):
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(length).encode() + b"\r\n" + extra + b"\r\n")

def answer(s, limit=60):
    """Status line of the answer, or 'closed' / 'timeout'."""
    s.settimeout(limit)
    buf = b""
    try:
        while b"\r\n" not in buf:
            d = s.recv(65536)
            if not d:
                return "closed" if not buf else buf[:60].decode("latin-1")
            buf += d
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "closed"
    return buf.split(b"\r\n", 1)[0].decode("latin-1")

def whole_reply(s, limit=10):
    """The whole reply, up to the server's close (latin-1; empty if none came)."""
    s.settimeout(limit)
    buf = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
    except OSError:
        pass
    return buf.decode("latin-1")

def send_body(body, limit=120):
    s = conn()
    try:
        s.sendall(head(b"/v1/chat/completions", len(body)))
        try:
            view = memoryview(body)
            for i in range(0, len(body), 1 << 20):
                s.sendall(view[i:i + (1 << 20)])
        except OSError:
            pass  # the server may close early (413): read what it said
        return answer(s, limit)
    finally:
        s.close()

def big(mb):
    content = "word " * (mb * (1 << 20) // 5)
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()

def call_full(body, limit=300):
    """Status line and error code of one request with ``body`` (the whole answer is read)."""
    s = conn(limit)
    try:
        s.sendall(head(b"/v1/chat/completions", len(body)))
        s.sendall(body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = s.recv(65536)
            if not d:
                return "closed"
            buf += d
        top, rest = buf.split(b"\r\n\r\n", 1)
        n = [int(l.split(b":")[1]) for l in top.split(b"\r\n") if l.lower().startswith(b"content-length:")]
        while n and len(rest) < n[0]:
            d = s.recv(65536)
            if not d:
                break
            rest += d
        try:
            code = json.loads(rest)["error"]["code"]
        except Exception:
            code = None
        return top.split(b"\r\n", 1)[0].decode("latin-1") + " " + str(code)
    except OSError as e:
        return "closed " + type(e).__name__
    finally:
        s.close()

if mode.startswith("fit"):  # n concurrent valid requests of ~400 KB of text each (they fit a 128k window)
    import threading
    out = []
    def one(i):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": ("alpha ", "beta ")[i % 2] * 80000}],
                           "max_tokens": 4}).encode()
        out.append(call_full(body))
    ts = [threading.Thread(target=one, args=(i,)) for i in range(int(mode[3:]))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for st in out:
        print("ANSWER", st)
        if " 200 " not in st:
            refused.append(st)
elif mode.startswith("ctx8x"):  # n requests of 8 MB of text, within the body and content bounds of a large window
    for i in range(int(mode[5:])):
        t = time.monotonic()
        st = call_full(big(8))
        print("ANSWER", st, round(time.monotonic() - t, 1))
        if " 400 " in st or " 413 " in st or " 429 " in st:
            refused.append(st)
elif mode in ("big8", "big60"):
    st = send_body(big(8 if mode == "big8" else 60))
    print("ANSWER", st)
    if " 413 " in st or " 400 " in st:
        refused.append(st)
elif mode == "nested":
    body = b'{"model": "m", "messages": ' + b"[" * 200000 + b"]" * 200000 + b"}"
    st = send_body(body)
    print("ANSWER", st)
    if " 400 " in st:
        refused.append(st)
elif mode == "conns":
    held, failed = [], 0
    for i in range(10000):
        try:
            held.append(conn(timeout=5))
        except OSError:
            failed += 1
            if failed > 200:
                break
    print("OPENED", len(held), "FAILED", failed)
    time.sleep(3)
    closed = 0
    for s in held:
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    print("CLOSED_BY_SERVER", closed)
    if closed:
        refused.append("%d connections closed" % closed)
    for s in held:
        s.close()
elif mode == "slow":
    # slowloris headers, a body that never completes, HTTP/0.9, a 2 MiB header line, HTTP/7.0, Upgrade + body
    t0 = time.monotonic()
    a = conn(); a.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    b = conn(); b.sendall(head(b"/v1/chat/completions", 10 ** 9) + b'{"model"')
    c = conn(); c.sendall(b"GET /v1/models\r\n")
    d = conn()
    try:
        d.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 << 20) + b"\r\n\r\n")
    except OSError:
        pass
    e = conn(); e.sendall(b"GET /v1/models HTTP/7.0\r\nHost: x\r\n\r\n")
    # a body behind an Upgrade head (llhttp would hand it to the new protocol, the app get it empty)
    f = conn(); f.sendall(head(b"/v1/chat/completions", 7, b"Connection: Upgrade\r\nUpgrade: h2c\r\n") + b'{"a":1}')
    for name, s in (("headers", a), ("body", b), ("http09", c), ("bigheader", d), ("version", e), ("upgrade", f)):
        if name == "upgrade":  # which refusal: an empty body would be refused too, as bad JSON
            whole = whole_reply(s, 90)
            code = re.search(r'"code":\s*"(\w+)"', whole)
            st = (whole.split("\r\n", 1)[0] or "closed") + " code=" + (code.group(1) if code else "?")
        else:
            st = answer(s, 90)
        print("ANSWER", name, st, round(time.monotonic() - t0, 1))
        if st != "timeout":
            refused.append(name + " " + st)
        s.close()
elif mode == "noread":
    socks = []
    for i in range(64):
        try:
            s = conn()
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 1000}],
                               "max_tokens": 64, "logprobs": True}).encode()
            s.sendall(head(b"/v1/chat/completions", len(body)) + body)
            socks.append(s)
        except OSError:
            refused.append("connect %d" % i)
    time.sleep(15)  # never read
    for s in socks:
        s.close()
    refused.append("held %d unread" % len(socks))
print("END %.3f" % time.time())
print("REFUSED", json.dumps(refused))
sys.exit(3 if refused else 0)
'''
