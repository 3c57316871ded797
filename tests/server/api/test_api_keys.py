"""The API key file: its format and errors (never naming a key), constant-time lookup of every key,
reloads that keep the keys in force when the file breaks, SIGHUP, and the CLI's start-up checks."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvboost_hf.cli import main
from kvboost_hf.server.api.keys import KeyFileError, KeyRing, parse_key_file

SECRET_KEY = "sk-very-secret-0123"


@pytest.mark.parametrize("data, says", [
    ("{nope", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ("{}", "must be a JSON object of at least one key"),
    (json.dumps({SECRET_KEY: "alice"}), "entry 1: the value must be an object"),
    (json.dumps({SECRET_KEY: {}}), "'tenant' must be"),
    (json.dumps({SECRET_KEY: {"tenant": "a b"}}), "'tenant' must be"),
    (json.dumps({SECRET_KEY: {"tenant": "x" * 65}}), "'tenant' must be"),
    (json.dumps({SECRET_KEY: {"tenant": "a", "store_bytes": 0}}), "'store_bytes' must be a positive integer"),
    (json.dumps({SECRET_KEY: {"tenant": "a", "store_bytes": "1GB"}}), "'store_bytes' must be a positive integer"),
    (json.dumps({SECRET_KEY: {"tenant": "a", "admin": "yes"}}), "'admin' must be true or false"),
    (json.dumps({SECRET_KEY: {"tenant": "a", "quota": 5}}), "unknown field(s) ['quota']"),
    (json.dumps({" ": {"tenant": "a"}}), "a key must be non-empty"),
    (json.dumps({"k1": {"tenant": "a", "store_bytes": 5}, SECRET_KEY: {"tenant": "a", "store_bytes": 6}}),
     "entry 2: tenant 'a' has another 'store_bytes'"),
])
def test_a_malformed_file_says_what_to_change_and_never_names_a_key(data, says):
    with pytest.raises(KeyFileError) as err:
        parse_key_file(data)
    assert says in str(err.value) and SECRET_KEY not in str(err.value)


def test_lookup_finds_each_key_and_nothing_near_it(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"ka": {"tenant": "a", "store_bytes": 100}, "kb": {"tenant": "b", "admin": True},
                                "ka2": {"tenant": "a", "store_bytes": 100}}))
    ring = KeyRing(path)
    assert ring.grant_for("ka").tenant.name == "a" and not ring.grant_for("ka").admin
    assert ring.grant_for("kb").admin and ring.grant_for("ka2").tenant == ring.grant_for("ka").tenant
    for near in ("k", "ka ", "KA", "ka2x", "", "kb\x00"):
        assert ring.grant_for(near) is None
    assert set(ring.tenants()) == {"a", "b"} and ring.tenants()["a"].store_bytes == 100


def test_reload_replaces_the_keys_and_a_broken_file_keeps_them(tmp_path, caplog):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({SECRET_KEY: {"tenant": "a"}, "kb": {"tenant": "b"}}))
    ring = KeyRing(path)
    grant = ring.grant_for(SECRET_KEY)
    path.write_text(json.dumps({"kb": {"tenant": "b"}}))
    assert ring.reload() and ring.grant_for(SECRET_KEY) is None and not ring.is_current(grant)
    path.write_text(json.dumps({SECRET_KEY: {"tenant": "a", "admin": True}, "kb": {"tenant": "b"}}))
    assert ring.reload() and not ring.is_current(grant)  # the same key with another role is another grant
    path.write_text("{broken")
    assert not ring.reload()
    assert ring.grant_for("kb") is not None and "previous ones stay in force" in caplog.text
    assert SECRET_KEY not in caplog.text


def test_sighup_reloads_the_tenancy(tmp_path):
    from kvboost_hf.server.routes.tenancy import reload_on_sighup

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"ka": {"tenant": "a"}}))

    class Tenancy:
        reloads = 0

        def reload(self):
            Tenancy.reloads += 1

    before = signal.getsignal(signal.SIGHUP)
    try:
        reload_on_sighup(Tenancy())
        os.kill(os.getpid(), signal.SIGHUP)
        assert Tenancy.reloads == 1
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_cli_refuses_a_bad_key_file_before_loading_anything(tmp_path, capsys, monkeypatch):
    import kvboost_hf.server.launch

    def reached(*args, **kwargs):
        raise AssertionError("a bad key file got as far as loading a model")

    monkeypatch.setattr(kvboost_hf.server.launch, "load_served_model", reached)
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({SECRET_KEY: {"tenant": "no spaces please"}}))
    for argv, says in ((["serve", "--api-keys", str(path)], "entry 1: 'tenant' must be"),
                       (["serve", "--api-keys", str(tmp_path / "missing.json")], "cannot read the API key file"),
                       (["serve", "--api-key", "k", "--api-keys", str(path)], "not allowed with argument")):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and says in err and SECRET_KEY not in err, err
