"""``kvmesh demo``: a real-model fleet and an emulated llm-d fleet, each compared with and without kvmesh.

It sits above the fleet launcher and the benchmark harness and composes them: ``run`` (both parts and
their tables), ``real_vllm`` (the real-model part on vLLM servers) and ``cli`` (the command).
"""

from kvmesh.demo.run import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
