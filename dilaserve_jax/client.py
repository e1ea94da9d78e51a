"""Command-line client: `python -m dilaserve_jax.client [--target HOST:PORT] [--stream] "prompt"`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from google.protobuf.json_format import MessageToDict


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.client",
                                description="Send a prompt to a dilaserve-jax server and print the answer and its timings.")
    p.add_argument("prompt", nargs="?", help="prompt text (omit with --state)")
    p.add_argument("--target", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--stream", action="store_true", help="show the canvas filling in, step by step")
    p.add_argument("--slo-ms", type=float, help="latency objective in ms (the server default otherwise)")
    p.add_argument("--deadline-ms", type=float, help="gRPC deadline in ms (overrides --slo-ms on the server)")
    p.add_argument("--max-new-tokens", type=int, help="answer length limit")
    p.add_argument("--block-length", type=int, help="semi-autoregressive block length")
    p.add_argument("--tau-min", type=float, help="quality floor: lowest threshold the server may use")
    p.add_argument("--tau-max", type=float, help="threshold ceiling")
    p.add_argument("--max-accuracy-drop", type=float, metavar="PTS",
                   help="own bound on the predicted accuracy loss, points vs tau_max (the server budget otherwise)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token", default=os.environ.get("DILASERVE_AUTH_TOKEN"),
                   help="bearer token, if the server requires one (default: $DILASERVE_AUTH_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) for a TLS server")
    p.add_argument("--json", action="store_true", help="print the final response as JSON")
    p.add_argument("--state", action="store_true", help="print the cluster state instead of generating")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import grpc

    from dilaserve_jax.frontend.client import DiLaServeClient

    if not args.state and args.prompt is None:
        print("error: a prompt is required (or --state)", file=sys.stderr)
        return 2
    kw = dict(max_new_tokens=args.max_new_tokens, block_length=args.block_length, slo_ms=args.slo_ms,
              tau_min=args.tau_min, tau_max=args.tau_max, temperature=args.temperature, seed=args.seed,
              max_accuracy_drop=args.max_accuracy_drop)
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
                            print(f"step {u.step:3d} [{u.step_kind:7s} tau={u.tau:.2f} +{u.tokens_committed}] {u.canvas}",
                                  file=sys.stderr, flush=True)
                    else:
                        final = event.final
            else:
                final = client.generate(args.prompt, timeout=timeout, **kw)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(final, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)))
    else:
        print(final.text)
        print(f"[{final.instance}] {len(final.token_ids)} tokens, {describe_finish(final.finish_reason)}, "
              f"{final.steps} steps, mean tau {final.mean_tau:.2f}, predicted accuracy loss "
              f"{final.predicted_accuracy_loss:.2f} points, queue {final.queue_ms:.1f} ms, decode "
              f"{final.decode_ms:.1f} ms, total {final.total_ms:.1f} ms, deadline "
              f"{'met' if final.deadline_met else 'missed'} ({final.deadline_ms:.0f} ms)"
              + (f", moved {final.moves}x" if final.moves else ""), file=sys.stderr)
    return 0


def describe_finish(reason: int) -> str:
    from dilaserve_jax.frontend import dilaserve_pb2 as pb

    return {pb.FINISH_REASON_STOP: "finished: stop (the answer ended)",
            pb.FINISH_REASON_LENGTH: "finished: length (cut by max_new_tokens; raise it for the rest)",
            pb.FINISH_REASON_ABORTED: "finished: aborted"}.get(reason, "finished: unspecified")


if __name__ == "__main__":
    raise SystemExit(main())
