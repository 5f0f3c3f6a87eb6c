"""RLDP over RLlib's RLlink protocol: a run driven end to end by a policy server; the server's (and the
client's) refusal of an unauthenticated peer before anything is unpickled, and of any non-loopback host; one
run actor and one SAC training loop for both transports; a policy server that restores, freezes and saves
its policy with the provenance of the runs that trained it (ERRATA E14); studies that refuse a controller."""

import json
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from ray.rllib.env.external import RLlink, get_rllink_message, send_rllink_message

from raydp.config import TrainConfig, validate_config
from raydp.control.address import RLlinkAddress
from raydp.control.transports import parse_controller
from raydp.control.policies import policy_layout_for, sac_settings, trained_on
from raydp.control.rllink import (
    MAGIC,
    SECRET_ENV,
    RLlinkPolicyClient,
    RLlinkPolicyServer,
    check_policy_server,
    resolve_secret,
)
from raydp.errors import ConfigError
from raydp.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from tests.test_rldp import assert_within_the_filters_budget


def _saved_module(path: Path):
    """A saved policy's SAC module, rebuilt from its manifest and module.safetensors (raydp-policy-v3), as any
    reader of the format would, with no pickle."""
    from raydp.control.store import build_module, load_module_state

    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "raydp-policy-v3" and not (path / "module").exists()
    return build_module(manifest, load_module_state(path))

SECRET = "rllink-test-secret-0123456789"
STRICT = {"privacy_mode": "strict", "action_decoding": "relative"}  # what a run of tiny_config() declares


