"""One engine of the time-to-first-token benchmark, in a process of its own:
`python ttft_engine.py SPEC.json OUT.json`.

For each prompt: with `store_first`, it is run once (computed, and stored by the connector), the
device prefix cache is reset, and then it is timed; without, it is timed as it comes (computed
from scratch, or served from a tier another engine filled). A timed run asks for one token, so
its latency is the time to the first token of an idle engine. With `batches`, prompts then
run together, distinct, for the throughput when nothing hits (each of `batches`, new prompts
each time).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "e2e"))

from scenario import reset_prefix_cache


def external_hits(llm: Any) -> float:
    time.sleep(0.2)  # the last step's stats reach the counters with the next one
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def main(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], **spec["engine"])
    one = SamplingParams(temperature=0.0, max_tokens=1)
    # Warm-up, with a prompt shorter than a block: nothing to store or hit.
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 16)], one, use_tqdm=False)
    before = external_hits(llm)
    ttft = []
    for ids in spec["prompts"]:
        prompt = TokensPrompt(prompt_token_ids=ids)
        if spec.get("store_first"):
            llm.generate([prompt], one, use_tqdm=False)
            reset_prefix_cache(llm)
        start = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        ttft.append(time.perf_counter() - start)
    out: dict[str, Any] = {"ttft": ttft, "external_hits": external_hits(llm) - before}
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("batch_tokens", 1), ignore_eos=True
    )
    out["throughput"] = []
    for batch in spec.get("batches", ()):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        tokens = sum(len(o.prompt_token_ids or ()) + len(o.outputs[0].token_ids) for o in outputs)
        out["throughput"].append(tokens / took)
    del llm
    return out


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    Path(sys.argv[2]).write_text(json.dumps(main(spec)))
