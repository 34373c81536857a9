"""Modules that import only the standard library and torch, for code megarl runs inside other programs' processes.

megarl's vLLM worker extension runs inside the vLLM server, in vLLM's own environment, where megarl is not
installed: this directory goes on that server's PYTHONPATH (megarl.sampler.vllm_engine.server_env) next to
megarl/sampler/vllm_ext, so logic both sides need is written once, here.
"""
