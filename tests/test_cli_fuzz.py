"""The ``hicache`` command never shows a traceback (issue 57): every subcommand, every option, every setting.

The subcommands and their options are read from the command's own parser (:func:`hicache_core.cli.build_parser`),
so a new one is fuzzed without a word here (and :func:`test_every_command_has_a_base_invocation` asks for the
valid invocation its bad values are put into). Each option gets every value of :data:`BAD` (numbers that make no
sense, text, URLs, files that are not what it takes), each positional likewise, and each declared ``HICACHE_*``
setting (from the settings registry) the values it refuses, under a few light commands. Every case must end in:

* no ``Traceback`` on stdout or stderr, and no ``internal error`` (the command's last-resort line for a bug);
* an exit status of 0, 1 (the answer is no, or what was asked about failed) or 2 (bad usage);
* a non-zero status with a message on stderr of at most two lines, starting ``hicache ...``; for 2, nothing on
  stdout and a first line that names the option, the value or the variable.

The cases run in this process through :func:`hicache_core.cli.main` with stdout and stderr captured (a process
each would cost CI minutes of torch's import). The runners of ``demo``, ``bench`` and ``calibrate`` do GPU-scale
work, so they are replaced by a stub that records its call: what is tested of them is that the command refuses
every bad value before it calls them (and the stub checks the numbers it is given). A few cases are real
processes: ``--version``, stdout closed before the command writes, and a bad setting.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from hicache_core import cli
from hicache_core.plugins.registry import reset_registry
from hicache_core.plugins.versions import CORE_VERSION
from hicache_core.settings import SettingError
from hicache_core.settings.registry import declared
from hicache_core.storage.url import redact_url

ROOT = Path(__file__).resolve().parents[1]

#: Values no option should turn into a traceback: numbers that make no sense, text, URLs; ``{name}`` is a file
#: or folder made by :func:`files`.
BAD = ["-1", "0", "-0.5", "1.5", "nan", "inf", "-inf", "1e400", "99999999999999999999", "0x10", "", " ", "abc",
       ",", "a,,b", "-", "nul\x00byte", "ftp://x", "file://relative/x", "file:///nonexistent/hicache-fuzz",
       "{list}", "{string}", "{number}", "{not_json}", "{not_utf8}", "{missing}", "{folder}"]  # fmt: skip
#: More values for a URL (a positional ``url``, ``--storage``): schemes, hosts and options nothing serves.
BAD_URLS = ["memory://", "://x", "file://", "file://{file_url}", "file://{folder}?o_direct=banana",
            "file://{folder}?bogus=1", "file://user:pw@{folder}", "redis://127.0.0.1:1/0?timeout=1",
            "mooncake://127.0.0.1:1", "s3://", "peer://127.0.0.1:1/0?timeout=1&insecure=1"]  # fmt: skip

#: The runners that do GPU-scale work (module, function): replaced by a stub.
HEAVY = [
    ("hicache_core.tools.demo", "run_demo"),
    ("hicache_core.tools.storage_demo", "run_storage_demo"),
    ("hicache_core.tools.bench.sweep", "run_bench"),
    ("hicache_core.tools.bench.cpu", "run_cpu_bench"),
    ("hicache_core.tools.bench.overlap_command", "run_overlap"),
    ("hicache_core.tools.bench.storage", "run_storage_bench"),
    ("hicache_core.tools.calibrate", "run_calibrate"),
]


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf subcommand of ``parser`` (``("storage", "check")``), with its parser."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(commands(sub, (*path, name)) or {(*path, name): sub})
    return found


COMMANDS = commands(cli.build_parser())


def base_invocations(f: dict[str, str]) -> dict[tuple[str, ...], tuple[list[str], list[str]]]:
    """A valid invocation of each command: (positionals, options); a case puts one bad value into it."""
    geometry = ["--shape", "llama-8b", "--layers", "2", "--page-size", "4"]
    explain = ["--pool", "mha", "--layout", "page_first", "--op", "load_to_device_per_layer", "--io-backend", "auto"]
    return {
        ("plugins",): ([], []),
        ("settings",): ([], []),
        ("matrix",): ([], ["--pool", "mla", "--device", "cpu"]),
        ("explain",): ([], [*explain, "--device", "cpu"]),
        ("demo",): ([], ["--device", "cpu"]),
        ("bench",): ([], ["--device", "cpu", "--out", f["out"]]),
        ("calibrate",): ([], ["--out", f["profile"]]),
        ("stats",): ([f["snapshots"]], []),
        ("explain-miss",): ([f["store_url"]], ["--model-id", "m", *geometry, "--token-ids", "1,2,3,4,5,6,7,8"]),
        ("storage", "check"): (["memory://fuzz"], []),
        ("storage", "stats"): (["memory://fuzz"], []),
        ("size",): ([], ["--config", f["config"], "--hicache-size", "0.05", "--device", "cpu"]),
    }


@pytest.fixture(scope="module")
def f(tmp_path_factory) -> dict[str, str]:
    """The files and folders the cases name (``{name}`` in :data:`BAD`)."""
    d = tmp_path_factory.mktemp("fuzz")
    made = {"list": "[1, 2]", "string": '"abc"', "number": "42", "not_json": "{not json", "file_url": "x"}
    for name, text in made.items():
        (d / name).write_text(text)
    (d / "not_utf8").write_bytes(b"\xff\xfe\x00bad")
    (d / "folder").mkdir()
    (d / "store").mkdir()
    (d / "snapshots").mkdir()
    (d / "snapshots" / "hicache-1.json").write_text(json.dumps({}))
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
                                               "torch_dtype": "bfloat16"}))  # fmt: skip
    paths = {name: str(d / name) for name in [*made, "not_utf8", "folder"]}
    return {**paths, "missing": str(d / "missing"), "out": str(d / "out"), "profile": str(d / "profile.json"),
            "snapshots": str(d / "snapshots"), "store": str(d / "store"), "store_url": f"file://{d / 'store'}",
            "config": str(d / "config.json")}  # fmt: skip


@pytest.fixture(scope="module")
def stubs() -> Iterator[list[tuple[str, tuple, dict]]]:
    """The heavy runners replaced by a stub that records its call, checks its numbers and prints a line."""
    calls: list[tuple[str, tuple, dict]] = []
    with pytest.MonkeyPatch.context() as mp:
        for module, name in HEAVY:
            mp.setattr(f"{module}.{name}", _stub(name, calls))
        yield calls


def _stub(name: str, calls: list):
    def run(*args, **kwargs):
        calls.append((name, args, kwargs))
        for value in [*args, *kwargs.values()]:
            numbers = value if isinstance(value, (tuple, list)) else [value]
            for n in numbers:
                assert isinstance(n, bool) or not isinstance(n, (int, float)) or n >= 1, (name, args, kwargs)
        print(f"{name} would run")
        return 0

    return run


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """A case may load the registry under a bad HICACHE_* value: the next test gets one of its own."""
    yield
    reset_registry()


def run(argv: list[str]) -> tuple[int, str, str]:
    """``hicache ARGV`` in this process: (exit status, stdout, stderr); stdin is empty."""
    out, err = io.StringIO(), io.StringIO()
    stdin, sys.stdin = sys.stdin, io.StringIO("")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    finally:
        sys.stdin = stdin
    return code, out.getvalue(), err.getvalue()


def check(argv: list[str], names: list[str], code: int, out: str, err: str) -> str | None:
    """What is wrong with how ``hicache ARGV`` ended, or ``None`` (the rules of the module docstring)."""
    if "Traceback" in out + err or "internal error" in err:
        return "a traceback or an internal error"
    if code not in (0, 1, 2):
        return f"exit {code}"
    if code == 0:
        return None
    lines = err.strip().splitlines()
    if not lines or len(lines) > 2 or not lines[0].startswith("hicache"):
        return "not a message of one or two lines starting 'hicache' on stderr"
    if code == 2 and out:
        return "bad usage printed on stdout"
    if code == 2 and not any(n and n in lines[0] for n in names):
        return f"the first line names none of {names}"
    return None


def _fill(value: str, f: dict[str, str]) -> str:
    return value.format(**f) if "{" in value else value


def _option_cases(f: dict[str, str]) -> Iterator[tuple[list[str], list[str]]]:
    """(argv, what the first line of a usage error may name) for every option and positional of every command."""
    bases = base_invocations(f)
    for path, parser in COMMANDS.items():
        positionals, options = bases.get(path, ([], []))
        exclusive = {a.dest: g for g in parser._mutually_exclusive_groups for a in g._group_actions}
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            url = action.dest in ("url", "storage")
            values = [_fill(v, f) for v in (BAD + BAD_URLS if url else BAD)]
            if not action.option_strings:  # a positional (each command has at most one): the bad value in its place
                for value in values:
                    yield [*path, *options, "--", value], _names(action.dest, value)
                continue
            option = action.option_strings[-1]
            kept = _without(options, action, exclusive.get(action.dest))
            if action.nargs == 0:  # a flag: on, and given a value it does not take
                yield [*path, *positionals, *kept, option], [option]
                yield [*path, *positionals, *kept, f"{option}=x"], [option]
                continue
            for value in values:
                yield [*path, *positionals, *kept, f"{option}={value}"], _names(option, value)


def _names(option: str, value: str) -> list[str]:
    """What a usage error about ``option=value`` may name: the option, the value (or its quoted form)."""
    shown = [option, repr(value), value.strip(), value.split("?")[0].replace("file://", ""), redact_url(value)]
    return [n for n in shown if n.strip()]


def _without(options: list[str], action: argparse.Action, group) -> list[str]:
    """``options`` less ``action``'s own (and those of its mutually exclusive group)."""
    drop = set(action.option_strings)
    if group is not None:
        drop |= {s for a in group._group_actions for s in a.option_strings}
    kept, skip = [], False
    for item in options:
        if skip:
            skip = False
            continue
        if item in drop:
            skip = True
            continue
        kept.append(item)
    return kept


