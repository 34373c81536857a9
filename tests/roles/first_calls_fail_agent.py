"""An agent whose first FAILING calls raise before making any request; later calls run the shipped agent
(docs/examples/agent/tool_agent.py). Used by tests/roles/test_multiturn_e2e.py: the calls a thread pool starts
first are the first group's episodes, so that group fails whole and the next one in part."""
import threading

FAILING = 6
_lock = threading.Lock()
_calls = 0


def run(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    global _calls
    with _lock:
        _calls += 1
        call = _calls
    if call <= FAILING:
        raise RuntimeError(f"call {call} fails before its first request")
    from tool_agent import run as tool_agent_run  # on the sampler's path (docs/examples/agent), not the test's
    return tool_agent_run(base_url, prompt, answer, meta)
