"""`--model` sets the prefill and decode speeds from the model's size, not only its KV size;
the speed flags override it, and `--kv-bytes-per-token` (no model) warns that only the KV size
changes."""

from __future__ import annotations

import pytest

from kvoffload.simulate.models import MODELS

# One 4,096-token prompt, alone: its first token comes at the end of the one step that computes
# the whole prompt (decode step + prompt tokens; no KV is read, nothing decodes yet).
ONE = [
    "--workload", "shared-prefix", "--prefixes", "1", "--questions", "1",
    "--prefix-tokens", "4000", "--question-tokens", "96",
]  # fmt: skip


def one_step_ttft(prefill_per_s: float, attention: float, step_ms: float) -> float:
    return step_ms / 1000 + 4096 * (1 + 2047.5 / attention) / prefill_per_s


@pytest.mark.parametrize(
    ("model", "speeds"),
    [
        # The calibrated default: Llama-3-8B on one H200.
        (None, (30_000, 30_000, 6.0)),
        ("llama-3-8b", (30_000, 30_000, 6.0)),
        # 70.6B parameters against 8.03B: 8.8x the FLOP per prompt token and the bytes of
        # weights per step; attention matches the weights at 70.6e9 / (2 x 80 x 8,192).
        ("llama-3-70b", (3_410, 52_800, 52.8)),
        ("llama-3.1-405b", (593, 96_300, 303)),
        ("mistral-7b", (33_300, 27_000, 5.41)),
    ],
)
def test_the_model_sets_the_prefill_and_decode_speeds(run_cli, model, speeds):
    code, out, err = run_cli(*ONE, *(["--model", model] if model else []))
    assert (code, err) == (0, "")
    engine = out["engine"]
    got = tuple(
        engine[k] for k in ("prefill_tokens_per_s", "prefill_attention_tokens", "decode_step_ms")
    )
    assert got == speeds
    assert out["runs"][0]["result"]["ttft_mean_s"] == pytest.approx(one_step_ttft(*speeds))


def test_a_70b_takes_about_nine_times_the_8bs_time_to_first_token(run_cli):
    _, small, _ = run_cli(*ONE)
    _, large, _ = run_cli(*ONE, "--model", "llama-3-70b")
    ttft = [o["runs"][0]["result"]["ttft_mean_s"] for o in (small, large)]
    assert ttft == [pytest.approx(0.15185, abs=1e-5), pytest.approx(1.30055, abs=1e-5)]


def test_a_speed_flag_overrides_the_models(run_cli):
    _, out, _ = run_cli(*ONE, "--model", "llama-3-70b", "--prefill-tokens-per-s", "5000")
    engine = out["engine"]
    assert engine["prefill_tokens_per_s"] == 5000
    assert (engine["prefill_attention_tokens"], engine["decode_step_ms"]) == (52_800, 52.8)
    assert engine["kv_bytes_per_token"] == MODELS["llama-3-70b"]


def test_kv_bytes_per_token_alone_warns_that_the_speeds_stay_the_8bs(run_cli):
    code, out, err = run_cli(*ONE, "--kv-bytes-per-token", "327680", "--decode-step-ms", "50")
    assert code == 0
    assert err == (
        "kvoffload simulate: warning: --kv-bytes-per-token changes only the KV size: "
        "--prefill-tokens-per-s, --prefill-attention-tokens stay llama-3-8b's on one H200 (use "
        "--model, or give them for your model)\n"
    )
    engine = out["engine"]
    assert (engine["prefill_tokens_per_s"], engine["decode_step_ms"]) == (30_000, 50)
    speeds = ["--prefill-tokens-per-s", "3410", "--prefill-attention-tokens", "52800"]
    speeds += ["--decode-step-ms", "50"]
    code, _, err = run_cli(*ONE, "--kv-bytes-per-token", "327680", *speeds)
    assert (code, err) == (0, "")