def test_every_command_has_a_base_invocation(f):
    missing = sorted(" ".join(p) for p in COMMANDS if p not in base_invocations(f))
    assert not missing, f"give these commands a valid invocation in base_invocations(): {missing}"
    assert len(COMMANDS) >= 12  # the parser was walked, not found empty


def test_every_base_invocation_succeeds(f, stubs):
    for path, (positionals, options) in base_invocations(f).items():
        code, out, err = run([*path, *positionals, *options])
        assert code in (0, 1) and "Traceback" not in out + err, (path, code, err)


def test_no_bad_value_of_any_option_ends_in_a_traceback(f, stubs):
    wrong, cases = [], 0
    for argv, names in _option_cases(f):
        cases += 1
        code, out, err = run(argv)
        problem = check(argv, names, code, out, err)
        if problem:
            wrong.append(f"hicache {' '.join(map(repr, argv))}: {problem} (exit {code})\n  stderr: {err[:400]!r}"
                         f"\n  stdout: {out[:200]!r}")  # fmt: skip
    assert cases > 1500, cases
    assert not wrong, f"{len(wrong)} of {cases} cases:\n" + "\n".join(wrong[:40])
    assert list(Path(f["store"]).iterdir()) == []  # the checks and explain-miss left the store as it was
    assert not Path(f["missing"]).exists() and not Path("/nonexistent").exists()


