"""A study on a two-node Ray cluster with its storage on an S3-compatible object store (issue 31): moto's server
stands in for S3, ``ray.cluster_utils.Cluster`` starts a head and a worker node on this machine; the trials run on
both nodes, read the dataset from the store, and everything comes back from it (Tune's experiment, checkpoints,
and each trial's run directory with its ledger and adapters). Slow tier: it starts two Ray nodes."""

import json
import shutil
import tempfile
import os
import socket
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.slow

BUCKET = "raydp-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def object_store(monkeypatch):
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(key, value)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket=BUCKET)
    yield port
    server.stop()


@pytest.fixture()
def two_nodes(object_store, separate_ray):
    import ray
    from ray.cluster_utils import Cluster

    # the session's Ray is shut down for this test's two nodes (separate_ray), and started again after it.
    # The nodes' temporary folder inside an owner-only one, as a data owner's cluster must have it (docs/privacy.md:
    # a study on private data refuses a Ray whose folder other local users can enter)
    root = Path(tempfile.mkdtemp(prefix="raydp-nodes-", dir="/tmp"))
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "temp_dir": str(root / "ray")})
    cluster.add_node(num_cpus=1, temp_dir=str(root / "ray"))
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(root, ignore_errors=True)


def test_a_study_runs_on_two_nodes_with_its_storage_on_an_object_store(two_nodes, object_store, tmp_path):
    import boto3
    import pyarrow.fs

    from raydp.study.runner import run_study

    uri = f"s3://{BUCKET}/studies?endpoint_override=127.0.0.1:{object_store}&scheme=http&region=us-east-1"
    study = {"name": "cluster", "models": ["embedded-tiny"], "epsilons": [2.0], "seeds": [0, 1],
             "strategies": ["static"], "resources": {"cpus_per_trial": 1}, "storage": uri,
             "wandb": {"mode": "disabled"},
             "base": {"data": {"n_records": 300}, "max_steps": 12, "eval_every": 6, "eval_max_records": 16,
                      "public_eval_records": 16, "warmup_steps": 2}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(study))
    study_dir = run_study(path, tmp_path / "out", progress=False)

    table = pd.read_parquet(study_dir / "results.parquet")
    assert len(table) == 2 and (table["status"] == "TERMINATED").all() and table["within_budget"].all()
    # the trials ran on both nodes
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{object_store}")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])]
    results = [k for k in keys if k.endswith("/result.json")]
    nodes = set()
    for key in results:
        rows = [json.loads(line) for line in s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().splitlines()]
        nodes |= {r["node_id"] for r in rows if r.get("done")}
    assert len(results) == 2 and len(nodes) == 2 and None not in nodes, nodes
    import ray

    assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # one trial on each node
    # the dataset and every trial's outputs are on the store, and the study directory's copies came from it
    assert any(k.startswith("studies/cluster/dataset/") and k.endswith("train.parquet") for k in keys)
    filesystem, _ = pyarrow.fs.FileSystem.from_uri(uri)
    for name in table["trial"]:
        local = study_dir / "trials" / name
        for wanted in ("summary.json", "privacy_ledger.parquet", "adapter/adapter_model.safetensors"):
            on_store = [k for k in keys if k.endswith(wanted) and "checkpoint_" in k]
            assert on_store, wanted
            assert (local / wanted).exists(), (name, wanted)
        summary = json.loads((local / "summary.json").read_text())
        matches = []
        for key in (k for k in keys if k.endswith("/summary.json") and "checkpoint_" in k):
            with filesystem.open_input_stream(f"{BUCKET}/{key}") as f:
                matches.append(json.loads(f.read()) == summary)
        assert any(matches), name  # the local copy is the stored one
    assert not os.path.exists(study_dir / "tune")  # Tune kept nothing on the driver's disk
