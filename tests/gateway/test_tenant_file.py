"""The tenants file: `kvgate tenants add | list | revoke`, its validation, and the watcher that
reloads it (including a Kubernetes Secret's symlink swap)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from gateway.errors import TenantError
from gateway.request.tenant import SCOPE_USER, hash_key
from gateway.tenancy.registry import TenantRegistry
from gateway.tenancy.tenant_file import (
    TenantFileError,
    TenantFileWatcher,
    add_key,
    load,
    parse,
    revoke,
)
from kvgate_cli import main


def kvgate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_add_prints_the_key_once_and_stores_only_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.yaml"
    status, out, err = kvgate(
        capsys,
        "tenants",
        "add",
        "--file",
        str(path),
        "acme",
        "--scope",
        "user",
        "--billing-profile",
        "anthropic",
        "--model",
        "kvgate-sim-8b",
        "--requests-per-min",
        "600",
        "--tokens-per-min",
        "100000",
        "--max-prompt-tokens",
        "32000",
        "--max-inflight",
        "8",
        "--label",
        "ci",
    )
    assert status == 0
    key = out.strip()
    assert key.startswith("sk-kvg-") and len(key) > 40 and "\n" not in key  # stdout: the key only
    assert "created tenant acme" in err
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    entry = load(path).tenants["acme"]
    assert (entry.scope, entry.billing_profile, entry.models) == (
        "user",
        "anthropic",
        ["kvgate-sim-8b"],
    )
    assert (entry.requests_per_min, entry.tokens_per_min, entry.max_prompt_tokens) == (
        600,
        100000,
        32000,
    )
    assert entry.max_inflight == 8
    assert entry.keys[0].label == "ci" and entry.keys[0].created
    # a second key for the same tenant keeps the policy, and is a different key
    status, out2, err = kvgate(capsys, "tenants", "add", "--file", str(path), "acme")
    assert status == 0 and "added a key to tenant acme" in err and out2 != out
    assert [len(load(path).tenants["acme"].keys), load(path).tenants["acme"].scope] == [2, "user"]
    # list: ids, never hashes in full, never keys
    status, out, _ = kvgate(capsys, "tenants", "list", "--file", str(path))
    assert status == 0 and "acme" in out and entry.keys[0].id in out
    assert hash_key(key) not in out and key not in out
    status, out, _ = kvgate(capsys, "tenants", "list", "--file", str(path), "--json")
    listed = json.loads(out)
    assert [k["id"] for k in listed["acme"]["keys"]] == [
        k.id for k in load(path).tenants["acme"].keys
    ]
    assert listed["acme"]["requests_per_min"] == 600


def test_revoke_by_id_prefix_by_key_and_whole_tenant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.json"  # JSON works the same way
    k1, entry1, _ = add_key(path, "acme")
    k2, _, _ = add_key(path, "acme")
    k3, _, _ = add_key(path, "globex")
    assert json.loads(path.read_text())["tenants"]["acme"]["keys"][0]["sha256"] == hash_key(k1)

    status, _, err = kvgate(capsys, "tenants", "revoke", "--file", str(path), entry1.id[:8])
    assert status == 0 and f"key {entry1.id} of tenant acme" in err
    assert [k.sha256 for k in load(path).tenants["acme"].keys] == [hash_key(k2)]
    status, _, err = kvgate(capsys, "tenants", "revoke", "--file", str(path), k2)  # the key itself
    assert status == 0 and load(path).tenants["acme"].keys == []
    status, _, err = kvgate(capsys, "tenants", "revoke", "--file", str(path), "--tenant", "globex")
    assert status == 0 and "tenant globex (1 keys)" in err and "globex" not in load(path).tenants
    # mistakes name the problem and change nothing
    before = path.read_text()
    status, _, err = kvgate(capsys, "tenants", "revoke", "--file", str(path), "abc")
    assert status == 1 and "no key matches" in err and "at least 6 characters" in err
    status, _, err = kvgate(capsys, "tenants", "revoke", "--file", str(path), "--tenant", "nope")
    assert status == 1 and "no tenant 'nope'" in err and "acme" in err
    status, _, err = kvgate(capsys, "tenants", "add", "--file", str(path), "bad name")
    assert status == 1 and "tenant name 'bad name'" in err
    status, _, err = kvgate(
        capsys, "tenants", "add", "--file", str(path), "acme", "--billing-profile", "cheap"
    )
    assert status == 1 and "unknown billing profile 'cheap'; choose one of anthropic" in err
    assert path.read_text() == before
    assert k3  # (globex's key was revoked with its tenant)


def test_an_id_prefix_must_name_one_key(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    a, b = "abcdef" + "0" * 58, "abcdef" + "1" * 58
    path.write_text(f"tenants:\n  acme:\n    keys: [{{sha256: {a}}}, {{sha256: {b}}}]\n")
    with pytest.raises(TenantFileError, match="matches several keys"):
        revoke(path, "abcdef")
    with pytest.raises(TenantFileError, match="revoke either one key"):
        revoke(path)
    assert revoke(path, "ABCDEF1") == ["key abcdef111111 of tenant acme"]
    assert [k.sha256 for k in load(path).tenants["acme"].keys] == [a]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants: [1, 2", "not valid YAML"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("tenants:\n  acme:\n    keys:\n      - key: sk-plain\n", "lists a key in plain text"),
        ("tenants:\n  acme:\n    scope: org\n", "Input should be 'tenant' or 'user'"),
        ("tenants:\n  acme:\n    keys:\n      - sha256: abc\n", "64-character lowercase SHA-256"),
        ("tenants:\n  acme:\n    requests_per_min: 0\n", "greater than 0"),
        ("tenants:\n  acme:\n    max_inflight: 0\n", "greater than 0"),
        ("tenants:\n  acme:\n    rpm: 5\n", "Extra inputs are not permitted"),
        ("tenants:\n  'a/b': {}\n", "tenant name 'a/b'"),
        (
            "tenants:\n  a:\n    keys: [{sha256: " + "a" * 64 + "}]\n  b:\n"
            "    keys: [{sha256: " + "a" * 64 + "}]\n",
            "belongs to both 'a' and 'b'",
        ),
        ("version: 2\n", "Input should be 1"),
        # fair flow control's weights and bands (issue 43): the entry is named
        ("tenants:\n  acme:\n    weight: 0\n", "tenants.acme.weight"),
        ("tenants:\n  acme:\n    weight: -2\n", "greater than 0"),
        ("tenants:\n  acme:\n    priority: 1.5\n", "tenants.acme.priority"),
        (
            "tenants:\n  acme:\n    priority: 5\n    priority_range: [0, 2]\n",
            "outside priority_range",
        ),
        ("tenants:\n  acme:\n    priority_range: [3, 1]\n", "low <= high"),
    ],
)
def test_an_invalid_file_says_where_and_why(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tenants.yaml"
    with pytest.raises(TenantFileError, match=r"tenants\.yaml") as info:
        parse(text, path)
    assert message in str(info.value)


def test_a_tenants_max_inflight_is_its_policys(tmp_path: Path) -> None:
    """Issue 45, item 6: the per-tenant override of `tenant_max_inflight`."""
    content = parse("tenants:\n  acme:\n    max_inflight: 3\n  globex: {}\n", tmp_path / "t.yaml")
    assert content.tenants["acme"].policy().max_inflight == 3
    assert content.tenants["globex"].policy().max_inflight is None  # the gateway's bound


def test_a_missing_file_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(TenantFileError, match="create it with 'kvgate tenants add --file"):
        load(tmp_path / "absent.yaml")
    assert parse("", tmp_path / "empty.yaml").tenants == {}


def _registry_with(path: Path) -> tuple[TenantRegistry, TenantFileWatcher]:
    registry = TenantRegistry.from_pairs(b"secret", ["quick:sk-quick"])
    watcher = TenantFileWatcher(path, registry, interval_s=0.01)
    watcher.load_now()
    return registry, watcher


def test_the_watcher_adds_and_revokes_keys_and_keeps_the_last_good_content(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tenants.yaml"
    k1, e1, _ = add_key(path, "acme", scope=SCOPE_USER, requests_per_min=5)
    registry, watcher = _registry_with(path)
    acme = registry.authenticate(k1)
    assert acme.name == "acme" and acme.policy.scope == "user"
    assert acme.policy.requests_per_min == 5
    assert registry.authenticate("sk-quick").name == "quick"  # the --tenant pair stays

    async def reload() -> bool:
        return await watcher.maybe_reload()

    assert not asyncio.run(reload())  # nothing changed
    k2, _, _ = add_key(path, "acme")
    assert asyncio.run(reload())
    assert registry.authenticate(k2).name == "acme"
    revoke(path, e1.id)
    assert asyncio.run(reload())
    with pytest.raises(TenantError) as revoked:
        registry.authenticate(k1)
    with pytest.raises(TenantError) as unknown:
        registry.authenticate("sk-never-issued")
    # one code path: a revoked key is just absent
    assert (revoked.value.message, revoked.value.code, revoked.value.status) == (
        unknown.value.message,
        unknown.value.code,
        unknown.value.status,
    )
    # a broken edit is logged and ignored: the last good content stays in force
    path.write_text("tenants: [oops")
    assert not asyncio.run(reload())
    assert watcher.num_failures == 1 and "not valid YAML" in (watcher.last_error or "")
    assert registry.authenticate(k2).name == "acme"
    # so is a file that tries to take over a --tenant name
    path.write_text("tenants:\n  quick: {}\n")
    assert not asyncio.run(reload())
    assert "defined both by --tenant and in the tenants file" in (watcher.last_error or "")
    # and one with a bad weight (issue 43): refused, naming the entry
    path.write_text("tenants:\n  acme:\n    weight: 0\n")
    assert not asyncio.run(reload())
    assert "tenants.acme.weight" in (watcher.last_error or "")
    assert registry.authenticate(k2).name == "acme"
    # and a deleted file
    path.unlink()
    assert not asyncio.run(reload()) and "disappeared" in (watcher.last_error or "")
    assert registry.authenticate(k2).name == "acme"


def _kubelet_write(volume: Path, content: str, generation: int) -> None:
    """What the kubelet's AtomicWriter does for a Secret volume: a new timestamped directory,
    `..data_tmp` pointed at it, renamed over `..data`; the user-visible file is a symlink to
    `..data/<key>` and is never touched itself."""
    new = volume / f"..2026_11_30_10_00_0{generation}.000000001"
    new.mkdir()
    (new / "tenants.yaml").write_text(content)
    data = volume / "..data"
    old = os.readlink(data) if data.is_symlink() else None
    tmp_link = volume / "..data_tmp"
    tmp_link.symlink_to(new.name)
    os.replace(tmp_link, data)
    if old is not None:  # the kubelet then removes the previous generation
        shutil.rmtree(volume / old)
    visible = volume / "tenants.yaml"
    if not visible.is_symlink():
        visible.symlink_to("..data/tenants.yaml")


def test_a_kubernetes_secret_update_by_symlink_swap_is_reloaded(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch.yaml"
    k1, _, _ = add_key(scratch, "acme")
    volume = tmp_path / "secret-volume"
    volume.mkdir()
    _kubelet_write(volume, scratch.read_text(), 1)
    registry, watcher = _registry_with(volume / "tenants.yaml")
    assert registry.authenticate(k1).name == "acme"

    k2, _, _ = add_key(scratch, "globex")  # the operator edits a copy and updates the Secret
    _kubelet_write(volume, scratch.read_text(), 2)
    assert asyncio.run(watcher.maybe_reload())
    assert registry.authenticate(k2).name == "globex"
    assert watcher.num_reloads == 1


def test_serve_refuses_to_start_on_a_bad_tenants_file_or_redis_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  acme:\n    scope: everyone\n")
    serve = ["serve", "--engine", "http://127.0.0.1:9", "--tenants-file"]
    status, out, _ = kvgate(capsys, *serve, str(path))
    assert status == 2 and "tenants.yaml" in out and "Input should be 'tenant' or 'user'" in out
    status, out, _ = kvgate(capsys, *serve, str(tmp_path / "absent.yaml"))
    assert status == 2 and "create it with 'kvgate tenants add" in out
    status, out, _ = kvgate(capsys, *serve[:-1], "--redis-url", "localhost:6379")
    assert status == 2 and "must start with one of redis://, rediss://, unix://" in out