def tiny_config(**overrides):
    values = {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "data": {"n_records": 300},
              "max_steps": 12, "max_length": 96, "eval_every": 12, "eval_max_records": 8, "public_eval_records": 16,
              "warmup_steps": 2, "settings": {"t_warm": 2, "t_rl": 2, "b_sac": 4, "k": 2, "n_max": 8, "hidden": 32}}
    values.update(overrides)
    return validate_config(TrainConfig, values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Payload:
    """Unpickling this creates ``path`` (a harmless stand-in for code execution)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def server(local_ray):
    previous = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = SECRET
    config = tiny_config()
    srv = RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), port=free_port(),
                             trained_on=trained_on(config)).start()
    yield srv
    srv.stop()
    if previous is None:
        os.environ.pop(SECRET_ENV, None)
    else:
        os.environ[SECRET_ENV] = previous


# -- a run driven over RLlink ----------------------------------------------------------------------
# ~70 s: an RLDP run driven over RLlink (issue 15); the handshake and refusals, the loopback-only rule,
# the one run actor's client factory, the shared training loop and the server's restore/freeze/save with
# the runs' provenance are the other tests of test_rllink.py, an RLDP run through the broker test_rldp.py
@pytest.mark.slow
def test_an_rldp_run_driven_over_rllink(server, tmp_path):
    from raydp.runner.launch import train

    assert server.url.startswith("rllink://127.0.0.1:")  # loopback unless told otherwise
    summary = train(tiny_config(controller=server.url), tmp_path / "run", progress=False)
    run = tmp_path / "run"
    assert summary["controller_transport"] == {"kind": "rllink", "address": server.url}
    assert json.loads((run / "summary.json").read_text())["controller_transport"]["address"] == server.url
    decisions = pd.read_parquet(run / "controller_decisions.parquet")
    assert list(decisions["step"]) == [4, 6, 8, 10, 12]  # t > T_warm and t mod T_RL == 0, as via the broker
    controller = summary["controller"]
    assert controller["decisions"] == 5 and controller["transitions"] == 4
    # no timing in the run's files: it depends on the private batch sizes (the decisions do not)
    assert not {"action_latency_ms_median", "weights_versions_seen"} & set(controller)
    assert "latency_s" not in decisions.columns
    # the server's RLlib algorithm got the run's 4 transitions and trained K x B_SAC on each
    assert server.wait_idle(60)
    counters = server.counters()
    assert counters["errors"] == [] and counters["malformed_messages"] == 0 and counters["refused_uploads"] == 0
    assert counters["transitions_received"] == 4 and counters["transitions_trained"] == 4
    assert counters["env_steps_sampled"] == 4  # RLlib's own NUM_ENV_STEPS_SAMPLED_LIFETIME
    assert counters["module_steps_trained"] == 4 * 2 * 4 and counters["replay_size"] == 4
    # the run's provenance entry (ERRATA E14) reached the server with its final upload: nothing unattributed
    assert counters["provenance_received"] == 1 and counters["unattributed_transitions"] == 0
    entry = server.runner.provenance[0]
    assert entry["dataset_id"] == summary["dataset_id"] and entry["privacy_mode"] == "strict"
    assert entry["epsilon"] == pytest.approx(summary["privacy"]["epsilon"])
    # the privacy guarantee is the broker path's: same ledger, the Renyi filter (E13), within budget
    privacy = summary["privacy"]
    assert privacy["within_budget"] and privacy["epsilon"] <= 2.0
    assert privacy["privacy_mode"] == "strict" and privacy["releases_per_step"] == ["gradient", "norm_histogram",
                                                                                     "loss_sum"]
    ledger = PrivacyLedger.load(run / LEDGER_FILENAME)
    assert len(ledger) == summary["steps"] == 12 and all(len(row.releases) == 3 for row in ledger)
    assert_within_the_filters_budget(privacy, ledger)
    assert not (run / "policy").exists()  # the policy server owns the policy; the run saves none


# -- refusal of unauthenticated peers --------------------------------------------------------------
def test_unauthenticated_clients_are_refused_before_anything_is_unpickled(server, tmp_path):
    marker = tmp_path / "PWNED"
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(Payload(live)))
    assert live.exists()  # the payload is real: unpickling it creates its file
    host, port = server.address.host, server.address.port
    refused = server.counters()["clients_refused"]

    # 1. RLlink straight away, no secret: a pickle-bearing object array in the very first message
    with socket.create_connection((host, port), timeout=10) as s:
        send_rllink_message(s, {"type": "PING", "x": np.array([Payload(marker)], dtype=object)})
        assert s.recv(len(MAGIC)) == MAGIC  # all it gets is the challenge ...
        with pytest.raises(ConnectionError):  # ... then the door: no PONG
            while True:
                get_rllink_message(s)
    # 2. a plain GET_CONFIG with no secret: no config (the server's pickle) comes back
    with socket.create_connection((host, port), timeout=10) as s:
        send_rllink_message(s, {"type": "GET_CONFIG"})
        s.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
        assert received.startswith(MAGIC) and len(received) == len(MAGIC) + 32  # challenge only
    # 3. Ray's message helpers with the wrong secret
    with pytest.raises(ConnectionError, match="refused the handshake"):
        RLlinkPolicyClient(host, port, "intruder", secret=b"not-the-secret-at-all", connect_timeout_s=5)
    assert not marker.exists()  # nothing was unpickled
    assert server.counters()["clients_refused"] == refused + 3
    check_policy_server(RLlinkAddress(host, port), SECRET.encode())  # the server still serves its secret holder
    assert server.counters()["errors"] == []


def test_the_client_refuses_a_server_that_cannot_prove_the_secret(tmp_path):
    """Clients unpickle the config: one that does not check the server would run its pickle."""
    marker = tmp_path / "PWNED-client"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(MAGIC + os.urandom(32))
            conn.recv(64)
            conn.sendall(os.urandom(32))  # a wrong proof, then a poisoned config
            send_rllink_message(conn, {"type": "SET_CONFIG", "config": pickle.dumps(Payload(marker))})
            conn.recv(1)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(ConnectionError, match="failed to prove the secret"):
        RLlinkPolicyClient("127.0.0.1", listener.getsockname()[1], "run", secret=SECRET.encode(),
                           connect_timeout_s=5)
    thread.join(5)
    listener.close()
    assert not marker.exists()


def test_the_server_refuses_to_start_without_a_secret(monkeypatch, tmp_path):
    for name in (SECRET_ENV, "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
    config = tiny_config()
    with pytest.raises(ConfigError, match="no RLlink secret"):
        RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), port=free_port(),
                           trained_on=trained_on(config))


def test_secret_sources_follow_rays_order(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("default-file-token\n")
    (tmp_path / "tok").write_text("path-token")
    env = {SECRET_ENV: "x" * 16, "RAY_AUTH_TOKEN": "env-token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}
    assert resolve_secret(env, tmp_path) == (b"x" * 16, SECRET_ENV)
    del env[SECRET_ENV]
    assert resolve_secret(env, tmp_path) == (b"env-token", "RAY_AUTH_TOKEN")
    del env["RAY_AUTH_TOKEN"]
    assert resolve_secret(env, tmp_path) == (b"path-token", "RAY_AUTH_TOKEN_PATH")
    assert resolve_secret({}, tmp_path) == (b"default-file-token", "~/.ray/auth_token")
    assert "hidden" in repr(resolve_secret({}, tmp_path)[0])  # a secret never prints itself
    with pytest.raises(ConfigError, match="too short"):
        resolve_secret({SECRET_ENV: "short"}, tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_secret({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, tmp_path)


# -- the --controller flag -------------------------------------------------------------------------
def test_controller_urls_and_their_one_line_errors(capsys):
    assert parse_controller("broker") is None
    assert parse_controller("rllink://:5555") == RLlinkAddress("127.0.0.1", 5555)
    assert parse_controller("rllink://localhost:7000") == RLlinkAddress("127.0.0.1", 7000)  # never resolved
    for bad, message in (("http://127.0.0.1:1", "rllink://HOST:PORT"), ("rllink://127.0.0.1", "port"),
                         ("rllink://127.0.0.1:99999", "port"), ("rllink://user:pw@127.0.0.1:1", "secret"),
                         ("rllink://127.0.0.1:1/x", "nothing after")):
        with pytest.raises(ConfigError, match=f"invalid config: controller: .*{message}"):
            tiny_config(controller=bad)
    with pytest.raises(ConfigError, match="drives a run whose dials a policy sets \\(strategy rldp\\), not 'static'"):
        validate_config(TrainConfig, {"strategy": "static", "epsilon": 1.0, "controller": "rllink://:5555"})
    with pytest.raises(ConfigError, match="settings.save_policy does not apply"):
        tiny_config(controller="rllink://:5555", settings={**tiny_config().settings, "save_policy": "p"})
    from raydp.cli import main

    assert main(["train", "-o", "/nonexistent/x", "--strategy", "rldp", "--epsilon", "1",
                 "--controller", "rllink://nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "controller" in err[0]


# -- loopback only (plaintext after the handshake) -------------------------------------------------
def test_non_loopback_rllink_is_refused_everywhere_with_an_ssh_tunnel_hint(monkeypatch, tmp_path, capsys):
    """RLlink carries no per-message MAC: across machines an on-path attacker could inject pickles. The
    config, the run's client, the launcher's probe and the server all refuse a non-loopback host."""
    import raydp.control.address as address
    from raydp.cli import main
    from raydp.control.connection import client_from_connection
    from raydp.control.rllink import rllink_connection

    monkeypatch.setenv(SECRET_ENV, SECRET)
    hint = r"ssh -L 5555:127\.0\.0\.1:5555 server"
    for host in ("10.1.2.3", "0.0.0.0", "192.168.1.7", "policy.example.org"):
        with pytest.raises(ConfigError, match=rf"invalid config: controller: RLlink will not connect to {host}.*{hint}"):
            tiny_config(controller=f"rllink://{host}:5555")
    for host in ("127.0.0.1", "127.0.0.2", "localhost"):  # all of loopback stays accepted
        assert tiny_config(controller=f"rllink://{host}:5555").controller == f"rllink://{host}:5555"

    config = tiny_config()
    port = free_port()
    with pytest.raises(ConfigError, match=rf"will not listen on 0\.0\.0\.0.*{hint}"):
        RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), host="0.0.0.0", port=port,
                           trained_on=trained_on(config))
    with pytest.raises(ConnectionRefusedError):  # it never bound, on any interface
        socket.create_connection(("127.0.0.1", port), timeout=2).close()

    attempts = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: attempts.append(a))
    monkeypatch.setattr(socket.socket, "connect", lambda self, *a: attempts.append(a))
    remote = RLlinkAddress("10.1.2.3", 5555)
    with pytest.raises(ConfigError, match=hint):
        RLlinkPolicyClient("10.1.2.3", 5555, "run", secret=SECRET.encode(), expect=STRICT)
    with pytest.raises(ConfigError, match=hint):
        rllink_connection(remote, SECRET.encode(), STRICT)
    with pytest.raises(ConfigError, match=hint):
        client_from_connection({"kind": "rllink", "host": "10.1.2.3", "port": 5555, "secret": SECRET.encode(),
                                "expect": STRICT}, "run")
    with pytest.raises(ConfigError, match=hint):
        check_policy_server(remote, SECRET.encode())
    assert attempts == []  # refused before a single packet

    config_file = tmp_path / "run.yaml"
    config_file.write_text("model: embedded-tiny\nepsilon: 2.0\n")
    from raydp.runner.policy_server import main as server_main

    for run in (lambda: main(["policy-server", "--config", str(config_file), "--host", "0.0.0.0"]),
                lambda: server_main(["--config", str(config_file), "--host", "10.0.0.5"])):
        assert run() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "ssh -L 5555:127.0.0.1:5555" in err[0]


# -- one run actor for both transports ------------------------------------------------------------
def test_one_run_actor_serves_both_transports(server, monkeypatch, tmp_path):
    import importlib.util

    import ray

    from raydp.control.broker import PolicyBroker
    from raydp.control.connection import client_from_connection
    from raydp.control.rllink import rllink_connection
    from raydp.control.service import PolicyClient
    from raydp.runner import actor
    from raydp.runner.launch import RAY_NAMESPACE

    assert importlib.util.find_spec("raydp.runner.rllink_actor") is None  # no twin of FineTuningRun
    config = tiny_config()
    layout, settings = policy_layout_for(config), sac_settings(config)
    broker = PolicyBroker.options(name="factory-test-broker", namespace=RAY_NAMESPACE).remote(
        layout.as_dict(), settings.as_dict())
    try:
        client = client_from_connection({"kind": "broker", "broker_name": "factory-test-broker",
                                         "namespace": RAY_NAMESPACE, "explore": True, "service": None}, "run-1")
        assert type(client) is PolicyClient and client.layout == layout
    finally:
        ray.kill(broker)
    expect = {"privacy_mode": "strict", "action_decoding": config.strategy_settings().action_decoding}
    client = client_from_connection(rllink_connection(server.address, SECRET.encode(), expect), "run-2")
    try:
        assert type(client) is RLlinkPolicyClient and client.layout == layout and client.service == server.url
    finally:
        client.close()
    with pytest.raises(ValueError, match="unknown policy connection kind"):
        client_from_connection({"kind": "pigeon"}, "run-3")

    # the actor's body closes whatever client it built, however the run ends
    closed = []

    class Client:
        service = None

        def close(self):
            closed.append(True)

    monkeypatch.setattr("raydp.control.connection.client_from_connection", lambda connection, run_id: Client())

    def failing_run(*args, **kwargs):
        raise RuntimeError("the run failed")

    monkeypatch.setattr("raydp.runner.run.run_training", failing_run)
    values = config.model_dump(mode="json")
    with pytest.raises(RuntimeError, match="the run failed"):
        actor.run_with_connection(values, str(tmp_path / "a"), False, {"kind": "rllink"}, "run-4", False)
    assert closed == [True]
    monkeypatch.setattr("raydp.runner.run.run_training", lambda *a, **k: {"steps": 1})
    assert actor.run_with_connection(values, str(tmp_path / "b"), False, {"kind": "rllink"}, "run-5", False) == {
        "steps": 1}
    assert closed == [True, True]


# -- one SAC training loop for both transports -----------------------------------------------------
def test_the_training_loop_trains_once_per_pending_transition_and_survives_an_error():
    from collections import deque

    from ray.rllib.utils.metrics import (
        ENV_RUNNER_RESULTS,
        LEARNER_RESULTS,
        NUM_ENV_STEPS_SAMPLED_LIFETIME,
        NUM_MODULE_STEPS_TRAINED,
    )

    import importlib

    from raydp.control import rllink, service
    from raydp.control.training import TrainingLoop

    pending = deque(range(7))

    class Algo:
        """train() takes one pending transition (as the runners' sample() does); its 3rd call fails first."""

        calls = consumed = 0

        def train(self):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("learner hiccup")
            pending.popleft()
            self.consumed += 1
            return {LEARNER_RESULTS: {"default_policy": {NUM_MODULE_STEPS_TRAINED: 8}},
                    ENV_RUNNER_RESULTS: {NUM_ENV_STEPS_SAMPLED_LIFETIME: self.consumed}}

    algo = Algo()
    loop = TrainingLoop(algo, lambda: len(pending), poll_s=(0.001, 0.01), error_pause_s=0.01).start()
    try:
        assert loop.wait_idle(10)
        time.sleep(0.1)  # idle: no train() without a pending transition
        assert algo.calls == 8 and algo.consumed == 7 and not pending
        pending.extend(range(3))  # more arrive later: the idle loop picks them up
        assert loop.wait_idle(10)
        time.sleep(0.05)
    finally:
        loop.stop(5)
    assert not loop.thread.is_alive()
    assert algo.calls == 11 and algo.consumed == 10
    assert loop.counters() == {"train_calls": 10, "transitions_trained": 10, "module_steps_trained": 80,
                               "env_steps_sampled": 10, "errors": ["RuntimeError('learner hiccup')"]}
    # a decision waits for training on every earlier transition: met at once when trained; a failed train()
    # may have lost the transition it took, so a wait still short of its count fails instead of hanging
    loop.wait_trained(10)
    with pytest.raises(RuntimeError, match="training failed"):
        loop.wait_trained(11)
    # both transports train through it: each builds this TrainingLoop and no other training loop
    import inspect
    import pkgutil

    for transport in (rllink, service):
        modules = [transport] + [importlib.import_module(f"{transport.__name__}.{m.name}")
                                 for m in pkgutil.iter_modules(getattr(transport, "__path__", []))]
        source = "".join(inspect.getsource(m) for m in modules)
        assert source.count("TrainingLoop(") == 1 and "threading.Thread(" not in source, transport.__name__


# -- a policy server restores, freezes and saves its policy -------------------------------------------
def provenance(tag: str) -> dict:
    """A run's provenance entry, as ``raydp.runner.run.policy_provenance`` builds it (ERRATA E14)."""
    return {"dataset_id": "rdi1:" + "ab" * 16, "public_data": False, "privacy_mode": "strict", "privacy_unit": "record",
            "epsilon": 1.5, "delta": 1e-5, "guarantee": "renyi-filter", "labels": [], "rdp_orders": [2.0, 8.0],
            "rdp_curve": [0.05, 0.4], "entry_id": f"test-{tag}"}


def drive(client, decisions: int, seed: int) -> list[float]:
    """``decisions`` decisions on random observations; returns the rewards of the closed transitions."""
    rng = np.random.default_rng(seed)
    layout, rewards, reward = client.layout, [], None
    for _ in range(decisions):
        obs = layout.pack(rng.normal(size=(2, layout.f_adapter)), rng.normal(size=layout.g_global))
        client.decide(obs, reward)
        if reward is not None:
            rewards.append(reward)
        reward = float(rng.normal())
    return rewards


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def policy_server(config, **kwargs) -> RLlinkPolicyServer:
    return RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), port=free_port(),
                              trained_on=trained_on(config), **kwargs).start()


