"""RoPE specification: what a relocation needs to know about a model's rotary embedding.

A stored key is ``s * R(p) k`` where ``R(p)`` rotates pairs of features by ``p * inv_freq[i]`` and
``s`` is a scaling the model folds into cos/sin (YaRN's mscale). Relocating by ``delta`` is the pure
rotation ``R(delta)``: ``s`` is already inside the stored key and must not be applied again. So a spec
holds only the pair layout and the (possibly scaled) inverse frequencies, never the mscale.

M-RoPE (Qwen2-VL family): every frequency band reads one of the t/h/w position streams. A uniform
shift of all three by ``delta`` (what moving a chunk does) is a 1-D rotation by ``delta`` in M-RoPE
position units, so the same spec serves it.

MLA (DeepSeek-V2): the cache row is ``[kv_c | k_pe]``; only the ``k_pe`` band rotates. ``rope_offset``
says where that band starts.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Literal

import torch
import xxhash

Style = Literal["neox", "gptj"]


@dataclasses.dataclass(frozen=True, slots=True)
class RopeSpec:
    """Pair layout and frequencies of a rotary embedding, as seen by a stored key row.

    head_dim: width of one stored key row (for MLA, ``kv_lora_rank + qk_rope_head_dim``).
    rotary_dim: width of the rotated band (``< head_dim`` for partial rotary and MLA).
    rope_offset: first feature of the rotated band (0, or ``kv_lora_rank`` for MLA).
    style: ``neox`` pairs feature i with i + rotary_dim/2; ``gptj`` pairs 2i with 2i+1.
    inv_freq: the ``rotary_dim // 2`` inverse frequencies, scaling already applied.
    """

    style: Style
    head_dim: int
    rotary_dim: int
    inv_freq: tuple[float, ...]
    rope_offset: int = 0
    is_mrope: bool = False

    def __post_init__(self) -> None:
        if self.style not in ("neox", "gptj"):
            raise ValueError(f"RopeSpec.style must be 'neox' or 'gptj', got {self.style!r}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"RopeSpec.rotary_dim must be even and positive, got {self.rotary_dim}")
        if self.rope_offset < 0 or self.rope_offset + self.rotary_dim > self.head_dim:
            raise ValueError(
                f"RopeSpec band [{self.rope_offset}, {self.rope_offset + self.rotary_dim}) "
                f"does not fit head_dim={self.head_dim}"
            )
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(
                f"RopeSpec.inv_freq has {len(self.inv_freq)} entries, expected rotary_dim/2="
                f"{self.rotary_dim // 2}"
            )

    def inv_freq_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.inv_freq, dtype=torch.float64, device=device)

    def cos_sin(
        self, delta: int | torch.Tensor, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin of ``delta * inv_freq``, shape ``[num_deltas, rotary_dim // 2]``.

        The angle is formed in fp64 so a large delta does not lose the phase; cos/sin are rounded
        once to fp32, the precision the kernels rotate in.
        """
        d = torch.as_tensor(delta, dtype=torch.float64, device="cpu").reshape(-1)
        angle = d[:, None] * self.inv_freq_tensor()[None, :]
        return angle.cos().float().to(device), angle.sin().float().to(device)

    def fingerprint(self) -> str:
        """Stable hash of everything that changes the meaning of a stored key row."""
        h = xxhash.xxh3_64()
        h.update(f"{self.style}|{self.head_dim}|{self.rotary_dim}|{self.rope_offset}|{self.is_mrope}".encode())
        h.update(torch.tensor(self.inv_freq, dtype=torch.float64).numpy().tobytes())
        return h.hexdigest()

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeSpec:
        """Derive the spec from a Hugging Face config, using transformers' own rope initialisers."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", "")
        is_mla = getattr(text, "kv_lora_rank", None) is not None and hasattr(text, "qk_rope_head_dim")
        if is_mla:
            rotary_dim = int(text.qk_rope_head_dim)
            head_dim = int(text.kv_lora_rank) + rotary_dim
            rope_offset = int(text.kv_lora_rank)
        else:
            head_dim = int(
                getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            )
            factor = getattr(text, "partial_rotary_factor", None)
            factor = float(factor or _rope_parameters(text).get("partial_rotary_factor", 1.0) or 1.0)
            rotary_dim = int(head_dim * factor)
            rope_offset = 0
        params = _rope_parameters(text)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type in _VLLM_ROPE_ALIASES:
            text = _with_rope_type(text, _VLLM_ROPE_ALIASES[rope_type])
            rope_type = _VLLM_ROPE_ALIASES[rope_type]
        inv_freq = _inv_freq(text, rope_type, rotary_dim, ROPE_INIT_FUNCTIONS)
        style: Style = "gptj" if is_mla or model_type in _GPTJ_TYPES else "neox"
        is_mrope = "mrope_section" in params
        return cls(
            style=style,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            inv_freq=tuple(float(x) for x in inv_freq),
            rope_offset=rope_offset,
            is_mrope=is_mrope,
        )

    @classmethod
    def from_vllm_rotary(cls, rotary: Any, head_dim: int | None = None, rope_offset: int = 0) -> RopeSpec:
        """Derive the spec from a vLLM ``RotaryEmbedding`` module (any scaled subclass).

        The frequencies are read back from an fp32 cos/sin table, never from ``rotary.cos_sin_cache``
        as the model holds it: vLLM casts that buffer to the model dtype, and bf16 cos/sin give the
        frequencies to only ~3e-3, a phase error of radians after a few thousand positions.
        """
        rotary_dim = int(rotary.rotary_dim)
        style: Style = "neox" if getattr(rotary, "is_neox_style", True) else "gptj"
        return cls(
            style=style,
            head_dim=int(head_dim if head_dim is not None else getattr(rotary, "head_size", rotary_dim)),
            rotary_dim=rotary_dim,
            inv_freq=tuple(float(x) for x in _vllm_inv_freq(rotary, rotary_dim // 2)),
            rope_offset=rope_offset,
            is_mrope=getattr(rotary, "mrope_section", None) is not None,
        )


def _vllm_inv_freq(rotary: Any, half: int) -> torch.Tensor:
    table = None
    compute = getattr(rotary, "_compute_cos_sin_cache", None)
    if compute is not None:
        try:
            table = compute()
        except (TypeError, AttributeError, RuntimeError):
            table = None
    if table is None or table.dtype not in (torch.float32, torch.float64):
        table = rotary.cos_sin_cache
    # Row p of the table holds [cos(p f) * s, sin(p f) * s]; row 1 gives f, whatever the scale s.
    row = table[1].detach().double().cpu()
    approx = torch.atan2(row[half : 2 * half], row[:half])
    # Prefer the module's own frequencies, bit for bit, when one of its formulas reproduces row 1.
    for exact in _vllm_inv_freq_candidates(rotary):
        if exact.numel() == half and torch.allclose(exact, approx, rtol=1e-5, atol=0.0):
            return exact
    if table.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"cannot recover exact RoPE frequencies from {type(rotary).__name__}: its cos/sin "
            f"table is {table.dtype} and no fp32 table or frequency formula is available"
        )
    return approx


def _vllm_inv_freq_candidates(rotary: Any) -> list[torch.Tensor]:
    compute = getattr(rotary, "_compute_inv_freq", None)
    if compute is None:
        return []
    found = []
    # YaRN-style subclasses take the scaling factor, the rest take the base.
    for arg in (getattr(rotary, "scaling_factor", None), getattr(rotary, "base", None)):
        if arg is None:
            continue
        try:
            found.append(compute(arg).detach().double().cpu().reshape(-1))
        except (TypeError, AttributeError, RuntimeError):
            continue
    # Linear scaling divides positions, not frequencies: row 1 is at f / factor.
    factors = getattr(rotary, "scaling_factors", None)
    if factors:
        found += [f / float(factors[0]) for f in list(found)]
    return found


# vLLM's DeepSeek model files rename the rope type inside the live hf_config at model build time
# (so a worker sees "deepseek_yarn" where the scheduler saw "yarn"); the frequencies are YaRN's.
_VLLM_ROPE_ALIASES = {"deepseek_yarn": "yarn", "deepseek_llama_scaling": "yarn"}

# Frequencies that change with the sequence length: no single rotation moves a stored key.
_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})


def _with_rope_type(text: Any, rope_type: str) -> Any:
    text = copy.deepcopy(text)
    text.rope_parameters = dict(_rope_parameters(text), rope_type=rope_type)
    return text


# Model types whose HF implementation pairs adjacent features (complex multiply) rather than halves.
_GPTJ_TYPES = frozenset({"gptj", "codegen", "deepseek_v2", "deepseek_v3", "glm", "chatglm"})


def _rope_parameters(text: Any) -> dict[str, Any]:
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_theta" not in params and hasattr(text, "rope_theta"):
        params["rope_theta"] = text.rope_theta
    return params


def _inv_freq(text: Any, rope_type: str, rotary_dim: int, init_functions: dict) -> torch.Tensor:
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(f"rope type '{rope_type}' changes its frequencies with the sequence length")
    if rope_type != "default" and rope_type not in init_functions:
        # Falling back to plain theta^(-2i/d) would relocate with silently wrong frequencies.
        raise ValueError(f"unknown rope type '{rope_type}'")
    if rope_type != "default":
        inv_freq, _attention_scaling = init_functions[rope_type](text, "cpu")
    else:
        base = float(_rope_parameters(text).get("rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    inv_freq = inv_freq.double().reshape(-1)
    if inv_freq.numel() != rotary_dim // 2:
        raise ValueError(
            f"rope init '{rope_type}' gave {inv_freq.numel()} frequencies, expected {rotary_dim // 2}"
        )
    if not torch.isfinite(inv_freq).all() or (inv_freq <= 0).any() or math.isnan(float(inv_freq.sum())):
        raise ValueError(f"rope init '{rope_type}' gave non-positive or non-finite frequencies")
    return inv_freq
