# Unit checks of caps.py's search for the lowest cap, no GPU, no torch: launches are
# scripted (each returns what a worker would have written), so the bisection's decisions
# can be read off.
#   1. overran_cap: a rank's last out-of-memory whose live bytes plus request exceed the
#      limit is the program's; one within the limit, a rank with none, a missing or broken
#      file are not;
#   2. a probe that fails by the program's own need is launched once more, for either
#      allocator: trains on the second launch -> the cap trains, and the table names it;
#   3. a probe that fails within the limit (the allocator's failure) is not launched again,
#      and neither is one that the program overruns twice (CAPS_RETRY=1), nor one whose
#      second launch fails within the limit; the table counts the launches overrun;
#   4. CAPS_RETRY=0 launches nothing again.
#   python3 benches/gpu/dist/caps_unit_check.py
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import caps  # noqa: E402

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


MIB = 1 << 20


def write(path, seen):
    with open(path, "w") as f:
        json.dump({"rank": 0, "error": "OutOfMemoryError: CUDA out of memory", "oom_seen": seen}, f)


# 1. overran_cap
with tempfile.TemporaryDirectory() as tmp:
    over = os.path.join(tmp, "over.json")
    write(over, {"request": 785 * MIB, "allocated": 8070 * MIB, "limit": 8853 * MIB, "count": 1})
    within = os.path.join(tmp, "within.json")
    write(within, {"request": 785 * MIB, "allocated": 7000 * MIB, "limit": 8853 * MIB, "count": 3})
    none = os.path.join(tmp, "none.json")
    write(none, None)
    broken = os.path.join(tmp, "broken.json")
    with open(broken, "w") as f:
        f.write("{")
    missing = os.path.join(tmp, "missing.json")
    check(caps.overran_cap([over]) == {"request": 785 * MIB, "allocated": 8070 * MIB,
                                       "limit": 8853 * MIB, "count": 1}, "live + request > limit is the program's")
    check(caps.overran_cap([within]) is None, "a request that fit the limit is the allocator's failure")
    check(caps.overran_cap([none, missing, broken]) is None, "no rank noted an out-of-memory")
    check(caps.overran_cap([within, missing, over]) is not None, "any rank's overrun counts")


class ScriptedRunner:
    """caps.Runner's launch, answered from `script`: per (column, cap) a list of outcomes,
    one per launch: 'ok', 'oom' (the allocator's) or 'over' (the program's own need)."""

    def __init__(self, script):
        self.script = {key: list(outcomes) for key, outcomes in script.items()}
        self.caps, self.first_cap = caps.caps_for("fraction")
        self.overran = {}
        self.launched = []

    def launch(self, row, col, name, gpus, extra_env=None):
        cap = float(extra_env["DIST_CAP_RATIO"])
        self.launched.append((col, round(cap, 3)))
        outcomes = self.script.get((col, round(cap, 3)), ["ok"])
        outcome = outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]
        if outcome == "ok":
            return [{"rank": 0, "step_ms_median": 10.0, "peaks_bytes": {"whole": {"reserved": 1}}}], None, False, 1.0
        if outcome == "over":
            self.overran[name] = {"request": 2, "allocated": 9, "limit": 10, "count": 1}
        return None, "fail: rank 0: OutOfMemoryError: out of memory", True, 1.0

    def checkpoint(self):
        pass


def search(script, col="sa", retry=None):
    if retry is None:
        os.environ.pop("CAPS_RETRY", None)
    else:
        os.environ["CAPS_RETRY"] = str(retry)
    os.environ["CAPS_PROBES"] = "4"
    runner = ScriptedRunner(script)
    result = {"uncapped": {col: [{"outside": 0}]}}
    caps.lowest_cap(runner, "ddp_gpt2", col, "0", 1000, result)
    return runner, result["caps"][col]


# 2. the program's overrun at 1.000 the first time only: launched again, and it trains.
#    Bisection from 1.020: 1.020 ok, 1.005 ok, 1.000 over then ok.
for col in ("sa", "pt_expandable"):
    runner, found = search({(col, 1.0): ["over", "ok"]}, col)
    check(found["lowest"] == 1.0, f"{col}: trains at 1.000 on the second launch (lowest {found['lowest']})")
    check(runner.launched.count((col, 1.0)) == 2, f"{col}: 1.000 launched twice ({runner.launched})")
    check(found["probes"][1.0].get("program_overran"), f"{col}: the overrun is recorded")
    check("at 1.000 in 1 of 2 launches" in caps.cap_text(found), f"{col}: the table names it: {caps.cap_text(found)}")

# 3. the allocator's failure at 1.000: one launch, the lowest cap 1.005, nothing named.
runner, found = search({("sa", 1.0): ["oom"]})
check(found["lowest"] == 1.005 and found["exact"], f"the allocator's failure stands (lowest {found['lowest']})")
check(runner.launched.count(("sa", 1.0)) == 1, f"the allocator's failure is not launched again ({runner.launched})")
check(caps.cap_text(found) == "1.005", f"nothing named: {caps.cap_text(found)}")
#    the program overruns both launches: failed, named, launched exactly twice.
runner, found = search({("sa", 1.0): ["over", "over"]})
check(found["lowest"] == 1.005, f"overrun twice: 1.000 fails (lowest {found['lowest']})")
check(runner.launched.count(("sa", 1.0)) == 2, f"launched twice, not more ({runner.launched})")
check(len(found["probes"][1.0].get("program_overran") or []) == 2, "both overruns recorded")
check("at 1.000 in 2 of 2 launches" in caps.cap_text(found), f"named: {caps.cap_text(found)}")

#    the program overruns the first launch, the allocator fails the second: 1 of 2 named.
runner, found = search({("sa", 1.0): ["over", "oom"]})
check(found["lowest"] == 1.005 and runner.launched.count(("sa", 1.0)) == 2,
      f"an allocator failure after an overrun fails the cap ({runner.launched})")
check("at 1.000 in 1 of 2 launches" in caps.cap_text(found), f"named: {caps.cap_text(found)}")

# 4. CAPS_RETRY=0: the overrun fails the cap at once.
runner, found = search({("sa", 1.0): ["over", "ok"]}, retry=0)
check(found["lowest"] == 1.005 and runner.launched.count(("sa", 1.0)) == 1,
      f"CAPS_RETRY=0 launches once ({runner.launched}, lowest {found['lowest']})")

if failures:
    print(f"caps_unit_check: {len(failures)} failed")
    sys.exit(1)
print("caps_unit_check: all passed")
