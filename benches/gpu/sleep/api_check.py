"""The Python side of sleep and wake without a GPU or PyTorch: every misuse the Python layer
sees itself raises a clear ValueError, TypeError or SleepError before reaching the library;
what it passes to the library comes back as a SleepError carrying the library's one-line
message (on a machine without a driver, that the driver is missing); the signal handlers of
`streamalloc run --sleep-signals` report failures in one line and never raise.

    PYTHONPATH=python STREAMALLOC_LIB=target/release/libstreamalloc.so python3 benches/gpu/sleep/api_check.py

Prints one line per check and "api_check: ok" last; exits 1 on the first failure.
"""

import io
import os
import signal
import sys
import time

import streamalloc._sleep as sleep_module
import streamalloc.torch as st

checks = 0


def expect(exc_type, needle, fn, *args, **kwargs):
    global checks
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        text = str(err)
        if needle not in text or "\n" in text:
            sys.exit(f"api_check: {fn.__name__}{args}: {needle!r} not in one-line {text!r}")
        checks += 1
        print(f"ok  {fn.__name__}{args}{kwargs or ''} -> {exc_type.__name__}: {text}")
        return text
    sys.exit(f"api_check: {fn.__name__}{args} did not raise {exc_type.__name__}")


# Arguments the Python layer refuses itself, before any library call.
expect(ValueError, "backup must be one of 'none', 'cpu', not 'gpu'", st.sleep, ["kv"], backup="gpu")
expect(ValueError, "no tags given", st.sleep, [])
expect(ValueError, "no tags given", st.wake, ())
expect(ValueError, "invalid tag ''", st.sleep, [""])
expect(ValueError, "invalid tag 'a\\x00b'", st.wake, ["a\0b"])
expect(ValueError, "1 to 256 bytes", st.sleep, ["x" * 257])
expect(TypeError, "a tag is a str, not int", st.sleep, [1])
expect(TypeError, "tags must be a str or an iterable of str, not NoneType", st.wake, None)
expect(TypeError, "a tag is a str, not bytes", st.release_host_backup, [b"kv"])
# Not installed: every call says what to do.
for call in (lambda: st.sleep("kv"), lambda: st.wake("kv"), lambda: st.tags(),
             lambda: st.release_host_backup("kv")):
    expect(st.SleepError, "call streamalloc.torch.install() first", call)
with_region = lambda: st.region("kv").__enter__()  # noqa: E731
expect(st.SleepError, "call streamalloc.torch.install() first", with_region)

# Past the Python checks, the library answers; its message becomes the SleepError's.
sleep_module._installed = lambda: True
sleep_module._device = lambda device: 0
for call in (lambda: st.sleep(["kv_cache", "weights"], backup="cpu"), lambda: st.wake("kv_cache"),
             lambda: st.tags(), lambda: st.release_host_backup(["kv_cache"])):
    text = expect(st.SleepError, "streamalloc: device 0: ", call)
    if not os.path.exists("/dev/nvidiactl") and "libcuda" not in text:
        sys.exit(f"api_check: without a driver the library should say so, not {text!r}")

# The signal handlers: a failure is one line on stderr, the program goes on.
expect(ValueError, "backup must be one of", sleep_module.install_signal_handlers, backup="host")
sleep_module._pools[(0, "kv_cache")] = object()  # as if a region had been made
captured = io.StringIO()
real_stderr, sys.stderr = sys.stderr, captured
try:
    sleep_module.install_signal_handlers(backup="cpu")
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.05)  # the handlers run between statements
finally:
    sys.stderr = real_stderr
lines = captured.getvalue().splitlines()
if len(lines) != 2 or not all(line.startswith("streamalloc: ") and "failed" in line for line in lines):
    sys.exit(f"api_check: signal handlers said {lines!r}")
checks += 1
print(f"ok  signals -> {lines[0]}")
print(f"api_check: ok ({checks} checks)")
