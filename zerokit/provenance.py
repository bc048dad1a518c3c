"""Where a results file's numbers came from: command, date, git commit, machine and versions.

Every file under benchmarks/results carries this record, so a figure can be traced to the
code that produced it; `zerokit timeline` writes it too. The benchmark scripts put `provenance(...)` into their JSON and
`provenance_lines(...)` into their Markdown. Commands that are not benchmark scripts (the
demo, `zerokit formats --underflow`) are recorded as transcripts:

    python -m zerokit.provenance record benchmarks/results/demo.txt -- scripts/demo.sh
    python -m zerokit.provenance record benchmarks/results/underflow.txt -- python -m zerokit formats --underflow

writes the provenance as `#` lines, then the command's output (stdout and stderr, progress
bars reduced to their final state), and exits with the command's status.

The commit is `git rev-parse HEAD` of this checkout, with "-dirty" appended when
`git status --porcelain` lists anything (modified, staged or untracked files, ignored ones
excepted): the numbers then came from code that no commit holds exactly.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPO) -> str:
    """HEAD's full hash, "-dirty" appended if the work tree differs from it; "unknown" outside a git checkout.

    Outside a checkout (a copy of the tree without .git, as scripts/gpu_check.sh may run on), the
    environment variable ZEROKIT_GIT_COMMIT, when set by whoever made the copy, is reported instead,
    marked as given rather than read.
    """
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        given = os.environ.get("ZEROKIT_GIT_COMMIT", "").strip()
        return f"{given} (given by ZEROKIT_GIT_COMMIT: no git checkout where this ran)" if given else "unknown"
    return head + ("-dirty" if status.strip() else "")


def machine() -> dict:
    """Host, OS, CPU model and count, GPUs (names; empty without CUDA), load average at the start."""
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    info = {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpu_model": cpu_model or platform.processor() or None, "cpu_count": os.cpu_count(), "gpus": [],
            # other work on the machine when the run started (timings on a busy machine are slower)
            "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    try:
        import torch
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def versions() -> dict:
    """Python, torch (with its CUDA build, if any) and numpy versions."""
    out = {"python": platform.python_version()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
    except ImportError:
        out["torch"] = None
    try:
        import numpy
        out["numpy"] = numpy.__version__
    except ImportError:
        pass
    return out


def command_line(script: str | Path, argv: list[str] | None = None) -> str:
    """`python <script relative to the repository root> <args>`: the command to rerun, from the root."""
    args = sys.argv[1:] if argv is None else list(argv)
    path = Path(script).resolve()
    try:
        shown = str(path.relative_to(REPO))
    except ValueError:
        shown = str(path)
    return " ".join(shlex.quote(a) for a in ["python", shown, *args])


def provenance(command: str) -> dict:
    """The record every results file carries: command, date (UTC), commit, machine, versions."""
    return {"command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine(), "versions": versions()}


def provenance_lines(record: dict, prefix: str = "- ") -> list[str]:
    """The same record as short text lines (Markdown bullets by default, `# ` for transcripts)."""
    m, v = record["machine"], record["versions"]
    hw = f"{m['cpu_model'] or 'unknown CPU'}, {m['cpu_count']} CPUs" + (f", GPUs: {', '.join(m['gpus'])}"
                                                                       if m["gpus"] else "")
    ver = ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)
    return [f"{prefix}command (from the repository root): `{record['command']}`", f"{prefix}date: {record['date']}",
            f"{prefix}commit: {record['commit']}",
            f"{prefix}machine: {hw}; {m['platform']} ({m['hostname']}); load average {m['load_average_1min']}",
            f"{prefix}versions: {ver}"]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def write_pair(out: Path, result: dict, markdown: str) -> None:
    """Write a benchmark's results as `out`.json (the record, provenance included) and `out`.md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown)
    print(f"wrote {out}.json and .md")


def clean_transcript(text: str) -> str:
    """Keep what a terminal would finally show: the last carriage-return segment of each line, no colour codes."""
    lines = []
    for line in _ANSI.sub("", text).split("\n"):
        segments = [s for s in line.split("\r") if s.strip()]
        lines.append(segments[-1].rstrip() if segments else "")
    return "\n".join(lines).rstrip("\n") + "\n"


def record(out: Path, command: list[str]) -> int:
    """Run `command` from the repository root; write provenance + its cleaned output to `out`."""
    prov = provenance(" ".join(shlex.quote(c) for c in command))
    # Bytes, decoded here: text mode's universal newlines would turn every progress-bar "\r" into a line.
    done = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    body = clean_transcript(done.stdout.decode("utf-8", errors="replace"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(provenance_lines(prov, prefix="# ")) + f"\n# exit status: {done.returncode}\n\n" + body)
    sys.stdout.write(body)
    print(f"wrote {out}")
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="run a command and save its output with provenance")
    rec.add_argument("out", type=Path, help="transcript to write, e.g. benchmarks/results/demo.txt")
    rec.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    sub.add_parser("show", help="print this checkout's provenance record")
    args = p.parse_args(argv)
    if args.action == "show":
        print("\n".join(provenance_lines(provenance("python -m zerokit.provenance show"))))
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("record needs a command after --")
    return record(args.out, cmd)


if __name__ == "__main__":
    sys.exit(main())
