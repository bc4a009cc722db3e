"""Patch of vLLM's Ray placement group (``vllm.v1.executor.ray_utils._wait_until_pg_ready`` and
the Ray executors' ``shutdown``): a cluster with fewer NPUs than the engine's workers fails at
once, saying what was asked, what the cluster offers and the fix; and an engine's shutdown gives
back the NPUs its placement group reserved.

Upstream limitations (vLLM 0.32):

- ``initialize_ray_cluster`` only warns when the cluster has fewer devices than the world size,
  then waits for the placement group for up to ``PG_WAIT_TIMEOUT`` (30 minutes) while Ray's
  autoscaler prints "No available node types can fulfill resource request {'NPU': 1.0}" every
  35 s; its final error counts GPUs. A cluster that has the NPUs but has lent them to someone
  else still gets vLLM's wait, with its log lines: NPUs may be freed or nodes added.
- The executors kill their workers at shutdown but keep the placement group they created until
  the driver process exits: a second engine in the same process (an RL loop, a script that
  makes engines one after the other, an in-process engine core) waited 30 minutes for NPUs its
  predecessor no longer used. Placement groups the user made (``parallel_config.placement_group``
  or the current one) are left alone.

Remove when vLLM refuses a placement group its cluster cannot hold and removes the ones it made.
"""

import functools
import importlib.util

from vllm.platforms import current_platform

from vllm_ascend.logger import get_logger

logger = get_logger(__name__)


class RayClusterTooSmallError(ValueError):
    pass


def _fail_if_the_cluster_cannot_hold(placement_group, ray) -> None:
    key = current_platform.ray_device_key
    asked = sum(bundle.get(key, 0) for bundle in placement_group.bundle_specs)
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")),
                   key=lambda n: n["NodeManagerAddress"])
    offered = sum(n["Resources"].get(key, 0) for n in nodes)
    if asked <= offered:
        return
    ray.util.remove_placement_group(placement_group)  # or the autoscaler keeps asking for it
    per_node = ", ".join(f"{n['NodeManagerAddress']}: {n['Resources'].get(key, 0):g}"
                         for n in nodes)
    raise RayClusterTooSmallError(
        f"vllm-ascend: the engine asks Ray for {asked:g} {key}s (one per worker: tensor x "
        f"pipeline parallel size), but the Ray cluster at "
        f"{ray.get_runtime_context().gcs_address} offers {offered:g} ({len(nodes)} node(s), "
        f"{key}s per node: {per_node}). Fix: give Ray each node's NPUs (Ray detects an Ascend "
        f"node's NPUs at `ray start`, limited by ASCEND_RT_VISIBLE_DEVICES; `ray status` lists "
        f"them; a simulated node offers its devices with `VLLM_ASCEND_SIM_DEVICES=N ray start "
        f"... --resources '{{\"{key}\": N}}'`), add nodes, or ask for fewer ranks "
        f"(--tensor-parallel-size, --pipeline-parallel-size). See docs/multi_node.md.")


_made_by_vllm: set = set()  # ids of the placement groups vLLM created (it waits for those only)


def _remove_if_made_by_vllm(executor, ray) -> None:
    config = getattr(executor, "parallel_config", None)  # None: its start failed early
    group = config.placement_group if config is not None else None
    if group is not None and group.id in _made_by_vllm and ray.is_initialized():
        _made_by_vllm.discard(group.id)
        ray.util.remove_placement_group(group)
        logger.info("vllm-ascend: the engine's Ray placement group is removed: its NPUs are free")


def apply() -> None:
    if importlib.util.find_spec("ray") is None:
        return  # vLLM's Ray executors refuse to start without Ray, with the install command
    from vllm.v1.executor import ray_executor, ray_executor_v2, ray_utils

    if getattr(ray_utils._wait_until_pg_ready, "_ascend", False):
        return
    wait = ray_utils._wait_until_pg_ready

    @functools.wraps(wait)
    def wait_until_pg_ready(placement_group):
        _fail_if_the_cluster_cannot_hold(placement_group, ray_utils.ray)
        _made_by_vllm.add(placement_group.id)
        return wait(placement_group)

    wait_until_pg_ready._ascend = True
    ray_utils._wait_until_pg_ready = wait_until_pg_ready
    for cls in (ray_executor_v2.RayExecutorV2, ray_executor.RayDistributedExecutor):
        cls.shutdown = _then_remove_the_placement_group(cls.shutdown, ray_utils.ray)


def _then_remove_the_placement_group(shutdown, ray):
    @functools.wraps(shutdown)
    def shutdown_and_remove(self):
        shutdown(self)
        _remove_if_made_by_vllm(self, ray)

    return shutdown_and_remove
