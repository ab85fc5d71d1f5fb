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
        (["--pcie-gbps", "inf"], "--pcie-gbps: expected a number in 0.01..10000, got 'inf'"),
        (["--pcie-gbps", "5e-324"], "--pcie-gbps: expected a number in 0.01..10000"),
        (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s: expected a number in 1..1e+09"),
        (["--decode-step-ms", "1.7e308"], "--decode-step-ms: expected a number in 0.001..1e+06"),
        (
            ["--max-batched-tokens", "8", "--max-running", "16"],
            "--max-batched-tokens 8 is less than --max-running 16",
        ),
        (
            ["--sweep-cpu-gib", "1e-300"],
            "--sweep-cpu-gib 1e-300 holds no chunk: one chunk is 2,097,152 bytes",
        ),
        (
            [
                "--kv-bytes-per-token",
                "1",
                "--tokens-per-block",
                "1",
                "--blocks-per-chunk",
                "4096",
                "--cpu-gib",
                "1",
                "--verify-data",
            ],
            "--verify-data would allocate a 64.0 GiB CPU pool",
        ),
        (
            [
                "--workload",
                "shared-prefix",
                "--prefix-tokens",
                "65536",
                "--questions",
                "256",
                "--tokens-per-block",
                "1",
                "--gpu-blocks",
                "4194304",
                "--kv-bytes-per-token",
                "1",
                "--blocks-per-chunk",
                "64",
                "--cpu-gib",
                "0.001",
            ],
            "the workload makes 16,826,368 blocks of --tokens-per-block 1; the simulator takes "
            "at most 4,194,304",
        ),
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
            "--plot /no/such/dir/x.png: '/no/such/dir' is not a directory",
        ),
        (["--sweep-cpu-gib", "1", "--plot", "/tmp"], "--plot '/tmp': expected a file name"),
        (["--sweep-cpu-gib", "1", "--plot", ""], "--plot '': expected a file name"),
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
            "--gpu-blocks 100 is too small: request 'c0-t3' needs 320 blocks of 16 tokens "
            "(the most of any request)",
        ),
        (
            ["--conversations", "100000", "--turns", "1000"],
            "the simulator takes at most 67,108,864: use fewer or smaller requests",
        ),
        (["--trace", "/no/such/trace.jsonl"], "--trace /no/such/trace.jsonl: not a regular file"),
        (["--trace", "/dev/zero"], "--trace /dev/zero: not a regular file"),
        (["--trace", "/tmp"], "--trace /tmp: not a regular file"),
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
        ({**GOOD, "arrival": -1}, "arrival", "expected seconds in 0..1e+09, got -1"),
        ({**GOOD, "arrival": "soon"}, "arrival", "expected seconds in 0..1e+09, got 'soon'"),
        ({**GOOD, "arrival": True}, "arrival", "expected seconds in 0..1e+09, got True"),
        ({**GOOD, "arrival": 10**400}, "arrival", "expected seconds in 0..1e+09, got 1000000"),
        (
            '{"id": "r", "arrival": NaN, "prompt": [1], "output_tokens": 1}',
            "arrival",
            "expected seconds in 0..1e+09, got nan",
        ),
        ({**GOOD, "prompt": []}, "prompt", "expected a non-empty list"),
        ({**GOOD, "prompt": "hello"}, "prompt", "expected a non-empty list"),
        ({**GOOD, "prompt": [1, -2]}, "prompt", "token ids must be ints in 0..2147483647"),
        ({**GOOD, "prompt": [{"segment": "s"}]}, "prompt[0]", 'expected {"segment": name'),
        ({**GOOD, "prompt": [seg("", 3)]}, "prompt[0].segment", "expected a non-empty string"),
        ({**GOOD, "prompt": [seg("s", 0)]}, "prompt[0].tokens", "expected an int >= 1, got 0"),
        ({**GOOD, "prompt": [seg("s", 2), 5]}, "prompt[1]", 'expected {"segment": name'),
        (
            {**GOOD, "prompt": [seg("s", 1 << 23), seg("t", 1 << 23)]},
            "prompt",
            "more than 16,777,216 tokens with the output",
        ),
        ({**GOOD, "output_tokens": 0}, "output_tokens", "expected an int in 1..16777216, got 0"),
        ({"id": "r", "prompt": [1]}, "output_tokens", "expected an int in 1..16777216, got None"),
        ({**GOOD, "output_tokens": 10**23}, "output_tokens", "expected an int in 1..16777216"),
        ('{"id": "r", "prompt": [' + "1" * 5000 + '], "output_tokens": 1}', "json", "not accepted"),
        ('{"id": "r", "kv_transfer_params": ' + "[" * 100000, "json", "not"),
        (
            '{"id": "a", "id": "b", "prompt": [1], "output_tokens": 1}',
            "json",
            "not accepted: field 'id' appears twice",
        ),
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
        (
            {**GOOD, "kv_transfer_params": {"max_load_tokens": 10**29}},
            "kv_transfer_params.max_load_tokens",
            "expected an int >= 0, got 100000000000000000000000000000",
        ),
        (
            {**GOOD, "kv_transfer_params": {"max_load_token": 5}},
            "kv_transfer_params.max_load_token",
            "unknown; allowed: max_load_tokens, max_offload_tokens",
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
    assert "--gpu-blocks 8 is too small: request 'r' needs 63 blocks of 16 tokens" in err


def test_a_line_that_is_not_utf8_names_its_line(tmp_path, run_cli):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b'{"id": "a", "prompt": [1], "output_tokens": 1}\n{"id": "\xff"}\n')
    code, _, err = run_cli("--trace", str(trace), json_out=False)
    assert code == 2
    assert f"--trace {trace} line 2: json: not UTF-8 (byte 9)" in err
