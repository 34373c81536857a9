"""sampler.engine=vllm against a real vLLM 0.32.0 server on CPU (never mocked).

One server for the module (module fixture); the fault test, last, stops and kills it. Every log-prob is checked
against a transformers forward of the same HF model in fp32, with the weights of the version megarl assigned to
the token -- and checked *not* to match the other version (what AReaL #1569's mislabelling would give).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megarl.protocols import GenerationRequest, SamplingParams
from tests.helpers import draw_adapter

from . import intruder
from .conftest import start_engine

pytestmark = pytest.mark.vllm

EOS = 256
TEMPERATURE = 0.7  # != 1, so raw (un-tempered) and processed log-probs differ


@pytest.fixture(scope="module")
def engine(vllm_python, vllm_model_dir, tmp_path_factory):
    engine = start_engine(vllm_python, vllm_model_dir, tmp_path_factory.mktemp("vllm"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf(vllm_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="module")
def served(hf):
    """{"weights": what the module's server runs now}: the model's own until an update test loads others."""
    return {"weights": hf[0].state_dict()}


def _requests(tok, prompts, n, max_new_tokens=48, temperature=TEMPERATURE, tag="r"):
    out = []
    for i in range(n):
        ids = tok.encode(prompts[i % len(prompts)], add_special_tokens=False)
        out.append(GenerationRequest(f"{tag}{i}", ids, SamplingParams(temperature, 1.0, 0, max_new_tokens),
                                     stop_token_ids=(EOS,)))
    return out


@torch.no_grad()
def _hf_logprobs(model, prompt, tokens, temperature):
    """(tempered, raw) log-probs of `tokens` after `prompt` under `model`, one fp32 forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    target = torch.tensor(tokens)[:, None]
    tempered = torch.log_softmax(logits / temperature, -1).gather(1, target)[:, 0]
    raw = torch.log_softmax(logits, -1).gather(1, target)[:, 0]
    return tempered, raw


@torch.no_grad()
def _hf_logprobs_over_kept_kv(old, new, prompt, tokens, boundary, temperature):
    """Log-probs of tokens[boundary:] as an engine that keeps the KV cache across a swap computes them
    (kv_on_update=keep): the new weights attend over K/V the old weights wrote for prompt + tokens[:boundary-1]
    (token boundary-1 is the first input of the first step after the swap, so its K/V are the new weights')."""
    seq = list(prompt) + list(tokens)
    split = len(prompt) + boundary - 1  # inputs [0, split) ran under the old weights
    out = old(input_ids=torch.tensor([seq[:split]]), use_cache=True)
    logits = new(input_ids=torch.tensor([seq[split:-1]]), cache=out.cache,
                 use_cache=True).logits[0].float()
    target = torch.tensor(tokens[boundary:])[:, None]
    return torch.log_softmax(logits / temperature, -1).gather(1, target)[:, 0]


def test_generation_and_lag0_logprobs_match_transformers(engine, hf):
    """Behaviour log-probs = log_softmax(logits / T) of the sampled token over the full vocabulary (vLLM's
    processed_logprobs), to fp32 rounding; vLLM's default raw_logprobs (no temperature) would be far off."""
    model, tok = hf
    start = time.monotonic()
    completions = engine.generate(_requests(tok, ["a-k=", "d-q=", "m-z=", "b-e="], 8))
    elapsed = time.monotonic() - start
    gaps, raw_gaps, n = [], [], 0
    for c in completions:
        assert c.finish_reason in ("stop", "length")
        assert c.versions == [0] * len(c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) > 0
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS  # the stop token is included, as megarl's contract says
        tempered, raw = _hf_logprobs(model, c.prompt_ids, c.token_ids, TEMPERATURE)
        got = torch.tensor(c.logprobs)
        gaps.append((got - tempered).abs().max().item())
        raw_gaps.append((got - raw).abs().max().item())
        n += len(c.token_ids)
    print(f"\nlag-0 |vLLM - transformers| max over {n} tokens: {max(gaps):.2e} (vs raw log-probs: {max(raw_gaps):.2e}); "
          f"{n / elapsed:.0f} tokens/s")
    assert max(gaps) < 1e-4
    assert max(raw_gaps) > 1e-2  # the mode matters: un-tempered log-probs would be wrong


def _tcp_listeners(pids) -> list[str]:
    """The TCP sockets (v4 and v6) in LISTEN state held by any of `pids`, as "pid hexaddr:hexport"."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening[fields[9]] = fields[1]
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                out.append(f"{pid} {listening[target[8:-1]]}")
    return out


def _process_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(entry))
    return pids


def _as_nobody(path: str, route: str, body: dict):
    """intruder.call(path, route, body) from a forked child running as uid/gid 65534; its result (the error name
    of the connect, or "reached" if the request got through)."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit (the parent has threads)
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            result = intruder.call(path, route, body)
            code = 13 if result == "PermissionError" else 3 if result == "FileNotFoundError" else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {13: "PermissionError", 3: "FileNotFoundError", 0: "reached"}.get(os.waitstatus_to_exitcode(status),
                                                                              f"exit {status}")


def test_a_process_outside_the_run_cannot_pause_the_server_or_call_its_worker(engine, hf):
    """N2: the dev-mode routes (/pause, /collective_rpc, /resume) take no key in vLLM 0.32. The server listens on
    no TCP port (its HTTP server is on a Unix socket in a 0700 directory of the sampler's): a process of another
    user gets PermissionError on connect, for /pause and /collective_rpc alike. A process that reaches the socket
    without the server's keys gets 401 on /v1 and has every worker-extension call refused (unsigned megarl_join,
    an unsigned megarl_update of a zeroed model.norm.weight, one with a forged HMAC). Afterwards the server still
    generates with the weights it served (nothing was loaded) and the sampler's own signed calls still go through
    (the forged counter did not advance the worker's)."""
    import json
    import stat
    import subprocess
    import sys
    from pathlib import Path

    sockets = engine.socket_dir
    info = os.stat(sockets.dir)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert stat.S_ISSOCK(os.stat(sockets.path).st_mode) and engine.client.url == f"unix:{sockets.path}"
    api_pid = engine.server.proc.pid
    assert _tcp_listeners([api_pid]) == []  # the HTTP server: no port at all
    zmq = [p.name for p in sockets.dir.iterdir() if p.name != "http.sock"]
    print(f"\nserver sockets in {sockets.dir}: http.sock + {len(zmq)} of vLLM's ZeroMQ; TCP listeners of the "
          f"server's other processes (torch's own bootstrap store): {_tcp_listeners(_process_group(api_pid))}")
    with open(f"/proc/{api_pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert engine.client.headers["Authorization"].split()[1].encode() not in cmdline
    assert engine._rpc_key not in cmdline

    if os.geteuid() == 0:  # another user (nobody): the kernel refuses the connect, the directory being 0700
        assert _as_nobody(sockets.path, "/pause?mode=keep", {}) == "PermissionError"
        assert _as_nobody(sockets.path, "/collective_rpc", intruder.rpc("megarl_update", "{}")) == "PermissionError"
    else:
        print("not root: the other-user connect is not tried (the 0700 directory above is what refuses it)")
    command = [sys.executable, str(Path(intruder.__file__)), sockets.path]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "MEGARL_VLLM_RPC_KEY")}
    out = subprocess.run(command + ["completions", "join", "update", "update_forged"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    print(f"a process with the socket but not the keys: {got}")
    assert got["completions"][0] == 401
    for call, why in (("join", "not a signed call"), ("update", "not a signed call"),
                      ("update_forged", "wrong signature")):
        assert got[call][0] == 500 and "refused" in got[call][1] and why in got[call][1], (call, got[call])

    assert isinstance(engine._rpc("megarl_counts", {}, 60.0), dict)  # the sampler's own next call is accepted
    model, tok = hf  # the module's server still runs the model's own weights here (`served`)
    for c in engine.generate(_requests(tok, ["a-k="], 2, tag="after-intruder")):
        tempered, _ = _hf_logprobs(model, c.prompt_ids, c.token_ids, TEMPERATURE)
        assert (torch.tensor(c.logprobs) - tempered).abs().max() < 1e-4  # the zeroed norm was never loaded


def _perturbed(model, scale=0.5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {name: (t + scale * t.std() * torch.randn(t.shape, generator=gen)).contiguous()
            for name, t in model.state_dict().items() if name in _names(model)}


def _names(model):
    from safetensors import safe_open

    with safe_open(os.path.join(model.name_or_path, "model.safetensors"), "pt") as f:
        return set(f.keys())


LORA = {"rank": 4, "alpha": 8.0}


def _adapter_version(model, engine, directory, seed=7):
    """learner.lora: switch the module's server to adapter versions (VLLMEngine.take_adapters: the worker keeps the
    checkpoint's frozen base) and draw an adapter whose update is about half each weight's spread, as `_perturbed`
    is. Returns (the adapter, the model it makes as *peft* merges it onto the checkpoint's base): the expected
    weights come from peft, not from megarl's merge, and from the base, not from what the server ran before."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.config.schema import LoraConfig
    from megarl.models import lora

    cfg = LoraConfig(**LORA)
    engine.take_adapters(cfg)
    spec = lora.adapter_spec(model.config.to_dict(), cfg)
    assert {name: tuple(shape) for name, shape, _ in spec} == {n: tuple(s) for n, (s, _) in engine.weight_spec().items()}
    adapter = draw_adapter(model.state_dict(), model.config.to_dict(), cfg, seed=seed)
    lora.save_peft(directory, adapter, cfg, model.name_or_path)
    base_model = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32)
    return adapter, PeftModel.from_pretrained(base_model, str(directory)).merge_and_unload().eval()


@pytest.mark.parametrize("policy, adapter", [("keep", False), ("recompute", False), ("keep", True)],
                         ids=["keep", "recompute", "keep-lora"])
def test_update_mid_rollout_versions_and_kv_policy_exact(engine, hf, served, policy, adapter, tmp_path):
    """Requests running across an in-flight update (pause keep with the policy's clear_cache -> load over gloo ->
    resume):
    * the KV the requests continue over is the configured policy's: the tokens after the update have the
      log-probs of the new weights over the old weights' KV (keep) or over a prefix recomputed under the new
      weights (recompute), and not the other policy's. This fails if megarl leaves /pause's clear_cache to
      vLLM 0.32's default (true: keep would silently recompute), or if vLLM makes its code match its docstring
      (clear_cache ignored with mode=keep: recompute would silently keep);
    * megarl's per-token versions say exactly which weights sampled each token -- each log-prob matches the
      assigned version's recomputation and not the other's -- and the requests finish whole. This is the check
      that catches AReaL #1569 (versions mislabelled when an update lands during an HTTP call): with the boundary
      one token off either way, or the client's own token count at the pause used instead of the worker's, the
      assertions on `assigned` fail.
    keep-lora (learner.lora, last: the server then stays on adapters): the version is an adapter only, merged by
    megarl's vLLM worker into the checkpoint's base; the same checks hold against peft's merge of it, and the
    requests after it match that merge at fp32 noise (the lag-0 gap)."""
    from transformers import AutoModelForCausalLM

    model, tok = hf
    engine.kv_on_update = policy  # one server serves both: clear_cache is a per-pause argument
    case = f"{policy}-lora" if adapter else policy
    # The update has to land while a request runs. The wait below sees a request mid-rollout, but on a loaded
    # machine every request can end before the wait sees one, or the pause can arrive after the few running ones
    # finished (CI saw both: every request ended whole on one side of it), or land only where the model is so sure
    # of its next tokens that both versions give them the same log-prob, so a boundary one token off would not show
    # (CI saw that too): then the round is repeated with new requests and a new version, up to five times, each
    # repeat with three times the requests (the server runs 8 at once: three waves), so the server still has two
    # waves to decode when the wait sees one request mid-rollout.
    def boundary_tells(c, b):  # token b-1 relabelled new and token b old would both fail the `assigned` check
        got = torch.tensor(c.logprobs)
        old_lp, _ = _hf_logprobs(old_model, c.prompt_ids, c.token_ids, TEMPERATURE)
        new_lp, _ = _hf_logprobs(new_model, c.prompt_ids, c.token_ids, TEMPERATURE)
        return bool((got[b - 1] - new_lp[b - 1]).abs() > 1e-4 and (got[b] - old_lp[b]).abs() > 1e-4)

    for attempt in range(5):
        if adapter:
            staged, new_model = _adapter_version(model, engine, tmp_path / f"adapter{attempt}", seed=7 + attempt)
            new_weights = new_model.state_dict()
        else:
            new_weights = staged = _perturbed(model, seed=engine.version + 1)
            assert set(new_weights) == set(engine.weight_spec())
            new_model = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).eval()
            new_model.load_state_dict(new_weights, strict=False)
            new_model.tie_weights()
        old_model = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).eval()
        old_model.load_state_dict(served["weights"], strict=False)
        old_model.tie_weights()

        requests = _requests(tok, ["a-z=", "b-y=", "c-x="], 24 if attempt else 8, max_new_tokens=60,
                             tag=f"{case}-u{attempt}")
        version = engine.version + 1
        for r in requests:
            engine.add_request(r)
        done, deadline = {}, time.monotonic() + 60
        while not any(t.received >= 3 for t in list(engine._running.values())):  # some are mid-rollout
            done.update({c.request_id: c for c in engine.step()})
            if len(done) == len(requests):  # all ended before one was seen mid-rollout (CI saw it): next round
                break
            assert time.monotonic() < deadline, f"round {attempt}: no request reached 3 tokens in 60 s"
            time.sleep(0.002)
        engine.stage_weights({k: v.clone() for k, v in staged.items()}, version)
        served["weights"] = new_weights
        assert engine.version == version
        while len(done) < len(requests):
            done.update({c.request_id: c for c in engine.step()})
        straddle = [(c, c.versions.count(version - 1)) for c in done.values()]
        if any(0 < b < len(c.token_ids) and boundary_tells(c, b) for c, b in straddle):
            break

    straddling, discriminating, total, shifted_caught = 0, 0, 0, 0
    after_update = []  # (engine's, keep's, recompute's) log-prob of each straddling request's tokens after the update
    for r in requests:
        c = done[r.request_id]
        b = c.versions.count(version - 1)
        assert c.versions == [version - 1] * b + [version] * (len(c.token_ids) - b)
        got = torch.tensor(c.logprobs)
        old_lp, _ = _hf_logprobs(old_model, c.prompt_ids, c.token_ids, TEMPERATURE)
        new_lp, _ = _hf_logprobs(new_model, c.prompt_ids, c.token_ids, TEMPERATURE)  # over a recomputed prefix
        after = new_lp[b:]
        if 0 < b < len(c.token_ids):
            straddling += 1
            kept = _hf_logprobs_over_kept_kv(old_model, new_model, c.prompt_ids, c.token_ids, b, TEMPERATURE)
            after_update += zip(got[b:].tolist(), kept.tolist(), new_lp[b:].tolist())
            after = kept if policy == "keep" else new_lp[b:]
        # Recomputation under the version megarl assigned to each token (and, after the update, the policy's KV) ...
        assigned = torch.cat([old_lp[:b], after])
        assert (got - assigned).abs().max() < 1e-4, (r.request_id, b, (got - assigned).abs().max())
        # ... and under the other one: where the two versions disagree, the token's log-prob must be the
        # assigned version's, so a label one token off (AReaL #1569) fails the line above.
        other = torch.cat([new_lp[:b], old_lp[b:]])
        differs = (assigned - other).abs() > 1e-3
        assert ((got - other).abs()[differs] > 1e-3 - 1e-4).all()
        discriminating += int(differs.sum())
        total += len(c.token_ids)
        if 0 < b < len(c.token_ids):  # the AReaL #1569 failure: the boundary one token off
            shifted_caught += int(boundary_tells(c, b))
    assert straddling >= 1, [done[r.request_id].versions for r in requests]
    assert discriminating >= total // 2, (discriminating, total)  # the check has power: most tokens tell versions apart
    assert shifted_caught >= 1  # a boundary one token off (either way) is caught on real data

    # The KV policy, on every token after the update: the configured policy's log-prob, not the other's. The
    # model is confident on these prompts (log-probs near 0), so one token rarely tells the two KVs apart; the
    # tokens after the update do (every one of them attends over the kept or the recomputed prefix).
    mine, theirs = (1, 2) if policy == "keep" else (2, 1)
    telling = [t for t in after_update if abs(t[1] - t[2]) > 1e-3]
    assert telling, f"no token after the update tells keep from recompute: {after_update}"
    for t in after_update:
        assert abs(t[0] - t[mine]) < 1e-4, (policy, t)
    for t in telling:
        assert abs(t[0] - t[theirs]) > 1e-3 - 1e-4, (policy, t)
    gap_mine = max(abs(t[0] - t[mine]) for t in after_update)
    gap_theirs = min(abs(t[0] - t[theirs]) for t in telling)
    print(f"\n{case}: {straddling} of {len(requests)} requests straddle the update; {len(after_update)} tokens "
          f"after it: |engine - {policy}| <= {gap_mine:.1e}, |engine - other policy| >= {gap_theirs:.1e} "
          f"({len(telling)} telling); {discriminating} of {total} tokens have log-probs > 1e-3 apart under the "
          f"two versions; a one-off boundary caught in {shifted_caught}; swap {engine.stats()['swap_time_s']:.3f}s")

    # Later requests run entirely on the new weights.
    later = engine.generate(_requests(tok, ["e-j="], 2, tag=f"{case}-after"))
    lag0_gap = 0.0
    for c in later:
        assert set(c.versions) == {version}
        new_lp, _ = _hf_logprobs(new_model, c.prompt_ids, c.token_ids, TEMPERATURE)
        lag0_gap = max(lag0_gap, (torch.tensor(c.logprobs) - new_lp).abs().max().item())
    print(f"{case}: requests after the update vs transformers with the new weights: max |gap| {lag0_gap:.1e}")
    assert lag0_gap < 1e-4


def test_hung_then_killed_server_is_reported(engine, hf):
    """A server that stops answering fails the request within request_timeout_s; one that dies is named by step()
    (the sampler loop raises it; fault.on_failure takes over)."""
    from megarl.sampler.vllm_engine import VLLMError

    _, tok = hf
    engine.client.timeout_s = 5.0
    pgid = engine.server.proc.pid
    os.killpg(pgid, signal.SIGSTOP)  # every process of the server: alive, listening, answering nothing
    start = time.monotonic()
    engine.add_request(_requests(tok, ["a-z="], 1, max_new_tokens=60, tag="hang")[0])
    with pytest.raises(VLLMError, match=rf"vLLM server {engine.client.url}.*(no stream data for 5s|no answer)"):
        while True:
            engine.step()
            assert time.monotonic() - start < 30
    hung_s = time.monotonic() - start
    os.killpg(pgid, signal.SIGKILL)
    os.killpg(pgid, signal.SIGCONT)
    start = time.monotonic()
    engine.server.proc.wait(10)  # dead (reaped by the kernel's SIGKILL): the next step must say so
    engine.add_request(_requests(tok, ["a-z="], 1, tag="dead")[0])
    with pytest.raises(VLLMError, match=rf"vLLM server {engine.client.url} \(pid {pgid}\) exited"):
        while True:
            engine.step()
            assert time.monotonic() - start < 30
            time.sleep(0.05)
    print(f"\nhung server reported after {hung_s:.1f}s, killed one after {time.monotonic() - start:.1f}s")


def test_an_update_the_server_refuses_is_raised_at_once_naming_the_call_and_the_cause(vllm_python, vllm_model_dir,
                                                                                   tmp_path):
    """The worker cannot load a tensor (a wrong shape): stage_weights raises a VLLMError naming the call, the
    server and vLLM's reason at once, and the version does not advance. vLLM 0.32's reload has by then moved
    the model's layers to the meta device, so the server cannot generate again (measured: the next request
    fails with "Tensor on device cpu is not on the expected device meta"): the sampler loop lets the error end
    the process and fault.on_failure takes over (restart: a new server). Its own server, as it breaks it."""
    from megarl.sampler.vllm_engine import VLLMError

    engine = start_engine(vllm_python, vllm_model_dir, tmp_path)
    try:
        weights = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in engine.weight_spec().items()}
        last = list(weights)[-1]  # in the last bucket: every bucket is received before the load fails
        weights[last] = torch.zeros(weights[last].numel() + 1)
        version, start = engine.version, time.monotonic()
        with pytest.raises(VLLMError, match=rf"^megarl_update: /collective_rpc on vLLM server {engine.client.url}: "
                                            rf"HTTP 500.*Attempted to load weight"):
            engine.stage_weights(weights, version + 1)
        refused_s = time.monotonic() - start
        assert engine.version == version and refused_s < 30, refused_s
        print(f"\nrefused update raised after {refused_s:.1f}s")
    finally:
        engine.close()
