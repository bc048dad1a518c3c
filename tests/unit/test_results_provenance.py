"""zerokit/provenance.py: every results file can say which command, date, commit, machine and versions made it."""
import json
import re
import sys

from zerokit import provenance as _results

COMMIT = re.compile(r"^([0-9a-f]{40}(-dirty)?|unknown)$")


def test_commit_is_head_with_a_dirty_flag_or_unknown_outside_git(tmp_path, monkeypatch):
    """git_commit() is a full hash, "-dirty" when the tree differs from it; "unknown" where there is no checkout."""
    monkeypatch.delenv("ZEROKIT_GIT_COMMIT", raising=False)
    assert COMMIT.match(_results.git_commit()), _results.git_commit()
    assert _results.git_commit(tmp_path) == "unknown"


def test_a_copy_without_git_reports_the_commit_it_was_given_as_given(tmp_path, monkeypatch):
    """Outside a checkout ZEROKIT_GIT_COMMIT is reported, marked as given; inside one, git's answer wins."""
    monkeypatch.setenv("ZEROKIT_GIT_COMMIT", "0123abc-dirty")
    given = _results.git_commit(tmp_path)
    assert given == "0123abc-dirty (given by ZEROKIT_GIT_COMMIT: no git checkout where this ran)"
    assert COMMIT.match(_results.git_commit()), _results.git_commit()


def test_provenance_has_command_date_commit_machine_and_versions():
    """The record carries all five, and its text lines show each of them."""
    record = _results.provenance("python benchmarks/x.py --flag")
    assert set(record) == {"command", "date", "commit", "machine", "versions"}
    assert record["versions"]["torch"] and record["versions"]["python"] and record["machine"]["cpu_count"]
    json.dumps(record)  # results files are JSON
    text = "\n".join(_results.provenance_lines(record))
    for needle in ("python benchmarks/x.py --flag", record["date"], record["commit"], "torch"):
        assert needle in text


def test_transcript_keeps_what_a_terminal_finally_shows():
    """Progress bars redrawn with carriage returns keep only their last state; colour codes go."""
    raw = "step 1/3\rstep 2/3\rstep 3/3 done\n\x1b[32mloss 2.68\x1b[0m\n"
    assert _results.clean_transcript(raw) == "step 3/3 done\nloss 2.68\n"


def test_record_writes_provenance_then_output_and_returns_the_status(tmp_path):
    """`record OUT -- cmd`: '#' provenance lines, the exit status, then the command's output; its status is returned."""
    out = tmp_path / "t.txt"
    script = "import sys; sys.stdout.write('step 1\\rstep 2\\n'); print('hello'); raise SystemExit(3)"
    status = _results.main(["record", str(out), "--", sys.executable, "-c", script])
    assert status == 3
    text = out.read_text()
    header, body = text.split("\n\n", 1)
    assert all(line.startswith("# ") for line in header.splitlines())
    for key in ("command", "date", "commit", "machine", "versions", "exit status: 3"):
        assert key in header, key
    assert body == "step 2\nhello\n"


def test_write_pair_writes_the_record_and_its_markdown(tmp_path):
    """zerokit/provenance.write_pair: out.json holds the record as written, out.md the markdown, folders made."""
    out = tmp_path / "nested" / "cost"
    _results.write_pair(out, {"command": "python x.py", "rows": [1, 2]}, "# title\n")
    assert json.loads(out.with_suffix(".json").read_text()) == {"command": "python x.py", "rows": [1, 2]}
    assert out.with_suffix(".md").read_text() == "# title\n"
