"""Code that runs inside vLLM's worker process (this directory goes on the server's PYTHONPATH).

Its modules import only the standard library, torch and (at call time) vLLM: the server runs in the separate
vLLM environment (megarl.sampler.vllm_env), where megarl itself is not installed.
"""
