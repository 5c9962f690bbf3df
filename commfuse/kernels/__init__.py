"""The kernels' host side: one kernel family a module (fused_tail.py, gated_norm.py, quantize.py,
p2p_allreduce.py, on the shared family.py), their LaunchPlans and the Python executor (launch.py), NVRTC and the cubin cache
(jit.py), the C++ hot path and its plan table (native.py, table.py), and the parameter structs and
constants the kernels share with the host (params.py)."""