#: Model configs of each family ``hicache size`` knows; every key of each gets every value of :data:`BAD_JSON`.
CONFIGS = {
    "gqa": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
            "head_dim": 64, "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]},
    "mla": {"num_hidden_layers": 2, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "num_attention_heads": 4,
            "hidden_size": 256, "torch_dtype": "bfloat16"},
    "hybrid": {"num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "hidden_size": 128, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
               "linear_num_value_heads": 4, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
               "layer_types": ["linear_attention", "full_attention"] * 2, "torch_dtype": "bfloat16"},
}  # fmt: skip
BAD_JSON = [None, "32", -1, 0, 1.5, float("nan"), float("inf"), True, [], {}, [1, "x"], 10**30]


def test_no_bad_model_config_ends_in_a_traceback(tmp_path):
    wrong, cases = [], 0
    path = tmp_path / "config.json"
    for family, config in CONFIGS.items():
        variants = [{**config, key: value} for key in config for value in BAD_JSON]
        variants += [{k: v for k, v in config.items() if k != key} for key in config]  # each key missing
        variants += [{"text_config": value} for value in BAD_JSON] + [{"text_config": config}, {}]
        for variant in variants:
            path.write_text(json.dumps(variant))  # NaN and Infinity as Python's json writes them
            argv = ["size", "--config", str(path), "--device-tokens", "4096", "--mamba-slots", "8", "--device", "cpu"]
            cases += 1
            code, out, err = run(argv)
            problem = check(argv, ["config", str(path)], code, out, err)
            if problem:
                wrong.append(f"{family} {json.dumps(variant)[:200]}: {problem} (exit {code})\n  stderr: {err[:300]!r}")
    assert cases > 150, cases
    assert not wrong, f"{len(wrong)} of {cases} cases:\n" + "\n".join(wrong[:40])


