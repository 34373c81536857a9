"""Code that runs inside vLLM's worker process (this directory goes on the server's PYTHONPATH).

Its modules import only the standard library, torch and (at call time) vLLM: the server runs in the separate
vLLM environment (megarl.sampler.vllm_env), where megarl itself is not installed (megarl/portable, on the same
PYTHONPATH, holds the torch-only logic they share with megarl, such as the LoRA merge).
"""