def connect(srv, run_id: str, **kwargs) -> RLlinkPolicyClient:
    """A run's client; it declares a strict run in tiny_config()'s clip decoding unless ``expect`` is given."""
    kwargs.setdefault("expect", STRICT)
    return RLlinkPolicyClient(srv.address.host, srv.address.port, run_id, secret=SECRET.encode(), **kwargs)


@pytest.fixture(scope="module")
def saved_policy(local_ray, tmp_path_factory):
    """A fresh policy server trained by run A (4 transitions, then its provenance entry) and run B (2
    transitions, then it dies: no entry), saved when it stops."""
    previous = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = SECRET
    path = tmp_path_factory.mktemp("rllink-policies") / "first"
    srv = policy_server(tiny_config())
    try:
        run_a = connect(srv, "run-a")
        rewards = drive(run_a, 5, seed=1)
        run_a.end()
        assert run_a.save_policy(Path("ignored"), {}, {}, provenance=provenance("run-a")) is None
        run_a.close()
        run_b = connect(srv, "run-b")
        rewards += drive(run_b, 3, seed=2)
        assert wait_for(lambda: srv.counters()["transitions_received"] == 6)
        run_b.close()  # no end(), no save_policy: a run that died
        assert srv.wait_idle(60)
        counters = srv.counters()
    finally:
        manifest = srv.stop(save_to=path)
        if previous is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = previous
    return {"path": path, "manifest": manifest, "rewards": rewards, "counters": counters}


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)


