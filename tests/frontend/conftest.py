"""An in-process gRPC server on a free port, driven from a background event-loop thread."""
import asyncio
import threading
import time

import grpc
import pytest

from dilaserve_jax.frontend.client import DiLaServeClient
from dilaserve_jax.frontend.server import ServerOptions, start_server
from dilaserve_jax.frontend.validation import Limits
from dilaserve_jax.models import CharTokenizer
from dilaserve_jax.serving.cluster.cluster import Cluster, InstanceInfo
from dilaserve_jax.serving.cluster.weights_swap import NewWeights
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.cluster.hosts.fake_hosts import LetterFakeRunner
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig


class ServerThread:
    def __init__(self, cluster, http=None, **options):
        """`http`: HttpOptions to serve the OpenAI-compatible API too (at `http_base`)."""
        self.cluster = cluster
        self.options = ServerOptions(port=0, metrics_port=0, grace_s=5.0, **options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = self.call(start_server(cluster, self.options, http))
        self.target = f"127.0.0.1:{self.running.port}"
        self.http_base = f"http://127.0.0.1:{self.running.http_port}" if self.running.http_port else None

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def ready(self):
        self.cluster.start()
        self.cluster.warm_up()
        self.call(self.running.set_serving(True))
        return self

    def client(self, **kw):
        return DiLaServeClient(self.target, **kw)

    def stop(self):
        try:
            self.call(self.running.drain_and_stop(1.0))
        finally:
            self.cluster.stop()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


CharFakeRunner = LetterFakeRunner  # printable characters, so answers decode as text


def fake_loader(names, delay_s=0.0):
    """Reload for fake runners: the "weights" are a number derived from the source."""
    def load(source, step):
        time.sleep(delay_s)
        return NewWeights(f"fake:{source}", {n: len(source) % 7 for n in names})
    return load


def fake_cluster(instances=2, slots=4, max_queue=64, step_scale=1.0, policy="dilaserve", runner_cls=None,
                 load_delay_s=0.0, threshold=None):
    latency = LatencyModel.from_profile(fake_profile())
    engines, infos = [], []
    for i in range(instances):
        runner = (runner_cls or CharFakeRunner)(slots, real_sleep=True,
                                                step_time=lambda k, b, l, blk: step_scale * (0.004 if k == 0 else 0.001))
        cfg = SchedulerConfig(num_slots=slots, policy=policy, max_queue=max_queue,
                              **({"threshold": threshold} if threshold is not None else {}))
        engines.append(Engine(runner, Scheduler(cfg, latency), clock=time.monotonic, name=f"instance-{i}"))
        infos.append(InstanceInfo(f"instance-{i}", 1, (i,)))
    tok = CharTokenizer()
    limits = Limits(max_len=256, vocab_size=tok.vocab_size, reserved_ids=frozenset({tok.mask_id, tok.pad_id}),
                    default_max_new_tokens=32, default_block_length=16, default_slo_ms=5000)
    return Cluster(engines, infos, layout=f"{instances}x1", policy=policy, model_source="fake", tokenizer=tok,
                   limits=limits, loader=fake_loader([e.name for e in engines], load_delay_s))


@pytest.fixture
def fake_server():
    server = ServerThread(fake_cluster()).ready()
    yield server
    server.stop()


def status_of(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()
