"""RLDP over RLlib's RLlink protocol: a run driven end to end by a policy server, and the server's (and the
client's) refusal of an unauthenticated peer before anything is unpickled."""

import json
import os
import pickle
import socket
import threading

import numpy as np
import pandas as pd
import pytest
from ray.rllib.env.external import get_rllink_message, send_rllink_message

from raydp.config import TrainConfig, validate_config
from raydp.control.address import RLlinkAddress, parse_controller
from raydp.control.policies import policy_layout_for, sac_settings
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

SECRET = "rllink-test-secret-0123456789"


def tiny_config(**overrides):
    values = {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "data": {"n_records": 300},
              "max_steps": 12, "max_length": 96, "eval_every": 12, "eval_max_records": 8, "public_eval_records": 16,
              "warmup_steps": 2, "rldp": {"t_warm": 2, "t_rl": 2, "b_sac": 4, "k": 2, "n_max": 8, "hidden": 32}}
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
    srv = RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), port=free_port()).start()
    yield srv
    srv.stop()
    if previous is None:
        os.environ.pop(SECRET_ENV, None)
    else:
        os.environ[SECRET_ENV] = previous


# -- a run driven over RLlink ----------------------------------------------------------------------
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
    assert controller["action_latency_ms_median"] > 0 and controller["weights_versions_seen"]
    # the server's RLlib algorithm got the run's 4 transitions and trained K x B_SAC on each
    assert server.wait_idle(60)
    counters = server.counters()
    assert counters["errors"] == [] and counters["malformed_chunks"] == 0
    assert counters["transitions_received"] == 4 and counters["transitions_trained"] == 4
    assert counters["env_steps_sampled"] == 4  # RLlib's own NUM_ENV_STEPS_SAMPLED_LIFETIME
    assert counters["module_steps_trained"] == 4 * 2 * 4 and counters["replay_size"] == 4
    # the privacy guarantee is the broker path's: same ledger, the Renyi filter (E13), within budget
    privacy = summary["privacy"]
    assert privacy["within_budget"] and privacy["epsilon"] <= 2.0
    assert privacy["privacy_mode"] == "strict" and privacy["releases_per_step"] == ["gradient", "norm_histogram",
                                                                                     "loss_sum"]
    ledger = PrivacyLedger.load(run / LEDGER_FILENAME)
    assert len(ledger) == summary["steps"] == 12 and all(len(row.releases) == 3 for row in ledger)
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

    flt = privacy["filter"]
    assert privacy["guarantee"] == "renyi-filter" and privacy["epsilon"] == pytest.approx(flt["epsilon"])
    orders = [a for a in flt["orders"] if float(a).is_integer()]
    acc = dpa_rdp.RdpAccountant(orders)
    for q, s in zip(ledger.q, ledger.sigma_eff):
        acc.compose(dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(s))))
    budget = [b for a, b in zip(flt["orders"], flt["budget_rdp"]) if float(a).is_integer()]
    assert all(r <= b * (1 + 1e-6) for r, b in zip(acc._rdp, budget))
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
        RLlinkPolicyServer(policy_layout_for(config), sac_settings(config), port=free_port())


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
    assert parse_controller("rllink://localhost:7000").loopback
    assert not parse_controller("rllink://10.1.2.3:7000").loopback
    for bad, message in (("http://127.0.0.1:1", "rllink://HOST:PORT"), ("rllink://127.0.0.1", "port"),
                         ("rllink://127.0.0.1:99999", "port"), ("rllink://user:pw@127.0.0.1:1", "secret"),
                         ("rllink://127.0.0.1:1/x", "nothing after")):
        with pytest.raises(ConfigError, match=f"invalid config: controller: .*{message}"):
            tiny_config(controller=bad)
    with pytest.raises(ConfigError, match="RLDP run only"):
        validate_config(TrainConfig, {"strategy": "dpsgd", "epsilon": 1.0, "controller": "rllink://:5555"})
    with pytest.raises(ConfigError, match="rldp.save_policy does not apply"):
        tiny_config(controller="rllink://:5555", rldp={"save_policy": "p"})
    from raydp.cli import main

    assert main(["train", "-o", "/nonexistent/x", "--strategy", "rldp", "--epsilon", "1",
                 "--controller", "rllink://nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "controller" in err[0]
