#!/usr/bin/env python3
"""Measures how long `streamalloc view FILE` takes to serve the page's data, and its peak
memory: the time from starting the command to the last byte of `/api/data?f=0&d=0`, and
the maximum resident set size `/usr/bin/time -v` reports once the viewer is stopped.

    python3 benches/snapshots/measure_view.py [--bin target/release/streamalloc] FILE...

Prints one row per file: events, seconds to data, peak RSS in MiB. Large inputs come from
benches/snapshots/large_snapshot.py.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time


def get(port, path):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        chunks = []
        while True:
            data = s.recv(1 << 20)
            if not data:
                break
            chunks.append(data)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


def measure(binary, path):
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        started = time.monotonic()
        proc = subprocess.Popen(
            ["/usr/bin/time", "-v", "-o", report.name, binary, "view", path, "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if not match:
            proc.wait()
            sys.exit(f"{path}: the viewer did not start: {proc.stderr.read().strip()}")
        port = int(match.group(1))
        status, blob = get(port, "/api/data?f=0&d=0")
        seconds = time.monotonic() - started
        _, files = get(port, "/api/files")
        events = sum(d["events"] for d in json.loads(files)[0]["devices"])
        # /usr/bin/time reports when its child ends: stop the viewer, not time.
        viewer = int(subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()[0])
        os.kill(viewer, signal.SIGTERM)
        proc.wait()
        rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                                open(report.name).read()).group(1))
    if not status.endswith("200 OK"):
        sys.exit(f"{path}: /api/data answered {status}")
    return events, seconds, rss_kib / 1024, len(blob)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/streamalloc")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    print(f"{'file':40} {'events':>10} {'to data (s)':>12} {'peak RSS (MiB)':>15}")
    for path in args.files:
        events, seconds, rss, _ = measure(args.bin, path)
        print(f"{os.path.basename(path):40} {events:>10} {seconds:>12.2f} {rss:>15.0f}")


if __name__ == "__main__":
    main()
