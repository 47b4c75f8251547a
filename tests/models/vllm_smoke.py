"""Start vLLM (CPU, dummy weights) on model directories, one after another, and generate.

Run as a script so the engine's spawned subprocess has a guarded ``__main__``. Prints one JSON
line per model: ``{"arch", "ok", "prompt_tokens", "image_tokens", "output_ids", "error"}``. A VLM
gets a prompt with two PIL images, so multi-image serving is exercised.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path


def _images(n: int) -> list:
    import numpy as np
    from PIL import Image

    return [Image.fromarray((np.random.RandomState(i).rand(64, 64, 3) * 255).astype("uint8")) for i in range(n)]


def smoke(path: Path) -> dict:
    from vllm import LLM, SamplingParams

    arch = json.loads((path / "orbitkv_model.json").read_text())["arch"]
    row: dict = {"arch": arch, "ok": False}
    try:
        vlm = arch == "smolvlm"
        llm = LLM(
            model=str(path),
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=512,
            max_num_seqs=2,
            enforce_eager=True,
            # Engine and worker in this process: two fewer interpreter + vLLM imports per model.
            distributed_executor_backend="uni",
            limit_mm_per_prompt={"image": 2} if vlm else None,
        )
        params = SamplingParams(max_tokens=4, temperature=0.0)
        if vlm:
            prompt = "<|im_start|>User:<image><image>Compare the two images.<end_of_utterance>\nAssistant:"
            request = {"prompt": prompt, "multi_modal_data": {"image": _images(2)}}
        else:
            request = {"prompt": "hello there, describe the image"}
        out = llm.generate(request, params)[0]
        image_id = llm.get_tokenizer().convert_tokens_to_ids("<image>") if vlm else -1
        row.update(
            ok=len(out.outputs[0].token_ids) == 4,
            prompt_tokens=len(out.prompt_token_ids),
            image_tokens=sum(t == image_id for t in out.prompt_token_ids),
            output_ids=list(out.outputs[0].token_ids),
        )
        del llm
        gc.collect()
    except Exception as exc:  # reported as a row, so one failing model does not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    return row


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for arg in sys.argv[1:]:
        print("SMOKE " + json.dumps(smoke(Path(arg))), flush=True)
