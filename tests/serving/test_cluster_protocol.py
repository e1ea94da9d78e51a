"""One cluster contract for the threaded cluster and the simulator's, a typed state from both,
the administrative hold, and an actuator with no import circle (no JAX)."""
import ast
import inspect
import time
from pathlib import Path

import pytest

from serving_support import req
from dilaserve_jax.serving.cluster.admin import ClusterBusy
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.cluster import Cluster
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner, fake_profile
from dilaserve_jax.serving.cluster.protocol import ServingCluster
from dilaserve_jax.serving.cluster.state import ClusterState, InstanceState
from dilaserve_jax.serving.cluster.weights_swap import NewWeights
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.request import RequestState
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
from dilaserve_jax.sim.cluster import SimCluster
from dilaserve_jax.sim.simulator import SimConfig, Simulation

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "dilaserve_jax" / "serving" / "cluster"
LATENCY = LatencyModel.from_profile(fake_profile())


def threaded_cluster(n=2):
    engines = [Engine(FakeRunner(2), Scheduler(SchedulerConfig(2, policy="fcfs-static"), LATENCY),
                      clock=time.monotonic, name=f"instance-{i}") for i in range(n)]
    infos = [InstanceInfo(e.name, 1, (i,)) for i, e in enumerate(engines)]
    return Cluster(engines, infos, layout=f"{n}x1", policy="fcfs-static", model_source="fake", tokenizer=None,
                   limits=None, step_timeout_s=None,
                   loader=lambda source, step: NewWeights(source, {e.name: 0 for e in engines}))


def simulated_cluster():
    sim = Simulation(SimConfig(devices=2, policy="fcfs-static", layout="2x1", slots=2, tp_degrees=(1,)), [],
                     step_time=None, latency=LATENCY, quality=None, prior=None, param_bytes=0.0,
                     runner_factory=lambda info, clock: FakeRunner(2, clock))
    return SimCluster(2, "2x1", sim.make_instance, policy="fcfs-static")


def protocol_methods():
    return {name: member for name, member in vars(ServingCluster).items()
            if callable(member) and not name.startswith("_")}


def test_the_protocol_names_what_the_actuator_and_the_frontends_use():
    assert {"snapshots", "engine", "instance_of", "compiled_placements", "add_arrival_observer", "submit", "abort",
            "reconfigure", "migrate", "state"} <= set(protocol_methods())
    assert {"ready", "layout", "infos"} <= set(ServingCluster.__annotations__)


@pytest.mark.parametrize("make", [threaded_cluster, simulated_cluster], ids=["Cluster", "SimCluster"])
def test_both_clusters_satisfy_the_protocol_with_compatible_signatures(make):
    cluster = make()
    assert isinstance(cluster, ServingCluster)
    for name, member in protocol_methods().items():
        want = list(inspect.signature(member).parameters.values())[1:]  # without self
        have = inspect.signature(getattr(type(cluster), name)).parameters
        have_list = list(have.values())[1:]
        assert [p.name for p in have_list[:len(want)]] == [p.name for p in want], name
        for p in want:  # same kind, and a default wherever the protocol has one
            assert have[p.name].kind == p.kind, (name, p.name)
            assert p.default is inspect.Parameter.empty or have[p.name].default is not inspect.Parameter.empty, \
                (name, p.name)
        assert all(p.default is not inspect.Parameter.empty or p.kind is p.VAR_KEYWORD
                   for p in have_list[len(want):]), f"{name}: extra parameters need defaults"
    for attr in ServingCluster.__annotations__:
        assert hasattr(cluster, attr), attr


def test_both_clusters_report_the_same_typed_state():
    threaded, simulated = threaded_cluster(), simulated_cluster()
    for cluster in (threaded, simulated):
        state = cluster.state()
        assert isinstance(state, ClusterState) and all(isinstance(i, InstanceState) for i in state.instances)
        assert state.layout == "2x1" and state.controller.mode == "manual" and state.in_flight == 0
        assert [i.device_ids for i in state.instances] == [(0,), (1,)]
        assert all(i.up and i.slots == 2 and i.running == i.waiting == 0 for i in state.instances)
        assert state["instances"][0]["slots"] == 2  # readable by field name too
        with pytest.raises(AttributeError):
            state.layout = "1x2"  # frozen
    plain = threaded.state().as_dict()
    assert plain["instances"][0]["device_ids"] == [0] and plain["controller"]["mode"] == "manual"


def test_the_simulated_cluster_submits_and_aborts_through_the_protocol():
    cluster = simulated_cluster()
    a, b = req("a", 0.0, 60.0, answer=16), req("b", 0.0, 60.0, answer=16)
    ha, hb = cluster.submit(a), cluster.submit(b, instance="tp1@1")
    assert hb.instance == "tp1@1" and cluster.state().in_flight == 2
    assert cluster.abort("b") and not cluster.abort("nobody")
    while cluster.process_next({}) is not None:
        pass
    assert ha.result(0).state == RequestState.FINISHED_OK
    assert hb.result(0).state == RequestState.FINISHED_ABORTED and cluster.state().in_flight == 0


def test_one_administrative_operation_at_a_time_and_no_admin_after_its_hold():
    cluster = threaded_cluster()
    with cluster.exclusive("reconfiguration") as admin:
        assert admin.layout == "2x1"
        with pytest.raises(ClusterBusy):
            cluster.reload("1")
        with pytest.raises(ClusterBusy):
            cluster.exclusive("reload", wait_s=0.01).__enter__()
    with pytest.raises(RuntimeError):
        admin.weights_swapped("x", "reload")
    assert cluster.builder is None and cluster.compiled_placements() == frozenset()
    with pytest.raises(ValueError):
        cluster.reconfigure("1x2")  # no builder: the layout is fixed


def _type_checking_only(node) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Cluster-layer modules imported at run time: at module top, or (top_level_only=False)
    anywhere, e.g. inside a function. Imports for type checkers only are not run."""
    tree = ast.parse(path.read_text())
    tree.body = [n for n in tree.body if not _type_checking_only(n)]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.rsplit(".", 1)[-1] for m in out if m.startswith("dilaserve_jax.serving.cluster.")}


def test_the_cluster_layer_imports_at_module_top_and_has_no_circle():
    modules = {p.stem: p for p in CLUSTER_DIR.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        top, anywhere = _imports(path, True), _imports(path, False)
        assert anywhere == top, f"{name} imports {sorted(anywhere - top)} lazily or under a condition"
        graph[name] = top & set(modules)
    assert not graph["reshape"] & {"cluster"} and not graph["weights_swap"] & {"cluster"}
    done, path = set(), []

    def visit(node):
        assert node not in path, "import circle: " + " -> ".join(path[path.index(node):] + [node])
        if node in done:
            return
        path.append(node)
        for nxt in graph[node]:
            visit(nxt)
        path.pop()
        done.add(node)

    for name in graph:
        visit(name)
