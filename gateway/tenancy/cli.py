"""`kvgate tenants add | list | revoke`: edit the tenants file the gateway watches.

`add` prints the new key alone on stdout (everything else goes to stderr), so
`KEY=$(kvgate tenants add --file tenants.yaml acme)` captures it; the file keeps only its hash.
A running gateway picks the change up within its reload interval: no restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gateway.request.tenant import SCOPES

TENANTS_FILE_ENV = "KVGATE_TENANTS_FILE"


def add_tenants_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def with_file(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--file",
            type=Path,
            default=os.environ.get(TENANTS_FILE_ENV),
            help=f"the tenants file (YAML, or JSON if named *.json; default ${TENANTS_FILE_ENV})",
        )

    add = actions.add_parser(
        "add", help="create a tenant (or update it) and print a new key for it, once"
    )
    with_file(add)
    add.add_argument("name", help="tenant name: letters, digits, '_', '.', '-'")
    add.add_argument("--scope", choices=SCOPES, help="cache isolation scope (default tenant)")
    add.add_argument("--billing-profile", help="billing profile name (e.g. anthropic, openai)")
    add.add_argument(
        "--model", action="append", dest="models", metavar="MODEL", help="an allowed model"
    )
    add.add_argument("--requests-per-min", type=int, help="rate limit, requests per minute")
    add.add_argument("--tokens-per-min", type=int, help="rate limit, tokens per minute")
    add.add_argument("--max-prompt-tokens", type=int, help="largest prompt accepted")
    add.add_argument(
        "--max-inflight",
        type=int,
        help="requests in flight at once per gateway process (default: tenant_max_inflight)",
    )
    add.add_argument(
        "--trusted-tracing",
        action="store_true",
        default=None,
        help="let the tenant's traceparent decide tracing (default: sampled at the ratio)",
    )
    add.add_argument(
        "--route-receipts",
        action="store_true",
        default=None,
        help="answers carry the x-kvgate-route receipt: the replica chosen and why",
    )
    add.add_argument("--label", help="a note kept with the key (who or what uses it)")

    listing = actions.add_parser("list", help="tenants, their policies and key ids")
    with_file(listing)
    listing.add_argument("--json", action="store_true", help="print JSON")

    revoke = actions.add_parser("revoke", help="remove a key (by id or the key) or a tenant")
    with_file(revoke)
    revoke.add_argument("key", nargs="?", help="a key id from 'list' (or a prefix), or the key")
    revoke.add_argument("--tenant", help="remove this tenant and all its keys")


def run_tenants(args: argparse.Namespace) -> int:
    from gateway.tenancy.tenant_file import TenantFileError, add_key, load, revoke

    if args.file is None:
        print(f"kvgate tenants: give --file PATH or set {TENANTS_FILE_ENV}", file=sys.stderr)
        return 2
    path: Path = args.file
    try:
        if args.action == "add":
            key, entry, created = add_key(
                path,
                args.name,
                label=args.label,
                scope=args.scope,
                billing_profile=args.billing_profile,
                models=args.models,
                requests_per_min=args.requests_per_min,
                tokens_per_min=args.tokens_per_min,
                max_prompt_tokens=args.max_prompt_tokens,
                max_inflight=args.max_inflight,
                trusted_tracing=args.trusted_tracing,
                route_receipts=args.route_receipts,
            )
            verb = "created tenant" if created else "added a key to tenant"
            print(
                f"{verb} {args.name} in {path}; key id {entry.id}. The key follows; store it "
                "now: only its hash is kept.",
                file=sys.stderr,
            )
            print(key)
            return 0
        if args.action == "revoke":
            for what in revoke(path, args.key, args.tenant):
                print(f"revoked {what} in {path}", file=sys.stderr)
            return 0
        content = load(path)
    except (TenantFileError, ValueError, OSError) as exc:
        print(f"kvgate tenants: {exc}", file=sys.stderr)
        return 1
    if args.json:
        listing = {
            name: {
                **t.model_dump(exclude={"keys"}),
                "keys": [{"id": k.id, "created": k.created, "label": k.label} for k in t.keys],
            }
            for name, t in content.tenants.items()
        }
        print(json.dumps(listing, indent=2))
        return 0
    header = ("tenant", "scope", "billing", "models", "req/min", "tok/min", "max prompt", "keys")
    table = [header]
    for name, t in content.tenants.items():
        keys = " ".join(k.id + (f"({k.label})" if k.label else "") for k in t.keys)
        table.append(
            (
                name,
                t.scope,
                t.billing_profile or "-",
                ",".join(t.models) or "*",
                str(t.requests_per_min or "-"),
                str(t.tokens_per_min or "-"),
                str(t.max_prompt_tokens or "-"),
                keys or "-",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
