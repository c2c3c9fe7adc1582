"""Running on a Ray cluster that is already up: ``--ray.address`` / ``RAY_ADDRESS`` (as
``ray job submit`` sets it) join it and start nothing, ``--<role>.node`` puts each role on
the nodes it names, and the weights cross nodes over the object store.

The cluster is Ray's own multi-node test cluster: two raylets on this machine, each a node
with its own resources and labels (``pool=learn`` for the head, ``pool=rollout``)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from rlhf.cli.config import ConfigError, RLConfig, replace
from rlhf.cli.nodes import NODE_ID_LABEL, NodeSpec, NodeSpecError, unmatched
from rlhf.cli.presets import resolve

from .conftest import rlhf_process, small_run

NODE = "0f" * 28


def test_node_specs_parse_and_match() -> None:
    assert not NodeSpec.parse("", flag="--vllm.node")
    assert NodeSpec.parse(" spread ", flag="--vllm.node") == NodeSpec(spread=True)
    spec = NodeSpec.parse("pool=rollout, zone=b", flag="--vllm.node")
    assert spec.labels == (("pool", "rollout"), ("zone", "b"))
    assert spec.matches({"pool": "rollout", "zone": "b", NODE_ID_LABEL: NODE})
    assert not spec.matches({"pool": "rollout"})  # every label must hold
    assert NodeSpec.parse(NODE, flag="--actor.node").labels == ((NODE_ID_LABEL, NODE),)
    for bad in ("rollout", "pool=", "=x", "pool=a b", NODE[:-1] + "g"):
        with pytest.raises(NodeSpecError, match="--vllm.node"):
            NodeSpec.parse(bad, flag="--vllm.node")


def test_a_spec_no_alive_node_satisfies_is_named_with_the_nodes() -> None:
    nodes = [
        {"Alive": True, "NodeID": "a" * 56, "Labels": {"pool": "learn", NODE_ID_LABEL: "a" * 56}},
        {"Alive": False, "NodeID": "b" * 56, "Labels": {"pool": "rollout"}},
    ]
    specs = {
        "--actor.node": NodeSpec.parse("pool=learn", flag="--actor.node"),
        "--vllm.node": NodeSpec.parse("pool=rollout", flag="--vllm.node"),  # its node is dead
        "--critic.node": NodeSpec(spread=True),  # any node will do
    }
    (problem,) = unmatched(specs, nodes)
    assert problem.startswith("--vllm.node pool=rollout: no alive node")
    assert f"{'a' * 12}… pool=learn" in problem


def test_colocated_roles_cannot_name_different_nodes() -> None:
    hybrid = replace(resolve("ppo"), **{"actor.model.path": "m", "data.prompt_data": "d",
                                        "train.colocate_all": True})  # fmt: skip
    ok = replace(hybrid, **{"actor.node": "pool=a", "vllm.node": "pool=a"})
    assert ok.validate() is ok
    bad = replace(hybrid, **{"actor.node": "pool=a", "vllm.node": "pool=b", "critic.node": "x"})
    with pytest.raises(ConfigError) as raised:
        bad.validate()
    # The spec that does not parse is listed; the contradiction is checked once all parse.
    assert "--critic.node 'x': expected 'spread'" in str(raised.value)
    with pytest.raises(ConfigError, match="--vllm.node pool=b contradicts --actor.node pool=a"):
        replace(bad, **{"critic.node": ""}).validate()
    roles = replace(hybrid, **{"critic.node": "spread"}).role_nodes()
    assert roles["ref"] == roles["actor"] and roles["critic"] == (
        "--critic.node",
        NodeSpec(spread=True),
    )


def test_relative_paths_become_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    config = replace(RLConfig(), **{"run_dir": "runs/x", "actor.model.path": "model",
                                    "train.reward_model_path": "org/hub-name"})  # fmt: skip
    out = config.with_absolute_paths()
    assert out.run_dir == str(tmp_path / "runs" / "x")
    assert out.actor.model.path == str(tmp_path / "model")
    assert out.train.reward_model_path == "org/hub-name"  # nothing here by that name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_nothing_answers_at_is_named_at_once(assets, tmp_path) -> None:
    port = _free_port()  # closed again: nothing listens there
    args = ["train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=1)]
    out = rlhf_process(*args, "--ray.address", f"127.0.0.1:{port}", timeout=300)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert f"--ray.address '127.0.0.1:{port}': no Ray head answers there" in out.stderr
    out = rlhf_process(*args, env={"RAY_ADDRESS": f"127.0.0.1:{port}"}, timeout=300)
    assert out.returncode == 2 and "RAY_ADDRESS '127.0.0.1:" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine: the head (``pool=learn``, with the dashboard that
    ``ray job submit`` talks to) and a worker (``pool=rollout``)."""
    from ray.cluster_utils import Cluster

    dashboard = _free_port()
    made = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "labels": {"pool": "learn"},
                        "include_dashboard": True, "dashboard_port": dashboard},
    )  # fmt: skip
    worker = made.add_node(num_cpus=2, labels={"pool": "rollout"})
    yield {
        "address": made.address,
        "dashboard": f"http://127.0.0.1:{dashboard}",
        "learn": made.head_node.node_id,
        "rollout": worker.node_id,
    }
    made.shutdown()


