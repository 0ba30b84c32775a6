"""API keys as a replica holds them (router/keys.py): the keys file's format and its errors, the
limits a line sets over the defaults, and reloading (revocation, and what a bad file keeps)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.keys import KeyLimits, KeyLine, KeyRing, key_digest, read_keys_file


def test_a_keys_file_line_sets_its_own_limits_over_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(
        "# comment\n"
        "sk-a team-a 5 10 concurrency=3 tokens_per_s=100.5 token_burst=900\n"
        "\n"
        "sk-b  # a key alone\n"
        "sk-c tenant 0 0 isolate_cache=true weight=3 priority=5 best_priority=-2\n"
    )
    defaults = KeyLimits(requests_per_s=2.0, max_concurrent=8)
    a, b, c = (line.api_key(defaults) for line in read_keys_file(path))
    assert (a.name, a.requests_per_s, a.burst) == ("team-a", 5.0, 10)
    limits = a.limits
    assert (limits.max_concurrent, limits.tokens_per_s, limits.tokens_burst) == (3, 100.5, 900)
    assert (b.name, b.requests_per_s, b.burst, b.limits.max_concurrent) == ("key-4", 2.0, 2, 8)
    assert b.limits.tokens_burst == 1 and not b.limits.isolate_cache
    assert c.limits.isolate_cache and c.requests_per_s == 0.0
    assert (c.limits.weight, c.limits.priority, c.limits.best_priority) == (3.0, 5, -2)
    assert (a.limits.weight, a.limits.priority, a.limits.best_priority) == (1.0, 0, 0)
    assert a.digest == key_digest("sk-a") and "sk-a" not in repr(a)
    assert KeyLimits(tokens_per_s=10.0).tokens_burst == 600  # a minute's worth


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("sk-a a 1 2 3", "expected '<key>"),
        ("sk-a a x", "must be numbers"),
        ("sk-a a 1 2 colour=red", "unknown option 'colour'"),
        ("sk-a a 1 2 isolate_cache=maybe", "true or false"),
        ("sk-a a 1 concurrency=-1 2", "expected '<key>"),
        ("sk-a a 1 2 concurrency=-1", "max_concurrent must be >= 0"),
        ("sk-a a 1 2 weight=0", "weight must be in 0.01..100"),
        ("sk-a a 1 2 priority=-5", "more urgent than best_priority 0"),
        ("sk-a a 1 2 best_priority=9999", "priority must be in -1000..1000"),
    ],
)
def test_a_bad_keys_file_names_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"sk-ok fine\n{line}\n")
    with pytest.raises(ValueError, match=message) as err:
        KeyRing(path=path).lookup("sk-ok")
    assert f"{path}:2" in str(err.value)


def test_the_ring_reloads_its_file_and_keeps_what_it_had_on_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alice\nsk-b bob\n")
    ring = KeyRing([KeyLine("sk-given", "given")], path)
    assert ring.configured and {k.name for k in ring.keys} == {"given", "alice", "bob"}
    assert not ring.reload_if_changed()  # unchanged
    _rewrite(path, "sk-a alice\nsk-c carol\n")
    assert ring.reload_if_changed()
    assert ring.lookup("sk-b") is None and ring.lookup("sk-c") is not None
    _rewrite(path, "sk-a alice 1 2 3 4 5\n")  # unparseable: the keys held stay
    assert not ring.reload_if_changed() and ring.lookup("sk-c") is not None
    path.unlink()  # gone (a Secret mid-update): the same
    assert not ring.reload_if_changed() and ring.lookup("sk-a") is not None
    _rewrite(path, "")  # emptied: still configured, only the given key is valid
    assert ring.reload_if_changed() and ring.configured
    assert [k.name for k in ring.keys] == ["given"]
    assert not KeyRing().configured and KeyRing(path=path).configured


def _rewrite(path: Path, text: str) -> None:
    """Replace the file as a Secret's update does (a new file), with a new mtime."""
    new = path.with_suffix(".new")
    new.write_text(text)
    os.replace(new, path)
