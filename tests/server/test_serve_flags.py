"""`serve` command-line surface: the positional model, the access flags and `--version`."""

from __future__ import annotations

import argparse

import pytest

import replayssm
from replayssm.cli import main
from replayssm.server.launch import API_KEY_ENV, access_options, add_serve_parser, resolve_model


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(list(argv))


def test_model_positional_or_flag():
    """`serve MODEL` and `serve --model MODEL` name the same model; both agreeing is fine too."""
    assert resolve_model(parse("serve", "demo")) == "demo"
    assert resolve_model(parse("serve", "--model", "demo")) == "demo"
    assert resolve_model(parse("serve", "demo", "--model", "demo", "--port", "9")) == "demo"


@pytest.mark.parametrize("argv,message", [
    (("serve", "demo", "--model", "other"), "two different models"),
    (("serve",), "no model"),
])
def test_model_missing_or_conflicting_is_an_error(argv, message, capsys):
    """Two different models, or none, stop `serve` with status 2 and a one-line message."""
    with pytest.raises(ValueError, match=message):
        resolve_model(parse(*argv))
    assert main(list(argv)) == 2 and message in capsys.readouterr().err


def test_api_key_from_flag_or_environment(monkeypatch):
    """The key comes from --api-key, else REPLAYSSM_API_KEY; the flag wins; neither means no key."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert access_options(parse("serve", "demo"))["api_key"] is None
    assert access_options(parse("serve", "demo", "--api-key", "a"))["api_key"] == "a"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert access_options(parse("serve", "demo"))["api_key"] == "from-env"
    assert access_options(parse("serve", "demo", "--api-key", "a"))["api_key"] == "a"
    with pytest.raises(ValueError, match="--api-key"):
        access_options(parse("serve", "demo", "--api-key", ""))


def test_cors_flags():
    """CORS lists parse as vLLM spells them (a JSON list) or comma-separated; they are off by default,
    and the other CORS flags without --allowed-origins are an error rather than ignored."""
    default = access_options(parse("serve", "demo"))
    assert default["allowed_origins"] is None
    opts = access_options(parse("serve", "demo", "--allowed-origins", '["http://a.example", "http://b"]',
                                "--allowed-methods", "GET, POST", "--allow-credentials"))
    assert opts["allowed_origins"] == ["http://a.example", "http://b"]
    assert opts["allowed_methods"] == ["GET", "POST"] and opts["allow_credentials"] is True
    with pytest.raises(ValueError, match="--allowed-headers needs --allowed-origins"):
        access_options(parse("serve", "demo", "--allowed-headers", "x-a"))
    with pytest.raises(SystemExit):
        parse("serve", "demo", "--allowed-origins", "[1, 2]")


def test_version_flag(capsys):
    """`replayssm --version` prints the package version and exits 0."""
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"replayssm {replayssm.__version__}"
