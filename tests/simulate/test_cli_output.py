"""What `kvoffload simulate` prints: the comparison table, JSON, the sweep and its plot, and a
quiet end when the reader goes away."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvoffload
from kvoffload.cli import main

# A small reasoning chat whose 10-chunk CPU tier is tight: decode chunks then crowd out prompts.
SMALL = [
    "--conversations", "6", "--turns", "3", "--system-prompts", "2",
    "--system-prompt-tokens", "128", "--user-tokens", "32", "--thinking-tokens", "64",
    "--answer-tokens", "32", "--gpu-blocks", "48", "--max-running", "4",
    "--kv-bytes-per-token", "1024",
    # The speeds a model of this KV size would have (without them, a warning says they are
    # llama-3-8b's).
    "--prefill-tokens-per-s", "30000", "--prefill-attention-tokens", "30000",
    "--decode-step-ms", "6",
]  # fmt: skip
CPU_GIB = str(40 * 16 * 1024 / 2**30)  # 40 chunks


def test_compare_prompt_only_prints_both_columns_and_the_change(capsys):
    assert main(["simulate", *SMALL, "--cpu-gib", CPU_GIB, "--compare", "offload_prompt_only"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no progress bar without a terminal
    lines = out.splitlines()
    assert lines[0].startswith("reasoning-chat: conversations 6, turns 3, system prompts 2")
    assert "1,024 KV bytes/token, 16-token chunks of 0.015625 MiB, GPU cache 48 blocks" in lines[1]
    assert lines[2] == f"CPU tier {float(CPU_GIB):g} GiB (lru)"
    assert lines[3].startswith("prefix-reuse bound ")
    head = lines[5].split()
    assert head == ["prompt-only", "off", "prompt-only", "on", "change"]
    rows = {line[:27].strip(): line[27:].split() for line in lines[6:]}
    off, on = int(rows["chunks written GPU->CPU"][0]), int(rows["chunks written GPU->CPU"][1])
    assert on < off
    assert rows["chunks written GPU->CPU"][2] == f"{(on - off) / off:+.1%}"
    assert rows["of them past the prompt"][1] == "0"
    assert rows["requests"] == ["18", "18"]


def test_json_echoes_the_workload_and_config(capsys):
    assert main(["simulate", *SMALL, "--cpu-gib", CPU_GIB, "--json", "--seed", "3"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == {
        "name": "reasoning-chat",
        "conversations": 6,
        "turns": 3,
        "system_prompts": 2,
        "system_prompt_tokens": 128,
        "user_tokens": 32,
        "thinking_tokens": 64,
        "answer_tokens": 32,
        "seed": 3,
    }
    assert out["engine"]["model"] is None
    assert out["engine"]["kv_bytes_per_token"] == 1024
    (run,) = out["runs"]
    assert (run["offload_prompt_only"], run["eviction_policy"]) == (True, "lru")
    assert run["cpu_gib"] == float(CPU_GIB)
    r = run["result"]
    assert r["cpu_hit_rate"] == r["cpu_hit_tokens"] / r["prompt_tokens"]


def test_model_presets_set_the_chunk_size(capsys):
    assert main(["simulate", "--model", "llama-3-70b", "--json", "--conversations", "2"]) == 0
    import json

    engine = json.loads(capsys.readouterr().out)["engine"]
    # 80 layers x K and V x 8 heads x 128 dims x 2 bytes, 16 tokens per chunk.
    assert engine["kv_bytes_per_token"] == 80 * 2 * 8 * 128 * 2
    assert engine["bytes_per_chunk"] == 16 * 327_680


def test_compare_eviction_policy_runs_lru_and_arc(capsys):
    assert main(["simulate", *SMALL, "--cpu-gib", CPU_GIB, "--compare", "eviction_policy"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[5].split() == ["lru", "arc", "change"]


def test_sweep_plots_a_readable_png(tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    png = tmp_path / "sweep.png"
    sizes = ",".join(str(n * 16 * 1024 / 2**30) for n in (8, 16, 64))
    argv = [*SMALL, "--sweep-cpu-gib", sizes, "--compare", "offload_prompt_only"]
    assert main(["simulate", *argv, "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[5].split()[:4] == ["CPU", "GiB", "setting", "GPU"]
    assert len(out) == 6 + 3 * 2  # one row per size and setting
    pixels = image.imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.png"]  # no temporary left


def test_a_reader_that_goes_away_ends_it_quietly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "simulate", *SMALL, "--cpu-gib", CPU_GIB],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head -0`: gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert err == b""


def test_head_takes_the_first_line():
    cmd = (
        f"set -o pipefail; {sys.executable} -m kvoffload.cli simulate {' '.join(SMALL)} "
        f"--cpu-gib {CPU_GIB} | head -1"
    )
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("reasoning-chat: conversations 6")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvoffload {kvoffload.__version__}"


@pytest.mark.parametrize(
    ("redirect", "code", "stderr"),
    [
        (">&-", 0, ""),  # no stdout at all: nothing to print, no error
        ("2>&-", 0, None),  # no stderr: the table still comes out
        (">/dev/full", 1, "kvoffload simulate: cannot write the output: No space left on device"),
    ],
)
def test_a_closed_or_full_output_ends_without_a_traceback(redirect, code, stderr):
    cmd = f"{sys.executable} -m kvoffload simulate {' '.join(SMALL)} --cpu-gib {CPU_GIB} {redirect}"
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert done.returncode == code
    assert "Traceback" not in done.stderr
    if stderr is not None:
        assert done.stderr.strip() == stderr
    if redirect == "2>&-":
        assert done.stdout.startswith("reasoning-chat: conversations 6")


def test_a_plot_that_cannot_be_written_is_reported_after_the_table(capsys):
    pytest.importorskip("matplotlib")
    # /proc passes the up-front checks as root, but no file can be created in it.
    sizes = str(40 * 16 * 1024 / 2**30)
    code = main(["simulate", *SMALL, "--sweep-cpu-gib", sizes, "--plot", "/proc/x/y.png"])
    out, err = capsys.readouterr()
    assert code == 2 and "--plot /proc/x/y.png: '/proc/x' is not a directory" in err
    code = main(["simulate", *SMALL, "--sweep-cpu-gib", sizes, "--plot", "/proc/kvoffload.png"])
    out, err = capsys.readouterr()
    if code == 2:  # not root: refused up front
        assert "is not writable" in err
    else:
        assert code == 1
        assert out.splitlines()[5].startswith("CPU GiB")
        assert err.startswith("kvoffload simulate: --plot /proc/kvoffload.png: cannot write it:")
