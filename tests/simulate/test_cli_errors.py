"""Every user mistake: a message naming the flag (or trace line and field), exit code 2, no
traceback, nothing run."""

from __future__ import annotations

import pytest
from sim_helpers import TINY, seg, write_trace


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu-gib", "inf"], "--cpu-gib: expected a finite number > 0, got 'inf'"),
        (["--cpu-gib", "nan"], "--cpu-gib: expected a finite number > 0, got 'nan'"),
        (["--cpu-gib", "-1"], "--cpu-gib: expected a finite number > 0, got '-1'"),
        (["--cpu-gib", "0"], "--cpu-gib: expected a finite number > 0, got '0'"),
        (["--cpu-gib", "0.001"], "--cpu-gib 0.001 holds no chunk: one chunk is 2,097,152 bytes"),
        (["--cpu-gib", "1e9"], "the simulator takes at most 4,194,304: raise --blocks-per-chunk"),
        (["--system-prompts", "0"], "--system-prompts: expected an int in 1..1,048,576, got '0'"),
        (["--turns", "-3"], "--turns: expected an int in 1..1,048,576, got '-3'"),
        (["--conversations", "2.5"], "--conversations: expected an int in 1..1,048,576"),
        (["--thinking-tokens", "-1"], "--thinking-tokens: expected an int in 0..1,048,576"),
        (["--max-load-tokens", "-1"], "--max-load-tokens: expected an int in 0.."),
        (["--max-offload-tokens", "x"], "--max-offload-tokens: expected an int in 0.."),
        (["--gpu-blocks", "0"], "--gpu-blocks: expected an int in 1..4,194,304, got '0'"),
        (["--pcie-gbps", "inf"], "--pcie-gbps: expected a finite number > 0"),
        (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s: expected a finite number > 0"),
        (["--eviction-policy", "fifo"], "--eviction-policy: invalid choice: 'fifo'"),
        (["--workload", "poem"], "--workload: invalid choice: 'poem'"),
        (["--model", "gpt-5"], "--model: invalid choice: 'gpt-5'"),
        (["--model", "qwen3-32b", "--kv-bytes-per-token", "8"], "not allowed with argument"),
        (["--sweep-cpu-gib", "1,x"], "--sweep-cpu-gib: expected comma-separated sizes in GiB"),
        (["--sweep-cpu-gib", "2,2"], "--sweep-cpu-gib: expected 1 to 16 distinct sizes"),
        (["--sweep-cpu-gib", "1,2", "--cpu-gib", "4"], "--cpu-gib and --sweep-cpu-gib are"),
        (["--plot", "x.png"], "--plot needs --sweep-cpu-gib"),
        (
            ["--sweep-cpu-gib", "1", "--plot", "/no/such/dir/x.png"],
            "--plot /no/such/dir/x.png: directory '/no/such/dir' does not exist",
        ),
        (
            ["--workload", "chat", "--thinking-tokens", "10"],
            "--thinking-tokens does not apply to --workload chat (it takes --answer-tokens,",
        ),
        (["--prefixes", "3"], "--prefixes does not apply to --workload reasoning-chat"),
        (
            ["--compare", "offload_prompt_only", "--offload-decode"],
            "--offload-decode contradicts --compare offload_prompt_only",
        ),
        (
            ["--compare", "eviction_policy", "--eviction-policy", "arc"],
            "--eviction-policy contradicts --compare eviction_policy",
        ),
        (["--compare", "speed"], "--compare: invalid choice: 'speed'"),
        (
            ["--gpu-blocks", "100"],
            "--gpu-blocks 100 is too small: request 'c0-t0' (2,304 prompt + 1,280 output "
            "tokens) needs 224 blocks of 16 tokens",
        ),
        (
            ["--conversations", "100000", "--turns", "1000"],
            "the simulator takes at most 268,435,456: use fewer or smaller requests",
        ),
        (["--trace", "/no/such/trace.jsonl"], "--trace /no/such/trace.jsonl: cannot read it"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags(run_cli, args, message):
    code, out, err = run_cli(*args, json_out=False)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert out == ""


def test_trace_and_workload_flags_exclude_each_other(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", [{"id": "a", "prompt": [1], "output_tokens": 1}])
    code, _, err = run_cli("--trace", trace, "--workload", "chat", "--turns", "2", json_out=False)
    assert code == 2
    assert "--workload, --turns cannot be combined with --trace" in err


GOOD = {"id": "r", "prompt": [seg("s", 32)], "output_tokens": 4}


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        ("{not json", "json", "not valid JSON"),
        ("[1, 2]", "json", "expected an object, got list"),
        ({**GOOD, "colour": 1}, "colour", "unknown field; allowed: arrival, id,"),
        ({**GOOD, "id": ""}, "id", "expected a non-empty string, got ''"),
        ({**GOOD, "id": 7}, "id", "expected a non-empty string, got 7"),
        ({**GOOD, "id": "first"}, "id", "'first' is already used on line 1"),
        ({**GOOD, "arrival": -1}, "arrival", "expected a finite number of seconds >= 0"),
        ({**GOOD, "arrival": "soon"}, "arrival", "expected a finite number of seconds >= 0"),
        ({**GOOD, "arrival": True}, "arrival", "expected a finite number of seconds >= 0"),
        ({**GOOD, "prompt": []}, "prompt", "expected a non-empty list"),
        ({**GOOD, "prompt": "hello"}, "prompt", "expected a non-empty list"),
        ({**GOOD, "prompt": [1, -2]}, "prompt", "token ids must be ints in 0..2147483647"),
        ({**GOOD, "prompt": [{"segment": "s"}]}, "prompt[0]", 'expected {"segment": name'),
        ({**GOOD, "prompt": [seg("", 3)]}, "prompt[0].segment", "expected a non-empty string"),
        ({**GOOD, "prompt": [seg("s", 0)]}, "prompt[0].tokens", "expected an int in 1..16777216"),
        (
            {
                **GOOD,
                "prompt": [
                    seg(
                        "s",
                        2,
                    ),
                    5,
                ],
            },
            "prompt[1]",
            'expected {"segment": name',
        ),
        ({**GOOD, "output_tokens": 0}, "output_tokens", "expected an int >= 1, got 0"),
        ({"id": "r", "prompt": [1]}, "output_tokens", "expected an int >= 1, got None"),
        ({**GOOD, "kv_transfer_params": "abc"}, "kv_transfer_params", "expected an object"),
        (
            {**GOOD, "kv_transfer_params": {"max_load_tokens": -1}},
            "kv_transfer_params.max_load_tokens",
            "expected an int >= 0, got -1",
        ),
        (
            {**GOOD, "kv_transfer_params": {"max_offload_tokens": 1.5}},
            "kv_transfer_params.max_offload_tokens",
            "expected an int >= 0, got 1.5",
        ),
    ],
)
def test_bad_trace_lines_name_the_line_and_field(tmp_path, run_cli, line, field, problem):
    lines = [{**GOOD, "id": "first"}, "# a comment", line]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    code, out, err = run_cli("--trace", trace, *TINY, json_out=False)
    assert code == 2
    assert f"--trace {trace} line 3: {field}: {problem}" in err
    assert "Traceback" not in err
    assert out == ""


def test_an_empty_trace_is_an_error(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", ["", "# nothing"])
    code, _, err = run_cli("--trace", trace, json_out=False)
    assert (code, "no requests in it" in err) == (2, True)


def test_a_trace_request_bigger_than_the_gpu_names_it(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", [{**GOOD, "prompt": [seg("s", 1000)]}])
    code, _, err = run_cli("--trace", trace, *TINY, "--gpu-blocks", "8", json_out=False)
    assert code == 2
    assert "--gpu-blocks 8 is too small: request 'r' (1,000 prompt + 4 output tokens)" in err