def test_a_policy_server_saves_its_policy_with_the_provenance_of_the_runs_that_trained_it(saved_policy):
    from ray.rllib.core.columns import Columns

    from raydp.control.store import load_manifest, policy_privacy_mode

    path, counters = saved_policy["path"], saved_policy["counters"]
    manifest = load_manifest(path)
    assert manifest == saved_policy["manifest"]
    assert counters["errors"] == [] and counters["transitions_trained"] == counters["train_calls"] == 6
    assert manifest["transitions"] == 6 and manifest["sac_updates"] == 6 * 2
    config = tiny_config()
    assert manifest["trained_on"]["privacy_mode"] == "strict" and manifest["layout"] == policy_layout_for(config).as_dict()
    assert manifest["trained_on"]["action_decoding"] == config.strategy_settings().action_decoding and manifest["trained_on"]["runs"] == 1
    # run A's entry as it sent it, but for its id (the server's); run B's 2 transitions are not hidden: an
    # entry of unknown dataset and spend
    first, unknown = manifest["provenance"]
    expected = {k: v for k, v in provenance("run-a").items() if k != "entry_id"}
    assert first["entry_id"] != "test-run-a" and {k: first[k] for k in expected} == expected
    assert unknown["unattributed_transitions"] == 2 and unknown["dataset_id"] is None
    assert unknown["rdp_curve"] is None and unknown["privacy_mode"] == "strict"
    assert policy_privacy_mode(manifest) == "strict"
    # the replay buffer holds exactly the rewards the runs sent; the module rebuilds from its manifest and safetensors
    with np.load(path / "replay.npz") as replay:
        assert sorted(replay["reward"]) == pytest.approx(sorted(saved_policy["rewards"]))
    module = _saved_module(path)
    obs = torch.zeros((1, policy_layout_for(config).obs_dim))
    assert torch.isfinite(module.forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]).all()


