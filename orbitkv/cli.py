"""``orbitkv`` command line: a table of sub-commands, each a module with ``main(argv) -> int``.

Modules are imported only when their command runs, so ``orbitkv store ls`` never imports vLLM.
The benches and the lab are not in the serving wheel: their commands stay here, and where their
distribution is not installed the command says what to install and exits 2.
"""

from __future__ import annotations

import importlib
import sys

# Top-level packages outside the serving wheel: (what it is, the checkout's install line).
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "orbitkv_lab": ("OrbitKV's lab", "pip install -e lab"),
    "orbitkv_bench": ("OrbitKV's bench", "pip install -e lab -e bench"),
}

# (words, "module:function", help). The longest matching word prefix wins.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("make-model",), "orbitkv.models.make_model:main", "write a tiny local model directory"),
    (("model", "smollm2"), "orbitkv.models.smollm2:main", "build (once) the real SmolLM2-135M checkpoint"),
    (("check", "operator"), "orbitkv_lab.checks.operator:main", "exactness of relocate/patch"),
    (("check", "window"), "orbitkv_lab.checks.window:main", "window operations in vLLM vs re-prefill"),
    (("check", "gpu"), "orbitkv_bench.checks.gpu:main", "Triton kernels, load vs memcpy, live V2 server (CUDA)"),
    (("check", "exactness"), "orbitkv.checks.exactness:main", "a live server never passes approximate KV as exact"),
    (("check", "batch-variance"), "orbitkv_lab.checks.batch_variance:main", "does vLLM compute a token the same in a shorter step?"),
    (("check", "step-split"), "orbitkv_lab.checks.step_split:main", "real model: vLLM alone, a prefix-cache hit vs one prefill"),
    (("bench", "kernels"), "orbitkv_bench.kernels:main", "fused load throughput vs memcpy"),
    (("bench", "store"), "orbitkv_bench.store:main", "store tiers vs raw I/O"),
    (("bench", "agent"), "orbitkv_bench.agent:main", "agent trace: OrbitKV vs APC vs none"),
    (("bench", "replicas"), "orbitkv_bench.replicas:main", "agent trace on repeated servers: the noise between twins"),
    (("bench", "fidelity"), "orbitkv_bench.fidelity:main", "answers on real weights: each reuse mode vs full prefill"),
    (("bench", "bytes"), "orbitkv_bench.bytes:main", "store budget: canonical + patches vs conditioned entries"),
    (("bench", "holes"), "orbitkv_bench.holes:main", "a hole's cost vs the same tokens as a prefix"),
    (("bench", "fleet"), "orbitkv_bench.fleet:main", "compose fleet run locally: sessions, moves, faults"),
    (("store",), "orbitkv.store.cli:main", "stats | ls | verify | gc"),
    (("store", "compile"), "orbitkv.connector.worker.compile:main", "form every patch the stored entries allow"),
    (("demo",), "orbitkv.agent.demo:main", "the main job: vLLM + OrbitKV on an agent workload"),
    (("serve",), "orbitkv.serving.serve:main", "vLLM OpenAI server with OrbitKV"),
    (("route",), "orbitkv.routing.service:main", "routing front: chunk-set or prefix ranking from KV events"),
    (("audit",), "orbitkv.serving.audit:main", "the live audit of approximate requests, as a sidecar"),
    (("fidelity",), "orbitkv_lab.fidelity.cli:main", "fidelity lab against competing repairs"),
]


def _usage() -> str:
    lines = ["usage: orbitkv COMMAND [ARGS...]", "", "commands:"]
    for words, _, text in COMMANDS:
        lines.append(f"  {' '.join(words):<18} {text}")
    return "\n".join(lines)


def _missing_part(missing: str | None, module_name: str) -> str | None:
    """Why the command cannot run when importing its module missed ``missing``: a distribution
    outside the serving wheel, or a module not written yet; None for anything else (raised)."""
    top = (missing or "").split(".")[0]
    if top in OPTIONAL_PACKAGES:
        what, install = OPTIONAL_PACKAGES[top]
        return f"is part of {what}, not the serving wheel: from a checkout, `{install}`"
    if missing == module_name:
        return "is not built yet"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from orbitkv import __version__

        print(__version__)
        return 0
    for words, target, _ in sorted(COMMANDS, key=lambda c: -len(c[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, func_name = target.split(":")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                missing = _missing_part(exc.name, module_name)
                if missing is None:
                    raise
                print(f"orbitkv: '{' '.join(words)}' {missing}", file=sys.stderr)
                return 2
            return int(getattr(module, func_name)(argv[len(words) :]) or 0)
    print(f"orbitkv: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