#: Metric snapshots that are JSON but not what ``hicache_core.metrics.write_snapshot`` writes.
BAD_SNAPSHOTS = [
    {"m": 1},
    {"m": {"values": 1}},
    {"m": {"values": [1]}},
    {"m": {"values": [{"labels": [], "value": 1}]}},
    {"m": {"values": [{"labels": {}, "value": "1"}]}},
    {"m": {"values": [{"labels": {}, "value": {}}]}},
    {"m": {"values": [{"labels": {}, "value": {"count": 1, "sum": 1, "buckets": [[1]]}}]}},
    {"m": {"values": [{"labels": {}, "value": float("nan")}]}},
]


def test_no_bad_snapshot_or_token_file_ends_in_a_traceback(tmp_path, f):
    cases = []
    for i, snap in enumerate(BAD_SNAPSHOTS):
        (tmp_path / f"hicache-{i}.json").write_text(json.dumps(snap))
        cases.append((["stats", str(tmp_path / f"hicache-{i}.json")], [f"hicache-{i}.json"]))
    hist = {"m": {"values": [{"labels": {}, "value": {"count": 1, "sum": 1.0, "buckets": [[1, 1]]}}]}}
    (tmp_path / "a.json").write_text(json.dumps(hist))
    (tmp_path / "b.json").write_text(json.dumps({"m": {"values": [{"labels": {}, "value": 1}]}}))
    cases.append((["stats", str(tmp_path / "a.json"), str(tmp_path / "b.json")], ["snapshots"]))  # kinds disagree
    tokens = ["1 2 abc", "[1, -1]", "[[1]]", "1e5", "", "[1, 2", "{}", "true", '["1"]', "99999999999999999999999"]
    geometry = ["--shape", "llama-8b", "--layers", "2", "--page-size", "4"]
    base = ["explain-miss", f["store_url"], "--model-id", "m", *geometry]
    for i, text in enumerate(tokens):
        (tmp_path / f"tokens-{i}").write_text(text)
        cases.append(([*base, "--tokens", str(tmp_path / f"tokens-{i}")], ["--tokens", "token"]))
    wrong = []
    for argv, names in cases:
        code, out, err = run(argv)
        problem = check(argv, names, code, out, err)
        if problem:
            wrong.append(f"hicache {' '.join(argv)}: {problem} (exit {code})\n  stderr: {err[:300]!r}")
    assert not wrong, "\n".join(wrong)


