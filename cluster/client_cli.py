"""`specd generate`: one prompt to a running server, over gRPC (the default) or the OpenAI-compatible
HTTP API (`--http`), and the address, TLS and token options every client command shares (admin too).

The HTTP path uses only the standard library (urllib, ssl), so it also shows what any HTTP client sends.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any

from specd.configs.schema import ServerConfig


def add_client_options(p: argparse.ArgumentParser) -> None:
    """Address, TLS and token options of the commands that call a server (generate, admin)."""
    default_address = f"{ServerConfig.host}:{ServerConfig.port}"
    p.add_argument("--address", default=None,
                   help=f"server address (default {default_address}; with --http "
                        f"{ServerConfig.host}:{ServerConfig.http_port})")
    p.add_argument("--tls", action="store_true", help="connect with TLS (implied by --ca-file)")
    p.add_argument("--ca-file", default=None, help="PEM CA that signed the server's certificate")
    p.add_argument("--cert-file", default=None, help="client certificate (PEM) for mutual TLS")
    p.add_argument("--key-file", default=None, help="client key (PEM) for mutual TLS")
    p.add_argument("--server-name", default=None,
                   help="gRPC over TLS: the name the server's certificate must carry, where the address does "
                        "not say it (a router pod's IP behind a certificate for the Service's name)")
    p.add_argument("--token-file", default=None, help="file whose first line is the bearer token")
    p.add_argument("--token-env", default="SPECD_TOKEN",
                   help="environment variable holding the bearer token (default SPECD_TOKEN)")


def grpc_address(args: argparse.Namespace) -> str:
    return args.address or f"{ServerConfig.host}:{ServerConfig.port}"


def client_security(args: argparse.Namespace):
    from specd.cluster.auth import client_token
    from specd.cluster.client import Security

    return Security(tls=args.tls, ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file,
                    token=client_token(args.token_file, args.token_env), server_name=args.server_name)


def _summary(reason: str, usage: dict[str, Any]) -> str:
    return (f"[{reason}] {usage.get('completion_tokens', 0)} tokens in {usage.get('total_time_s', 0):.2f} s, "
            f"ttft {usage.get('time_to_first_token_s', 0):.3f} s, accepted {usage.get('accepted', 0)}/"
            f"{usage.get('drafted', 0)} drafted, tokens per step {usage.get('tokens_per_step', 0):.2f}")


def _generate_grpc(args: argparse.Namespace) -> int:
    import grpc

    from specd.cluster.client import SpecdClient

    kw: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=args.stop or (), gamma=args.gamma,
        tree_width=args.tree_width, gamma_policy=args.gamma_policy or "",
        speculation=False if args.no_speculation else None,
    )
    kw["text" if args.raw else "prompt"] = args.prompt
    try:
        with SpecdClient(grpc_address(args), timeout=args.timeout, security=client_security(args)) as client:
            if args.stream:
                usage, reason = {}, ""
                for chunk in client.stream(**kw):
                    print(chunk.text, end="", flush=True)
                    usage, reason = chunk.usage or usage, chunk.finish_reason or reason
                print()
            else:
                out = client.generate(**kw)
                print(out.text)
                usage, reason = out.usage, out.finish_reason
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(_summary(reason, usage), file=sys.stderr)
    return 0


def http_body(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The endpoint and JSON body of `specd generate --http` (greedy unless --temperature, as over gRPC)."""
    body: dict[str, Any] = {"temperature": args.temperature or 0.0, "stream": args.stream}
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    for key, value in (("max_tokens", args.max_new_tokens), ("top_k", args.top_k), ("top_p", args.top_p),
                       ("seed", args.seed), ("stop", args.stop)):
        if value is not None:
            body[key] = value
    spec = {k: v for k, v in (("gamma_max", args.gamma), ("tree_width", args.tree_width),
                              ("policy", args.gamma_policy),
                              ("enabled", False if args.no_speculation else None)) if v is not None}
    if spec:
        body["speculation"] = spec
    if args.raw:
        return "/v1/completions", {**body, "prompt": args.prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": args.prompt}]}


def _generate_http(args: argparse.Namespace) -> int:
    from specd.cluster.auth import client_token

    if args.server_name:
        print("error: --server-name is for gRPC; over HTTP, address the server by a name its certificate "
              "carries", file=sys.stderr)
        return 2
    tls = args.tls or bool(args.ca_file)
    address = args.address or f"{ServerConfig.host}:{ServerConfig.http_port}"
    path, body = http_body(args)
    headers = {"Content-Type": "application/json"}
    token = client_token(args.token_file, args.token_env)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    context = None
    if tls:
        context = ssl.create_default_context(cafile=args.ca_file)
        if args.cert_file:
            context.load_cert_chain(args.cert_file, args.key_file)
    request = urllib.request.Request(f"{'https' if tls else 'http'}://{address}{path}",
                                     data=json.dumps(body).encode(), headers=headers, method="POST")
    chat = path.endswith("chat/completions")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout, context=context) as response:
            if not args.stream:
                out = json.loads(response.read())
                choice = out["choices"][0]
                print(choice["message"]["content"] if chat else choice["text"])
                usage, reason = out["usage"], choice["finish_reason"]
            else:
                usage, reason = {}, ""
                for line in response:
                    data = line.decode().strip().removeprefix("data: ")
                    if not line.startswith(b"data: ") or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        print(f"\nerror: {event['error']['message']}", file=sys.stderr)
                        return 1
                    for choice in event["choices"]:
                        text = choice["delta"].get("content", "") if chat else choice["text"]
                        print(text, end="", flush=True)
                        reason = choice["finish_reason"] or reason
                    usage = event.get("usage") or usage
                print()
    except urllib.error.HTTPError as err:
        print(f"error: HTTP {err.code}: {json.loads(err.read())['error']['message']}", file=sys.stderr)
        return 1
    except urllib.error.URLError as err:
        print(f"error: {err.reason}", file=sys.stderr)
        return 1
    print(_summary(reason, {**usage, **usage.get("speculation", {})}), file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    return _generate_http(args) if args.http else _generate_grpc(args)


def add_cli(subparsers) -> None:
    """Register `specd generate` (called by cluster/cli.py)."""
    g = subparsers.add_parser("generate", help="send one prompt to a running server")
    g.add_argument("prompt", help="a user message (rendered with the chat template), or raw text with --raw")
    add_client_options(g)
    g.add_argument("--http", action="store_true",
                   help="use the OpenAI-compatible HTTP API (server.http_port) instead of gRPC")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, not a chat message")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--gamma", type=int, default=None, help="draft length budget per step")
    g.add_argument("--tree-width", type=int, default=None, help="1 = chain; >1 = token tree")
    g.add_argument("--gamma-policy", default=None,
                   help="goodput (the server's default), fixed, egag, confidence or adaptive")
    g.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    g.set_defaults(func=_cmd_generate)
