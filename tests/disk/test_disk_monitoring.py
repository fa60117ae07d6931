"""Free space is visible (issue 17.3): `rolloutd doctor` reports it where sandboxes, images and
the journal live and warns below sandbox.disk_low_mb; init publishes node.disk / node.disk_low;
the exporter exposes rolloutd_disk_free_bytes."""
from __future__ import annotations

import json
import subprocess
import sys

import zmq
from rolloutd.bus import codec
from rolloutd.sandbox.doctor import disk_checks

from tests.disk.fs import Filler, free_bytes, small_tmpfs
from tests.ops.helpers import free_port, wait_for
from tests.ops.test_exporter import scrape, series


def test_doctor_disk_checks_warn_below_the_threshold():
    with small_tmpfs(8 * 1024) as fs:
        checks = {c.name: c for c in disk_checks({"sandboxes": fs / "sb", "images": None, "journal": fs / "j.db"}, 4)}
        assert checks["disk_free_sandboxes"].ok and str(fs) in checks["disk_free_sandboxes"].detail
        assert checks["disk_free_images"].ok and checks["disk_free_images"].detail == "not configured"
        filler = Filler(fs)
        filler.fill()
        low = {c.name: c for c in disk_checks({"sandboxes": fs / "sb", "journal": fs / "j.db"}, 4)}
        assert not low["disk_free_sandboxes"].ok and low["disk_free_sandboxes"].optional  # a warning
        assert "disk low" in low["disk_free_journal"].detail
        filler.release()


def test_doctor_cli_reports_free_space(tmp_path):
    with small_tmpfs(8 * 1024) as fs:
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[sandbox]\nroot_dir = "{fs}/sb"\ndisk_low_mb = 64\n[gateway]\njournal = "{fs}/j.db"\n')
        r = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "doctor", "--quick", "--json", "--config",
                            str(cfg), "--images-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
        checks = {c["name"]: c for c in json.loads(r.stdout)}
        for what in ("sandboxes", "journal"):
            assert not checks[f"disk_free_{what}"]["ok"], checks  # 8 MB < 64 MB
            assert "below 64 MB" in checks[f"disk_free_{what}"]["detail"]
        assert checks["disk_free_images"]["ok"] and str(tmp_path) in checks["disk_free_images"]["detail"]


def test_node_disk_low_event_and_exporter_free_bytes(up_factory):
    with small_tmpfs(8 * 1024) as fs:
        ctx = zmq.Context.instance()
        up = up_factory(f"sandbox.root_dir={fs}/sb", "sandbox.disk_low_mb=64", f"gateway.journal={fs}/j.db",
                        "daemon.heartbeat_s=0.3", ready=False)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"node.disk_low")
        sub.connect(up.events)
        up.wait_ready()
        port = free_port()
        exp = subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", "exporter", "--port", str(port),
                                "--events", up.events], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert sub.poll(30_000), "no node.disk_low event within 30 s\n" + up.log()[-2000:]
            topic, body = sub.recv_multipart()
            ev = codec.unpack(body)
            assert topic == b"node.disk_low" and ev["what"] == "sandboxes"
            assert ev["threshold_bytes"] == 64 * 2**20 and 0 < ev["free_bytes"] <= 8 * 2**20

            def exported():
                try:
                    m = series(scrape(port), "rolloutd_disk_free_bytes")
                except OSError:
                    return None
                whats = {dict(lbl)["what"]: v for lbl, v in m.items()}
                return whats if {"sandboxes", "journal"} <= set(whats) else None

            whats = wait_for(exported, 30, "rolloutd_disk_free_bytes for sandboxes and journal", 0.3)
            now = free_bytes(fs)
            for v in whats.values():  # both live on the 8 MB tmpfs
                assert 0 < v <= 8 * 2**20 and abs(v - now) < 2 * 2**20
        finally:
            sub.close()
            exp.terminate()
            exp.wait(10)
            up.stop()
