"""The public facade: every exported name resolves, and importing it alone stays light."""

import subprocess
import sys

import shardkit as sk


def test_every_public_name_resolves_to_its_definition():
    for name in sk.__all__:
        value = getattr(sk, name)
        assert getattr(value, "__name__", name) == name or not callable(value), name


def test_unknown_name_is_an_attribute_error():
    try:
        sk.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_spec_layer_imports_without_torch_distributed():
    code = ("import sys, shardkit as sk; sk.Plan(mesh=sk.Mesh(dp=2)).to_json(); "
            "print('torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