def _refused(setting) -> list[str]:
    """Up to two values ``setting`` refuses; a setting that takes any text gets paths and a URL instead."""
    values = []
    for text in ("banana", "-1", "0", "nan", "1e400", "2.5", "99999999999999999999"):
        try:
            setting.parse_text(text)
        except SettingError:
            values.append(text)
    return values[:2] or ["/nonexistent/hicache-fuzz", "ftp://x"]


#: Light commands a bad setting is tried under (a few each reads: the registry, host pools, stores, metrics).
ENV_COMMANDS = [["plugins"], ["settings", "--json"], ["size", "--config", "{config}", "--hicache-size", "0.05"],
                ["storage", "check", "memory://fuzz-env"], ["stats"], ["matrix", "--pool", "mha"],
                ["demo", "--device", "cpu"]]  # fmt: skip


def test_no_bad_setting_ends_in_a_traceback(f, stubs, monkeypatch):
    wrong, cases = [], 0
    for name, entry in sorted(declared().items()):
        for value in _refused(entry.setting):
            monkeypatch.setenv(name, value)
            reset_registry()  # plugins read their settings when they load
            for command in ENV_COMMANDS:
                argv = [_fill(a, f) for a in command]
                cases += 1
                code, out, err = run(argv)
                problem = check(argv, [name], code, out, err)
                if problem:
                    wrong.append(f"{name}={value!r} hicache {' '.join(argv)}: {problem} (exit {code})\n"
                                 f"  stderr: {err[:400]!r}")  # fmt: skip
            monkeypatch.delenv(name)
    assert cases > 300, cases
    assert not wrong, f"{len(wrong)} of {cases} cases:\n" + "\n".join(wrong[:40])


def test_every_command_stops_quietly_when_its_reader_has_gone(f, stubs):
    """``hicache ... | head -1``: a write to a closed pipe ends the command with 141 and nothing on stderr."""

    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    for path, (positionals, options) in base_invocations(f).items():
        err = io.StringIO()
        with contextlib.redirect_stdout(Closed()), contextlib.redirect_stderr(err):
            code = cli.main([*path, *positionals, *options])
        assert (code, err.getvalue()) == (cli.EXIT_PIPE_CLOSED, ""), path


def test_an_internal_error_is_one_line_and_traceback_shows_it(monkeypatch, capsys):
    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_size", broken)
    assert cli.main(["size", "--config", "x"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == ("hicache size: internal error: KeyError: 'a bug' (hicache --traceback size ... "
                                 "shows where; please report it)\n")  # fmt: skip
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["--traceback", "size", "--config", "x"])


def test_no_command_or_an_unknown_one_is_bad_usage(capsys):
    for argv in ([], ["bogus"], ["storage"], ["--bogus"]):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("hicache"), (argv, err)


def _process(*argv: str, stdout=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")} | env
    return subprocess.run([sys.executable, "-m", "hicache_core.cli", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=environ, cwd=ROOT, timeout=120)  # fmt: skip


def test_version_is_the_distributions():
    try:
        expected = metadata.version("hicache-core")
    except metadata.PackageNotFoundError:
        expected = CORE_VERSION
    done = _process("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"hicache-core {expected}\n", "")


def test_a_closed_pipe_ends_the_process_quietly():
    """``hicache plugins | head -1``, the reader gone before the first write: 141, as a shell reports SIGPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = _process("plugins", stdout=write)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_a_bad_setting_in_a_process_is_one_line():
    done = _process("storage", "check", "memory://fuzz", HICACHE_VERIFY="banana")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("hicache storage check: error: HICACHE_VERIFY='banana' is not 1 or 0 (also true/yes/on "
                           "or false/no/off)\n")  # fmt: skip
