"""Fidelity lab: OrbitKV's relocate + patch against token-recompute (CacheBlend, VLCache, MPIC,
EPIC) and storage/selection (KVCapsule, MM-ShiftKV) repairs, all given the same relocated KV.

``orbitkv fidelity --arch ARCH --json --plot DIR`` (``orbitkv_lab.fidelity.cli``); see
``docs/fidelity.md``.
"""
