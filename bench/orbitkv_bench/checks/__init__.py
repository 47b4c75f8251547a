"""``orbitkv check gpu``: the Triton kernels against their references, the fused load against
device memcpy on ``bench kernels``' arms, a live server; and the numerics they share."""
