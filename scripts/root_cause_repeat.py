"""How often `run_ranks` names the root cause: the signal cases of tests/distributed/test_root_cause.py
(4 ranks, stage 3, rank 2 killed inside backward by SIGSEGV or SIGKILL), N times each (default 20),
with TORCH_DISTRIBUTED_DEBUG=OFF and DETAIL. Counts the runs whose report starts with rank 2 and the
signal (and, for SIGSEGV, faulthandler's Python stack in rank 2's part).

    python scripts/root_cause_repeat.py 20
"""
import os
import re
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "tests"), os.path.join(_HERE, "..", "tests", "distributed")]
from test_root_cause import _rank2_fails_in_stage3_backward
from zerokit.launch import RankFailed, run_ranks


if __name__ == '__main__':
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    for debug in ("OFF", "DETAIL"):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
        for how in ("SIGSEGV", "SIGKILL"):
            good, secs, bad = 0, [], []
            for i in range(N):
                t = time.monotonic()
                try:
                    run_ranks(_rank2_fails_in_stage3_backward, 4, how, timeout_s=120)
                    bad.append("no failure")
                    continue
                except RankFailed as e:
                    exc, text = e, str(e)
                secs.append(time.monotonic() - t)
                first = re.split(r"\n(?=rank \d of 4 )", text)[0]
                ok = exc.rank == 2 and first.startswith(f"rank 2 of 4 died by signal {how} without a report")
                if how == "SIGSEGV":
                    ok = ok and "Fatal Python error: Segmentation fault" in first and " in hook" in first
                good += ok
                if not ok:
                    bad.append(text[:300])
            print(f"DEBUG={debug} {how}: named correctly {good} of {N}; seconds per run min {min(secs):.1f} "
                  f"max {max(secs):.1f}", flush=True)
            for b in bad:
                print("   BAD:", b, flush=True)
