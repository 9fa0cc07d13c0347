"""Ray's fake multi-node provider, with nodes that share no disk: the autoscaler of `cluster/nodes.py start
--autoscale` (cluster/autoscale.yaml) launches each worker node the way `nodes.py add-worker` does (a network
namespace of its own, the worker user, its own temp dir), instead of a process beside the head.

FakeMultiNodeProvider keeps the node table and the ids (the node's Ray id is the provider's, so the autoscaler
matches its load reports, `use_node_id_as_ip`); only starting and stopping a node differ. The monitor runs in the
head's namespace: a node is made from the host's (`ip netns exec <host namespace>`), where the bridge is.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import (NODE_KIND_WORKER, STATUS_UP_TO_DATE, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME,
                                 TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE)

NODES_PY = str(Path(__file__).resolve().parent / "nodes.py")


def _nodes(*args: str) -> str:
    host = f"emb{os.environ.get('EMBED_NET', '10.213.7').split('.')[-1]}-host"
    return subprocess.run(["ip", "netns", "exec", host, sys.executable, NODES_PY, *args], check=True, text=True,
                          capture_output=True).stdout.strip()


class NetnsNodeProvider(FakeMultiNodeProvider):
    """FakeMultiNodeProvider whose worker nodes are cluster/nodes.py's (module docstring)."""

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        resources = copy.deepcopy(resources)
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            node_id = self._next_hex_node_id()
            cpus, gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
            resources.pop("object_store_memory", None)
            name = _nodes("add-worker", "--cpus", str(cpus), "--gpus", str(gpus), "--type", node_type,
                          "--node-id", node_id, "--resources", json.dumps(resources), "--no-wait")
            self._nodes[node_id] = {"tags": {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type,
                                             TAG_RAY_NODE_NAME: node_id, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                                             **tags}, "name": name}

    def _terminate_node(self, node):
        _nodes("remove-node", node["name"])