def test_raydp_policy_list_shows_what_a_policy_servers_manifest_records(saved_policy, capsys):
    """The server knows its model and run count, not the runs' pair counts or epsilons: the listing says
    what it knows and invents nothing ("None pairs" before)."""
    from raydp.cli import main

    path = saved_policy["path"]
    assert main(["policy", "list", "--policy-dir", str(path.parent)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("first "))
    assert f"{tiny_config().model} (rllink, 1 run(s))" in row and "None" not in row
    assert "strict, 2 run(s) on dataset(s)" in row


def test_a_policy_server_restores_a_saved_policy_and_continues_its_provenance(saved_policy, secret, tmp_path):

    path = saved_policy["path"]
    saved = _saved_module(path).get_state(inference_only=True)
    srv = policy_server(tiny_config(), restore=path)
    manifest = None
    try:
        assert srv.counters()["replay_size"] == 6  # the saved replay buffer came back
        with pytest.raises(ConfigError, match="serves a strict-mode policy; a paper-mode run"):
            connect(srv, "paper-run", expect={"privacy_mode": "paper", "action_decoding": "relative"})
        with pytest.raises(ConfigError, match="acts in 'relative' clip decoding; this run decodes 'paper'"):
            connect(srv, "paper-decoding", expect={"privacy_mode": "strict", "action_decoding": "paper"})
        client = connect(srv, "run-c", expect={"privacy_mode": "strict", "action_decoding": "relative"})
        state = client.module.get_state()
        assert state and set(state) <= set(saved)
        for key, value in state.items():  # the client acts with the saved weights, not a fresh policy's
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved[key])), key
        drive(client, 3, seed=3)
        client.end()
        client.save_policy(Path("ignored"), {}, {}, provenance=provenance("run-c"))
        client.close()
        assert srv.wait_idle(60)
        assert srv.counters()["transitions_trained"] == 2 and srv.counters()["errors"] == []
    finally:
        manifest = srv.stop(save_to=tmp_path / "continued")
    inherited = saved_policy["manifest"]["provenance"]
    assert [e["entry_id"] for e in manifest["provenance"][:-1]] == [e["entry_id"] for e in inherited]
    assert manifest["provenance"][-1]["epsilon"] == 1.5 and manifest["provenance"][-1]["entry_id"] not in {
        e["entry_id"] for e in inherited}
    assert manifest["transitions"] == 2 and manifest["trained_on"]["continued_from"] == path.name
    with np.load(tmp_path / "continued" / "replay.npz") as replay:
        assert len(replay["reward"]) == 6 + 2


def test_a_frozen_policy_server_serves_the_saved_weights_greedily_and_learns_nothing(saved_policy, secret, tmp_path):
    from ray.rllib.core.columns import Columns

    path = saved_policy["path"]
    with pytest.raises(ConfigError, match="needs a saved policy"):
        policy_server(tiny_config(), frozen=True)
    srv = policy_server(tiny_config(), restore=path, frozen=True)
    try:
        assert srv.training.thread is None  # no training thread at all
        client = connect(srv, "run-f")
        assert client.config.env_config["frozen"] is True and client.frozen
        assert not client.explore and client.service is None  # greedy; the run saves nothing
        obs = client.layout.pack(np.full((2, client.layout.f_adapter), 0.3), np.full(client.layout.g_global, -0.2))
        actions = [client.decide(obs, reward) for reward in (None, 0.5, -1.0, 2.0)]
        saved = _saved_module(path)
        with torch.no_grad():
            logits = saved.forward_inference({Columns.OBS: torch.as_tensor(obs[None])})[Columns.ACTION_DIST_INPUTS]
        mean = logits.chunk(3, dim=-1)[0][0].numpy()  # the Gaussian's mean: the saved policy's greedy action
        for action in actions:
            np.testing.assert_allclose(action, mean, rtol=1e-5, atol=1e-6)
        client.end()
        assert client.save_policy(Path("ignored"), {}, {}, provenance=provenance("run-f")) is None
        client.close()
        time.sleep(0.3)
        counters = srv.counters()
        assert client.uploaded == 0 and counters["transitions_received"] == 0 and counters["pending"] == 0
        assert counters["train_calls"] == 0 and counters["provenance_received"] == 0
        assert counters["replay_size"] == 6
        with pytest.raises(ConfigError, match="frozen policy is not trained"):
            srv.save(tmp_path / "copy")
    finally:
        srv.stop()
    assert not (tmp_path / "copy").exists()


