"""Command-line client: `python -m dilaserve_jax.client [--target HOST:PORT] [--stream] "prompt"`."""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

from google.protobuf.json_format import MessageToDict

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    prompt: str | None = opt(None, "prompt text (omit with --state)", positional=True)
    target: str = opt("127.0.0.1:50051", "server address")
    stream: bool = opt(False, "show the canvas filling in, step by step")
    slo_ms: float | None = opt(None, "latency objective in ms", default_text="the server's")
    deadline_ms: float | None = opt(None, "gRPC deadline in ms (overrides --slo-ms on the server)")
    max_new_tokens: int | None = opt(None, "answer length limit", default_text="the server's")
    block_length: int | None = opt(None, "semi-autoregressive block length", default_text="the server's")
    tau_min: float | None = opt(None, "quality floor: lowest threshold the server may use", default_text="the server's")
    tau_max: float | None = opt(None, "threshold ceiling", default_text="the server's")
    max_accuracy_drop: float | None = opt(None, "own bound on the predicted accuracy loss, points vs the server's "
                                                "τ ceiling", metavar="PTS", default_text="the server's budget")
    strict_admission: bool | None = opt(None, "refuse the call if it cannot meet its deadline (--no-strict-admission: "
                                              "serve it late)", default_text="the server's --admission")
    temperature: float = opt(0.0, "0 = greedy")
    seed: int = opt(0, "sampling seed")
    token: str | None = opt(None, "bearer token, if the server requires one", env="DILASERVE_AUTH_TOKEN",
                            default_text="$DILASERVE_AUTH_TOKEN")
    tls_ca: str | None = opt(None, "CA certificate (PEM) for a TLS server")
    json: bool = opt(False, "print the final response as JSON")
    state: bool = opt(False, "print the cluster state instead of generating")

    def __post_init__(self):
        if not self.state and self.prompt is None:
            raise ValueError("a prompt is required (or --state)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.client",
        description="Send a prompt to a dilaserve-jax server and print the answer and its timings.")
    return add_config_arguments(p, ClientConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(ClientConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    import grpc

    from dilaserve_jax.frontend.client import DiLaServeClient

    kw = dict(max_new_tokens=args.max_new_tokens, block_length=args.block_length, slo_ms=args.slo_ms,
              tau_min=args.tau_min, tau_max=args.tau_max, temperature=args.temperature, seed=args.seed,
              max_accuracy_drop=args.max_accuracy_drop, strict_admission=args.strict_admission)
    timeout = args.deadline_ms / 1000.0 if args.deadline_ms else None
    try:
        with DiLaServeClient(args.target, auth_token=args.token, tls_ca=args.tls_ca) as client:
            if args.state:
                print(json.dumps(MessageToDict(client.cluster_state(), always_print_fields_with_no_presence=True,
                                               preserving_proto_field_name=True), indent=1))
                return 0
            if args.stream:
                final = None
                for event in client.generate_stream(args.prompt, timeout=timeout, **kw):
                    if event.HasField("update"):
                        u = event.update
                        if not args.json:
                            log.info(f"step {u.step:3d} [{u.step_kind:7s} tau={u.tau:.2f} +{u.tokens_committed}] "
                                     f"{u.canvas}")
                    else:
                        final = event.final
            else:
                final = client.generate(args.prompt, timeout=timeout, **kw)
    except grpc.RpcError as err:
        log.error(f"error: {err.code().name}: {err.details()}")
        return 1
    if args.json:
        print(json.dumps(MessageToDict(final, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)))
    else:
        print(final.text)
        log.info(f"[{final.instance}] {len(final.token_ids)} tokens, {describe_finish(final.finish_reason)}, "
                 f"{final.steps} steps, mean tau {final.mean_tau:.2f}, predicted accuracy loss "
                 f"{final.predicted_accuracy_loss:.2f} points, queue {final.queue_ms:.1f} ms, decode "
                 f"{final.decode_ms:.1f} ms, total {final.total_ms:.1f} ms, deadline "
                 f"{'met' if final.deadline_met else 'missed'} ({final.deadline_ms:.0f} ms)"
                 + (f", moved {final.moves}x" if final.moves else ""))
    return 0


def describe_finish(reason: int) -> str:
    from dilaserve_jax.frontend import dilaserve_pb2 as pb

    return {pb.FINISH_REASON_STOP: "finished: stop (the answer ended)",
            pb.FINISH_REASON_LENGTH: "finished: length (cut by max_new_tokens; raise it for the rest)",
            pb.FINISH_REASON_ABORTED: "finished: aborted"}.get(reason, "finished: unspecified")


if __name__ == "__main__":
    raise SystemExit(main())
