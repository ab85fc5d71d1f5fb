"""What the real-engine suite and benchmark start engines with: a random-weight model that needs
no download, the environment, and a runner for an engine's process.

The model is a random-weight Llama of two layers, hidden size 128: prefill of a few thousand
tokens takes well under a second on two cores. `initializer_range` 0.2 (not Llama's 0.02) makes
the logits spread wide enough that greedy decoding is stable across batch shapes yet depends on
every token of the prefix, so KV loaded wrong shows up in the output. The tokenizer is a
`tokenizers` WordLevel one over `w0 ... wN`: a prompt of n words is n tokens, with no BOS added.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

VOCAB = 2048
LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 128, 4, 2


def engine_env() -> dict[str, str]:
    """The environment an engine of the suite runs in."""
    env = dict(os.environ)
    # vLLM's CPU backend sizes its KV cache from this (GiB); its default takes most of the
    # machine's memory, which takes seconds to allocate and leaves nothing for a second engine.
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float = 600) -> int:
    """Runs an engine's process to its end, its output into `log`, and returns its exit status.
    Past `timeout` seconds the whole process group is killed (a multiprocess or tensor-parallel
    engine has children of its own), and that is written at the log's end."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[killed after {timeout:.0f} s]\n")
            return -signal.SIGKILL


def kv_bytes_per_token() -> int:
    """Of the default model, float32: K and V of every layer."""
    return LAYERS * 2 * KV_HEADS * (HIDDEN // HEADS) * 4


def build_model(
    path: Path,
    *,
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    max_positions: int = 8192,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Path:
    """Writes the model and tokenizer to `path` (created) and returns it. With `sliding_window`,
    a Gemma 3 whose layers alternate sliding-window (first) and full attention: a hybrid model,
    two KV-cache groups."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    path.mkdir(parents=True, exist_ok=True)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if sliding_window is None:
        LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(path)
    else:
        config = Gemma3TextConfig(
            **common,
            head_dim=hidden // heads,
            sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
        Gemma3ForCausalLM(config).save_pretrained(path)

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(path)
    # No chat template: the suite sends completions only.
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return path