def test_policy_server_flags_are_checked_before_anything_starts(tmp_path, capsys):
    """--frozen needs --policy; --save refuses an existing path (and --frozen); a saved policy must suit the
    config: a paper-mode policy may not serve a strict config, and its clip decoding must match (E3/E14)."""
    from raydp.runner.policy_server import main as server_main
    from raydp.control.store import write_manifest

    config_file = tmp_path / "run.yaml"
    config_file.write_text("model: embedded-tiny\nepsilon: 2.0\nrldp: {n_max: 8, hidden: 32}\n")
    layout = policy_layout_for(tiny_config())

    def policy(name: str, mode: str, decoding: str) -> Path:
        (tmp_path / name).mkdir()
        write_manifest(tmp_path / name, layout=layout, sac={}, trained_on={"privacy_mode": mode,
                       "action_decoding": decoding}, results={}, transitions=1, updates=2,
                       provenance=[{**provenance(name), "privacy_mode": mode}])
        return tmp_path / name

    (tmp_path / "taken").mkdir()
    base = ["--config", str(config_file), "--port", str(free_port())]
    cases = [(["--frozen"], "--frozen serves a saved policy"),
             (["--policy", str(policy("ok", "strict", "relative")), "--frozen", "--save", str(tmp_path / "new")],
              "--frozen serves --policy untrained"),
             (["--save", str(tmp_path / "taken")], "already exists"),
             (["--policy", str(policy("paper", "paper", "relative"))], "trained in paper mode"),
             (["--policy", str(policy("eq10", "strict", "paper"))], "acts in 'paper' clip decoding"),
             (["--policy", str(tmp_path / "missing")], "no saved policy")]
    for extra, message in cases:
        assert server_main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)
    assert not (tmp_path / "new").exists()


# -- studies start their own policies --------------------------------------------------------------
def test_a_study_refuses_a_controller_other_than_the_broker(tmp_path, capsys):
    import yaml

    from raydp.cli import main
    from raydp.study.config import load_study

    study = {"name": "s", "epsilons": [2.0], "strategies": ["static", "rldp"], "models": ["embedded-tiny"],
             "base": {"max_steps": 4}}
    cases = [({"base": {"max_steps": 4, "controller": "rllink://127.0.0.1:5555"}}, "base.controller"),
             ({"settings_grid": {"rldp": {"controller": ["rllink://127.0.0.1:5555"]}}},
              "settings_grid.rldp.controller"),
             ({"strategy_settings": {"static": {"controller": "rllink://:5555"}}}, "strategy_settings.static.controller")]
    for i, (override, where) in enumerate(cases):
        path = tmp_path / f"study{i}.yaml"
        path.write_text(yaml.safe_dump({**study, **override}))
        with pytest.raises(ConfigError, match=rf"{where}: a study starts its own RLDP policies"):
            load_study(path)
        assert main(["study", str(path), "--check"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and where in err[0] and "controller: broker" in err[0]
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump({**study, "base": {"max_steps": 4, "controller": "broker"}}))
    assert load_study(path).base["controller"] == "broker"  # the default, written out, is fine


# -- review fixes: IPv4 loopback only, a port held for the server's life (F1) ---------------------------


def test_only_ipv4_loopback_is_accepted_and_localhost_is_never_resolved(server, monkeypatch):
    """The server binds IPv4 127.0.0.1: a client that reached [::1] (``localhost`` resolved through
    /etc/hosts, as Debian's ``::1 localhost`` does) would talk to whoever holds [::1]:P, a relay that
    passes the handshake through and then owns the plaintext session. ::1 is refused everywhere and
    ``localhost`` is the literal 127.0.0.1, never resolved."""
    from raydp.control.address import is_loopback, require_loopback

    assert tiny_config().strategy_settings().action_decoding == STRICT["action_decoding"]
    for host in ("::1", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1", "[::1]"):
        assert not is_loopback(host), host
        with pytest.raises(ConfigError, match="IPv4 loopback"):
            require_loopback(host)
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost"))
    assert parse_controller("rllink://localhost:7000") == RLlinkAddress("127.0.0.1", 7000)
    with pytest.raises(ConfigError, match="controller: .*IPv4 loopback"):
        tiny_config(controller="rllink://[::1]:7000")
    port = server.address.port
    with pytest.raises(ConfigError, match="IPv4 loopback"):
        RLlinkPolicyClient("::1", port, "run", secret=SECRET.encode(), expect=STRICT)
    with pytest.raises(ConfigError, match="IPv4 loopback"):
        check_policy_server(RLlinkAddress("::1", port), SECRET.encode())
    config = tiny_config()
    with pytest.raises(ConfigError, match="IPv4 loopback"):
        RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), host="::1", port=free_port(),
                           trained_on=trained_on(config))

    # an attacker's relay on [::1]:P, and a resolver that puts ::1 first for localhost
    relay = socket.socket(socket.AF_INET6)
    try:
        relay.bind(("::1", port))
    except OSError:
        relay.close()
        pytest.skip("no IPv6 loopback here")
    relay.listen(4)
    relay.setblocking(False)
    real = socket.getaddrinfo

    def debian(host, *args, **kwargs):
        found = real(host, *args, **kwargs)
        if host == "localhost":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))] + found
        return found

    monkeypatch.setattr(socket, "getaddrinfo", debian)
    try:
        client = RLlinkPolicyClient("localhost", port, "run", secret=SECRET.encode(), expect=STRICT,
                                    connect_timeout_s=5)
        client.close()
        assert client.service == f"rllink://127.0.0.1:{port}"
        check_policy_server(RLlinkAddress("localhost", port), SECRET.encode(), STRICT, timeout_s=5)
        with pytest.raises(BlockingIOError):  # nothing ever reached the relay
            relay.accept()
    finally:
        relay.close()


