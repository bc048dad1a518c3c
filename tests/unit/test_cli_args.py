"""The command line refuses out-of-range numbers in argparse (exit 2, the valid range in the message) and
reports a user mistake as one line on stderr (exit 1), the traceback only with --verbose or ZEROKIT_VERBOSE."""
import argparse

import pytest

from zerokit.cli import float_in_range, int_in_range, main

# (argv, the option argparse must name, a fragment of the range it must state)
REFUSED = [
    (["train", "--steps", "0"], "--steps", ">= 1"),
    (["train", "--accumulate", "0"], "--accumulate", ">= 1"),
    (["train", "--batch-size", "0"], "--batch-size", ">= 1"),
    (["train", "--nproc", "0"], "--nproc", ">= 1"),
    (["train", "--nproc", "-2"], "--nproc", ">= 1"),
    (["train", "--bucket-numel", "0"], "--bucket-numel", ">= 1"),
    (["train", "--prefetch", "-1"], "--prefetch", ">= 0"),
    (["train", "--clip", "-1"], "--clip", ">= 0"),
    (["train", "--lr", "nan"], "--lr", ">= 0"),
    (["train", "--timeout", "0"], "--timeout", "> 0"),
    (["train", "--steps", "ten"], "--steps", "integer"),
    (["compare", "--stages", "7"], "--stages", "between 0 and 3"),
    (["compare", "--stages", "0,4"], "--stages", "between 0 and 3"),
    (["compare", "--stages", "x"], "--stages", "comma-separated"),
    (["compare", "--nproc", "0"], "--nproc", ">= 1"),
    (["compare", "--steps", "0"], "--steps", ">= 1"),
    (["compare", "--batch-size", "-1"], "--batch-size", ">= 1"),
    (["compare", "--timeout", "-5"], "--timeout", "> 0"),
    (["memory", "--params", "1e9", "--world-size", "0"], "--world-size", ">= 1"),
    (["memory", "--model", "tiny", "--world-size", "2", "--seq-len", "0"], "--seq-len", ">= 1"),
    (["memory", "--params", "1e9", "--world-size", "8", "--shard-group-size", "0"], "--shard-group-size", ">= 1"),
    (["plan", "--params", "1e9", "--gpus", "0", "--gpu-memory", "80"], "--gpus", ">= 1"),
    (["plan", "--params", "1e9", "--gpus", "8", "--gpu-memory", "80", "--batch-size", "0"], "--batch-size", ">= 1"),
    (["plan", "--params", "1e9", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "-3"], "--seq-len", ">= 1"),
    (["plan", "--params", "1e9", "--gpus", "8", "--nodes", "0", "--gpu-memory", "80"], "--nodes", ">= 1"),
    (["explain", "--model", "tiny", "--world-size", "0", "--stage", "1"], "--world-size", ">= 1"),
    (["explain", "--model", "tiny", "--world-size", "2", "--stage", "1", "--bucket-numel", "0"], "--bucket-numel",
     ">= 1"),
    (["formats", "--underflow", "--steps", "0"], "--steps", ">= 1"),
    (["formats", "--underflow", "--batch-size", "0"], "--batch-size", ">= 1"),
]


@pytest.mark.parametrize("argv, option, valid", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_out_of_range_numbers_are_refused_by_argparse_with_the_valid_range(capsys, argv, option, valid):
    """Each out-of-range number exits 2 before anything runs, naming the option and the valid range."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and valid in err, err


def test_range_types_accept_the_bounds_and_name_the_range():
    """int_in_range / float_in_range accept their bounds and describe the range in the error."""
    assert int_in_range(1)("1") == 1
    assert int_in_range(0, 3)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="between 0 and 3, got 4"):
        int_in_range(0, 3)("4")
    assert float_in_range(0.0)("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
        float_in_range(0.0, low_open=True)("0")
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        float_in_range(0.0)("inf")


def test_compare_stages_parse_in_order_once_each():
    """--stages 3,0,3 runs stage 3 then stage 0."""
    from zerokit.commands.compare import stage_list
    assert stage_list("3,0,3") == [3, 0]
    assert stage_list(" 1 , 2 ") == [1, 2]


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--model", "nosuch", "--nproc", "2"], "unknown --model 'nosuch'"),
    (["train", "--model", "tiny", "--resume", "/nonexistent/ckpt"], "--resume /nonexistent/ckpt: no such directory"),
    (["train", "--model", "tiny", "--save-every", "2"], "--save-every K commits a checkpoint into --save DIR"),
    (["train", "--model", "tiny", "--resume", "auto"], "--resume auto resumes from --save DIR"),
    (["compare", "--model", "nosuch"], "unknown --model 'nosuch'"),
])
def test_a_user_mistake_is_one_line_on_stderr_before_any_rank_starts(capsys, monkeypatch, argv, fragment):
    """An unknown model or a missing --resume directory: exit 1, one line naming it, no traceback, no spawn."""
    import zerokit.launch

    def no_spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned for a mistake the parent can see")
    monkeypatch.setattr(zerokit.launch, "run_ranks", no_spawn)
    monkeypatch.delenv("ZEROKIT_VERBOSE", raising=False)
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith(f"zerokit {argv[0]}: error"), captured.err
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_verbose_prints_the_traceback(capsys, monkeypatch, how):
    """--verbose or ZEROKIT_VERBOSE=1 turns the one line into the full traceback."""
    argv = ["train", "--model", "nosuch"]
    if how == "flag":
        argv.append("--verbose")
    else:
        monkeypatch.setenv("ZEROKIT_VERBOSE", "1")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "unknown --model 'nosuch'" in err, err
