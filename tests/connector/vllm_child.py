"""A fresh process for ``test_vllm_stores.py``: engines one after another, results as JSON.

    python vllm_child.py SPEC.json

SPEC: ``{"model_dir", "out", "max_tokens", "llm_kwargs", "engines": [{"extra_config", "prompts"}]}``.
Each engine loads the connector by name only (the ``vllm.general_plugins`` entry point), runs its
prompts greedily one at a time and records each request's summary and output tokens, and what its
store's tiers counted (``hits.<tier>``).
"""

from __future__ import annotations

import json
import sys

from connector_vllm_testlib import engine, summary


def main(path: str) -> int:
    with open(path) as f:
        spec = json.load(f)
    results = []
    for run in spec["engines"]:
        with engine(
            spec["model_dir"],
            extra_config=run["extra_config"],
            module_path=None,
            **spec.get("llm_kwargs", {}),
        ) as eng:
            outputs = []
            for ids in run["prompts"]:
                out, _ = eng.run({"prompt_token_ids": ids}, max_tokens=spec["max_tokens"])
                outputs.append(
                    {"summary": summary(out), "token_ids": list(out.outputs[0].token_ids)}
                )
            stats = eng.sched_connector.store.stats()
            results.append(
                {
                    "outputs": outputs,
                    "tiers": eng.sched_connector.store.tier_names,
                    "hits": {k: v for k, v in stats.items() if k.startswith("hits.")},
                }
            )
    with open(spec["out"], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