def test_the_port_stays_bound_while_a_run_is_served_and_a_second_run_is_refused_as_busy(server):
    """Closing the listening socket during a run would let any local user bind 127.0.0.1:P for the next
    run; the server holds it for its whole life and a second run waits in its backlog until the handshake
    times out (busy)."""
    host, port = server.address.host, server.address.port
    first = connect(server, "run-a")
    try:
        intruder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            intruder.bind((host, port))
        intruder.close()
        with pytest.raises(ConnectionError, match="busy with another run"):
            connect(server, "run-b", connect_timeout_s=2)
        obs = first.layout.pack(np.zeros((2, first.layout.f_adapter)), np.zeros(first.layout.g_global))
        first.decide(obs, None)  # the first run is still served
    finally:
        first.close()
    connect(server, "run-c").close()  # and the next run after it
    assert server.counters()["listening"] and server.counters()["errors"] == []


# -- review fixes: runs declare their privacy mode with every upload (F2) --------------------------------
def test_a_training_client_declares_its_run_and_the_server_drops_other_declarations(secret, tmp_path):
    srv = policy_server(tiny_config())
    try:
        with pytest.raises(ConfigError, match="declare"):
            connect(srv, "undeclared", expect=None)
        with pytest.raises(ConfigError, match="privacy_mode"):
            connect(srv, "bad", expect={"privacy_mode": "lenient", "action_decoding": "relative"})
        client = connect(srv, "run")
        assert client.declared == STRICT
        for declared in ({"privacy_mode": "paper", "action_decoding": "relative"},
                         {"privacy_mode": "strict", "action_decoding": "paper"}, None):
            client.declared = declared
            drive(client, 2, seed=1)  # one transition, uploaded with that declaration
        client.declared = dict(STRICT)
        client._rpc(RLlink.PING)  # the server has read them all
        counters = srv.counters()
        assert counters["refused_uploads"] == 3 and counters["transitions_received"] == 0
        drive(client, 4, seed=2)
        assert wait_for(lambda: srv.counters()["transitions_received"] == 3)
        client.close()  # a run that dies: its transitions are labelled with its declared mode
        assert wait_for(lambda: srv.counters()["unattributed_transitions"] == 3)
        *_, unknown = srv.provenance()
        assert unknown["unattributed_transitions"] == 3 and unknown["privacy_mode"] == "strict"
    finally:
        srv.stop()


# -- review fixes: the served policy's mode is the restored policy's (F3) --------------------------------
def test_a_policy_server_refuses_to_restore_a_policy_of_another_mode_or_decoding(saved_policy, secret, tmp_path):
    import shutil

    def variant(name: str, **trained) -> Path:
        path = tmp_path / name
        shutil.copytree(saved_policy["path"], path)
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["trained_on"].update(trained)
        for entry in manifest["provenance"]:
            if "privacy_mode" in trained:
                entry["privacy_mode"] = trained["privacy_mode"]
        (path / "manifest.json").write_text(json.dumps(manifest))
        return path

    paper = variant("paper", privacy_mode="paper")
    for path, message in ((paper, "trained in paper mode"), (variant("eq10", action_decoding="paper"),
                                                               "acts in 'paper' clip decoding")):
        with pytest.raises(ConfigError, match=message) as refused:
            policy_server(tiny_config(), restore=path)
        assert "\n" not in str(refused.value)
    rldp = {**tiny_config().settings, "privacy_mode": "paper"}
    srv = policy_server(tiny_config(settings=rldp), restore=paper, frozen=True)
    try:
        assert srv.runner.config.env_config["policy"] == {"privacy_mode": "paper", "action_decoding": "relative"}
    finally:
        srv.stop()


# -- review fixes: provenance ids are the server's, malformed messages are dropped (F4, F5) ---------------
def test_wire_entries_get_fresh_ids_and_malformed_messages_leave_the_server_serving(saved_policy, secret, tmp_path):
    srv = policy_server(tiny_config(), restore=saved_policy["path"])
    inherited = saved_policy["manifest"]["provenance"]
    try:
        run_b = connect(srv, "run-b")
        drive(run_b, 4, seed=4)
        run_b.end()  # its entry reuses an inherited entry's id: it must not make its 3 transitions vanish
        reused = {**provenance("x"), "entry_id": inherited[0]["entry_id"], "dataset_id": "rdi1:" + "cd" * 16}
        run_b.save_policy(Path("ignored"), {}, {}, provenance=reused)
        run_b.close()
        run_c = connect(srv, "run-c")
        run_c.sock.settimeout(20)  # a dead listener would never answer
        for body in ({"episodes": None}, {"episodes": [{"not": "an episode"}]}, {"episodes": 3},
                     {"episodes": [], "provenance": {**provenance("y"), "note": b"\x00"}},
                     {"episodes": [], "provenance": "nonsense"}):
            send_rllink_message(run_c.sock, {"type": RLlink.EPISODES.name, "declared": STRICT, **body})
            kind, _ = run_c._rpc(RLlink.PING)
            assert kind == RLlink.PONG  # the listener survived, on the same connection
        counters = srv.counters()
        assert counters["malformed_messages"] == 5 and counters["listening"] and counters["provenance_received"] == 1
        # an empty EPISODES_AND_GET_STATE is answered at once (Ray's server would wait for a training step
        # that never comes, and the listener would serve no one again)
        send_rllink_message(run_c.sock, {"type": RLlink.EPISODES_AND_GET_STATE.name, "declared": STRICT,
                                         "episodes": []})
        kind, _ = get_rllink_message(run_c.sock)
        assert kind == RLlink.SET_STATE and run_c._rpc(RLlink.PING)[0] == RLlink.PONG
        run_c.close()
    finally:
        manifest = srv.stop(save_to=tmp_path / "continued")
    entries = manifest["provenance"]
    assert [e["entry_id"] for e in entries[: len(inherited)]] == [e["entry_id"] for e in inherited]
    (new,) = entries[len(inherited):]
    assert new["dataset_id"] == "rdi1:" + "cd" * 16 and new["entry_id"] not in {e["entry_id"] for e in inherited}
    assert manifest["transitions"] == 3 and not new.get("unattributed_transitions")
    assert json.loads((tmp_path / "continued" / "manifest.json").read_text()) == manifest


