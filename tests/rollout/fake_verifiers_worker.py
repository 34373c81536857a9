"""A stand-in for megarl/rollout/verifiers_worker.py speaking its protocol (stdlib only), misbehaving on demand:
argv[1] is the mode. tests/rollout/test_verifiers_adapter.py drives the adapter's validation with it."""
import json
import sys
import time

mode = sys.argv[1]
READY = {"type": "ready", "env": "fake", "harness": "null",
         "tasks": [{"index": 0, "prompt": [{"role": "user", "content": "2+2"}], "answer": "4", "info": {"k": 1}}]}
if mode == "silent":
    time.sleep(60)
if mode == "fails_to_load":
    print(json.dumps({"type": "error", "id": None, "error": "ModuleNotFoundError: taskset 'nope' not found"}))
    sys.exit(1)
print(json.dumps(READY if mode != "bad_ready" else dict(READY, tasks=[{"index": 0, "prompt": "2+2"}])), flush=True)
for n, line in enumerate(sys.stdin):
    request = json.loads(line)
    if mode == "slow_first" and n == 0:
        time.sleep(3)  # the adapter stopped waiting after 0.5 s: this answer arrives late
    if request.get("op") == "close":
        break
    result = {"type": "result", "id": request["id"], "ok": True, "reward": 1.0,
              "rewards": {"correct": {"score": 1.0, "weight": 1.0}}, "metrics": {}, "turns": 1, "errors": [],
              "messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}
    if mode == "not_json":
        print("Traceback (most recent call last): oops", flush=True)
    elif mode == "nan_reward":
        print(json.dumps(dict(result, reward="NaN")), flush=True)
    elif mode == "crash":
        print("worker: something broke", file=sys.stderr, flush=True)
        sys.exit(3)
    elif mode == "failed_episode":
        print(json.dumps(dict(result, ok=False, errors=["HarnessError: the program exited 1"])), flush=True)
    else:
        print(json.dumps(result), flush=True)
