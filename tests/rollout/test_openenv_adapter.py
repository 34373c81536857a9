"""task.env=openenv:<module>:<attr> without the openenv package: the spec and config refusals before launch, the
worker's pure mapping of OpenEnv schemas and observations (megarl/rollout/openenv_worker.py imports only the
standard library at module level), its request checks, and the adapter driving a stand-in worker. The real package:
tests/rollout/test_openenv_real.py (marker `openenv`)."""
import sys
from pathlib import Path

import pytest

from megarl.config.load import ConfigError, load_config
from megarl.rollout import openenv_worker
from megarl.rollout.env_adapters import agent_for
from megarl.rollout.env_worker import Worker
from megarl.rollout.openenv_adapter import META_ENV, META_TASK, OpenEnvTask, env_id_of, run_episode

FAKE = str(Path(__file__).with_name("fake_verifiers_worker.py"))  # speaks the same worker protocol


def test_env_specs_are_refused_before_launch_by_name():
    assert env_id_of("openenv:echo_env.server.app:app") == "echo_env.server.app:app"
    for spec in ("openenv:echo_env", "openenv:", "openenv:a b:app", "openenv:m:", "verifiers:x"):
        with pytest.raises(ValueError, match="task.env"):
            env_id_of(spec)
    for spec in ("openenv:echo_env", "openenv:", "openenv:m:", "gym:CartPole"):
        with pytest.raises(ConfigError, match="task.env"):
            load_config(None, [f"task.env={spec}", "eval.sets=[]"], check_files=False)
    with pytest.raises(ConfigError, match="task.env_tasks"):
        load_config(None, ["task.env=openenv:m:app", "eval.sets=[]", "task.env_tasks=0"], check_files=False)
    for key, value in (("task.agent", "m:f"), ("task.reward_fn", "m:f"), ("task.path", "x.jsonl")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["task.env=openenv:m:app", "eval.sets=[]", f"{key}={value}"], check_files=False)
    cfg = load_config(None, ["task.env=openenv:m.server.app:app", "eval.sets=[]"], check_files=False)
    assert agent_for(cfg.task) == "megarl.rollout.openenv_adapter:run_episode"


def test_the_action_must_have_one_required_text_field():
    text = {"type": "string"}
    assert openenv_worker.action_field({"properties": {"message": text, "metadata": {"type": "object"}},
                                        "required": ["message"]}) == "message"
    assert openenv_worker.action_field({"properties": {"code": text}}) == "code"
    for schema in ({"properties": {"x": {"type": "integer"}}, "required": ["x"]},  # not text
                   {"properties": {"a": text, "b": text}, "required": ["a", "b"]},  # two fields to fill
                   {"properties": {"a": text, "n": {"type": "integer"}}, "required": ["a", "n"]},
                   {"properties": {"metadata": {"type": "object"}}}):  # nothing to fill
        with pytest.raises(ValueError, match="exactly one required string field"):
            openenv_worker.action_field(schema)


def test_observations_read_as_their_text_or_their_fields():
    assert openenv_worker.observation_text({"text": "higher", "metadata": {"k": 1}}) == "higher"
    assert openenv_worker.observation_text({"board": [1, 2], "msg": "go"}) == '{"board": [1, 2], "msg": "go"}'
    with pytest.raises(ValueError, match="finite number"):
        openenv_worker._reward(float("nan"))
    assert openenv_worker._reward(None) == 0.0 and openenv_worker._reward(1) == 1.0


def test_episodes_run_through_the_worker_and_return_its_reward():
    worker = Worker([sys.executable, FAKE, "ok"], label="openenv worker").start(20.0)
    try:
        task = OpenEnvTask("openenv:m:app", worker=worker, agent_timeout_s=10.0)
        prompt = task.prompts[0]
        assert prompt.meta[META_ENV] == "m:app" and prompt.meta[META_TASK] == 0
        assert prompt.meta["data_source"] == "openenv:m:app"
        assert run_episode("http://u", prompt.text, prompt.answer, prompt.meta) == 1.0
    finally:
        worker.close()


def test_an_endpoint_error_names_its_status_not_the_session_url():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuses(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.dumps({"error": {"code": "context_length_exceeded"}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/sessions/SECRET-TOKEN/v1/chat/completions"
        with pytest.raises(RuntimeError, match="HTTP 400.*context_length_exceeded") as err:
            openenv_worker._post(url, {"messages": []}, 10.0)
        assert "SECRET-TOKEN" not in str(err.value)
    finally:
        server.shutdown()