# -- re-review: the handshake covers the address, so a relay to another server's port fails (R1) -----------
@pytest.mark.parametrize("server_at, client_dialled, proves", [
    ("127.0.0.1:7321", "127.0.0.1:7321", True),    # the address the client dialled is the server's
    ("127.0.0.1:7321", "127.0.0.1:7320", False),   # a relay from a free port to another raydp server
    ("127.0.0.2:7320", "127.0.0.1:7320", False),   # ... or from another loopback address
])
def test_the_handshake_binds_the_address_so_a_relay_to_another_server_fails(server_at, client_dialled, proves):
    """A socket pair is a perfect relay (every byte forwarded unchanged): what decides is the address each
    side puts under its MAC, its own, so the same secret (e.g. Ray's token) does not make servers
    interchangeable."""
    from raydp.control.rllink import _key, client_handshake, server_handshake

    key = _key(b"the-same-secret-on-both-servers")
    server_end, client_end = socket.socketpair()
    outcome = {}

    def serve():
        outcome["ok"] = server_handshake(server_end, key, server_at)
        if not outcome["ok"]:
            server_end.close()  # as the server does with a peer that proved nothing

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        if proves:
            client_handshake(client_end, key, client_dialled)
        else:
            with pytest.raises(ConnectionError):
                client_handshake(client_end, key, client_dialled)
            client_end.close()  # as the client does: nothing RLlink is ever sent
    finally:
        thread.join(10)
        server_end.close()
        client_end.close()
    assert outcome["ok"] is proves  # the server, too, accepts only a proof for its own address


def test_speaking_rllink_leaves_rays_own_serialization_of_numpy_arguments_alone(local_ray):
    """RLlib's RLlink helpers patch msgpack with msgpack_numpy for the whole process, after which Ray sends a numpy
    array inside a dict argument as msgpack_numpy's dict (the worker sees a dict). raydp gives the wire functions
    their own numpy-aware msgpack instead: arrays still cross RLlink, and Ray's arguments stay arrays."""
    import socket as socket_module

    import ray
    from ray.rllib.env.external import RLlink, get_rllink_message, send_rllink_message

    from raydp.control.rllink import use_numpy_msgpack

    use_numpy_msgpack()  # as the server and the client do when they start

    left, right = socket_module.socketpair()
    try:
        send_rllink_message(left, {"type": RLlink.PING.name, "array": np.arange(3.0)})
        kind, body = get_rllink_message(right)
    finally:
        left.close()
        right.close()
    assert kind == RLlink.PING and isinstance(body["array"], np.ndarray)

    @ray.remote
    def kind_of(value):
        return type(value["a"]).__name__

    assert ray.get(kind_of.remote({"a": np.arange(3.0)})) == "ndarray"


def test_importing_rllink_leaves_rays_module_alone_and_the_explicit_call_installs_the_msgpack():
    """The wire functions' msgpack is installed by an explicit, idempotent call where RLlink is spoken (the
    server's EnvRunner, the client, the probe), not as a side effect of an import. A fresh interpreter: this
    session's other tests may have made the call already."""
    import subprocess
    import sys

    script = """
import msgpack
import ray.rllib.env.external.rllink as wire
packb, before = msgpack.packb, wire.msgpack
import raydp.control.rllink as rllink
assert wire.msgpack is before is None, wire.msgpack
rllink.use_numpy_msgpack()
assert wire.msgpack is rllink.NumpyMsgpack
rllink.use_numpy_msgpack()
assert wire.msgpack is rllink.NumpyMsgpack and msgpack.packb is packb  # idempotent; msgpack itself untouched
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_transport_is_declared_by_its_registry_line_alone(monkeypatch):
    """A new transport's spec names its value form and its parser's module: matching, parsing and the error that
    lists the known forms follow from the registry (nothing else names broker or rllink)."""
    import raydp.control.transports as transports
    from raydp.control.transports import TransportSpec, transport_for

    mine = TransportSpec("mine", "mine://HOST", "raydp.control.service:broker_client",
                         "raydp.control.service:BrokerLaunch", parser="raydp.control.address:loopback_host")
    monkeypatch.setattr(transports, "TRANSPORTS", (*transports.TRANSPORTS, mine))
    assert transport_for("mine://localhost") is mine and mine.parse("localhost") == "127.0.0.1"
    assert transport_for("broker").kind == "broker" and transport_for("rllink://:1").kind == "rllink"
    with pytest.raises(ValueError, match="expected 'broker', 'rllink://HOST:PORT' or 'mine://HOST', got 'nope'"):
        transport_for("nope")
    assert not mine.matches("mine:/x") and not mine.matches(None)
