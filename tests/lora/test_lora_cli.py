"""``--lora-modules`` in vLLM's two forms; misuse is a one-line error, not a start-up."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.cli_args import build_parser, lora_module


def test_lora_modules_forms() -> None:
    assert lora_module("sql=/a/sql") == {"name": "sql", "path": "/a/sql"}
    assert lora_module('{"name": "c", "path": "/a/c", "base_model_name": "m"}') == {
        "name": "c", "path": "/a/c", "base_model_name": "m"}
    for bad in ("sql", "=/p", '{"name": "c"}', "{nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)
    args = build_parser().parse_args(["--enable-lora", "--max-loras", "3", "--lora-modules",
                                      "a=/x", '{"name": "b", "path": "/y"}'])
    assert [m["name"] for m in args.lora_modules] == ["a", "b"]
    assert args.enable_lora and args.max_loras == 3


def test_lora_modules_need_enable_lora(capsys) -> None:
    from pagedllm.entrypoints.openai.api_server import main

    assert main(["--lora-modules", "a=/x"]) == 1
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
