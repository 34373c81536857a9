"""The program megarl runs inside the verifiers environment (megarl/rollout/verifiers_env.py): one `verifiers`
environment, its dataset listed, its episodes run against the base_urls megarl hands it.

It imports only the standard library and `verifiers` (run as `ENV/bin/python verifiers_worker.py --env ID`, never
importing megarl: its pins fight megarl's). The whole verifiers stack runs unchanged: `vf.load_environment` builds
the environment (its taskset, its single-agent seat with the tool-less `null` chat harness in the local subprocess
runtime, the task's tool servers), and each episode is `env.run_slot` with an `EvalClientConfig` whose base_url is
the episode's session of megarl's endpoint; the task's rewards (`@vf.reward`, judges) score the trace.

Protocol: JSON lines, stdin in, stdout out (anything else the stack prints goes to stderr: fd 1 is moved there).

    out  {"type": "ready", "env": ID, "harness": "null", "tasks": [{"index": i, "prompt": [messages],
          "answer": str | null, "info": {...}}, ...]}                               once, first
    in   {"id": N, "op": "run", "task": i, "base_url": URL, "timeout_s": S}         one episode
    out  {"type": "result", "id": N, "ok": bool, "reward": float, "rewards": {name: {"score", "weight"}},
          "metrics": {...}, "messages": [...], "turns": int, "errors": [str]}        when it ended
    out  {"type": "error", "id": N | null, "error": str}                           a request it cannot run
    in   {"op": "close"}  (or end of input)                                         cancel what runs, exit 0

Episodes run concurrently (asyncio; at most --max-concurrent at once), each bounded by its request's timeout_s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
import traceback

if __package__:  # imported as a megarl module (the tests)
    from megarl.rollout.worker_lines import check_request, protocol_stdout, refuse_start, send
else:  # run as a file by its environment's Python, which has no megarl: the sibling file
    from worker_lines import check_request, protocol_stdout, refuse_start, send

API_KEY_VAR = "MEGARL_VERIFIERS_API_KEY"  # the session URL carries megarl's secret; the key is a placeholder
HARNESS = "null"  # the tool-less chat loop (with the task's MCP tools): model calls only, no model-written code


def _task_row(index: int, data, base_fields) -> dict:
    """One task as megarl reads it: the opening messages, the answer (if the data has one), and the fields the
    task's own data type adds (not verifiers' TaskData fields: runtime settings, not the task) as info."""
    fields = data.model_dump(mode="json", exclude_none=True)
    messages = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt or []]
    answer = fields.get("answer")
    info = {k: v for k, v in fields.items() if k != "answer" and k not in base_fields}
    return {"index": index, "prompt": messages, "answer": None if answer is None else str(answer), "info": info}


def _result(request_id: int, episode) -> dict:
    traces = episode.traces
    rewards, metrics, messages, turns = {}, {}, [], 0
    for trace in traces:
        rewards.update({name: None if r is None else {"score": r.score, "weight": r.weight}
                        for name, r in trace.rewards.items()})
        metrics.update({name: value for name, value in trace.metrics.items()})
        messages = [m.model_dump(mode="json", exclude_none=True) for m in trace.messages]
        turns += trace.num_turns
    reward = sum(t.reward for t in traces)
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    errors += [f"{e.type}: {e.message}" for t in traces for e in t.errors]
    ok = bool(episode.ok) and not errors and math.isfinite(reward)
    return {"type": "result", "id": request_id, "ok": ok, "reward": reward if math.isfinite(reward) else 0.0,
            "rewards": rewards, "metrics": metrics, "messages": messages, "turns": turns, "errors": errors}


class Worker:
    def __init__(self, env_id: str, model: str, max_concurrent: int, out):
        import verifiers.v1 as vf

        self.vf, self.model, self.out = vf, model, out
        self.write_lock = threading.Lock()
        config = vf.resolve_env_config({"taskset": {"id": env_id},
                                        "agent": {"harness": {"id": HARNESS}, "runtime": {"type": "subprocess"}}})
        self.env = vf.load_environment(config)
        self.env_id = env_id
        if not self.env.taskset.bounded:
            raise ValueError(f"verifiers environment {env_id!r}: its taskset is infinite; megarl lists the whole "
                             f"dataset as prompts, so it needs a finite one")
        self.tasks = list(self.env.taskset)
        if not self.tasks:
            raise ValueError(f"verifiers environment {env_id!r}: its taskset has no tasks")
        self.gate = asyncio.Semaphore(max_concurrent)
        os.environ.setdefault(API_KEY_VAR, "megarl")

    def send(self, message: dict) -> None:
        send(self.out, self.write_lock, message)

    def ready(self) -> dict:
        return {"type": "ready", "env": self.env_id, "harness": HARNESS,
                "tasks": [_task_row(i, task.data, self.vf.TaskData.model_fields) for i, task in enumerate(self.tasks)]}

    async def run(self, request: dict) -> None:
        from verifiers.v1.env import RunSlot

        request_id = request["id"]
        try:
            task = self.tasks[request["task"]]
            ctx = self.vf.ModelContext(model=self.model, client=self.vf.EvalClientConfig(
                base_url=request["base_url"], api_key_var=API_KEY_VAR))
            async with self.gate:
                episode = await asyncio.wait_for(self.env.run_slot(RunSlot(task), ctx), request["timeout_s"])
            self.send(_result(request_id, episode))
        except asyncio.TimeoutError:
            self.send({"type": "error", "id": request_id,
                       "error": f"episode of task {request['task']} ran past {request['timeout_s']:g}s"})
        except Exception as exc:  # noqa: BLE001 - one episode's failure is that episode's answer
            self.send({"type": "error", "id": request_id, "error": f"{type(exc).__name__}: {exc}\n"
                                                                   f"{traceback.format_exc(limit=-3)}"[-4000:]})


async def serve(worker: Worker, lines: asyncio.Queue) -> None:
    running: set[asyncio.Task] = set()
    async with worker.env.serving():
        worker.send(worker.ready())
        while True:
            line = await lines.get()
            if line is None:
                break
            try:
                request = json.loads(line)
            except ValueError as exc:
                worker.send({"type": "error", "id": None, "error": f"request is not JSON: {exc}"})
                continue
            if (problem := check_request(request)) is not None:
                worker.send({"type": "error", "id": request.get("id") if isinstance(request, dict) else None,
                             "error": problem})
                continue
            if request["op"] == "close":
                break
            if not 0 <= request["task"] < len(worker.tasks):
                worker.send({"type": "error", "id": request["id"],
                             "error": f"task {request['task']} out of range (0..{len(worker.tasks) - 1})"})
                continue
            job = asyncio.create_task(worker.run(request))
            running.add(job)
            job.add_done_callback(running.discard)
        for job in running:
            job.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="megarl's verifiers worker (JSON lines on stdin/stdout)")
    parser.add_argument("--env", required=True, help="the verifiers taskset/environment id (an installed package)")
    parser.add_argument("--model", default="megarl", help="the model name sent with each request")
    parser.add_argument("--max-concurrent", type=int, default=4)
    args = parser.parse_args(argv)
    out = protocol_stdout()
    loop = asyncio.new_event_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read() -> None:  # blocking stdin on its own thread; the loop only sees whole lines
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    try:
        worker = Worker(args.env, args.model, args.max_concurrent, out)
    except Exception as exc:  # noqa: BLE001 - told to megarl as the first line, then exit
        return refuse_start(out, f"loading verifiers environment {args.env!r}", exc)
    threading.Thread(target=read, daemon=True, name="stdin").start()
    loop.run_until_complete(serve(worker, lines))  # serving() has torn down the tool servers and interception
    out.flush()
    # Exit without collecting the stack's leftover objects: their finalizers need the event loop (asyncio's
    # subprocess transports print "Event loop is closed" to stderr otherwise), and nothing is left to clean up.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