def test_a_run_joins_a_cluster_places_roles_by_node_and_resumes_as_a_job(
    assets, tmp_path, cluster
) -> None:
    """GRPO with the engine on one node and the learners on another: it trains and syncs
    (object store across nodes, every sync read back in full), then resumes from its
    checkpoint as a ``ray job submit`` job, which finds the cluster through RAY_ADDRESS."""
    driver = tmp_path / "driver"  # the driver's working directory is not the cluster's
    driver.mkdir()
    flags = [*small_run(assets, steps=2), "--vllm.verify_sync", "full", "--ckpt.save_steps", "1",
             "--vllm.node", "pool=rollout", "--actor.node", "pool=learn"]  # fmt: skip
    model = flags.index("--actor.model.path") + 1
    flags[model] = os.path.relpath(flags[model], driver)
    out = subprocess.run(
        [sys.executable, "-m", "rlhf.cli", "train", "grpo", "--run_dir", "run", *flags,
         "--ray.address", cluster["address"]],
        capture_output=True, text=True, timeout=900, cwd=driver,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"[plan] ray: joined the cluster at {cluster['address']}, 2 node(s)" in out.stdout
    assert "[plan] nodes: actor pool=learn, ref pool=learn, engines pool=rollout" in out.stdout
    assert (
        "[plan] weight sync: object_store (auto: 2 nodes with CPUs only, 1 engine; not "
        "shared_memory: needs one machine; the cluster has 2 nodes)" in out.stdout
    )
    run = driver / "run"
    placement = json.loads((run / "placement.json").read_text())
    assert placement["engines"]["nodes"] == [cluster["rollout"]]
    assert placement["engines"]["node_spec"] == "pool=rollout"
    assert placement["actor"]["nodes"] == placement["ref"]["nodes"] == [cluster["learn"]]
    report = json.loads((run / "sync.json").read_text())
    assert report["engines_loaded"] == [{"object_store": 2}]  # both syncs loaded, read back
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000002",
    ]

    # The same run, one step further, submitted as a job: no --ray.address, no cwd of ours.
    ray_cli = pathlib.Path(sys.executable).parent / "ray"
    flags[model] = str(assets["model"])
    steps = flags.index("--train.num_steps") + 1
    flags[steps] = "3"
    job = subprocess.run(
        [str(ray_cli), "job", "submit", "--address", cluster["dashboard"], "--",
         sys.executable, "-m", "rlhf.cli", "train", "grpo", "--run_dir", str(run), *flags,
         "--ckpt.load_enable", "True"],
        capture_output=True, text=True, timeout=900, check=False,
        # `ray job submit` would take RAY_ADDRESS (the test run's own cluster) over --address.
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )  # fmt: skip
    assert job.returncode == 0, (job.stdout[-4000:], job.stderr[-4000:])
    assert "[plan] ray: joined the cluster at" in job.stdout
    assert "step-00000002 at step 2" in job.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    report = json.loads((run / "sync.json").read_text())
    # The checkpoint's weights into the fresh engine at resume, then step 3's.
    assert report["engines_loaded"] == [{"object_store": 2}]
    placement = json.loads((run / "placement.json").read_text())
    assert placement["engines"]["nodes"] == [cluster["rollout"]]


def test_without_an_address_a_run_starts_its_own_cluster_beside_a_running_one(
    assets, tmp_path, cluster
) -> None:
    """A cluster already up on this machine (``ray start``, here the fixture's) is joined only
    when named: without ``--ray.address``/``RAY_ADDRESS`` the run starts a local one (Ray's
    ``ray.init()`` would join the running one, then refuse the CPUs we announce)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = ["train", "grpo", "--run_dir", str(tmp_path / "run"), *small_run(assets, steps=1)]
    out = subprocess.run(
        [sys.executable, "-m", "rlhf.cli", *args], capture_output=True, text=True, timeout=900,
        env={**env, "PYTHONUNBUFFERED": "1"}, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[plan] ray: a local cluster, 1 node(s)" in out.stdout


def test_a_node_spec_the_cluster_lacks_is_refused_without_waiting(assets, tmp_path, cluster):
    out = rlhf_process(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=1),
        "--ray.address", cluster["address"], "--vllm.node", "pool=gpu",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert "--vllm.node pool=gpu: no alive node of the Ray cluster carries these labels" in (
        out.stderr
    )
    assert "pool=learn" in out.stderr and "pool=rollout" in out.stderr
    assert not (tmp_path / "placement.json").exists()


def test_sft_joins_the_cluster_on_the_node_it_names(assets, tmp_path, cluster) -> None:
    """``rlhf train sft`` from another working directory, relative paths, its rank on the
    rollout node; a node spec no node satisfies is refused before anything starts."""
    base = ["train", "sft", "--dataset", str(assets["sft"]), "--input_template", "{}",
            "--num_steps", "2", "--batch_size", "8", "--micro_batch_size", "8",
            "--model.num_cpus_per_rank", "0.5", "--ray.address", cluster["address"]]  # fmt: skip
    model = os.path.relpath(assets["model"], tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "rlhf.cli", *base, "--run_dir", "sft", "--model.model.path",
         model, "--model.node", "pool=rollout"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    placement = json.loads((tmp_path / "sft" / "placement.json").read_text())
    pids = placement["model"].pop("pids")
    assert len(pids) == 1 and int(pids[0]) != os.getpid()  # the rank's own process
    assert placement == {
        "model": {"node_spec": "pool=rollout", "placement_group": [None],
                  "nodes": [cluster["rollout"]]}
    }  # fmt: skip
    assert (tmp_path / "sft" / "final" / "tokenizer.json").is_file()
    out = rlhf_process(*base, "--run_dir", str(tmp_path / "no"), "--model.model.path",
               str(assets["model"]), "--model.node", "pool=gpu", timeout=300)  # fmt: skip
    assert out.returncode == 2 and "--model.node pool=gpu: no alive node" in out.stderr, out.stderr[
        -2000:
    ]
