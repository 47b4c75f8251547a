"""vLLM's GPU model runner V2, its request-state half, on the CPU: what V2 does with a step's
``SchedulerOutput`` before the forward, run on the outputs of the engine-free scheduler rig
(``scheduler_testlib.py``).

``V2Runner`` is vLLM's own ``GPUModelRunner`` (``vllm/v1/worker/gpu/model_runner.py``) without its
``__init__``, which needs CUDA (streams, the distributed groups): the parts its request-state
methods use are built here as ``__init__`` / ``load_model`` / ``initialize_kv_cache`` build them,
from vLLM's classes, on the CPU. ``execute`` runs the head of ``GPUModelRunner.execute_model``
(``finish_requests``, ``free_states``, ``add_requests``, ``update_requests``, the block table's
staged writes), then ``gather_batch_req_state``, ``prepare_inputs`` (input ids, positions, seq
lens) and ``prepare_attn`` (block tables, slot mappings), and, for the forward, the count's own
update (``postprocess_num_computed_tokens``). What does not run: the model, the attention
backends, sampling, CUDA graphs.

Two device placements are changed, for the test's lifetime only (``monkeypatch``):

- vLLM's CPU build has ``is_uva_available()`` true (for its own runner) but no pinned memory, so
  V2's UVA buffers are built with vLLM's explicit-copy fallback (``NonUvaBuffer``), the path V2
  takes on a platform without pinned memory;
- vLLM's CPU build replaces Triton by a placeholder (no CPU backend), so V2's kernels in
  ``buffer_utils``, ``input_batch`` and ``block_table`` are compiled from their own source for
  Triton's interpreter (``TRITON_INTERPRET=1``), the way the project runs its own kernels here.
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Any

import torch

KERNEL_MODULES = (
    "vllm.v1.worker.gpu.buffer_utils",
    "vllm.v1.worker.gpu.input_batch",
    "vllm.v1.worker.gpu.block_table",
)


def interpret_v2_kernels(monkeypatch: Any) -> None:
    """V2's Triton kernels, compiled for Triton's interpreter, in place of vLLM's placeholders."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton
    import triton.language as tl
    from vllm.triton_utils import tl as placeholder_tl

    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "triton", triton)
        monkeypatch.setattr(module, "tl", tl)
        for attr, fn in list(vars(module).items()):
            if not isinstance(fn, types.FunctionType) or fn.__module__ != name:
                continue
            if not inspect.getsource(fn).lstrip().startswith("@triton.jit"):
                continue
            # The placeholder's jit returned the function as written; its constexpr annotations
            # were evaluated against the placeholder, so they are restored for the interpreter.
            kernel = types.FunctionType(
                fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            kernel.__annotations__ = {
                k: tl.constexpr if v is placeholder_tl.constexpr else v
                for k, v in fn.__annotations__.items()
            }
            monkeypatch.setattr(module, attr, triton.jit(kernel))


class V2Runner:
    """vLLM's ``GPUModelRunner`` on the CPU, as far as a step's request state goes."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, monkeypatch: Any) -> None:
        from vllm.utils.math_utils import cdiv
        from vllm.v1.worker.gpu import buffer_utils
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.lora_utils import LoraState
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from vllm.v1.worker.gpu.model_states import init_model_state
        from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.states import RequestState

        monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
        interpret_v2_kernels(monkeypatch)
        device = torch.device("cpu")
        model_config = vllm_config.model_config
        sched = vllm_config.scheduler_config
        runner = GPUModelRunner.__new__(GPUModelRunner)
        runner.vllm_config = vllm_config
        runner.model_config = model_config
        runner.device = device
        runner.max_num_reqs = sched.max_num_seqs
        runner.max_num_tokens = sched.max_num_batched_tokens
        runner.max_model_len = model_config.max_model_len
        runner.vocab_size = model_config.get_vocab_size()
        runner.num_speculative_steps = 0
        runner.use_pp = False
        runner.is_last_pp_rank = True
        runner.pp_handler = None
        runner.pcp_manager = None
        runner.pooling_runner = None
        runner.encoder_cache = None  # a text-only model
        runner.adaptive_verification = None
        runner.fast_prefill = None
        runner.kv_block_zeroer = None
        runner.lora_config = None
        runner.req_states = RequestState(
            max_num_reqs=runner.max_num_reqs, max_model_len=runner.max_model_len,
            max_num_batched_tokens=runner.max_num_tokens, num_speculative_steps=0,
            vocab_size=runner.vocab_size, device=device,
        )
        runner.input_buffers = InputBuffers(runner.max_num_reqs, runner.max_num_tokens, device)
        # The model's weights play no part in request state; a text model with 1-D RoPE gets
        # the default model state (no M-RoPE state, no prompt embeddings).
        runner.model_state = init_model_state(vllm_config, torch.nn.Module(), None, device)
        runner.decode_query_len = runner.model_state.num_new_sampled_tokens_per_step
        runner.sampler = Sampler(
            vllm_config=vllm_config, max_num_reqs=runner.max_num_reqs,
            vocab_size=runner.vocab_size, device=device, req_states=runner.req_states,
            num_speculative_tokens=runner.decode_query_len,
        )
        runner.prompt_logprobs_worker = PromptLogprobsWorker(runner.max_num_reqs, device)
        runner.lora_state = LoraState(max_num_reqs=runner.max_num_reqs)
        (group,) = kv_cache_config.kv_cache_groups
        block_size = group.kv_cache_spec.block_size
        runner.block_tables = BlockTables(
            block_sizes=[block_size], max_num_reqs=runner.max_num_reqs,
            max_num_batched_tokens=runner.max_num_tokens,
            max_num_blocks_per_group=[cdiv(runner.max_model_len, block_size)], device=device,
        )
        self.runner = runner
        self.block_size = block_size

    def execute(self, scheduler_output: Any) -> dict[str, dict[str, Any]]:
        """Step ``scheduler_output`` as V2 would up to its forward, and the count's update after
        it. Per scheduled request: the computed count V2 read for the step (``num_computed``),
        its ``positions``, ``input_ids``, ``seq_len`` and ``slots`` (where its KV is written)."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        runner = self.runner
        runner.finish_requests(scheduler_output)
        runner.free_states(scheduler_output)
        runner.add_requests(scheduler_output)
        runner.update_requests(scheduler_output)
        runner.block_tables.apply_staged_writes()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return {}
        state, _ = runner.gather_batch_req_state(scheduler_output, dummy_run=False)
        # Eager, no padding: the shape a batch with a prefill runs in.
        desc = BatchExecutionDescriptor(CUDAGraphMode.NONE, state.num_tokens, None)
        batch = runner.prepare_inputs(scheduler_output, state, desc, num_active_loras=0)
        _, slot_mappings = runner.prepare_attn(batch)
        device_counts = runner.req_states.num_computed_tokens.gpu
        out: dict[str, dict[str, Any]] = {}
        starts = batch.query_start_loc_np
        for i, req_id in enumerate(batch.req_ids):
            lo, hi = int(starts[i]), int(starts[i + 1])
            out[req_id] = {
                "num_computed": int(device_counts[int(batch.idx_mapping_np[i])]),
                "positions": batch.positions[lo:hi].tolist(),
                "input_ids": batch.input_ids[lo:hi].tolist(),
                "seq_len": int(batch.seq_lens[i]),
                "slots": slot_mappings[0, lo:hi].tolist(),
            }
        runner.postprocess_num_computed_tokens(batch)
        return out

    def num_computed_tokens(self, req_id: str) -> int:
        """The device-side count V2 holds for the request now."""
        states = self.runner.req_states
        return int(states.num_computed_tokens.gpu[states.req_id_to_index[req_id]])
